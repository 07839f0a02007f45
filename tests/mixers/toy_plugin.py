"""A pytest plugin that registers a toy mixer before collection (``-p tests.mixers.toy_plugin``).

It is a subclass of ``aft-simple`` under another name, so it keeps every promise of the contract
suite; ``test_registry.py`` runs the suites with it to show that registering a class is the only
edit a new mixer needs for them to cover it.
"""

from __future__ import annotations

from aftlab.mixers import register_mixer
from aftlab.mixers.aft.simple import AFTSimple

NAME = "zz-toy-plugin"


@register_mixer(NAME)
class ToyPluginMixer(AFTSimple):
    """``aft-simple`` under the name :data:`NAME`."""
