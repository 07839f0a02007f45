"""The task interface shared by every dataset, and the helpers that make batches deterministic.

A :class:`Task` turns a dataset into batches of token ids. Every training batch is a pure
function of ``(seed, step, rank, world_size, batch_size)``: a resumed run reads exactly the
batches an uninterrupted run reads (the data position *is* the step), and ``N`` processes with
``batch_size`` each read, concatenated in rank order, the batch one process with
``N * batch_size`` reads (each rank gets a disjoint slice of the same global batch).
"""

from __future__ import annotations

import errno
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from .._checks import check_positive_int

__all__ = [
    "DataError",
    "Task",
    "IGNORE_INDEX",
    "check_input_path",
    "count_correct",
    "step_rng",
    "shard",
    "pack_rows",
]

#: Target value of positions that carry no loss (PyTorch's ``cross_entropy`` default).
IGNORE_INDEX = -100

Kind = Literal["lm", "classify"]
Split = Literal["val", "test"]


class DataError(ValueError):
    """Bad data input a user can fix (missing path, too-short file, unknown task or option).

    The message is one line saying what is wrong and what to do; the command line prints it
    and exits with status 2.
    """


_SPECIAL_KINDS = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "named pipe (FIFO)"),
    (stat.S_ISSOCK, "socket"),
)


def check_input_path(
    path: str | os.PathLike,
    *,
    what: str,
    arg: str,
    folder_ok: bool = False,
    error: type[Exception] = DataError,
) -> Path:
    """``path`` as an existing regular file (or folder, with ``folder_ok``), else ``error``.

    Only ``os.stat`` looks at the path, so a named pipe, a device (``/dev/null``) or a socket is
    refused without being opened: opening a FIFO would block until someone writes to it.

    Args:
        path: the path the user gave.
        what: what it is, for the message (``"data path"``, ``"config file"``).
        arg: the command-line argument it came from (``"--data"``).
        folder_ok: accept a folder too.
        error: the exception class to raise (its message is one line naming ``arg``).

    Returns:
        ``path`` as a :class:`~pathlib.Path` (``~`` expanded).
    """
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
    except OSError as err:  # missing, a broken link, a file used as a folder, a loop of links
        gone = err.errno in (errno.ENOENT, errno.ENOTDIR)
        problem = "does not exist" if gone else f"cannot be read ({err.strerror})"
        raise error(f"{what} {str(p)!r} {problem}; check {arg}") from None
    if stat.S_ISREG(mode) or (folder_ok and stat.S_ISDIR(mode)):
        return p
    expected = "a regular file or a folder" if folder_ok else "a regular file"
    kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
    for test, name in _SPECIAL_KINDS:
        if test(mode):
            kind = f"a {name}"
    raise error(f"{what} {str(p)!r} is {kind}, expected {expected}; check {arg}")


def step_rng(*key: int) -> np.random.Generator:
    """A NumPy generator seeded by a tuple of ints in ``[0, 2^64)``, e.g. ``(seed, step, stream)``.

    The key is written as its length followed by two 32-bit words per int (so ``(0, 1)`` and
    ``(0, 1, 0)`` differ, which plain ``SeedSequence([0, 1])`` and ``([0, 1, 0])`` do not);
    ``np.random.SeedSequence`` mixes the words, so neighbouring keys give independent streams
    and the same key always gives the same stream.
    """
    words = [len(key)]
    for k in key:
        k = int(k)
        if not 0 <= k < 2**64:
            raise ValueError(f"step_rng: every key must be in [0, 2**64), got {k}")
        words += [k & 0xFFFFFFFF, k >> 32]
    return np.random.default_rng(np.random.SeedSequence(words))


def check_batch_args(where: str, *, step: int, batch_size: int, rank: int, world_size: int) -> None:
    """Validate the arguments of :meth:`Task.train_batch` (errors name the argument)."""
    check_positive_int(where, "step", step, allow_zero=True)
    check_positive_int(where, "batch_size", batch_size)
    check_positive_int(where, "world_size", world_size)
    check_positive_int(where, "rank", rank, allow_zero=True)
    if rank >= world_size:
        raise ValueError(f"{where}: 'rank' must be < world_size={world_size}, got {rank}")


def check_window_args(
    where: str, *, step: int, batch_size: int, rank: int, world_size: int, windows: int
) -> None:
    """Validate the arguments of :meth:`Task.consecutive_windows` (errors name the argument)."""
    check_batch_args(where, step=step, batch_size=batch_size, rank=rank, world_size=world_size)
    check_positive_int(where, "windows", windows)


def shard(global_rows: np.ndarray, *, batch_size: int, rank: int) -> np.ndarray:
    """Rows ``[rank * batch_size, (rank + 1) * batch_size)`` of a global batch.

    Args:
        global_rows: array whose first axis is the global batch ``G = batch_size * world_size``.
        batch_size: per-rank batch size ``B``.
        rank: this process's rank ``r``.

    Returns:
        ``global_rows[r * B:(r + 1) * B]``.
    """
    return global_rows[rank * batch_size : (rank + 1) * batch_size]


def count_correct(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> tuple[int, int]:
    """Count correct arg-max predictions where ``target != ignore_index``.

    Accuracy over a split is ``sum(correct) / sum(counted)`` over its batches, so every
    counted position (recall query, copied token, image label) weighs the same.

    Args:
        logits: ``(..., C)`` scores; the prediction is ``argmax`` over the last axis.
        target: ``(...)`` class ids, ``ignore_index`` where nothing is scored.
        ignore_index: target value of unscored positions.

    Returns:
        ``(correct, counted)`` as Python ints.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"count_correct: 'logits' must have shape {tuple(target.shape)} + (C,) to match "
            f"'target', got {tuple(logits.shape)}"
        )
    keep = target != ignore_index
    correct = (logits.argmax(dim=-1) == target) & keep
    return int(correct.sum()), int(keep.sum())


class Task:
    """A dataset as batches of token ids: the interface the trainer reads.

    Attributes:
        name: registry name (``"text"``, ``"digits"``, ...).
        kind: ``"lm"`` (a target per position, ``(B, T)``) or ``"classify"`` (one per sequence,
            ``(B,)``).
        vocab_size: number of input token ids; ids are ``0 .. vocab_size - 1``.
        num_classes: number of labels for ``"classify"`` tasks, else ``None`` (an lm predicts
            ``vocab_size`` ids).
        seq_len: tokens per sequence ``T``.
        metric: what evaluation reports: ``"bpc"``, ``"bpb"``, ``"bits/dim"`` (all from the
            mean loss via :meth:`metric_from_loss`) or ``"accuracy"`` (from predictions, see
            :func:`count_correct`).
        image_shape: ``(H, W)`` or ``(H, W, C)`` for pixel tasks, else ``None``.
        grid: ``(H, W)`` of the token grid for 2-d models (AFT-conv2d) on classification, else
            ``None``.
        seed: seed of the training stream.

    Batches are dicts of CPU tensors:
        ``"input"``: LongTensor ``(B, T)``.
        ``"target"``: LongTensor ``(B, T)`` for ``"lm"`` (``-100`` where there is no loss) or
        ``(B,)`` for ``"classify"``.
    """

    name: str
    kind: Kind
    vocab_size: int
    num_classes: int | None = None
    seq_len: int
    metric: str
    image_shape: tuple[int, ...] | None = None
    grid: tuple[int, int] | None = None
    seed: int = 0

    #: metrics computed from the mean negative log-likelihood, in bits.
    BITS_METRICS: ClassVar[tuple[str, ...]] = ("bpc", "bpb", "bits/dim")

    # ----------------------------------------------------------------- interface
    def train_batch(
        self, step: int, *, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> dict[str, torch.Tensor]:
        """The training batch of ``step`` for ``rank`` (a pure function of its arguments).

        Args:
            step: optimizer step (the data position), ``>= 0``.
            batch_size: rows per rank ``B``.
            rank: this process's rank ``r``, ``0 <= r < world_size``.
            world_size: number of processes ``N``; the global batch has ``N * B`` rows and this
                rank gets rows ``[r * B, (r + 1) * B)`` of it.

        Returns:
            ``{"input": (B, T), "target": (B, T) or (B,)}`` LongTensors.

        Raises:
            ValueError: an argument is out of range (:func:`check_batch_args`); a subclass
                writes :meth:`_train_batch`, which gets checked arguments.
        """
        check_batch_args(
            f"{self.name}.train_batch",
            step=step,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
        )
        return self._train_batch(step, batch_size=batch_size, rank=rank, world_size=world_size)

    def eval_batches(
        self, split: Split, *, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Batches covering ``split`` in a fixed order (the last batch may have fewer rows).

        Args:
            split: ``"val"`` or ``"test"``.
            batch_size: rows per batch.
            max_batches: stop after this many batches (``None``: the whole split).
        """
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """The task's one description: name, kind, sizes, metric, seed, then (subclasses) source,
        split sizes and settings; what a model is built from (``kind``, ``num_classes``,
        ``image_shape``), a run's ``task.json`` and its checkpoints' ``task``."""
        return {
            "task": self.name,
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "num_classes": self.num_classes,
            "seq_len": self.seq_len,
            "metric": self.metric,
            "image_shape": self.image_shape,
            "seed": self.seed,
        }

    # ----------------------------------------------------------------- long streams
    def document_starts(self, split: str) -> np.ndarray | None:
        """Offsets into ``split`` where a document begins (sorted int64, from 0), or ``None``
        for a task without document boundaries (one file, generated data, images)."""
        return None

    def stream(self, split: str) -> np.ndarray:
        """``split`` as one continuous 1-d stream of token ids (``aftlab eval --stream``).

        Raises:
            DataError: the task is not a stream of tokens (only the byte-level text tasks are).
        """
        raise DataError(self._not_a_stream("eval --stream"))

    def consecutive_windows(
        self, step: int, *, batch_size: int, rank: int = 0, world_size: int = 1, windows: int = 1
    ) -> dict[str, torch.Tensor]:
        """The ``windows`` consecutive windows of every stream read at ``step`` (``carry_state``;
        :meth:`ByteLMTask.consecutive_windows`).

        Raises:
            DataError: the task is not a stream of tokens.
        """
        raise DataError(self._not_a_stream("carry_state"))

    def document_batch(
        self, step: int, *, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> dict[str, torch.Tensor]:
        """:meth:`train_batch`'s rows with their document starts (``pack_documents``;
        :meth:`ByteLMTask.document_batch`).

        Raises:
            DataError: the task has no document boundaries.
        """
        raise DataError(
            f"pack_documents: task {self.name!r} has no document boundaries; it needs a corpus "
            "of several files (--task text with a folder as --data, or the default stdlib corpus)"
        )

    def _not_a_stream(self, what: str) -> str:
        return (
            f"{what}: task {self.name!r} is not one stream of tokens; it needs a byte-level text "
            "task (text, enwik8, text8)"
        )

    # ----------------------------------------------------------------- metric
    def metric_from_loss(self, mean_nll_nats: float) -> float:
        """Convert a mean negative log-likelihood in nats into the task's bits metric.

        ``bits = nats / ln 2``: per byte (``bpb``), per character (``bpc``) or per sub-pixel
        (``bits/dim``). The mean must be over scored targets (sum of losses over positions with
        ``target != -100``, divided by their count), not a mean of per-batch means.

        Raises:
            ValueError: the task's metric is ``"accuracy"``, which comes from predictions
                (:func:`count_correct`), not from the loss.
        """
        if self.metric not in self.BITS_METRICS:
            raise ValueError(
                f"{self.name}: metric {self.metric!r} is not a function of the loss; count "
                "correct predictions with aftlab.data.count_correct(logits, target)"
            )
        return float(mean_nll_nats) / math.log(2.0)

    # ----------------------------------------------------------------- helpers
    def _train_batch(
        self, step: int, *, batch_size: int, rank: int, world_size: int
    ) -> dict[str, torch.Tensor]:
        """:meth:`train_batch` for arguments already checked: what a subclass writes."""
        raise NotImplementedError

    def _check_split(self, split: str) -> None:
        if split not in ("val", "test"):
            raise ValueError(
                f"{self.name}.eval_batches: 'split' must be 'val' or 'test', got {split!r}"
            )

    def __repr__(self) -> str:
        cls = type(self).__name__
        return f"{cls}(name={self.name!r}, seq_len={self.seq_len}, metric={self.metric!r})"


def check_eval_args(where: str, *, batch_size: int, max_batches: int | None) -> None:
    """Validate the arguments of :meth:`Task.eval_batches`."""
    check_positive_int(where, "batch_size", batch_size)
    if max_batches is not None:
        check_positive_int(where, "max_batches", max_batches)


def pack_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A document batch of ``B`` rows as one row of packed documents (``pack_documents``).

    ``batch``: ``input``, ``target`` ``(B, T)`` and ``doc_start`` ``(B, T)`` bool, True where a
    document begins (:meth:`ByteLMTask.document_batch`). Every row start and every document
    start inside a row begins a new document of the packed row, so no position sees another row
    or another document.

    Returns:
        ``{"input": (1, B T), "target": (1, B T), "cu_seqlens": int32 [0, n_1, ..., B T]}``
        (the FlashAttention convention of :mod:`aftlab.ops._packed`).
    """
    start = batch["doc_start"]
    B, T = start.shape
    first = start.reshape(-1).clone()
    first[::T] = True
    ends = torch.tensor([B * T], dtype=torch.int64, device=first.device)
    cu = torch.cat([first.nonzero()[:, 0], ends]).to(torch.int32)
    return {
        "input": batch["input"].reshape(1, B * T),
        "target": batch["target"].reshape(1, B * T),
        "cu_seqlens": cu,
    }


def batch_slices(n: int, *, batch_size: int, max_batches: int | None) -> Iterator[slice]:
    """Slices ``[i, i + batch_size)`` covering rows ``0 .. n - 1`` in order, for eval batches.

    Args:
        n: number of rows of the split.
        batch_size: rows per batch ``B``; the last slice may be shorter.
        max_batches: stop after this many slices (``None``: all ``ceil(n / B)``).
    """
    stop = n if max_batches is None else min(n, max_batches * batch_size)
    return (slice(i, i + batch_size) for i in range(0, stop, batch_size))


def epoch_indices(n: int, *, seed: int, start: int, count: int) -> np.ndarray:
    """Sample ids ``start .. start + count - 1`` of an endless stream of shuffled epochs.

    Epoch ``e`` is a permutation of ``0 .. n - 1`` drawn from ``(seed, e)``; the stream visits
    every sample once per epoch (sampling without replacement) and position ``g`` of the stream
    is sample ``perm_e[g mod n]`` with ``e = g // n``.

    Args:
        n: number of samples in the split.
        seed: the task seed.
        start: first stream position (``step * global_batch``).
        count: number of positions.

    Returns:
        ``(count,)`` int64 sample ids.
    """
    pos = np.arange(start, start + count, dtype=np.int64)
    epochs = pos // n
    out = np.empty(count, dtype=np.int64)
    for e in np.unique(epochs):
        perm = step_rng(seed, int(e), 7).permutation(n)
        sel = epochs == e
        out[sel] = perm[pos[sel] % n]
    return out


def take_options(
    task: str, options: dict[str, Any], spec: dict[str, tuple[type | tuple[type, ...], Any]]
) -> dict[str, Any]:
    """Check a task's keyword options against ``spec`` and fill in defaults.

    Args:
        task: task name, for messages.
        options: what the user passed.
        spec: ``{option: (type or tuple of types, default)}``; numbers reject ``bool``; an
            option whose default is ``None`` also accepts ``None``.

    Returns:
        A dict with every option of ``spec``.

    Raises:
        DataError: an unknown option, or a value of the wrong type.
    """
    unknown = sorted(set(options) - set(spec))
    if unknown:
        known = ", ".join(sorted(spec)) or "none"
        raise DataError(f"task {task!r} has no option {unknown[0]!r}; its options are: {known}")
    out = {}
    for key, (typ, default) in spec.items():
        value = options.get(key, default)
        types = typ if isinstance(typ, tuple) else (typ,)
        bad = not isinstance(value, types) or (bool not in types and isinstance(value, bool))
        if bad and not (value is None and default is None):
            want = " or ".join(t.__name__ for t in types)
            raise DataError(
                f"task {task!r}: option {key!r} must be {want}, "
                f"got {type(value).__name__} {value!r}"
            )
        out[key] = value
    return out
