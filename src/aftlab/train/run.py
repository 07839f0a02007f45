"""Open a finished (or interrupted) run folder: its config, task, and newest checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.config import TransformerConfig
from .build import build_model, build_task
from .checkpoint import latest_checkpoint, load_checkpoint, read_checkpoint_config
from .config import TrainConfig
from .errors import UsageError

__all__ = ["LoadedRun", "load_run", "check_run_dir"]


@dataclass
class LoadedRun:
    """A run's config, task, model (weights loaded, eval mode) and checkpoint folder."""

    config: TrainConfig
    model_config: TransformerConfig
    task: Any
    model: nn.Module
    checkpoint: Path
    step: int


def check_run_dir(run_dir: str | Path) -> Path:
    """The newest checkpoint of ``run_dir``; a :class:`UsageError` saying why there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(
            f"run folder {str(run_dir)!r} does not exist (give the --out folder of a training run)"
        )
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise UsageError(
            f"run folder {str(run_dir)!r} has no checkpoint yet (train it first: aftlab train "
            f"--out {run_dir})"
        )
    return ckpt


def load_run(
    run_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    data: str | None = None,
    load_task: bool = True,
) -> LoadedRun:
    """Load a run folder for evaluation or sampling: its config and weights, never its training
    state (optimizer, RNG), which evaluation does not need.

    Args:
        run_dir: a run folder written by ``aftlab train``.
        device: where the model goes.
        data: use this data path instead of the one the run was trained on.
        load_task: build the task (False for plotting weights only).

    Raises:
        UsageError: no such run, no checkpoint, damaged checkpoint, weights not matching the config.
    """
    ckpt = check_run_dir(run_dir)
    saved = read_checkpoint_config(ckpt)
    try:
        config = TrainConfig.from_dict(saved["train"])
        model_config = TransformerConfig.from_dict(saved["model"])
        info = saved["task"]
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"checkpoint {str(ckpt)!r} has an unreadable config.json ({e})") from None
    if data is not None:
        config = config.replace(data=data)
    task = build_task(config) if load_task else None
    torch.manual_seed(config.seed)
    model = build_model(model_config, info).to(device)
    state = load_checkpoint(ckpt, model, map_location=device, with_state=False)
    model.eval()
    return LoadedRun(config, model_config, task, model, ckpt, state["step"])
