import json
import math
import sys

import pytest

from aftlab.cli import main
from aftlab.train.compare import format_decoding_table, format_table, unigram_baseline

from .helpers import TINY, write_text
from .test_compare_outcomes import child  # noqa: F401 (a fixture)


class _Counts:
    """A task stand-in with known byte frequencies: training targets 0,0,0,1 ; test targets 0,1."""

    vocab_size = 4

    def train_batch(self, step, *, batch_size):
        import torch

        return {"target": torch.tensor([[0, 0, 0, 1]])}

    def eval_batches(self, split, *, batch_size, max_batches):
        import torch

        yield {"target": torch.tensor([[0, 1, -100]])}


def test_unigram_baseline_is_add_one_smoothed_cross_entropy():
    # counts over 2 batches: c0 = 6, c1 = 2, +1 each over V = 4 -> p0 = 7/12, p1 = 3/12
    nats = unigram_baseline(_Counts(), train_batches=2, batch_size=1, test_batches=None)
    assert nats == pytest.approx(-(math.log(7 / 12) + math.log(3 / 12)) / 2)


def test_format_table():
    rows = [
        {
            "mixer": "attention",
            "parameters": 1234,
            "test_metric": 2.5,
            "tokens_per_s": 1000.4,
            "peak_memory_bytes": 3 * 2**20,
        },
        {
            "mixer": "(unigram baseline)",
            "parameters": 255,
            "test_metric": 5.0,
            "tokens_per_s": None,
            "peak_memory_bytes": None,
        },
    ]
    rows[0].update(lr=2e-3, val_metric=2.25)
    table = format_table(rows, "bpb", "cpu").splitlines()
    assert table[0] == (
        "| mixer | parameters | lr | val bpb | test bpb | train tokens/s | peak memory (cpu) |"
    )
    assert table[2] == "| attention | 1,234 | 0.002 | 2.2500 | 2.5000 | 1,000 | 3 MiB |"
    assert table[3] == "| (unigram baseline) | 255 |  |  | 5.0000 |  |  |"


@pytest.mark.slow
def test_compare_trains_each_mixer_and_writes_the_table(tmp_path, capsys):
    data = write_text(tmp_path / "data.txt", 20_000)
    out = tmp_path / "cmp"
    code = main(
        [
            "compare",
            "--data",
            str(data),
            "--mixers",
            "attention,aft-simple",
            "--steps",
            "4",
            "--out",
            str(out),
            *TINY,
            "--set",
            "lr=1e-2",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    rows = {r["mixer"]: r for r in results["rows"]}
    assert set(rows) == {"attention", "aft-simple", "(unigram baseline)"}
    for mixer in ("attention", "aft-simple"):
        summary = json.loads((out / mixer / "summary.json").read_text())
        assert rows[mixer]["test_metric"] == summary["test_bpb"] and summary["steps"] == 4
        assert rows[mixer]["parameters"] == summary["parameters"] > 0
        assert rows[mixer]["tokens_per_s"] > 0 and rows[mixer]["peak_memory_bytes"] >= 0
        assert f"| {mixer} |" in printed
        # the same size and budget for every mixer
        assert summary["tokens_seen"] == 4 * 4 * 16
    # the unigram baseline beats a uniform guess over 256 bytes (8 bits) on this small vocabulary
    assert 0 < rows["(unigram baseline)"]["test_metric"] < 6
    md = (out / "results.md").read_text()
    assert "| (unigram baseline) |" in md and "aftlab compare --task text" in md
    if (out / "loss_curves.png").exists():
        assert "loss_curves.png" in md
    else:
        pytest.importorskip("matplotlib")  # only allowed to be missing without matplotlib
        pytest.fail("loss_curves.png missing although matplotlib is installed")


def test_a_plot_that_cannot_be_drawn_is_a_line_on_stderr(tmp_path, monkeypatch, capsys):
    from aftlab.train.compare import _plot
    from aftlab.train.plot import plot_throughput

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    rows = [{"mixer": "attention", "tokens_per_s": 1.0, "peak_memory_bytes": 1}]
    assert _plot(plot_throughput, rows, tmp_path / "throughput.png", device="cpu") is None
    err = capsys.readouterr().err
    assert err.startswith("aftlab compare: no throughput.png: plotting needs matplotlib")
    assert not (tmp_path / "throughput.png").exists()


@pytest.mark.usefixtures("child")
def test_the_rate_is_chosen_on_the_summaries_validation_metric(tmp_path, monkeypatch):
    """Each run's summary.json carries its final validation metric, equal to evaluating its final
    checkpoint (the computation compare made before); compare chooses the rate on it without
    loading a checkpoint. A summary without it (aftlab 0.1.0) falls back to that evaluation."""
    from aftlab.train import run as run_mod
    from aftlab.train.config import load_config
    from aftlab.train.trainer import evaluate

    load_run = run_mod.load_run

    def refuse(*args, **kwargs):
        raise AssertionError("compare loaded a checkpoint to choose a rate")

    monkeypatch.setattr(run_mod, "load_run", refuse)
    data = write_text(tmp_path / "data.txt", 20_000)
    out = tmp_path / "cmp"
    args = ["compare", "--data", str(data), "--mixers", "aft-simple", "--steps", "3"]
    args += ["--lrs", "1e-3,3e-2", "--out", str(out), *TINY, "--set", "sample_tokens=0"]
    assert main(args) == 0
    monkeypatch.setattr(run_mod, "load_run", load_run)
    results = json.loads((out / "results.json").read_text())
    row = results["rows"][0]
    direct = {}
    for lr in ("0.001", "0.03"):
        run_dir = out / "aft-simple" / f"lr{lr}-seed0"
        cfg, run = load_config(run_dir / "config.toml"), load_run(run_dir)
        res = evaluate(
            run.model, run.task, "val", batch_size=cfg.eval_batch_size, max_batches=cfg.eval_batches
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["val_loss"], summary["val_bpb"]) == (res["loss"], res["bpb"])
        assert not (run_dir / "val.json").exists()
        direct[float(lr)] = res["bpb"]
    assert row["val_by_lr"] == {"0.001": direct[1e-3], "0.03": direct[3e-2]}
    assert row["lr"] == min(direct, key=direct.get) and direct[1e-3] != direct[3e-2]
    old = out / "aft-simple" / "lr0.03-seed0"  # as aftlab 0.1.0 wrote it
    summary = json.loads((old / "summary.json").read_text())
    del summary["val_loss"], summary["val_bpb"]
    (old / "summary.json").write_text(json.dumps(summary))
    assert main(args) == 0
    assert json.loads((out / "results.json").read_text()) == results
    assert json.loads((old / "val.json").read_text())["bpb"] == direct[3e-2]


def test_format_decoding_table():
    rows = [
        {"mixer": m, "position": p, "state_bytes": b, "ms_per_token": t, "ms_min": t,
         "threads": 2}
        for m, p, b, t in [
            ("attention", 4096, 2**22, 1.5), ("attention", 65536, 2**26, 9.25),
            ("aft-decay", 4096, 3 * 2**10, 0.5), ("aft-decay", 65536, 3 * 2**10, 0.5),
        ]
    ]
    text = format_decoding_table(rows).splitlines()
    assert text[0].startswith("Decoding one sequence on this machine") and "2 threads" in text[0]
    assert text[2:] == [
        "| mixer | state at 4,096 | state at 65,536 | ms/token at 4,096 | ms/token at 65,536 |",
        "|---|---:|---:|---:|---:|",
        "| attention | 4 MiB | 64 MiB | 1.50 | 9.25 |",
        "| aft-decay | 3 KiB | 3 KiB | 0.50 | 0.50 |",
    ]
