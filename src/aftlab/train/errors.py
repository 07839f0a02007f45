"""The error a user can fix: the command line prints it as one line and exits with status 2."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Bad input from the user (config, data path, run folder, checkpoint).

    The message says what is wrong and what to do; ``aftlab`` prints it as
    ``aftlab: error: <message>`` and exits with status 2, without a traceback.
    """
