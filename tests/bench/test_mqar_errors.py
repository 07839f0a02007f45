"""benchmarks/mqar_errors.py: MQAR predictions split by the queried pair."""

from __future__ import annotations

import numpy as np
import pytest

from aftlab.data.synthetic import mqar

P = 4


@pytest.fixture
def by_pair(benchmark_script):
    return benchmark_script("mqar_errors").by_pair


def _examples(n: int = 300):
    rng = np.random.default_rng(0)
    return mqar(rng, n, seq_len=32, vocab=64, num_pairs=P, power_a=0.01, random_non_queries=False)


def test_a_perfect_model_answers_each_pair_with_its_own_value(by_pair):
    inp, target = _examples()
    table = by_pair(inp, target, target.copy())
    assert table.shape == (P + 1, 2 + P)
    np.testing.assert_array_equal(table[:, :2], 1.0)  # accuracy, in value set
    np.testing.assert_array_equal(table[:P, 2:], np.eye(P))  # pair i answers pair i
    np.testing.assert_allclose(table[P, 2:].sum(), 1.0)


def test_a_model_answering_always_the_last_value_scores_on_the_last_pair_only(by_pair):
    inp, target = _examples()
    pred = np.where(target != -100, inp[:, 2 * P - 1 : 2 * P], target)
    table = by_pair(inp, target, pred)
    np.testing.assert_array_equal(table[:P, 0], [0, 0, 0, 1])
    np.testing.assert_array_equal(table[:, 1], 1.0)
    np.testing.assert_array_equal(table[:, 2 + P - 1], 1.0)
    assert table[P, 0] == pytest.approx(1 / P, abs=0.05)  # 300 x 4 queries, pair uniform


def test_a_prediction_outside_the_value_set_counts_in_no_column(by_pair):
    inp, target = _examples()
    pred = np.where(target != -100, 0, target)  # token 0: never a value
    table = by_pair(inp, target, pred)
    np.testing.assert_array_equal(table, 0.0)


def test_on_a_trained_run_the_all_row_is_the_test_accuracy_aftlab_eval_reports(
    tmp_path, benchmark_script, capsys
):
    from aftlab.cli import main

    from ..train.helpers import TINY

    out = tmp_path / "run"
    args = ["--task", "recall", "--out", str(out), "--steps", "3", *TINY, "--set", "seq_len=32"]
    assert main(["train", *args]) == 0
    script = benchmark_script("mqar_errors")
    inp, target, pred = script.predictions(str(out))
    assert inp.shape == target.shape == pred.shape
    capsys.readouterr()
    assert main(["eval", str(out), "--split", "test"]) == 0
    reported = float(capsys.readouterr().out.split()[2])  # "test accuracy: 0.xxxx"
    assert script.by_pair(inp, target, pred)[-1, 0] == pytest.approx(reported, abs=1e-4)


def test_a_run_of_another_task_is_refused(tmp_path, benchmark_script):
    from aftlab.errors import UsageError

    from ..train.helpers import train_tiny

    out = train_tiny(tmp_path, 1)
    with pytest.raises(UsageError, match="not 'recall'"):
        benchmark_script("mqar_errors").predictions(str(out))
