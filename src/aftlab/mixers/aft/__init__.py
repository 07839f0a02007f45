"""AFT token mixers.

Importing registers "aft-full", "aft-local", "aft-simple", "aft-conv", "aft-decay" and
"rwkv4" (RWKV-4's time mixing: aft-decay with the token shift).
"""

from . import conv, decay, full, local, rwkv4, simple  # noqa: F401
