"""Generated tasks: multi-query associative recall and copying."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aftlab.data import DataError, build_task, count_correct
from aftlab.data.synthetic import mqar

from .helpers import check_contract


@pytest.mark.parametrize("name", ["recall", "copy"])
def test_contract(name):
    task = build_task(name, seq_len=32, seed=4)
    check_contract(task)
    assert (task.kind, task.metric, task.num_classes) == ("lm", "accuracy", None)
    with pytest.raises(ValueError, match="not a function of the loss"):
        task.metric_from_loss(1.0)


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_recall_targets_are_the_values_of_the_queried_keys(random_non_queries):
    P, T, V = 6, 48, 40
    task = build_task(
        "recall", seq_len=T, num_pairs=P, vocab=V, random_non_queries=random_non_queries
    )
    b = task.train_batch(2, batch_size=16)
    for inp, tgt in zip(b["input"].tolist(), b["target"].tolist(), strict=True):
        keys, values = inp[0 : 2 * P : 2], inp[1 : 2 * P : 2]
        assert len(set(keys)) == P and all(1 <= k < V // 2 for k in keys)
        assert len(set(values)) == P and all(V // 2 <= v < V for v in values)
        memory = dict(zip(keys, values, strict=True))
        queried = [t for t in range(T) if tgt[t] != -100]
        assert len(queried) == P and min(queried) >= 2 * P
        assert sorted(inp[t] for t in queried) == sorted(keys)  # every key asked once
        assert all(tgt[t] == memory[inp[t]] for t in queried)
        assert all((t - 2 * P) % 2 == 0 for t in queried)
        if not random_non_queries:
            rest = [inp[t] for t in range(2 * P, T) if t not in queried]
            assert set(rest) == {0}


def test_recall_query_gaps_follow_the_power_law():
    """Small ``a`` puts most queries early: p(g) ∝ a g^(a-1) decreases with the gap g."""
    rng = np.random.default_rng(0)
    T, P = 256, 4
    _, target = mqar(
        rng, 400, seq_len=T, vocab=64, num_pairs=P, power_a=0.01, random_non_queries=False
    )
    gaps = (np.nonzero(target != -100)[1] - 2 * P) // 2
    space = (T - 2 * P) // 2
    assert gaps.max() < space
    assert np.mean(gaps < space // 4) > 0.5  # uniform gaps would give 0.25


def test_copy_targets():
    task = build_task("copy", seq_len=21, vocab=7)
    L = 10
    b = task.train_batch(0, batch_size=8)
    inp, tgt = b["input"], b["target"]
    assert torch.equal(inp[:, L], torch.zeros(8, dtype=torch.long))  # the separator
    assert torch.equal(tgt[:, L : 2 * L], inp[:, :L])  # reproduce the string
    assert torch.equal(inp[:, L + 1 : 2 * L + 1], inp[:, :L])  # teacher forcing
    assert (tgt[:, :L] == -100).all() and (tgt[:, 2 * L :] == -100).all()
    assert int(inp[:, :L].min()) >= 1 and int(inp.max()) < 7
    short = build_task("copy", seq_len=21, length=4).train_batch(0, batch_size=2)
    assert (short["target"] != -100).sum(dim=1).tolist() == [4, 4]


def test_eval_sets_are_fixed_and_independent_of_the_seed():
    a = build_task("recall", seq_len=32, seed=0, eval_size=10)
    b = build_task("recall", seq_len=32, seed=9, eval_size=10)
    va = list(a.eval_batches("val", batch_size=4))
    vb = list(b.eval_batches("val", batch_size=4))
    assert [len(x["input"]) for x in va] == [4, 4, 2]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(va, vb, strict=True) for k in x)
    test = torch.cat([x["input"] for x in a.eval_batches("test", batch_size=10)])
    assert not torch.equal(test, torch.cat([x["input"] for x in va]))
    train_a = a.train_batch(0, batch_size=4)["input"]
    assert not torch.equal(train_a, b.train_batch(0, batch_size=4)["input"])  # seed matters
    assert len(list(a.eval_batches("val", batch_size=4, max_batches=1))) == 1


def test_a_perfect_predictor_scores_one():
    task = build_task("recall", seq_len=32, num_pairs=4, vocab=32, eval_size=20)
    correct = counted = 0
    for batch in task.eval_batches("test", batch_size=8):
        logits = torch.nn.functional.one_hot(batch["target"].clamp(min=0), 32).float()
        c, n = count_correct(logits, batch["target"])
        correct, counted = correct + c, counted + n
    assert counted == 20 * 4 and correct == counted


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("recall", {"num_pairs": 9}, r"num_pairs=9 needs 1 <= 4\*num_pairs <= seq_len=32"),
        (
            "recall",
            {"vocab": 10},
            "vocab=10 has 4 keys, fewer than num_pairs=8; raise vocab to at least 18",
        ),
        ("recall", {"power_a": 0.0}, "'power_a' must be > 0"),
        ("recall", {"num_pairs": True}, "option 'num_pairs' must be int, got bool"),
        ("recall", {"eval_size": 0}, "'eval_size' must be >= 1"),
        ("copy", {"length": 17}, r"'length' must be in 1..seq_len//2=16, got 17"),
        ("copy", {"vocab": 1}, "'vocab' must be >= 2"),
        (
            "copy",
            {"pairs": 3},
            "task 'copy' has no option 'pairs'; its options are: eval_size, length, vocab",
        ),
    ],
)
def test_bad_options(name, options, message):
    with pytest.raises(DataError, match=message):
        build_task(name, seq_len=32, **options)


@pytest.mark.parametrize("name", ["recall", "copy"])
def test_generated_tasks_take_no_data(tmp_path, name):
    with pytest.raises(DataError, match="generates its data; drop --data"):
        build_task(name, data=tmp_path, seq_len=32)
