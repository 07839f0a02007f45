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
    COMPARE_BUILDERS,
    PEERS,
    WKV,
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
    assert "| attention-sdpa |" in summary and "## Targets" in summary
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
        (["--peers", "aft-pytorch,nope"], "--peers"),
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


def _fake(mixer, mode, T, t, causal=True, nbytes=None):
    return {
        "mixer": mixer,
        "mode": mode,
        "T": T,
        "causal": causal,
        "status": "ok",
        "time_median_s": t,
        "bytes": nbytes,
    }


def _peer_row(peer, pair, impl, mode, T, t, finite=True):
    return {
        "peer": peer,
        "pair": pair,
        "impl": impl,
        "variant": pair if impl == "aftlab" else "theirs",
        "mode": mode,
        "T": T,
        "status": "ok",
        "time_median_s": t,
        "finite": True,
        "finite_large_input": finite,
    }


def test_targets_met_and_missed_with_shortfall():
    rows = [
        _fake("attention-sdpa", "train", 256, 0.1),
        _fake("attention-sdpa", "train", 4096, 40.0),
        _fake("aft-simple", "train", 4096, 1.0),  # 40x >= 30x
        _fake("aft-decay", "train", 4096, 2.0),  # 20x < 25x: missed by 1.25x
        _fake("aft-local", "train", 256, 0.2),  # slower than SDPA at T=256: missed by 2x
        _fake("aft-local", "train", 4096, 4.0),  # 10x < 12x
        _fake("aft-simple", "train", 2048, 1.0),
        _fake("aft-simple", "train", 16384, 8.5),  # 8.5 <= 9
        _fake("aft-decay", "train", 2048, 1.0),
        _fake("aft-decay", "train", 16384, 12.0),  # 12 > 9: missed by 4/3
        _fake("aft-simple", "forward", 1024, 9.0, nbytes=1e9),
        _fake("aft-simple", "forward", 16384, 1.0, nbytes=40e9),  # 2.5x the floor of 0.4 s
        _fake("aft-full", "train", 2048, 2.0, causal=False),
        _fake("aft-full-matmul", "train", 2048, 2.5, causal=False),  # 0.8 <= 1.2
        _fake("aft-full", "train", 2048, 1.5),  # 0.75 > 0.6
    ]
    compare = [
        _peer_row("hf-rwkv", "aft-decay", "aftlab", "train", 2048, 0.1),
        _peer_row("hf-rwkv", "aft-decay", "hf-rwkv", "train", 2048, 10.0),  # 100x < 150x
        _peer_row("aft-pytorch", "aft-simple", "aftlab", "forward", 1024, 1.0),
        _peer_row("aft-pytorch", "aft-simple", "aft-pytorch", "forward", 1024, 4.0),
        _peer_row("aft-pytorch", "aft-simple", "aftlab", "train", 1024, 1.0, finite=False),
        _peer_row("aft-pytorch", "aft-simple", "aft-pytorch", "train", 1024, 2.5),  # 2.5 < 3
        {"peer": "x", "status": "skipped", "note": "not installed"},
    ]
    result = {"results": rows, "compare": compare, "limits": {"copy_bytes_per_s": 100e9}}
    t = {x["target"]: x for x in evaluate_targets(result)}

    def check(prefix, status, value=None, shortfall=None):
        (row,) = [x for k, x in t.items() if k.startswith(prefix)]
        assert row["status"] == status, row
        if value is not None:
            assert row["value"] == pytest.approx(value)
        assert (row["shortfall"] is None) == (shortfall is None), row
        if shortfall is not None:
            assert row["shortfall"] == pytest.approx(shortfall)
            assert f"missed by {shortfall:.3g}" in row["measured"]
        return row

    check("aft-simple causal train at T=4096", "met", 40.0)
    check("aft-decay causal train at T=4096", "missed", 20.0, 1.25)
    check("aft-local causal train at T=4096", "missed", 10.0, 1.2)
    assert "n/a" in check("aft-conv causal train at T=4096", "n/a")["measured"]
    every = check("aft-local causal train faster than attention-sdpa at every", "missed", 0.5, 2)
    assert "T=256" in every["measured"]
    check("aft-simple train t(16384)", "met", 8.5)
    check("aft-decay train t(16384)", "missed", 12.0, 12 / 9)
    floor = check("aft-simple causal forward", "missed", 2.5, 1.25)
    assert "T=16384" in floor["measured"]
    check("aft-decay causal forward", "n/a")
    check("aft-full (non-causal) train", "met", 0.8)
    check("causal aft-full train", "missed", 0.75, 1.25)
    check("aft-decay train at T=2048 >= 150x", "missed", 100.0, 1.5)
    check("aftlab aft-simple >= 3x faster than aft-pytorch", "missed", 2.5, 1.2)
    check("aftlab aft-full >= 3x", "n/a")
    check("aftlab finite", "missed", 1, 1)


@pytest.fixture
def transformers_installed():
    pytest.importorskip("transformers", reason="the hf-rwkv peer needs transformers (test extra)")


def _peer_run(tmp_path, **kw):
    cfg = BenchConfig(
        mixers=["aft-decay"],
        lengths=[16],
        modes=["forward", "train"],
        causal=True,
        peers=["hf-rwkv"],
        compare_lengths=[8, 16],
        isolate=False,
        out=tmp_path,
        **TINY,
    )
    return run_bench(cfg, log=None, **kw)


def test_hf_rwkv_peer_is_gated_timed_and_reported(tmp_path, transformers_installed):
    result = _peer_run(tmp_path)
    rows = result["compare"]
    assert {(r["impl"], r["mode"], r["T"]) for r in rows} == {
        (i, m, T) for i in ("aftlab", "hf-rwkv") for m in ("forward", "train") for T in (8, 16)
    }
    for r in rows:
        assert r["status"] == "ok", r["note"]
        assert r["gate"] == "passed" and r["gate_max_error"] < 1e-4
        assert r["time_median_s"] > 0 and r["finite"] and r["finite_large_input"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## Targets" in summary and "## Against peers" in summary
    line = next(
        x for x in summary.splitlines() if "| rwkv_linear_attention_cpu | train | 16 |" in x
    )
    assert line.rstrip().endswith("x |")  # the speed ratio of ours over theirs
    (target,) = [x for x in result["targets"] if "rwkv_linear_attention_cpu" in x["target"]]
    assert target["status"] == "n/a" and "T=2048" in target["target"]


class _WrongWKV(WKV):
    def forward(self, x):
        return super().forward(x) * 1.01


def test_peer_gate_refuses_a_wrong_peer_and_a_missing_one_is_a_note(tmp_path, monkeypatch):
    name = "cmp:hf-rwkv:rwkv_linear_attention_cpu"
    monkeypatch.setitem(COMPARE_BUILDERS, name, lambda s: _WrongWKV(s, "aftlab"))
    rows = _peer_run(tmp_path)["compare"]
    theirs = [r for r in rows if r["impl"] == "hf-rwkv"]
    assert len(theirs) == 4 and all(r["status"] == "failed" for r in theirs)
    assert all(
        "correctness gate failed" in r["note"] and r["time_median_s"] is None for r in theirs
    )
    assert all(r["status"] == "ok" for r in rows if r["impl"] == "aftlab")

    monkeypatch.setitem(PEERS, "hf-rwkv", ("no_such_module_aftlab", "transformers", ()))
    (row,) = _peer_run(tmp_path)["compare"]
    assert row["status"] == "skipped" and "transformers is not installed" in row["note"]
    assert "transformers is not installed" in (tmp_path / "summary.md").read_text()


def test_old_compare_flag_and_peers_flag():
    cfg = config_from_args(_parse("--compare-aft-pytorch", "--peers", "hf-rwkv"))
    assert cfg.compare_aft_pytorch and cfg.peers == ["hf-rwkv"]


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
