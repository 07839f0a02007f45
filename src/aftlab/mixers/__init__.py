"""Token mixers behind one interface (:class:`SequenceMixer`) and a registry by name.

Importing this package registers every built-in mixer.
"""

from . import aft as _aft  # noqa: F401,E402  (registers the "aft-*" mixers)
from . import attention as _attention  # noqa: F401,E402  (registers "attention", "attention-naive")
from .base import MixerState, SequenceMixer
from .registry import (
    available_mixers,
    build_mixer,
    get_mixer_class,
    register_mixer,
    unregister_mixer,
)

__all__ = [
    "SequenceMixer",
    "MixerState",
    "register_mixer",
    "unregister_mixer",
    "get_mixer_class",
    "build_mixer",
    "available_mixers",
]
