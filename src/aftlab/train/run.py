"""Open a finished (or interrupted) run folder: its config, task, and newest checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..models.config import RWKV4Config, TransformerConfig, model_config_from_dict
from .build import build_model, build_task
from .checkpoint import latest_checkpoint, load_checkpoint, read_checkpoint_config
from .config import TrainConfig, check_stored

__all__ = ["LoadedRun", "load_run", "check_run_dir", "read_run_config"]


@dataclass
class LoadedRun:
    """A run's config, task, model (weights loaded, eval mode) and checkpoint folder.

    ``task_info`` is the checkpoint's description of the task (:meth:`aftlab.data.Task.info`),
    there even when the task itself was not built (``load_task=False``).
    """

    config: TrainConfig
    model_config: TransformerConfig | RWKV4Config
    task: Any
    model: nn.Module
    checkpoint: Path
    step: int
    task_info: dict[str, Any] = field(default_factory=dict)


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


def read_run_config(
    ckpt: Path,
) -> tuple[TrainConfig, TransformerConfig | RWKV4Config, dict[str, Any]]:
    """The train config, model config and task info of a checkpoint's ``config.json``.

    The one check of a stored config, for evaluation and ``train --resume`` alike: the
    ``train``, ``model`` and ``task`` sections, every setting that changes what is learned
    (:func:`~aftlab.train.config.check_stored`), no unknown key or field.

    Raises:
        UsageError: a damaged checkpoint, or a config.json that fails one of these checks.
    """
    saved = read_checkpoint_config(ckpt)
    unreadable = f"checkpoint {str(ckpt)!r} has an unreadable config.json"
    for section in ("train", "model", "task"):
        if not isinstance(saved, dict) or not isinstance(saved.get(section), dict):
            raise UsageError(f"{unreadable} (no {section!r} section)")
    check_stored(saved["train"], f"the config.json of checkpoint {str(ckpt)!r}")
    try:
        config = TrainConfig.from_dict(saved["train"])
        model_config = model_config_from_dict(saved["model"])
    except (TypeError, ValueError) as e:
        raise UsageError(f"{unreadable} ({e})") from None
    return config, model_config, saved["task"]


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
    config, model_config, info = read_run_config(ckpt)
    if data is not None:
        config = config.replace(data=data)
    task = build_task(config) if load_task else None
    torch.manual_seed(config.seed)
    model = build_model(model_config, info).to(device)
    state = load_checkpoint(ckpt, model, map_location=device, with_state=False)
    model.eval()
    return LoadedRun(config, model_config, task, model, ckpt, state["step"], info)
