"""``aftlab compare --sample N`` (the main job, ``make demo``): the table, then a sample from the
model with the best test metric, then where the results, plots and run folders went."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from aftlab.cli import main
from aftlab.train import compare
from aftlab.train.config import TrainConfig
from aftlab.train.trainer import Trainer

from .helpers import TINY, write_text


def test_table_then_a_sample_of_the_best_model_then_where_it_went(tmp_path, capsys):
    data = write_text(tmp_path / "data.txt", 20_000)
    out = tmp_path / "cmp"
    argv = ["compare", "--data", str(data), "--mixers", "attention,aft-local", "--steps", "3"]
    assert main([*argv, "--sample", "40", "--out", str(out), *TINY]) == 0
    stdout = capsys.readouterr().out
    rows = json.loads((out / "results.json").read_text())["rows"]
    models = [r for r in rows if not r["mixer"].startswith("(")]
    best = min(models, key=lambda r: r["test_metric"])["mixer"]  # bpb: lower is better
    other = next(r["mixer"] for r in models if r["mixer"] != best)

    table, _, rest = stdout.partition("--- sample from ")
    header, _, rest = rest.partition("\n")
    sample, _, last = rest.removesuffix("\n").rpartition("\n")  # the sample may hold newlines
    table = table.splitlines()
    assert table[0].startswith("| mixer |") and table[-3].startswith("| (unigram baseline)")
    assert table[-1].startswith("The table ranks the models after 3 steps")  # its regime
    assert header.startswith(f"{best} (best test bpb ")
    plots = "plots (loss_curves.png, throughput.png)"
    if importlib.util.find_spec("matplotlib") is None:
        plots = "no plots (pip install 'aftlab[plot]')"
    assert last == f"results.md, {plots} and a run folder per model: {out}/"

    def sampled_from(mixer: str) -> str:
        assert main(["sample", str(out / mixer), "--tokens", "40", "--device", "cpu"]) == 0
        return capsys.readouterr().out.removesuffix("\n")

    # the same seed and prompt: the best model's own sample, which the other model's is not
    assert sample == sampled_from(best) != sampled_from(other)


@pytest.mark.parametrize(
    "metric, values, best",
    [
        ("bpb", {"a": 2.0, "b": 1.5, "c": math.nan}, "b"),  # lower is better; NaN never wins
        ("accuracy", {"a": 0.4, "b": 0.9, "c": 0.1}, "b"),  # higher is better
        ("bpb", {"a": 1.5, "b": 1.5}, "a"),  # the first of equals
    ],
)
def test_best_model_by_test_metric_never_the_baseline(tmp_path, metric, values, best):
    rows = [{"mixer": m, "test_metric": v, "device": "cpu"} for m, v in values.items()]
    rows.append({"mixer": "(unigram baseline)", "test_metric": 0.0})  # better, but no model
    run_dirs = {m: tmp_path / m for m in values}
    chosen = compare._best_model(rows, run_dirs, metric, metric == "accuracy")
    assert chosen["mixer"] == best and chosen["run_dir"] == str(tmp_path / best)
    assert chosen["metric"] == metric and chosen["test_metric"] == values[best]
    assert compare._best_model(rows[-1:], run_dirs, metric, False) is None


@pytest.mark.parametrize("mixer, builds", [("aft-local", True), ("attention", False)])
def test_trainer_builds_the_kernels_before_any_timed_step(tmp_path, monkeypatch, mixer, builds):
    """On CPU an AFT run compiles the kernels in its setup, so no step's tokens/s includes it."""
    events = []
    monkeypatch.setattr("aftlab.kernels.status", lambda: events.append("build"))
    cfg = TrainConfig.from_dict(
        {
            "data": str(write_text(tmp_path / "d.txt")),
            "seq_len": 16,
            "steps": 1,
            "device": "cpu",
            "mixer": mixer,
            "sample_tokens": 0,
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        }
    )
    Trainer(cfg, run_dir=tmp_path / "run").fit()
    assert events == (["build"] if builds else []), events


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--sample", "-1"], "--sample must be an integer >= 0 (0: no sample), got -1"),
        (["--sample", "ten"], "--sample: invalid int value: 'ten'"),
        (["--task", "copy", "--sample", "5"], "--sample needs a text task"),
    ],
)
def test_bad_sample_one_line_exit_2(tmp_path, capsys, extra, says):
    out = tmp_path / "cmp"
    argv = ["compare", "--mixers", "attention", "--steps", "2", "--out", str(out), *TINY]
    if "copy" not in extra:
        argv += ["--data", str(write_text(tmp_path / "data.txt", 20_000))]
    try:
        code = main([*argv, *extra])
    except SystemExit as e:  # argparse's own errors (one line, see aftlab.cli._Parser)
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("aftlab: error:"), err
    assert says in err[0]
    assert not out.exists()  # nothing trained, nothing written
