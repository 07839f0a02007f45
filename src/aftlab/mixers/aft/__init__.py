"""AFT token mixers.

Importing registers "aft-full", "aft-local", "aft-simple", "aft-conv" and "aft-decay".
"""

from . import conv, decay, full, local, simple  # noqa: F401
