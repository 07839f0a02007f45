"""End-to-end tests of ``aftlab bench`` on tiny sizes. No assertion depends on timing."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import time

import pytest
import torch

from aftlab.bench import CASES, BenchConfig, Shape, default_cases, run_bench
from aftlab.bench.cli import add_arguments, config_from_args, main
from aftlab.bench.gate import check_case
from aftlab.bench.measure import (
    CaseSpec,
    _peak_memory,
    read_status_kib,
    run_isolated,
    tensor_bytes,
)
from aftlab.bench.report import CSV_FIELDS, evaluate_targets

TINY = dict(batch=1, dim=16, heads=4, repeats=1, limits_size="tiny", max_seconds_per_case=30.0)
STATUSES = {"ok", "skipped", "failed", "error"}


def _rows(result, mixer, mode=None):
    return [
        r for r in result["results"] if r["mixer"] == mixer and (mode is None or r["mode"] == mode)
    ]


def test_end_to_end_writes_schema(tmp_path):
    cfg = BenchConfig(
        mixers=["attention-sdpa"],
        lengths=[16, 32],
        causal=True,
        out=tmp_path,
        isolate=False,
        **TINY,
    )
    result = run_bench(cfg, argv=["aftlab", "bench", "--test"], log=None)

    for name in ("results.json", "results.csv", "summary.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data) >= {"machine", "limits", "config", "results", "compare", "targets"}
    assert data["machine"]["command"] == "aftlab bench --test"
    assert data["machine"]["torch"] == torch.__version__
    assert data["limits"]["gemm_flops_per_s"] > 0 and data["limits"]["bandwidth_bytes_per_s"] > 0
    # 3 modes x 2 lengths
    assert len(data["results"]) == 6
    for r in data["results"]:
        assert r["status"] in STATUSES
        assert set(CSV_FIELDS) - {"cpu_model", "gpu", "torch", "date", "command"} <= set(r)
        if r["status"] != "ok":
            assert r["note"] and r["time_median_s"] is None

    # attention through SDPA is torch's own: it must pass the gate and be measured everywhere
    sdpa = _rows(result, "attention-sdpa")
    assert len(sdpa) == 6
    for r in sdpa:
        assert r["status"] == "ok", r["note"]
        assert r["gate"] == "passed" and r["time_median_s"] > 0 and r["repeats"] == 1
        assert r["floor_s"] > 0 and r["ratio_to_floor"] == pytest.approx(
            r["time_median_s"] / r["floor_s"]
        )
        assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] >= 0
    decode = [r for r in sdpa if r["mode"] == "decode"]
    # the KV cache of attention holds at least k and v for every past position
    assert all(r["state_bytes"] >= 2 * r["B"] * r["T"] * r["d"] * 4 for r in decode)

    with open(tmp_path / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        csv_rows = list(reader)
    assert len(csv_rows) == len(data["results"])
    assert all(r["cpu_model"] and r["command"] == "aftlab bench --test" for r in csv_rows)

    summary = (tmp_path / "summary.md").read_text()
    assert "| attention-sdpa |" in summary and "## Targets (issue 5)" in summary
    pytest.importorskip("matplotlib")
    for mode in ("forward", "train", "decode"):
        assert (tmp_path / f"bench_{mode}.png").stat().st_size > 0


def test_isolated_case_runs_in_a_fresh_process():
    spec = CaseSpec(
        "attention-sdpa",
        "train",
        True,
        Shape(1, 16, 16, 4),
        "float32",
        "cpu",
        threads=1,
        repeats=2,
        warmup=1,
        max_seconds=30.0,
    )
    out = run_isolated(spec, timeout=120)
    assert out["status"] == "ok", out.get("note")
    assert out["pid"] != os.getpid()
    assert len(out["times"]) == 2 and all(t > 0 for t in out["times"])
    assert out["mem_method"] == "VmHWM - VmRSS" and out["peak_bytes"] >= 0


def _wrong_forward(x, causal):
    return CASES["attention-sdpa"].op(x, causal) * 1.01


def _wrong_backward(x, causal):
    # forward values exact, gradient of q off by 10%
    return CASES["attention-sdpa"].op(x, causal) + 0.1 * (x["q"] - x["q"].detach())


def test_correctness_gate_refuses_wrong_op():
    cases = default_cases()
    cases["attention-sdpa"] = dataclasses.replace(CASES["attention-sdpa"], op=_wrong_forward)
    cases["attention-naive"] = dataclasses.replace(CASES["attention-naive"], op=_wrong_backward)
    cfg = BenchConfig(
        mixers=["attention-sdpa", "attention-naive"],
        lengths=[16],
        modes=["forward", "train"],
        isolate=False,
        **TINY,
    )
    result = run_bench(cfg, cases=cases, log=None)
    for r in _rows(result, "attention-sdpa"):
        assert r["status"] == "failed" and r["gate"] == "failed"
        assert "correctness gate failed" in r["note"] and "y" in r["note"]
        assert r["time_median_s"] is None and r["peak_bytes"] is None
    fwd, train = (
        _rows(result, "attention-naive", "forward")[0],
        _rows(result, "attention-naive", "train")[0],
    )
    assert fwd["status"] == "ok" and fwd["gate"] == "passed"
    assert train["status"] == "failed" and "dq" in train["note"] and train["time_median_s"] is None


def test_oversize_and_over_budget_cases_are_skipped_with_a_note():
    cfg = BenchConfig(
        mixers=["attention-naive"],
        lengths=[16, 4096],
        modes=["forward"],
        isolate=False,
        max_memory_gb=0.25,
        **TINY,
    )
    result = run_bench(cfg, log=None)
    small, big = _rows(result, "attention-naive")
    assert small["status"] == "ok"
    assert big["status"] == "skipped" and "exceeds the memory limit" in big["note"]
    assert big["est_peak_bytes"] > 0.25 * 2**30 and big["time_median_s"] is None

    cfg = BenchConfig(
        mixers=["attention-sdpa"],
        lengths=[16, 32],
        modes=["train"],
        isolate=False,
        **{**TINY, "max_seconds_per_case": 1e-12},
    )
    rows = run_bench(cfg, log=None)["results"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert "budget" in rows[0]["note"] and "budget" in rows[1]["note"]


def test_causal_only_mixer_skipped_when_not_causal():
    cfg = BenchConfig(mixers=["aft-decay"], lengths=[16], modes=["forward"], isolate=False, **TINY)
    (row,) = run_bench(cfg, log=None)["results"]
    assert row["status"] == "skipped" and "causal only" in row["note"]


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--lengths", "16,x"], "--lengths"),
        (["--lengths", "0,16"], "--lengths"),
        (["--mixers", "attention-sdpa,nope"], "--mixers"),
        (["--modes", "forward,fwd"], "--modes"),
        (["--dim", "10", "--heads", "4"], "--dim 10 must be divisible by --heads 4"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--threads", "0"], "--threads"),
        (["--repeats", "0"], "--repeats"),
        (["--max-seconds-per-case", "0"], "--max-seconds-per-case"),
        (["--max-total-minutes", "-1"], "--max-total-minutes"),
        (["--also-noncausal", "aft-full", "--mixers", "aft-simple"], "--also-noncausal"),
    ],
)
def test_bad_arguments_raise_one_line_value_error(argv, expected):
    with pytest.raises(ValueError) as info:
        config_from_args(_parse(*argv))
    msg = str(info.value)
    assert expected in msg and "\n" not in msg


def test_module_main_prints_one_line_and_exits_2(capsys):
    assert main(["--lengths", "abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: bench: --lengths") and "\n" not in err


def test_cli_defaults_cover_the_issue():
    cfg = config_from_args(_parse())
    assert cfg.mixers == list(CASES) and cfg.lengths == [256, 1024, 4096, 16384]
    assert cfg.modes == ["forward", "train", "decode"] and (cfg.batch, cfg.dim) == (4, 256)


@pytest.mark.skipif(read_status_kib("VmHWM") is None, reason="needs Linux /proc")
def test_peak_memory_sees_a_64_mib_temporary():
    def alloc():
        x = torch.ones(16 * 2**20)  # 64 MiB, touched
        return float(x[-1])

    peak, method, seconds = _peak_memory(alloc, torch.device("cpu"))
    assert seconds > 0
    assert method == "VmHWM - VmRSS"
    assert 60 * 2**20 <= peak <= 200 * 2**20


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10, 4)
    state = {"k": a, "view": a[2:], "list": [torch.zeros(3, dtype=torch.float64)]}
    assert tensor_bytes(state) == 10 * 4 * 4 + 3 * 8


def _fake(mixer, mode, T, t, causal=True, peak=1, floor=None):
    return {
        "mixer": mixer,
        "mode": mode,
        "T": T,
        "causal": causal,
        "status": "ok",
        "time_median_s": t,
        "peak_bytes": peak,
        "ratio_to_floor": floor,
    }


def test_targets_met_and_missed_from_measurements():
    rows = [
        _fake("aft-simple", "train", 2048, 1.0, floor=2.0),
        _fake("aft-simple", "train", 16384, 12.0, floor=4.0),
        _fake("aft-local", "train", 2048, 1.0),
        _fake("aft-local", "train", 16384, 8.5, peak=10),
        _fake("attention-sdpa", "train", 4096, 40.0),
        _fake("aft-simple", "train", 4096, 2.0),
        _fake("aft-local", "train", 4096, 10.0),
        _fake("attention-sdpa", "train", 16384, 100.0, peak=20),
        _fake("aft-full", "train", 2048, 3.0, causal=False),
        _fake("aft-full-matmul", "train", 2048, 2.5, False),
        _fake("aft-full", "train", 2048, 1.5),
        _fake("aft-decay", "decode", 128, 1e-4),
        _fake("aft-decay", "decode", 16384, 2e-4),
    ]
    result = {
        "results": rows,
        "config": {"causal": True, "lengths": [2048, 4096, 16384]},
        "compare": [],
    }
    t = {(x["id"], x["target"].split()[0]): x for x in evaluate_targets(result)}
    assert t[("linear-growth", "aft-simple")]["status"] == "missed"  # 12x > 10x
    assert t[("linear-growth", "aft-local")]["status"] == "met"
    assert t[("linear-growth", "aft-conv")]["status"] == "n/a"
    assert t[("vs-sdpa", "aft-simple")]["value"] == pytest.approx(20.0)
    assert t[("vs-sdpa", "aft-simple")]["status"] == "met"
    assert t[("vs-sdpa", "aft-local")]["status"] == "missed"  # 4x < 6x
    assert t[("memory-vs-sdpa", "aft-local")]["status"] == "met"
    assert t[("near-floor", "aft-simple")]["status"] == "missed"  # 4x floor at the largest T
    assert t[("full-vs-matmul", "aft-full")]["value"] == pytest.approx(1.2)
    causal_train = [
        x for x in evaluate_targets(result) if x["target"].startswith("causal aft-full train")
    ][0]
    assert causal_train["status"] == "met" and causal_train["value"] == pytest.approx(0.5)
    decay = [x for x in evaluate_targets(result) if x["target"].startswith("aft-decay decode")][0]
    assert decay["status"] == "missed" and decay["value"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "name, causal",
    [
        (n, c)
        for n in CASES
        if n != "attention-naive"
        for c in (False, True)
        if c or not CASES[n].causal_only
    ],
)
def test_case_table_matches_its_reference(name, causal):
    """Every case's inputs, op and reference agree (or the op is not written yet)."""
    case = CASES[name]
    for mode in ("forward", "train"):
        T = 36 if name == "aft-local" else 12  # past the band of 32, so both of its parts run
        g = check_case(case, mode, causal, Shape(1, T, 8, 2), torch.float32, torch.device("cpu"))
        assert g.status in ("passed", "unavailable"), g.note
        if g.status == "passed":
            assert g.max_error < 1e-3


def _slow_sdpa(x, causal):
    time.sleep(0.05)
    return CASES["attention-sdpa"].op(x, causal)


def test_longer_length_skipped_when_linear_growth_would_exceed_budget():
    cases = default_cases()
    cases["attention-sdpa"] = dataclasses.replace(CASES["attention-sdpa"], op=_slow_sdpa)
    cfg = BenchConfig(
        mixers=["attention-sdpa"],
        lengths=[16, 1024, 2048],
        modes=["forward"],
        isolate=False,
        **{**TINY, "max_seconds_per_case": 2.0},
    )
    small, big, bigger = run_bench(cfg, cases=cases, log=None)["results"]
    assert small["status"] == "ok" and small["time_median_s"] >= 0.05
    assert big["status"] == "skipped" and "at least linear from" in big["note"]
    assert bigger["status"] == "skipped" and "budget" in bigger["note"]


def test_aftlab_cli_bench_prints_one_line_and_exits_2(capsys):
    from aftlab.cli import main as aftlab_main

    assert aftlab_main(["bench", "--lengths", "16,x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--lengths" in err and "\n" not in err


def test_total_time_cap_skips_the_remaining_cases():
    cfg = BenchConfig(
        mixers=["attention-sdpa"],
        lengths=[16, 32],
        modes=["forward"],
        isolate=False,
        max_total_minutes=1e-9,
        **TINY,
    )
    rows = run_bench(cfg, log=None)["results"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("--max-total-minutes" in r["note"] and r["time_median_s"] is None for r in rows)
