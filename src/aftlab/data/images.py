"""Pixel tasks: scikit-learn's 8x8 digits (generation and classification) and CIFAR-10.

An image is a sequence of its pixel values in raster order (row by row, left to right; for
colour images the three channels of a pixel follow each other, R, G, B: "channel-last" order,
as in the AFT paper's CIFAR-10 experiment). For generation the model predicts every value from
the ones before it: ``target = pixels``, ``input = [0] + pixels[:-1]`` (shifted right with a
constant 0 start value, so the first value is predicted from nothing), and the metric is bits
per dimension, ``mean NLL / ln 2`` over all values.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import (
    DataError,
    Task,
    batch_slices,
    check_eval_args,
    epoch_indices,
    shard,
    take_options,
)

__all__ = ["ImageTask", "build_digits", "build_digits_classify", "build_cifar10", "load_cifar10"]

_CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
# What a CIFAR-10 pickle may reference: numpy's array reconstruction, nothing else.
_SAFE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class ImageTask(Task):
    """Images as value sequences, for generation (``kind="lm"``) or classification.

    Training reads shuffled epochs: the global batch of ``step`` holds stream positions
    ``step * G .. step * G + G - 1`` (``G = batch_size * world_size``) of an endless sequence
    of permutations of the train split, one per epoch, drawn from ``(seed, epoch)``.
    Evaluation reads the split's images in order.

    Args:
        name: task name.
        images: ``{"train", "val", "test"}`` -> ``(N, D)`` ``uint8`` value arrays.
        labels: ``{"train", "val", "test"}`` -> ``(N,)`` int labels.
        kind: ``"lm"`` (generation, bits/dim) or ``"classify"`` (accuracy).
        vocab_size: number of pixel levels.
        image_shape: shape of one decoded image, ``prod == D``.
        num_classes: labels of the classification task.
        grid: token grid for classification.
        seed: seed of the training stream.
        source: description for :meth:`info`.
    """

    def __init__(
        self,
        name: str,
        images: dict[str, np.ndarray],
        labels: dict[str, np.ndarray],
        *,
        kind: str,
        vocab_size: int,
        image_shape: tuple[int, ...],
        num_classes: int,
        grid: tuple[int, int] | None,
        seed: int,
        source: str,
        split_rule: str,
    ) -> None:
        self.name = name
        self.kind = kind  # type: ignore[assignment]
        self.vocab_size = vocab_size
        self.image_shape = image_shape
        self.seq_len = int(np.prod(image_shape))
        self.num_classes = num_classes if kind == "classify" else None
        self.grid = grid if kind == "classify" else None
        self.metric = "accuracy" if kind == "classify" else "bits/dim"
        self.seed = seed
        self.images = images
        self.labels = labels
        self.source = source
        self.split_rule = split_rule
        for split, arr in images.items():
            if len(arr) == 0:
                raise DataError(f"{name}: the {split} split of {source} is empty; use more images")

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(
            source=self.source,
            split_images={k: len(v) for k, v in self.images.items()},
            grid=self.grid,
            split_rule=self.split_rule,
        )
        return out

    def _batch(self, pixels: np.ndarray, labels: np.ndarray) -> dict[str, torch.Tensor]:
        x = torch.from_numpy(pixels.astype(np.int64))
        if self.kind == "classify":
            return {"input": x, "target": torch.from_numpy(labels.astype(np.int64))}
        inp = torch.zeros_like(x)
        inp[:, 1:] = x[:, :-1]
        return {"input": inp, "target": x}

    def _train_batch(
        self, step: int, *, batch_size: int, rank: int, world_size: int
    ) -> dict[str, torch.Tensor]:
        g = batch_size * world_size
        ids = epoch_indices(len(self.images["train"]), seed=self.seed, start=step * g, count=g)
        ids = shard(ids, batch_size=batch_size, rank=rank)
        return self._batch(self.images["train"][ids], self.labels["train"][ids])

    def eval_batches(
        self, split: str, *, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        self._check_split(split)
        check_eval_args(f"{self.name}.eval_batches", batch_size=batch_size, max_batches=max_batches)
        images, labels = self.images[split], self.labels[split]
        for s in batch_slices(len(images), batch_size=batch_size, max_batches=max_batches):
            yield self._batch(images[s], labels[s])

    def decode_image(self, tokens: torch.Tensor | np.ndarray) -> np.ndarray:
        """Pixel values ``(..., D)`` as ``uint8`` images ``(..., *image_shape)``.

        Values stay in the task's levels (digits: 0..16, multiply by 255/16 to view; CIFAR-10:
        0..255).
        """
        arr = np.asarray(torch.as_tensor(tokens).cpu())
        D = self.seq_len
        if arr.ndim == 0 or arr.shape[-1] != D:
            raise ValueError(
                f"{self.name}.decode_image: 'tokens' must have shape (..., {D}), got {arr.shape}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"{self.name}.decode_image: 'tokens' must be values in 0..{self.vocab_size - 1}, "
                f"got range {arr.min()}..{arr.max()}"
            )
        return arr.astype(np.uint8).reshape(*arr.shape[:-1], *self.image_shape)


# --------------------------------------------------------------------------- digits
@functools.lru_cache(maxsize=1)
def _digits_splits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """scikit-learn's 1797 digits split by index: ``i % 10 == 8`` val, ``== 9`` test, else train.

    Loaded once per process; the arrays are read-only.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise DataError("the digits tasks need scikit-learn: pip install 'aftlab[data]'") from err
    bunch = load_digits()
    x = np.asarray(bunch.data).astype(np.uint8)  # (1797, 64), levels 0..16
    y = np.asarray(bunch.target).astype(np.int64)
    r = np.arange(len(x)) % 10
    masks = {"train": r < 8, "val": r == 8, "test": r == 9}
    images, labels = {k: x[m] for k, m in masks.items()}, {k: y[m] for k, m in masks.items()}
    for arr in (*images.values(), *labels.values()):
        arr.setflags(write=False)
    return images, labels


def build_digits(
    *, data: str | os.PathLike | None, seq_len: int | None, seed: int, **options: Any
) -> ImageTask:
    """``digits``: generate 8x8 digits value by value (vocab 17 levels, 64 values, bits/dim)."""
    return _digits("digits", "lm", data=data, seq_len=seq_len, seed=seed, options=options)


def build_digits_classify(
    *, data: str | os.PathLike | None, seq_len: int | None, seed: int, **options: Any
) -> ImageTask:
    """``digits-classify``: label 8x8 digits (64 tokens of 17 levels, 10 classes, grid 8x8)."""
    return _digits(
        "digits-classify", "classify", data=data, seq_len=seq_len, seed=seed, options=options
    )


def _digits(
    task: str, kind: str, *, data: Any, seq_len: int | None, seed: int, options: dict
) -> ImageTask:
    take_options(task, options, {})
    if data is not None:
        raise DataError(f"task {task!r} uses scikit-learn's bundled digits; drop --data")
    images, labels = _digits_splits()
    return ImageTask(
        task,
        images,
        labels,
        kind=kind,
        vocab_size=17,
        image_shape=(8, 8),
        num_classes=10,
        grid=(8, 8),
        seed=seed,
        source="sklearn.datasets.load_digits",
        split_rule="index % 10: 0-7 train, 8 val, 9 test",
    )


# --------------------------------------------------------------------------- CIFAR-10
class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that builds dicts, lists and numpy arrays and refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(N, 3072)`` uint8 channel-first rows and ``(N,)`` labels of one CIFAR-10 pickle."""
    try:
        with open(path, "rb") as f:
            obj = _ArrayUnpickler(io.BufferedReader(f), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise DataError(
            f"{path} is not a CIFAR-10 python batch ({err}); use the files of "
            "cifar-10-python.tar.gz"
        ) from err
    if not isinstance(obj, dict) or b"data" not in obj or b"labels" not in obj:
        raise DataError(f"{path} is not a CIFAR-10 python batch (no b'data' and b'labels' entries)")
    data = np.asarray(obj[b"data"])
    labels = np.asarray(obj[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(
            f"{path}: b'data' must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}"
        )
    if labels.shape != (len(data),) or (labels.size and (labels.min() < 0 or labels.max() > 9)):
        raise DataError(f"{path}: b'labels' must be {len(data)} ints in 0..9")
    return data, labels


def load_cifar10(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train and test images of a CIFAR-10 python folder in channel-last raster order.

    A row of the pickles holds the 1024 red, then green, then blue values; it becomes
    ``(32, 32, 3)`` flattened, i.e. value ``3 (32 i + j) + c`` is channel ``c`` of pixel ``(i, j)``.

    Returns:
        ``x_train (50000, 3072)``, ``y_train``, ``x_test (10000, 3072)``, ``y_test``.
    """
    missing = [f for f in _CIFAR_FILES if not (root / f).is_file()]
    if missing:
        raise DataError(
            f"{root} lacks the CIFAR-10 python batch file(s) {', '.join(missing)}; pass --data the "
            "cifar-10-batches-py folder"
        )
    parts = [_read_batch(root / f) for f in _CIFAR_FILES]

    def channel_last(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(
            x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).reshape(-1, 3072)
        )

    x_train = channel_last(np.concatenate([p[0] for p in parts[:5]]))
    y_train = np.concatenate([p[1] for p in parts[:5]])
    return x_train, y_train, channel_last(parts[5][0]), parts[5][1]


def build_cifar10(
    *, data: str | os.PathLike | None, seq_len: int | None, seed: int, **options: Any
) -> ImageTask:
    """``cifar10``: generate 32x32x3 images sub-pixel by sub-pixel (vocab 256, 3072, bits/dim).

    Options:
        val_size (int): images at the end of the train batches held out for validation;
            default ``min(5000, N_train // 10)`` (5000 for the real data).
    """
    opts = take_options("cifar10", options, {"val_size": (int, None)})
    if data is None or str(data) == "":
        raise DataError(
            "task 'cifar10' needs --data DIR, the local cifar-10-batches-py folder (no download)"
        )
    root = Path(data).expanduser()
    if not root.is_dir():
        raise DataError(
            f"--data {root} must be the cifar-10-batches-py folder (data_batch_1..5, test_batch)"
        )
    x_train, y_train, x_test, y_test = load_cifar10(root)
    n_val = opts["val_size"] if opts["val_size"] is not None else min(5000, len(x_train) // 10)
    if not 0 < n_val < len(x_train):
        raise DataError(f"cifar10: option 'val_size' must be in 1..{len(x_train) - 1}, got {n_val}")
    images = {"train": x_train[:-n_val], "val": x_train[-n_val:], "test": x_test}
    labels = {"train": y_train[:-n_val], "val": y_train[-n_val:], "test": y_test}
    return ImageTask(
        "cifar10",
        images,
        labels,
        kind="lm",
        vocab_size=256,
        image_shape=(32, 32, 3),
        num_classes=10,
        grid=None,
        seed=seed,
        source=str(root),
        split_rule=f"val = last {n_val} train images",
    )
