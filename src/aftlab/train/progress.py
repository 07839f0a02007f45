"""Training progress: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.3`` -> ``"1m15s"``; ``3700`` -> ``"1h01m"``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Report training progress: loss, learning rate, tokens/s and ETA.

    On a terminal (``stream.isatty()``) with ``tqdm`` installed this is a progress bar; otherwise
    one line every ``log_interval`` steps (and at the last step) such as
    ``step 20/400 | loss 2.3456 | lr 1.00e-03 | 12345 tok/s | ETA 1m23s``.

    Args:
        total: last step number.
        initial: steps already done (resumed runs).
        log_interval: steps between plain log lines.
        stream: where to write (default ``sys.stderr``).
        enabled: False silences everything (ranks other than 0).
    """

    def __init__(
        self,
        *,
        total: int,
        initial: int = 0,
        log_interval: int = 20,
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.total, self.initial, self.log_interval = total, initial, log_interval
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._start = time.perf_counter()
        self._bar = None
        if enabled and _isatty(self.stream):
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total,
                    initial=initial,
                    file=self.stream,
                    unit="step",
                    dynamic_ncols=True,
                    leave=True,
                )

    def update(self, step: int, *, loss: float, lr: float, tokens_per_s: float) -> None:
        """Record that optimizer step ``step`` (1-based) finished."""
        if not self.enabled:
            return
        done = step - self.initial
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(done, 1) * (self.total - step)
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s", refresh=False
            )
            self._bar.update(step - self._bar.n)
        elif step % self.log_interval == 0 or step == self.total or done == 1:
            self.write(
                f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
                f"{tokens_per_s:,.0f} tok/s | ETA {format_duration(eta)}"
            )

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
