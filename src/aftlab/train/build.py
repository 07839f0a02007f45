"""Build the task and the model a :class:`TrainConfig` describes."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..models.config import TransformerConfig
from .config import TrainConfig
from .errors import UsageError

__all__ = ["build_task", "build_model", "model_config_for"]


def build_task(config: TrainConfig) -> Any:
    """The :class:`aftlab.data.Task` of ``config`` (task name, data path, context, seed, options).

    Raises:
        UsageError: unknown task, missing/empty/too-short data, bad task option.
    """
    from .. import data as data_mod

    names = data_mod.available_tasks()
    if config.task not in names:
        import difflib

        near = difflib.get_close_matches(config.task, names, n=2)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise UsageError(f"unknown task {config.task!r}; {hint}known tasks: {', '.join(names)}")
    try:
        return data_mod.build_task(
            config.task,
            data=config.data,
            seq_len=config.seq_len,
            seed=config.seed,
            **config.task_options,
        )
    except data_mod.DataError as e:
        raise UsageError(str(e)) from None


def model_config_for(config: TrainConfig, task: Any) -> TransformerConfig:
    """The model's :class:`TransformerConfig`: sizes from ``config``, the rest from ``task``.

    For ``aft-conv`` on a task with a 2-d ``grid`` (digits classification), the grid goes into
    the mixer options unless the config sets one.
    """
    from ..mixers import available_mixers, get_mixer_class

    if config.mixer not in available_mixers():
        import difflib

        near = difflib.get_close_matches(config.mixer, available_mixers(), n=2)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise UsageError(
            f"unknown mixer {config.mixer!r}; {hint}known mixers: {', '.join(available_mixers())}"
        )
    extra: dict[str, Any] = {}
    grid = getattr(task, "grid", None)
    if (
        grid is not None
        and "grid" in inspect.signature(get_mixer_class(config.mixer).__init__).parameters
    ):
        extra["grid"] = tuple(grid)
    try:
        base = config.transformer_config(
            vocab_size=task.vocab_size, causal=task.kind == "lm", **extra
        )
        return TransformerConfig.from_dict({**base.to_dict(), "max_seq_len": task.seq_len})
    except (TypeError, ValueError) as e:
        raise UsageError(f"config: {e}") from None


def build_model(model_config: TransformerConfig, task_info: dict[str, Any]) -> nn.Module:
    """The model for a task: language model, pixel model or classifier.

    Args:
        model_config: from :func:`model_config_for` (or a checkpoint's ``config.json``).
        task_info: ``kind``, ``num_classes`` and ``image_shape`` of the task.

    Raises:
        UsageError: the mixer rejects its options (e.g. an unknown option name).
    """
    from .. import models

    kind = task_info["kind"]
    try:
        if kind == "classify":
            return models.TransformerClassifier(
                model_config, num_classes=int(task_info["num_classes"]), pooling="mean"
            )
        if task_info.get("image_shape") is not None:
            return models.PixelTransformer(
                model_config, image_shape=tuple(task_info["image_shape"])
            )
        return models.TransformerLM(model_config)
    except (TypeError, ValueError) as e:
        raise UsageError(f"cannot build the model: {e}") from None


def task_info(task: Any) -> dict[str, Any]:
    """What :func:`build_model` and evaluation need to know about a task (JSON-serialisable)."""
    shape = getattr(task, "image_shape", None)
    return {
        "name": task.name,
        "kind": task.kind,
        "vocab_size": task.vocab_size,
        "num_classes": getattr(task, "num_classes", None),
        "seq_len": task.seq_len,
        "metric": task.metric,
        "image_shape": list(shape) if shape is not None else None,
    }
