"""End-to-end tests of ``aftlab bench`` on tiny sizes. No assertion depends on timing."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import sys
import time

import pytest
import torch

from aftlab.bench import OPS, BenchConfig, Shape, cases, run_bench
from aftlab.bench.cases import OP_PEERS, PEERS, WKV, Scan, Spec, peer_module
from aftlab.bench.measure import check, execute, tensor_bytes
from aftlab.bench.report import CSV_FIELDS, TARGETS, ratios, target_table, targets
from aftlab.cli import main as aftlab_main
from aftlab.mixers import available_mixers, registry
from aftlab.mixers.aft.simple import AFTSimple

TINY = dict(batch=1, dim=16, heads=4, repeats=1, limits_size="tiny", max_seconds_per_case=30.0)
STATUSES = {"ok", "skipped", "failed", "error"}


def _run(tmp_path=None, cases=None, **kw):
    cfg = BenchConfig(**{"isolate": False, "out": tmp_path, **TINY, **kw})
    return run_bench(cfg, cases=cases, argv=["aftlab", "bench", "--test"], log=None)


def _rows(result, mixer, mode=None):
    return [r for r in result["results"] if r["mixer"] == mixer and mode in (None, r["mode"])]


def test_end_to_end_writes_schema(tmp_path):
    result = _run(tmp_path, mixers=["attention"], lengths=[16, 32], causal=True)
    for name in ("results.json", "results.csv", "summary.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data) >= {"machine", "limits", "config", "results", "compare", "ratios"}
    assert data["machine"]["command"] == "aftlab bench --test"
    assert data["machine"]["torch"] == torch.__version__
    assert data["limits"]["gemm_flops_per_s"] > 0 and data["limits"]["bandwidth_bytes_per_s"] > 0
    assert len(data["results"]) == 6  # 3 modes x 2 lengths
    for r in result["results"]:  # SDPA is torch's own: it passes the gate and is measured
        assert r["status"] == "ok", r["note"]
        assert r["gate"] == "passed" and r["time_median_s"] > 0 and r["repeats"] == 1
        assert r["ratio_to_floor"] == pytest.approx(r["time_median_s"] / r["floor_s"])
        assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] >= 0
        assert set(CSV_FIELDS) - {"cpu_model", "gpu", "torch", "date", "command"} <= set(r)
    # the KV cache holds at least k and v of every past position
    assert all(r["state_bytes"] >= 2 * r["B"] * r["T"] * r["d"] * 4 for r in _rows(
        result, "attention", "decode"))
    with open(tmp_path / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        assert all(r["cpu_model"] and r["command"] == "aftlab bench --test" for r in reader)
    summary = (tmp_path / "summary.md").read_text()
    assert "| attention |" in summary and "## Measured ratios" in summary
    assert "attention: growth exponent (train)" in summary
    pytest.importorskip("matplotlib")
    for mode in ("forward", "train", "decode"):
        assert (tmp_path / f"bench_{mode}.png").stat().st_size > 0


def test_cases_derive_from_the_mixer_registry(monkeypatch):
    """Every registered mixer is a case under its own name; a new one needs only its class."""
    assert set(cases()) == {*available_mixers(), "aft-full-matmul"}
    assert set(OPS) <= set(available_mixers())

    class Toy(AFTSimple):
        pass

    monkeypatch.setitem(registry._MIXERS, "toy", Toy)
    assert "toy" in cases() and cases()["toy"] is None
    result = _run(mixers=["toy"], lengths=[8], causal=True)
    fwd, train, decode = result["results"]
    assert fwd["status"] == train["status"] == "skipped" and "no op-level entry" in fwd["note"]
    assert decode["status"] == "ok" and decode["gate"] == "passed", decode["note"]


class _WrongStep(AFTSimple):
    def _step(self, x, state):
        y, state = super()._step(x, state)
        return y * 1.01, state


def test_decoding_gate_refuses_steps_that_differ_from_forward(monkeypatch):
    monkeypatch.setitem(registry._MIXERS, "wrong-step", _WrongStep)
    spec = Spec("wrong-step", "decode", True, Shape(1, 8, 16, 4), None)
    g = check(spec, None, torch.float32, torch.device("cpu"))
    assert g.status == "failed" and "wrong-step y" in g.note
    g = check(spec._replace(name="aft-simple"), None, torch.float32, torch.device("cpu"))
    assert g.status == "passed" and g.max_error < 1e-4


def _recording(fn, seen: dict, pick):
    """``fn`` that first records ``pick(*args)`` under the dtype of its first tensor."""

    def call(*args, **kwargs):
        got = pick(*args)
        seen.setdefault(got[0].dtype, got)
        return fn(*args, **kwargs)

    return call


@pytest.mark.parametrize("name", ["aft-decay", "hf-rwkv:aftlab:aft-decay"])
def test_gate_reference_sees_the_inputs_and_weights_rounded_to_the_dtype(name, monkeypatch):
    """The float64 reference of the gate computes on exactly what the case under test got (an
    op's bfloat16 inputs; a module's bfloat16 input and weights), so its error is the case's."""
    seen, op = {}, None
    if name in OPS:
        base = OPS[name]
        op = dataclasses.replace(
            base,
            fast=_recording(base.fast, seen, lambda *x: x),
            reference=_recording(base.reference, seen, lambda *x: x),
        )
    else:  # a peer's module (WKV): its input and its parameters
        pick = lambda m, x: (x, m.time_decay, m.time_first)  # noqa: E731
        monkeypatch.setattr(WKV, "forward", _recording(WKV.forward, seen, pick))
        monkeypatch.setattr(WKV, "reference", _recording(WKV.reference, seen, pick))
    check(Spec(name, "forward", True, Shape(1, 9, 8, 1), None), op, torch.bfloat16, "cpu")
    assert set(seen) == {torch.bfloat16, torch.float64}, list(seen)
    for a, e in zip(seen[torch.bfloat16], seen[torch.float64], strict=True):
        assert torch.equal(a.double(), e), f"{name}: the reference got other values"


def test_isolated_case_runs_in_a_fresh_process():
    cfg = BenchConfig(threads=1, repeats=2, warmup=1, max_seconds_per_case=30.0)
    out = execute(Spec("attention", "train", True, Shape(1, 16, 16, 4), cfg), None, isolate=True)
    assert out["status"] == "ok", out.get("note")
    assert out["mem_method"] == "VmHWM - VmRSS, fresh process" and out["peak_bytes"] >= 0
    assert out["repeats"] == 2 and 0 < out["time_min_s"] <= out["time_median_s"]


def _wrong_forward(*x, causal):
    return OPS["attention"].fast(*x, causal=causal) * 1.01


def _wrong_backward(q, k, v, causal):  # forward values exact, gradient of q off by 10%
    return OPS["attention"].fast(q, k, v, causal=causal) + 0.1 * (q - q.detach())


def test_correctness_gate_refuses_wrong_op():
    table = cases()
    for name, fast in (("attention", _wrong_forward), ("attention-naive", _wrong_backward)):
        table[name] = dataclasses.replace(OPS[name], fast=fast)
    result = _run(cases=table, mixers=["attention", "attention-naive"], lengths=[16],
                  modes=["forward", "train"])
    for r in _rows(result, "attention"):
        assert r["status"] == "failed" and r["gate"] == "failed"
        assert "correctness gate failed" in r["note"] and "attention y" in r["note"]
        assert r["time_median_s"] is None and r["peak_bytes"] is None
    fwd, train = _rows(result, "attention-naive")
    assert fwd["status"] == "ok" and fwd["gate"] == "passed"
    assert train["status"] == "failed" and "dq" in train["note"] and train["time_median_s"] is None


def test_oversize_and_over_budget_cases_are_skipped_with_a_note():
    result = _run(mixers=["attention-naive"], lengths=[16, 4096], modes=["forward"],
                  max_memory_gb=0.25)
    small, big = _rows(result, "attention-naive")
    assert small["status"] == "ok"
    assert big["status"] == "skipped" and "exceeds the memory limit" in big["note"]
    assert big["est_peak_bytes"] > 0.25 * 2**30 and big["time_median_s"] is None
    rows = _run(mixers=["attention"], lengths=[16, 32], modes=["train"],
                **{**TINY, "max_seconds_per_case": 1e-12})["results"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("budget" in r["note"] for r in rows)


def test_causal_only_mixer_skipped_when_not_causal():
    (row,) = _run(mixers=["aft-decay"], lengths=[16], modes=["forward"])["results"]
    assert row["status"] == "skipped" and "causal only" in row["note"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--lengths", "16,x"], "--lengths"),
        (["--lengths", "0,16"], "--lengths"),
        (["--mixers", "attention,nope"], "--mixers"),
        (["--mixers", "attention-sdpa"], "--mixers"),  # the implementation is the mixer's name
        (["--modes", "forward,fwd"], "--modes"),
        (["--dim", "10", "--heads", "4"], "--dim must be divisible by --heads 4"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--threads", "0"], "--threads"),
        (["--repeats", "0"], "--repeats"),
        (["--batch", "x"], "--batch"),
        (["--max-seconds-per-case", "0"], "--max-seconds-per-case"),
        (["--max-total-minutes", "-1"], "--max-total-minutes"),
        (["--also-noncausal", "aft-full", "--mixers", "aft-simple"], "--also-noncausal"),
        (["--peers", "aft-pytorch,nope"], "--peers"),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(argv, expected, capsys):
    try:
        code = aftlab_main(["bench", *argv])
    except SystemExit as e:  # argparse's own checks (a non-integer --batch)
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("aftlab: error:") and expected in err and "\n" not in err


def test_defaults_and_the_old_compare_flag():
    from aftlab.bench.cli import add_arguments, config_from_args
    from aftlab.cli import _Parser

    parser = _Parser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([]))
    assert cfg.mixers == available_mixers() and cfg.lengths == [256, 1024, 4096, 16384]
    assert cfg.modes == ["forward", "train", "decode"] and (cfg.batch, cfg.dim) == (4, 256)
    cfg = config_from_args(parser.parse_args(["--compare-aft-pytorch", "--peers", "hf-rwkv"]))
    assert cfg.peers == ["aft-pytorch", "hf-rwkv"] and cfg.isolate is True
    assert config_from_args(parser.parse_args(["--no-isolate"])).isolate is False


def test_peak_memory_sees_a_64_mib_temporary():
    """In a fresh process, as the bench measures: in this one, memory that earlier tests freed
    may still be resident and serve the temporary without raising the peak."""
    code = (
        "import torch; from aftlab.bench.measure import peak_memory\n"
        "def alloc():\n    x = torch.ones(16 * 2**20)  # 64 MiB, touched\n    return float(x[-1])\n"
        "print(*peak_memory(alloc, torch.device('cpu')), sep='|')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, method, seconds = out.stdout.strip().split("|")
    assert float(seconds) > 0 and method == "VmHWM - VmRSS"
    assert 60 * 2**20 <= int(peak) <= 200 * 2**20


def test_fresh_pages_lets_the_memory_call_see_what_timed_calls_left_in_the_heap():
    """The bench times its calls first, under glibc's own policy, which keeps a freed 16 MiB
    tensor in the heap for the next call; its memory call comes after fresh_pages, which also
    gives that memory back (without the trim the call below reads a peak of 0)."""
    code = (
        "import torch; from aftlab.bench.measure import peak_memory, fresh_pages\n"
        "def alloc():\n    x = torch.ones(4 * 2**20)  # 16 MiB, touched\n    return float(x[-1])\n"
        "for _ in range(3):\n    alloc()\n"
        "fresh_pages()\n"
        "print(peak_memory(alloc, torch.device('cpu'))[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 15 * 2**20 <= int(out.stdout) <= 64 * 2**20


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10, 4)
    state = {"k": a, "view": a[2:], "list": [torch.zeros(3, dtype=torch.float64)]}
    assert tensor_bytes(state) == 10 * 4 * 4 + 3 * 8


def _fake(mixer, mode, T, t, causal=True):
    return {"mixer": mixer, "mode": mode, "T": T, "causal": causal, "status": "ok",
            "time_median_s": t}


def test_measured_ratios():
    rows = [
        _fake("attention", "train", 256, 0.1),
        _fake("attention", "train", 4096, 40.0),
        _fake("aft-simple", "train", 4096, 1.0),  # 40x faster than attention
        _fake("aft-simple", "train", 2048, 1.0),
        _fake("aft-simple", "train", 16384, 9.0),  # growth exponent from 4096: log 9 / log 4
        _fake("aft-local", "train", 256, 0.2),  # slower than attention: 0.5
        _fake("aft-full", "train", 2048, 2.0, causal=False),
        _fake("aft-full-matmul", "train", 2048, 2.5, causal=False),  # 0.8
        _fake("aft-full", "train", 2048, 1.5),  # 0.75 of non-causal
        {**_fake("aft-conv", "train", 4096, 1.0), "status": "skipped"},  # not measured: no ratio
    ]
    got = {(x["ratio"], x["mode"], x["T"]): x["value"] for x in ratios({"results": rows})}
    assert got == pytest.approx({
        ("attention / aft-simple", "train", 4096): 40.0,
        ("aft-simple: growth exponent", "train", 4096): 0.0,
        ("aft-simple: growth exponent", "train", 16384): math.log(9) / math.log(4),
        ("attention: growth exponent", "train", 4096): math.log(400) / math.log(16),
        ("attention / aft-local", "train", 256): 0.5,
        ("aft-full (non-causal) / aft-full-matmul", "train", 2048): 0.8,
        ("aft-full: causal / non-causal", "train", 2048): 0.75,
    })


def test_targets_say_met_or_by_how_much_they_are_missed():
    cfg = {"device": "cpu", "batch": 4, "dim": 256, "dtype": "float32", "threads": 2}
    rows = [
        _fake("attention", "train", 256, 3.0),
        _fake("aft-local", "train", 256, 2.0),  # 1.5x: met exactly
        _fake("aft-conv", "train", 256, 2.5),  # 1.2x: missed by 1.25x
        _fake("attention", "train", 4096, 12.0),
        _fake("aft-local", "train", 4096, 2.0),  # 6x of 12: missed by 2x
        _fake("aft-simple", "train", 4096, 1.0),  # 12x of 30
        _fake("aft-simple", "train", 128, 1.0),  # no target below T = 256
        _fake("attention", "train", 128, 2.0),
        _fake("aft-local", "train", 1024, 1.0),  # every T >= 256 without its own: >= 1
        _fake("attention", "train", 1024, 0.5),
    ]
    result = {"results": rows, "config": cfg}
    result["ratios"] = ratios(result)
    got = {(x["ratio"], x["T"]): (x["target"], x["verdict"]) for x in targets(result)}
    assert got == {
        ("attention / aft-local", 256): (">= 1.5", "met"),
        ("attention / aft-conv", 256): (">= 1.5", "missed by 1.25x"),
        ("attention / aft-local", 4096): (">= 12", "missed by 2.00x"),
        ("attention / aft-simple", 4096): (">= 30", "missed by 2.50x"),
        ("attention / aft-local", 1024): (">= 1", "missed by 2.00x"),
    }
    text = "\n".join(target_table(result))
    assert "| attention / aft-local (train) | 4096 | 6 | >= 12 | missed by 2.00x |" in text
    # another regime (batch, threads) or device has none of these targets
    for other in ({"batch": 8}, {"threads": 1}, {"device": "cuda"}):
        assert targets({**result, "config": {**cfg, **other}}) == []
    # a bound from above (CUDA, every T): aft-full over its two products
    cuda = {**cfg, "device": "cuda:0"}
    rows = [_fake("aft-full", "train", 2048, 2.0, causal=False),
            _fake("aft-full-matmul", "train", 2048, 1.0, causal=False)]
    result = {"results": rows, "config": cuda}
    result["ratios"] = ratios(result)
    assert [x["verdict"] for x in targets(result)] == ["missed by 1.33x"]
    assert all(op in (">=", "<=") for op, _ in TARGETS.values())


@pytest.fixture
def transformers_installed():
    pytest.importorskip("transformers", reason="the hf-rwkv peer needs transformers (test extra)")


def _peer_run(tmp_path):
    return _run(tmp_path, mixers=["aft-decay"], lengths=[16], modes=["forward", "train"],
                causal=True, peers=["hf-rwkv"], compare_lengths=[8, 16])


def test_hf_rwkv_peer_is_gated_timed_and_reported(tmp_path, transformers_installed):
    rows = _peer_run(tmp_path)["compare"]
    assert {(r["impl"], r["mode"], r["T"]) for r in rows} == {
        (i, m, T) for i in ("aftlab", "hf-rwkv") for m in ("forward", "train") for T in (8, 16)
    }
    for r in rows:
        assert r["status"] == "ok", r["note"]
        assert r["gate"] == "passed" and r["gate_max_error"] < 1e-4
        assert r["time_median_s"] > 0 and r["finite"] and r["finite_large_input"]
    summary = (tmp_path / "summary.md").read_text()
    line = next(x for x in summary.splitlines() if "| hf-rwkv hf-rwkv rwkv_linear_attention_cpu "
                "(train) |" in x)
    assert line.count("x faster") == 2  # T = 8 and 16: how much faster ours is


def test_fla_peer_pairs_and_the_hgrn_reference():
    """fla's kernels need a GPU (run_cuda.sh runs them); here: the pairs build the right modules,
    ours match their references, and HGRN's float64 reference is its closed form
    ``h_t = sum_{j<=t} (prod_{j<i<=t} sigma(x_i)) x_j``."""
    s = Shape(2, 7, 5, 1, 8)
    package, module, pairs = PEERS["fla"]
    assert (package, module) == ("flash-linear-attention", "fla")
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    for ours, theirs in pairs.items():
        mine, peer = peer_module("fla", "aftlab", ours, s), peer_module("fla", "fla", theirs, s)
        assert type(mine) is type(peer) and peer.impl == "fla"
        mine = mine.double()
        torch.testing.assert_close(mine(x), mine.reference(x), rtol=1e-10, atol=1e-12)
    g = torch.sigmoid(x)
    want = torch.stack([
        sum(x[:, j] * torch.prod(g[:, j + 1 : t + 1], dim=1) for j in range(t + 1))
        for t in range(7)
    ], 1)
    torch.testing.assert_close(Scan(s, "fla").reference(x), want, rtol=1e-12, atol=1e-12)


class _WrongWKV(WKV):
    def forward(self, x):
        return super().forward(x) * 1.01


def test_peer_gate_refuses_a_wrong_peer_and_a_missing_one_is_a_note(tmp_path, monkeypatch):
    def wkv(s, impl):  # theirs wrong (and no transformers needed), ours right
        return _WrongWKV(s, "aftlab") if impl == "hf-rwkv" else WKV(s, impl)

    monkeypatch.setitem(OP_PEERS, "hf-rwkv", {"aft-decay": wkv})
    monkeypatch.setitem(PEERS, "hf-rwkv", ("torch", "torch", PEERS["hf-rwkv"][2]))
    rows = _peer_run(tmp_path)["compare"]
    theirs = [r for r in rows if r["impl"] == "hf-rwkv"]
    assert len(theirs) == 4 and all(r["status"] == "failed" for r in theirs)
    assert all("correctness gate failed" in r["note"] and r["time_median_s"] is None
               for r in theirs)
    assert all(r["status"] == "ok" for r in rows if r["impl"] == "aftlab")

    monkeypatch.setitem(PEERS, "hf-rwkv", ("no-such-package-aftlab", "no_such_module", {}))
    (row,) = _peer_run(tmp_path)["compare"]
    assert row["status"] == "skipped" and "no-such-package-aftlab is not installed" in row["note"]
    assert "no-such-package-aftlab is not installed" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("name, causal", [
    (n, c) for n in [*OPS, "aft-full-matmul"] for c in (False, True)
    if c or n == "aft-full-matmul" or not OPS[n].causal_only
])
def test_every_op_matches_its_reference(name, causal):
    """Each op's inputs, fast call and reference agree, forward and backward."""
    T = 36 if name == "aft-local" else 12  # past the band of 32: both of its parts run
    for mode in ("forward", "train"):
        s, cpu = Shape(1, T, 8, 2), torch.device("cpu")
        g = check(Spec(name, mode, causal, s, None), cases()[name], torch.float32, cpu)
        assert g.status == "passed" and g.max_error < 1e-3, g.note


def _slow_sdpa(*x, causal):
    time.sleep(0.05)
    return OPS["attention"].fast(*x, causal=causal)


def test_longer_length_skipped_when_linear_growth_would_exceed_budget():
    table = cases()
    table["attention"] = dataclasses.replace(OPS["attention"], fast=_slow_sdpa)
    small, big, bigger = _run(cases=table, mixers=["attention"], lengths=[16, 1024, 2048],
                              modes=["forward"], **{**TINY, "max_seconds_per_case": 2.0})["results"]
    assert small["status"] == "ok" and small["time_median_s"] >= 0.05
    assert big["status"] == "skipped" and "at least linear from" in big["note"]
    assert bigger["status"] == "skipped" and "budget" in bigger["note"]


def test_total_time_cap_skips_the_remaining_cases():
    rows = _run(mixers=["attention"], lengths=[16, 32], modes=["forward"],
                max_total_minutes=1e-9)["results"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("--max-total-minutes" in r["note"] and r["time_median_s"] is None for r in rows)


def test_without_matplotlib_the_report_is_written_and_the_plots_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    lines = []
    cfg = BenchConfig(isolate=False, out=tmp_path, **TINY, mixers=["aft-simple"], lengths=[8])
    run_bench(cfg, argv=["aftlab", "bench"], log=lines.append)
    assert (tmp_path / "summary.md").stat().st_size > 0 and not list(tmp_path.glob("*.png"))
    assert "plots skipped: plotting needs matplotlib" in lines[-1]
    assert "pip install 'aftlab[plot]'" in lines[-1]
