"""``aftlab compare`` writes its loss-curve and throughput plots next to its table."""

import json

import pytest

from aftlab.errors import UsageError
from aftlab.train.compare import run_compare
from aftlab.train.plot import plot_throughput

from .test_trainer import _config

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _finished_run(run_dir, *, speed, memory):
    """A run folder as ``aftlab train`` leaves it, so that compare reads it instead of training."""
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "parameters": 1000,
                "metric": "bpb",
                "test_bpb": 5.0,
                "test_loss": 3.5,
                "train_tokens_per_s": speed,
                "peak_memory_bytes": memory,
                "device": "cpu",
                "steps": 3,
            }
        )
    )
    (run_dir / "val.json").write_text(json.dumps({"loss": 3.4, "bpb": 4.9, "targets": 64}))
    records = [{"step": s, "split": "train", "loss": 5.0 - s, "time": 0.0} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_writes_loss_curves_and_throughput_next_to_its_table(tmp_path):
    out = tmp_path / "cmp"
    _finished_run(out / "attention", speed=1000.0, memory=30 * 2**20)
    _finished_run(out / "aft-simple", speed=3000.0, memory=10 * 2**20)
    run_compare(_config(tmp_path, "steps=3"), ["attention", "aft-simple"], out)
    md = (out / "results.md").read_text()
    for name in ("loss_curves.png", "throughput.png"):
        assert (out / name).read_bytes().startswith(PNG)
        assert f"]({name})" in md


def test_plot_throughput_leaves_out_rows_without_a_speed(tmp_path):
    rows = [
        {"mixer": "attention", "tokens_per_s": 10.0, "peak_memory_bytes": 2**20},
        {"mixer": "(unigram baseline)", "tokens_per_s": None, "peak_memory_bytes": None},
    ]
    assert plot_throughput(rows, tmp_path / "t.png", device="cpu").read_bytes().startswith(PNG)
    with pytest.raises(UsageError, match="no model has a measured speed"):
        plot_throughput(rows[1:], tmp_path / "u.png", device="cpu")
