"""Datasets as deterministic batches of token ids: ``build_task(name, data=..., seq_len=...)``.

Tasks (kind, metric, data):
    ``text`` (default): lm, bpb; a UTF-8 file or folder, default Python's stdlib sources.
    ``enwik8``, ``text8``: lm, bpc; a local copy of the file.
    ``digits``: lm, bits/dim; scikit-learn's 8x8 digits (extra ``aftlab[data]``).
    ``digits-classify``: classify, accuracy; the same digits, 10 labels.
    ``cifar10``: lm, bits/dim; a local ``cifar-10-batches-py`` folder.
    ``recall``: lm, accuracy; generated multi-query associative recall.
    ``copy``: lm, accuracy; generated copying.

See docs/data.md for splits and options. Example::

    task = build_task("text", seq_len=128)
    batch = task.train_batch(0, batch_size=8)      # {"input": (8, 128), "target": (8, 128)}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .._checks import did_you_mean
from .base import IGNORE_INDEX, DataError, Task, count_correct
from .images import ImageTask, build_cifar10, build_digits, build_digits_classify
from .synthetic import SyntheticTask, build_copy, build_recall
from .text import ByteLMTask, build_enwik8, build_text, build_text8

__all__ = [
    "DataError",
    "Task",
    "ByteLMTask",
    "ImageTask",
    "SyntheticTask",
    "IGNORE_INDEX",
    "available_tasks",
    "build_task",
    "BYTE_TASKS",
    "byte_level",
    "count_correct",
    "default_seq_len",
]

_BUILDERS: dict[str, tuple[Callable[..., Task], int]] = {
    "text": (build_text, 256),
    "enwik8": (build_enwik8, 256),
    "text8": (build_text8, 256),
    "digits": (build_digits, 64),
    "digits-classify": (build_digits_classify, 64),
    "cifar10": (build_cifar10, 3072),
    "recall": (build_recall, 64),
    "copy": (build_copy, 64),
}

#: the tasks whose tokens are the UTF-8 bytes of text, id = byte value (a :class:`ByteLMTask`)
BYTE_TASKS = ("text", "enwik8", "text8")


def byte_level(info: Mapping[str, Any]) -> bool:
    """Whether the task of ``info`` (:meth:`Task.info`, or a checkpoint's ``task``) is a
    byte-level text task: one of :data:`BYTE_TASKS`, a language model of 256 ids."""
    kind, vocab = info.get("kind"), info.get("vocab_size")
    return info.get("task") in BYTE_TASKS and kind == "lm" and vocab == 256


def available_tasks() -> list[str]:
    """Names accepted by :func:`build_task`, the default (``"text"``) first."""
    return list(_BUILDERS)


def _check_name(name: object) -> str:
    if name not in _BUILDERS:
        hint = did_you_mean(name, _BUILDERS)
        raise DataError(f"unknown task {name!r}; {hint}available: {', '.join(_BUILDERS)}")
    return name  # type: ignore[return-value]


def default_seq_len(name: str) -> int:
    """The sequence length ``name`` uses when ``seq_len`` is not given (fixed for images)."""
    return _BUILDERS[_check_name(name)][1]


def build_task(
    name: str,
    *,
    data: str | os.PathLike | None = None,
    seq_len: int | None = None,
    seed: int = 0,
    **options: Any,
) -> Task:
    """Build a task by name.

    Args:
        name: one of :func:`available_tasks`.
        data: file or folder for ``text``, ``enwik8``, ``text8``, ``cifar10``; ``None`` for the
            others (and for ``text``'s default corpus, Python's standard library sources).
        seq_len: tokens per sequence ``T``; ``None`` takes :func:`default_seq_len`. Image tasks
            ignore it: an image fixes the length (digits 64, cifar10 3072); read
            ``task.seq_len``.
        seed: seed of the training stream (evaluation sets never depend on it).
        **options: task options (docs/data.md); an unknown one is an error.

    Returns:
        The :class:`Task`.

    Raises:
        DataError: unknown task or option, missing/empty/unsuitable data, data shorter than one
            context; the message is one line saying what to do.
    """
    builder, default = _BUILDERS[_check_name(name)]
    if seq_len is None:
        seq_len = default
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise DataError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return builder(data=data, seq_len=seq_len, seed=seed, **options)
