"""The errors a user can fix, below every layer that raises them: :class:`UsageError` (the command
line prints it as one line and exits with status 2) and what reading a damaged file raises."""

from __future__ import annotations

from safetensors import SafetensorError

__all__ = ["UsageError", "READ_ERRORS", "reason"]


class UsageError(ValueError):
    """Bad input from the user (config, data path, run folder, checkpoint).

    The message says what is wrong and what to do; ``aftlab`` prints it as
    ``aftlab: error: <message>`` and exits with status 2, without a traceback.
    """


#: What reading a damaged file raises: the OS's errors, ``ValueError`` (json's and tomllib's
#: decode errors, ``UnicodeDecodeError``), ``RecursionError`` (brackets nested too deeply for
#: json or tomllib) and safetensors' own ``SafetensorError`` (a bad header or offsets).
READ_ERRORS = (OSError, ValueError, RecursionError, SafetensorError)


def reason(e: BaseException) -> str:
    """One line saying why ``e`` was raised: an OS error's text, or the message's first line."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    text = getattr(e, "strerror", None) or str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
