"""How ``aftlab train`` ended: its outcome, its exit status and the ``--outcome FILE`` record.

| outcome | exit status | what happened |
|---|---|---|
| ``completed`` | 0 | trained to ``steps``, tested, ``summary.json`` written |
| ``crashed`` | 1 | an unexpected error (Python's traceback), or a fatal signal (SIGSEGV, SIGBUS) |
| ``usage_error`` | 2 | bad input (one line) |
| ``disk_full`` | 2 | a write failed for want of space (one line) |
| ``diverged`` | 3 | a non-finite loss or weights (one line; nothing saved) |
| ``out_of_memory`` | 4 | an allocation failed (one line) |
| ``interrupted`` | 130 | Ctrl-C or SIGTERM (checkpoint saved), or killed by a signal |

The record, ``{"outcome", "exit_status", "error"}`` (``"traceback"`` too for a crash), is strict
JSON written atomically; where it cannot be written (a full disk), the exit status alone says
the outcome (:func:`outcome_of`).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._json import dumps
from ..data.base import DataError
from ..errors import READ_ERRORS, UsageError
from .checkpoint import _write_error, atomic_write_text

__all__ = [
    "EXIT_STATUS",
    "classify",
    "outcome_of",
    "read_outcome",
    "reports_outcome",
    "write_outcome",
]

#: ``aftlab train``'s exit status per outcome.
EXIT_STATUS = {
    "completed": 0,
    "crashed": 1,
    "usage_error": 2,
    "disk_full": 2,
    "diverged": 3,
    "out_of_memory": 4,
    "interrupted": 130,
}
_BY_STATUS = {s: o for o, s in EXIT_STATUS.items() if o != "disk_full"}
_NO_SPACE = {errno.ENOSPC: os.strerror(errno.ENOSPC), errno.EDQUOT: os.strerror(errno.EDQUOT)}
_NO_MEMORY = ("out of memory", "can't allocate memory", "not enough memory")
#: Signals that stop a run from outside; any other (SIGSEGV, SIGBUS, SIGABRT) is a crash.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


def _chain(e: BaseException | None):
    """``e`` and the exceptions it was raised from or during."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def classify(e: BaseException) -> str:
    """The outcome of a run that raised ``e`` (a failed write keeps its ``OSError`` as context)."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _NO_SPACE:
            return "disk_full"
        if isinstance(x, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(x, OSError) and x.errno == errno.ENOMEM
        ):
            return "out_of_memory"
    if isinstance(e, (UsageError, DataError)):  # safetensors reports a full disk as text only
        return "disk_full" if any(s in str(e) for s in _NO_SPACE.values()) else "usage_error"
    if isinstance(e, RuntimeError) and any(s in str(e) for s in _NO_MEMORY):
        return "out_of_memory"
    return "crashed"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def write_outcome(path: str | None, outcome: str, error: str | None = None, **extra: Any) -> None:
    """Write the record to ``path`` (rank 0, when given); a failed write is left to the status."""
    if path is None or int(os.environ.get("RANK", "0")) != 0:
        return
    record = {"outcome": outcome, "exit_status": EXIT_STATUS[outcome], "error": error, **extra}
    try:
        atomic_write_text(path, dumps(record, indent=2) + "\n")
    except UsageError:
        pass


def reports_outcome(command: Callable[[Any], int]) -> Callable[[Any], int]:
    """``command(args)`` that records what it raises in ``args.outcome`` (see the table).

    The command records a run that ended itself (0, 3 or 130). Out of memory becomes one line
    and status 4, a full disk's bare ``OSError`` the one-line error of a failed write; the rest
    goes on to :func:`aftlab.cli.main` (status 2 or 130) or to Python (a traceback, status 1).
    """

    @functools.wraps(command)
    def run(args: Any) -> int:
        path = getattr(args, "outcome", None)
        if path is not None and not Path(path).parent.is_dir():
            raise UsageError(f"--outcome {path!r}: its folder does not exist; create it first")
        try:
            return command(args)
        except (Exception, KeyboardInterrupt) as e:
            outcome = classify(e)
            error = None if outcome == "interrupted" else _first_line(e)
            if outcome == "disk_full" and not isinstance(e, (UsageError, DataError)):
                os_error = next(x for x in _chain(e) if isinstance(x, OSError))
                name = getattr(os_error, "filename", None)
                failed = _write_error(repr(name) if name else "a file", os_error)
                write_outcome(path, outcome, str(failed))
                raise failed from e
            if outcome == "out_of_memory":
                write_outcome(path, outcome, error)
                print(
                    f"aftlab: error: out of memory: {error} (free memory and continue with "
                    "--resume, or train a smaller batch_size or model into a new --out)",
                    file=sys.stderr,
                )
                return EXIT_STATUS[outcome]
            extra = {}
            if outcome == "crashed":
                error, extra = f"{type(e).__name__}: {error}", {"traceback": traceback.format_exc()}
            write_outcome(path, outcome, error, **extra)
            raise

    return run


def read_outcome(path: str | Path) -> dict[str, Any] | None:
    """The record at ``path``, or None (absent, unreadable, not a record)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except READ_ERRORS:
        return None
    ok = isinstance(record, dict) and record.get("outcome") in EXIT_STATUS
    return record if ok else None


def outcome_of(status: int, record: dict[str, Any] | None) -> tuple[str, str | None]:
    """``(outcome, cause)`` of a child ``aftlab train`` from its exit status and record.

    The record counts only where it agrees with the status (it may be stale or missing); a
    negative status (killed by a signal) is an interruption for the signals a user stops a
    run with, else a crash (SIGKILL included: the kernel's out-of-memory killer sends it).
    """
    if record is not None and record.get("exit_status") == status:
        return record["outcome"], record.get("error")
    if status < 0:
        try:
            sig = signal.Signals(-status)
        except ValueError:
            return "crashed", f"killed by signal {-status}"
        cause = f"killed by {sig.name}"
        if sig == signal.SIGKILL:
            cause += " (by the kernel when out of memory, or by another process)"
        return ("interrupted" if sig in _STOP_SIGNALS else "crashed"), cause
    return _BY_STATUS.get(status, "crashed"), f"exit status {status}"
