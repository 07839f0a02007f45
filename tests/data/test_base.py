"""The task registry, argument checks and shared helpers of ``aftlab.data``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aftlab.data import (
    DataError,
    available_tasks,
    build_task,
    count_correct,
    default_seq_len,
)
from aftlab.data.base import epoch_indices, shard, step_rng


def test_available_tasks():
    names = available_tasks()
    assert names[0] == "text"
    assert set(names) == {
        "text", "enwik8", "text8", "digits", "digits-classify", "cifar10", "recall", "copy",
    }  # fmt: skip
    assert default_seq_len("digits") == 64 and default_seq_len("cifar10") == 3072


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_unknown_task_suggests_the_closest():
    with pytest.raises(
        DataError, match=r"unknown task 'recal'; did you mean 'recall'\? available: text"
    ):
        build_task("recal", seq_len=16)
    with pytest.raises(DataError, match="unknown task 'zzz'; available:"):
        build_task("zzz", seq_len=16)


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True])
def test_bad_seq_len(seq_len):
    with pytest.raises(DataError, match="seq_len must be a positive int"):
        build_task("copy", seq_len=seq_len)


def test_bad_seed():
    with pytest.raises(DataError, match=r"seed must be an int in \[0, 2\*\*63\), got -1"):
        build_task("copy", seq_len=16, seed=-1)


def test_seq_len_defaults():
    assert build_task("recall").seq_len == default_seq_len("recall") == 64


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"step": -1}, ValueError, "'step' must be >= 0, got -1"),
        ({"batch_size": 0}, ValueError, "'batch_size' must be > 0"),
        ({"rank": 2, "world_size": 2}, ValueError, "'rank' must be < world_size=2, got 2"),
        ({"world_size": 1.0}, TypeError, "'world_size' must be an int"),
    ],
)
def test_train_batch_checks_its_arguments(kwargs, error, message):
    task = build_task("copy", seq_len=16)
    args = {"step": 0, "batch_size": 2, **kwargs}
    step = args.pop("step")
    with pytest.raises(error, match=message):
        task.train_batch(step, **args)


def test_eval_batches_checks_its_arguments():
    task = build_task("copy", seq_len=16)
    with pytest.raises(ValueError, match="'split' must be 'val' or 'test', got 'train'"):
        next(task.eval_batches("train", batch_size=2))
    with pytest.raises(ValueError, match="'max_batches' must be > 0"):
        next(task.eval_batches("val", batch_size=2, max_batches=0))


def test_step_rng_depends_on_every_key():
    draw = [step_rng(*k).integers(0, 2**31, size=4).tolist() for k in [(0, 1), (1, 0), (0, 1, 0)]]
    assert draw[0] != draw[1] and draw[0] != draw[2]
    assert step_rng(0, 1).integers(0, 2**31, size=4).tolist() == draw[0]
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*64\), got -1"):
        step_rng(0, -1)


def test_shard():
    rows = np.arange(12).reshape(6, 2)
    assert shard(rows, batch_size=2, rank=1).tolist() == [[4, 5], [6, 7]]


def test_epoch_indices_across_an_epoch_boundary():
    whole = epoch_indices(7, seed=0, start=0, count=21)
    assert all(sorted(whole[i : i + 7]) == list(range(7)) for i in (0, 7, 14))
    np.testing.assert_array_equal(epoch_indices(7, seed=0, start=5, count=6), whole[5:11])


def test_count_correct():
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])
    assert count_correct(logits, torch.tensor([[1, 1, -100]])) == (1, 2)
    with pytest.raises(ValueError, match=r"'logits' must have shape \(1, 2\) \+ \(C,\)"):
        count_correct(logits, torch.tensor([[1, 1]]))


def test_metric_from_loss_bits():
    task = build_task("copy", seq_len=16)
    task.metric = "bits/dim"  # any bits metric: nats / ln 2
    assert task.metric_from_loss(3 * math.log(2)) == pytest.approx(3.0)


@pytest.mark.parametrize("name", ["recall", "copy", "digits", "digits-classify"])
def test_a_new_instance_reads_the_same_batches(name):
    """Resuming = building the task again and asking for step k: the same data."""
    if name.startswith("digits"):
        pytest.importorskip("sklearn.datasets")
    a = build_task(name, seed=11)
    b = build_task(name, seed=11)
    for step in (0, 17, 1000):
        x = a.train_batch(step, batch_size=4, rank=1, world_size=2)
        y = b.train_batch(step, batch_size=4, rank=1, world_size=2)
        assert torch.equal(x["input"], y["input"]) and torch.equal(x["target"], y["target"])
    c = build_task(name, seed=12).train_batch(17, batch_size=4, rank=1, world_size=2)
    assert not torch.equal(
        c["input"], a.train_batch(17, batch_size=4, rank=1, world_size=2)["input"]
    )
