"""benchmarks/plot_scaling.py: the budget-scaling points, their order and crossings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def script(benchmark_script):
    return benchmark_script("plot_scaling")


def _results(path: Path, steps: int, rows: list[tuple], positional: str = "learned") -> str:
    """A compare's results.json: rows ``(mixer, test bpb, tokens/s)``, 2 seeds each."""
    path.mkdir(parents=True)
    config = {"steps": steps, "batch_size": 4, "seq_len": 8, "model": {"positional": positional}}
    out = [
        {
            "mixer": m, "lr": 2e-3, "seeds": [0, 1], "test_metric": bpb,
            "test_metric_min": bpb - 0.01, "test_metric_max": bpb + 0.01,
            "tokens_per_s": speed, "peak_memory_bytes": 2**20,
        }
        for m, bpb, speed in rows
    ]
    out.append({"mixer": "(unigram baseline)", "test_metric": 4.5, "tokens_per_s": None})
    (path / "results.json").write_text(json.dumps({"rows": out, "config": config}))
    return str(path / "results.json")


def test_points_by_curve_and_budget_and_where_they_cross(tmp_path, script):
    paths = [
        _results(tmp_path / "a", 10, [("attention", 3.0, 320.0), ("aft-decay", 2.5, 640.0)]),
        _results(tmp_path / "b", 40, [("attention", 2.0, 320.0), ("aft-decay", 2.2, 640.0)]),
        _results(tmp_path / "c", 10, [("attention", 2.9, 160.0)], positional="rotary"),
    ]
    curves = script.points(paths)
    assert set(curves) == {
        "attention (learned positions)", "aft-decay", "attention (rotary positions)"
    }
    att = curves["attention (learned positions)"]
    assert [(p["tokens"], p["seconds"], p["bpb"]) for p in att] == [
        (320, 1.0, 3.0), (1280, 4.0, 2.0)
    ]
    assert script.crossings(curves) == [
        "aft-decay and attention (learned positions) cross between 320 and 1,280 tokens"
    ]
    text = script.table(curves)
    assert "- 320 tokens: aft-decay 2.5000 < attention (rotary positions) 2.9000 < " in text
    assert "| aft-decay | 1,280 | 0.002 | 2 | 2.2000 (2.1900-2.2100) | 2 | 640 | 1 MiB |" in text


def test_a_crossing_within_the_seeds_spread_says_so(tmp_path, script):
    paths = [
        _results(tmp_path / "a", 10, [("attention", 3.0, 1.0), ("aft-local", 3.005, 1.0)]),
        _results(tmp_path / "b", 20, [("attention", 2.8, 1.0), ("aft-local", 2.5, 1.0)]),
    ]
    assert script.crossings(script.points(paths)) == [
        "aft-local and attention (learned positions) cross between 320 and 640 tokens (level "
        "within the seeds' min-max at 320)"
    ]


def test_no_crossing_is_said(tmp_path, script):
    paths = [
        _results(tmp_path / "a", 10, [("attention", 3.0, 1.0), ("aft-decay", 2.5, 1.0)]),
        _results(tmp_path / "b", 20, [("attention", 2.8, 1.0), ("aft-decay", 2.4, 1.0)]),
    ]
    assert script.table(script.points(paths)).endswith("- no two curves cross")


def test_the_plot_has_both_panels(tmp_path, script):
    pytest.importorskip("matplotlib")
    paths = [_results(tmp_path / "a", 10, [("rwkv4:architecture=rwkv4", 2.0, 100.0)])]
    script.main([*paths, "--out", str(tmp_path / "s.png")])
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert list(script.points(paths)) == ["RWKV-4"]
