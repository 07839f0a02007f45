"""Helpers of the data tests: small CIFAR-10 files in the exact format, the Task contract."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from aftlab.data import Task


def write_cifar(root: Path, *, n_train_per_batch: int = 4, n_test: int = 5, seed: int = 0) -> dict:
    """Fake CIFAR-10 python batches in the exact format (dicts with b"data", b"labels").

    Returns the arrays written: ``{"train": (N, 3072) uint8, "train_labels", "test", ...}``.
    """
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    train, train_labels = [], []
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else n_train_per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data}, f)
        if name != "test_batch":
            train.append(data)
            train_labels += labels
        else:
            test, test_labels = data, labels
    return {
        "train": np.concatenate(train),
        "train_labels": np.array(train_labels),
        "test": test,
        "test_labels": np.array(test_labels),
    }


def check_contract(task: Task, *, batch_size: int = 3) -> None:
    """Shapes, dtypes, ranges, determinism and rank sharding of ``task``'s batches."""
    T = task.seq_len
    b = task.train_batch(5, batch_size=batch_size)
    assert set(b) == {"input", "target"}
    assert b["input"].dtype == torch.long and b["input"].shape == (batch_size, T)
    assert 0 <= int(b["input"].min()) and int(b["input"].max()) < task.vocab_size
    if task.kind == "lm":
        assert b["target"].shape == (batch_size, T) and b["target"].dtype == torch.long
        scored = b["target"][b["target"] != -100]
        assert scored.numel() > 0
        assert 0 <= int(scored.min()) and int(scored.max()) < task.vocab_size
    else:
        assert b["target"].shape == (batch_size,) and b["target"].dtype == torch.long
        assert 0 <= int(b["target"].min()) and int(b["target"].max()) < task.num_classes

    # deterministic in the step, different across steps
    again = task.train_batch(5, batch_size=batch_size)
    assert all(torch.equal(b[k], again[k]) for k in b)
    other = task.train_batch(6, batch_size=batch_size)
    assert not torch.equal(b["input"], other["input"])

    # ranks: concatenating N shards of B rows == one process with N * B rows
    for world in (2, 3):
        whole = task.train_batch(7, batch_size=batch_size * world)
        parts = [
            task.train_batch(7, batch_size=batch_size, rank=r, world_size=world)
            for r in range(world)
        ]
        for k in whole:
            assert torch.equal(torch.cat([p[k] for p in parts]), whole[k]), (world, k)

    # evaluation is repeatable and honours max_batches
    first = list(task.eval_batches("val", batch_size=2, max_batches=2))
    assert 1 <= len(first) <= 2
    second = list(task.eval_batches("val", batch_size=2, max_batches=2))
    assert len(first) == len(second)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(first, second, strict=True) for k in x)
    assert first[0]["input"].shape[1] == T
    assert task.info()["task"] == task.name
