"""Build the task and the model a :class:`TrainConfig` describes.

:func:`model_config_for` is the one place a run's :class:`TransformerConfig` is built, once the
task is known; a checkpoint stores the result (``config.json``'s ``model``), which is what a
loader builds the model from. The task is described by :meth:`aftlab.data.Task.info`: what
:func:`build_model` reads, ``task.json`` and a checkpoint's ``task``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._checks import did_you_mean
from ..errors import UsageError
from ..models.config import RWKV4Config, TransformerConfig
from ..models.memory import check_memory, estimate_memory, parameter_count
from .config import TrainConfig

__all__ = ["build_task", "build_model", "model_config_for", "check_training_memory"]


def build_task(config: TrainConfig) -> Any:
    """The :class:`aftlab.data.Task` of ``config`` (task name, data path, context, seed, options).

    Raises:
        UsageError: unknown task, missing/empty/too-short data, bad task option.
    """
    from .. import data as data_mod

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


def model_config_for(config: TrainConfig, task: Any) -> TransformerConfig | RWKV4Config:
    """The run's model config: the config's ``[model]``, ``mixer`` and ``mixer_options``, with
    what the task decides.

    The task gives ``vocab_size``, ``max_seq_len`` (its ``seq_len``: an image fixes it),
    ``causal`` (``task.kind == "lm"``) and the mixer options the mixer takes from a task (its
    ``options_from_task``, e.g. aft-conv's ``grid`` on digits classification) that the config
    does not set. ``model.architecture = "rwkv4"`` gives an :class:`RWKV4Config`: a causal
    language model of text, which no other task trains.

    Raises:
        UsageError: an unknown mixer (with the close names), a model the task's sizes make
            invalid, an architecture the task cannot train.
    """
    from ..mixers import available_mixers, get_mixer_class

    if config.architecture != "transformer":
        if task.kind != "lm" or getattr(task, "image_shape", None) is not None:
            raise UsageError(
                f"config: model.architecture = {config.architecture!r} is a language model of "
                f"token sequences; task {config.task!r} needs a "
                + ("classifier" if task.kind != "lm" else "pixel model")
                + ' (model.architecture = "transformer")'
            )
        try:
            return config.model_config(vocab_size=task.vocab_size, max_seq_len=task.seq_len)
        except (TypeError, ValueError) as e:
            raise UsageError(f"config: {e}") from None
    try:
        mixer = get_mixer_class(config.mixer)
    except ValueError:
        names = available_mixers()
        raise UsageError(
            f"unknown mixer {config.mixer!r}; {did_you_mean(config.mixer, names)}"
            f"known mixers: {', '.join(names)}"
        ) from None
    options = dict(config.mixer_options)
    for name in mixer.options_from_task:
        if getattr(task, name, None) is not None:
            options.setdefault(name, getattr(task, name))
    try:
        return TransformerConfig(
            **config.model,
            vocab_size=task.vocab_size,
            max_seq_len=task.seq_len,
            mixer=config.mixer,
            mixer_options=options,
            causal=task.kind == "lm",
        )
    except (TypeError, ValueError) as e:
        raise UsageError(f"config: {e}") from None


def build_model(
    model_config: TransformerConfig | RWKV4Config, task_info: dict[str, Any]
) -> nn.Module:
    """The model for a task: language model, pixel model or classifier; an
    :class:`~aftlab.models.RWKV4LM` for an :class:`RWKV4Config`.

    Args:
        model_config: from :func:`model_config_for` (or a checkpoint's ``config.json``).
        task_info: the task's :meth:`~aftlab.data.Task.info` (or a checkpoint's ``task``):
            its ``kind``, ``num_classes`` and ``image_shape`` are read.

    Raises:
        UsageError: the mixer rejects its options (e.g. an unknown option name).
    """
    from .. import models

    kind = task_info["kind"]
    try:
        if isinstance(model_config, RWKV4Config):
            return models.RWKV4LM(model_config)
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
        first = str(e).splitlines()[0] if str(e) else type(e).__name__  # torch adds C++ frames
        raise UsageError(f"cannot build the model: {first}") from None


def check_training_memory(
    config: TrainConfig,
    model_config: TransformerConfig,
    task_info: dict[str, Any],
    micro_batch: int | None,
    *,
    device: torch.device,
) -> None:
    """Refuse a run that cannot fit on ``device``, before its model is built.

    :func:`~aftlab.models.memory.estimate_memory` of float32 parameters, their gradients and
    AdamW moments, and the activations of one micro-batch of ``micro_batch`` sequences (bf16
    ones with ``precision="bf16"``); ``micro_batch=None`` (FSDP, whose states are sharded):
    the parameters only. ``AFTLAB_MEMORY_CHECK=0`` skips it.

    Raises:
        UsageError: one line with the estimate and the memory available.
    """
    num_classes = task_info["num_classes"] if task_info["kind"] == "classify" else None
    needed = estimate_memory(
        model_config,
        num_classes=num_classes,
        dtype=torch.float32,
        batch_size=micro_batch,
        activation_dtype=torch.bfloat16 if config.precision == "bf16" else None,
    )
    n = parameter_count(model_config, num_classes=num_classes)
    what = f"training this model ({n:,} parameters"
    if micro_batch is not None:
        what += f", micro-batches of {micro_batch} x {model_config.max_seq_len} tokens"
    try:
        check_memory("config", needed, what + ")", device=device)
    except ValueError as e:
        raise UsageError(str(e)) from None

