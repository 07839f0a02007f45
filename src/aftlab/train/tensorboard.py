"""``--log tensorboard``: the scalars of ``metrics.jsonl``, also as TensorBoard event files.

Every number of a ``metrics.jsonl`` record but ``step`` and ``time`` becomes the scalar
``<split>/<key>`` at global step ``step`` and wall time ``time``: ``train/loss``, ``train/lr``,
``train/tokens``, ``train/tokens_per_s``, ``train/peak_memory_bytes``, ``val/loss``,
``val/<metric>``. The event files go to ``RUN_DIR/tb`` (``tensorboard --logdir RUN_DIR``, or a
compare folder for every mixer of a comparison). Needs the ``tensorboard`` package
(``pip install 'aftlab[tensorboard]'``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .checkpoint import run_subdir

__all__ = ["TensorBoardLog", "check_tensorboard", "TB_DIR"]

#: The folder of the event files inside a run folder.
TB_DIR = "tb"
_NOT_SCALARS = ("step", "time")


def check_tensorboard() -> None:
    """Raise :class:`UsageError` naming the extra when TensorBoard's writer cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UsageError(
            "--log tensorboard needs the tensorboard package, which is not installed "
            "(pip install 'aftlab[tensorboard]')"
        ) from None


class TensorBoardLog:
    """Write ``metrics.jsonl`` records as TensorBoard scalars into ``run_dir / "tb"``.

    Args:
        run_dir: the run folder.
        resumed_at: the step a resumed run restarts from; events of an earlier session at later
            steps are purged (as ``metrics.jsonl``'s lines after the checkpoint are dropped).
    """

    def __init__(self, run_dir: str | Path, *, resumed_at: int = 0) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(
            str(run_subdir(Path(run_dir) / TB_DIR)),  # never a link
            purge_step=resumed_at + 1 if resumed_at else None,
        )

    def write(self, record: dict[str, Any]) -> None:
        """Add one ``metrics.jsonl`` record: each finite number as ``<split>/<key>``."""
        split = record.get("split", "train")
        for key, value in record.items():
            if key in _NOT_SCALARS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(
                    f"{split}/{key}", value, global_step=record["step"], walltime=record["time"]
                )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
