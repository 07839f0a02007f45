"""The benchmark run: plan the cases, gate them, measure them, and write the report.

Example:
    >>> from aftlab.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(mixers=["attention-sdpa"], lengths=[16, 32], batch=1,
    ...                                dim=16, repeats=1, out="bench-out"))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cases import CASES, MATMUL_CASE, MODES, OpCase, Shape
from .gate import GateResult, check_case, check_module, gate_shape
from .machine import machine_info, measure_limits
from .measure import COMPARE_BUILDERS, PEERS, CaseSpec, can_isolate, run_case, run_isolated
from .report import ROW_FIELDS

__all__ = ["BenchConfig", "run_bench", "DTYPES"]

DTYPES = ("float32", "float64", "bfloat16", "float16")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


@dataclass
class BenchConfig:
    """Options of one benchmark run (the CLI flags of ``aftlab bench``).

    Attributes:
        mixers: case names from :data:`aftlab.bench.cases.CASES`.
        lengths: sequence lengths ``T`` for ``forward`` and ``train``.
        decode_positions: positions of the decoding step; default: ``lengths``.
        batch: ``B``. dim: ``d``. heads: ``h`` (attention heads, aft-conv heads).
        modes: subset of ``("forward", "train", "decode")``.
        causal: run every mixer causal (else non-causal; aft-decay is causal only).
        also_noncausal: mixers also run non-causal when ``causal`` is set (e.g. ``["aft-full"]``).
        device, dtype, threads: where and how (``threads``: ``torch.set_num_threads``).
        repeats: timed calls per case (median reported); warmup: untimed calls before.
        max_seconds_per_case: time budget of a case; cases whose floor already exceeds it are
            skipped, fewer repeats are timed when calls are slow, and a case running past 3x the
            budget (plus a minute of set-up) is killed and reported as skipped.
        max_memory_gb: skip cases whose estimated peak exceeds this; default 60% of the
            available memory (CPU) or of the free GPU memory.
        isolate: run each CPU case in a fresh process (default on CPU).
        peers: module-level comparisons with other packages, among
            :data:`aftlab.bench.measure.PEERS`: ``"aft-pytorch"`` (its AFTFull and AFTSimple
            beside our aft-full and aft-simple) and ``"hf-rwkv"`` (transformers' RWKV CPU path
            beside our aft-decay). compare_aft_pytorch: the same as ``"aft-pytorch"`` in peers.
        compare_lengths: lengths of that comparison; default: ``lengths`` up to 4096 (its
            AFTFull materialises ``exp(w)``, ``T x T``, twice per call).
        max_total_minutes: once the run has taken this long, the remaining cases are skipped
            with a note (cases run in the order of ``mixers``).
        limits_size: ``"full"`` or ``"tiny"`` (tests) for the machine-limit measurements.
        seed: seed of the random inputs.
        out: output directory, or None to write nothing.
    """

    mixers: list[str] = field(default_factory=lambda: list(CASES))
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 4096, 16384])
    decode_positions: list[int] | None = None
    batch: int = 4
    dim: int = 256
    heads: int = 4
    modes: list[str] = field(default_factory=lambda: list(MODES))
    causal: bool = False
    also_noncausal: list[str] = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    repeats: int = 5
    warmup: int = 1
    max_seconds_per_case: float = 60.0
    max_memory_gb: float | None = None
    isolate: bool | None = None
    peers: list[str] = field(default_factory=list)
    compare_aft_pytorch: bool = False
    compare_lengths: list[int] | None = None
    max_total_minutes: float | None = None
    limits_size: str = "full"
    seed: int = 0
    out: str | os.PathLike | None = None

    def validate(self, cases: dict[str, OpCase] | None = None) -> None:
        """Raise ``ValueError`` (one line, naming the option) on bad options."""
        known = CASES if cases is None else cases
        bad = [m for m in self.mixers if m not in known]
        if bad or not self.mixers:
            raise ValueError(f"bench: --mixers must name some of {list(known)}, got {self.mixers}")
        for name in self.also_noncausal:
            if name not in self.mixers:
                raise ValueError(
                    f"bench: --also-noncausal {name!r} is not among --mixers {self.mixers}"
                )
        for opt, vals in (
            ("lengths", self.lengths),
            ("decode-positions", self.decode_positions or [1]),
            ("compare-lengths", self.compare_lengths or [1]),
        ):
            if not vals or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals
            ):
                raise ValueError(f"bench: --{opt} must be positive integers, got {vals}")
        if any(p not in PEERS for p in self.peers):
            raise ValueError(f"bench: --peers must be some of {list(PEERS)}, got {self.peers}")
        bad_modes = [m for m in self.modes if m not in MODES]
        if bad_modes or not self.modes:
            raise ValueError(f"bench: --modes must be some of {list(MODES)}, got {self.modes}")
        for opt in ("batch", "dim", "heads", "repeats"):
            v = getattr(self, opt)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"bench: --{opt} must be a positive integer, got {v!r}")
        if self.warmup < 1:
            raise ValueError(f"bench: --warmup must be >= 1, got {self.warmup}")
        if self.dim % self.heads:
            raise ValueError(f"bench: --dim {self.dim} must be divisible by --heads {self.heads}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"bench: --threads must be a positive integer, got {self.threads!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"bench: --dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"bench: --device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("bench: --device cuda was asked for but torch sees no CUDA device")
        if not (self.max_seconds_per_case > 0 and math.isfinite(self.max_seconds_per_case)):
            raise ValueError(
                f"bench: --max-seconds-per-case must be > 0, got {self.max_seconds_per_case}"
            )
        if self.max_total_minutes is not None and not self.max_total_minutes > 0:
            raise ValueError(
                f"bench: --max-total-minutes must be > 0, got {self.max_total_minutes}"
            )
        if self.max_memory_gb is not None and not self.max_memory_gb > 0:
            raise ValueError(f"bench: --max-memory-gb must be > 0, got {self.max_memory_gb}")
        if self.limits_size not in ("full", "tiny"):
            raise ValueError(
                f"bench: limits_size must be 'full' or 'tiny', got {self.limits_size!r}"
            )
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"bench: --out {str(self.out)!r} exists and is not a directory")


def _max_memory_bytes(cfg: BenchConfig, device: torch.device) -> float:
    if cfg.max_memory_gb is not None:
        return cfg.max_memory_gb * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.6 * free
    return 0.6 * _mem_available()


def _variants(cfg: BenchConfig) -> list[tuple[str, bool]]:
    """(case, causal) in the order of ``cfg.mixers``; aft-full's matrix products right after it."""
    wants_matmul = any(m in cfg.modes for m in ("forward", "train"))
    out = []
    for name in cfg.mixers:
        out.append((name, cfg.causal))
        if cfg.causal and name in cfg.also_noncausal:
            out.append((name, False))
        if name == "aft-full" and wants_matmul and MATMUL_CASE.name not in cfg.mixers:
            out.append((MATMUL_CASE.name, False))
    return out


def _floors(case: OpCase, mode: str, s: Shape, causal: bool, limits: dict) -> dict:
    flops, nbytes = case.flops(mode, s, causal), case.bytes(mode, s, causal)
    f_bw = nbytes / limits["bandwidth_bytes_per_s"]
    f_fl = flops / limits["gemm_flops_per_s"]
    return {
        "flops": flops,
        "bytes": nbytes,
        "floor_bandwidth_s": f_bw,
        "floor_flops_s": f_fl,
        "floor_s": max(f_bw, f_fl),
        "floor_bound": "memory" if f_bw >= f_fl else "compute",
    }


def _row(**kw) -> dict:
    base = dict.fromkeys(ROW_FIELDS)
    base.update(kw)
    return base


def run_bench(
    cfg: BenchConfig,
    *,
    cases: dict[str, OpCase] | None = None,
    argv: list[str] | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Run the benchmark described by ``cfg``; write the report into ``cfg.out`` if set.

    Args:
        cfg: the options.
        cases: the case table (default :data:`aftlab.bench.cases.CASES`). This is the hook for
            adding or replacing a case (e.g. a deliberately wrong op, which the correctness gate
            must refuse). A case not in the built-in table runs in this process, not isolated.
        argv: the command line recorded in the report (default ``sys.argv``).
        log: called with one line per case as the run progresses (None: silent).

    Returns:
        ``{"machine": ..., "limits": ..., "config": ..., "results": [rows], "compare": [rows],
        "targets": [...]}``; each row has ``status`` ``"ok"``, ``"failed"`` (gate),
        ``"skipped"`` or ``"error"`` with a ``note``.
    """
    table = dict(CASES if cases is None else cases)
    table.setdefault(MATMUL_CASE.name, MATMUL_CASE)
    cfg.validate(table)
    say = log or (lambda _msg: None)
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    threads = torch.get_num_threads()
    isolate = cfg.isolate if cfg.isolate is not None else device.type == "cpu"
    esize = torch.empty((), dtype=dtype).element_size()
    mem_limit = _max_memory_bytes(cfg, device)
    t0 = time.perf_counter()

    say(f"measuring machine limits on {device} ({cfg.dtype}, {threads} threads)...")
    limits = measure_limits(device, dtype, size=cfg.limits_size)
    say(
        f"  GEMM {limits['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"bandwidth {limits['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
    )

    rows: list[dict] = []
    gates: dict[tuple, GateResult] = {}
    for name, causal in _variants(cfg):
        case = table[name]
        for mode in cfg.modes:
            if mode == "decode" and name == MATMUL_CASE.name:
                continue
            lengths = (cfg.decode_positions or cfg.lengths) if mode == "decode" else cfg.lengths
            given_up, last_ok = "", None
            for T in sorted(lengths):
                s = Shape(cfg.batch, T, cfg.dim, cfg.heads, esize)
                row = _row(
                    mixer=name,
                    causal=causal if mode != "decode" else True,
                    mode=mode,
                    T=T,
                    B=cfg.batch,
                    d=cfg.dim,
                    heads=cfg.heads,
                    dtype=cfg.dtype,
                    device=cfg.device,
                    threads=threads,
                )
                rows.append(row)
                row.update(_floors(case, mode, s, row["causal"], limits))
                row["est_peak_bytes"] = case.mem_estimate(mode, s, row["causal"])
                if case.causal_only and not row["causal"]:
                    row.update(status="skipped", note=f"{name} is causal only (use --causal)")
                elif mode == "decode" and case.mixer is None:
                    row.update(status="skipped", note=f"{name} has no decoding module")
                elif given_up:
                    row.update(status="skipped", note=given_up)
                elif _out_of_time(cfg, t0):
                    row.update(status="skipped", note=_TOTAL_NOTE.format(cfg.max_total_minutes))
                elif row["est_peak_bytes"] > mem_limit:
                    row.update(
                        status="skipped",
                        note=(
                            f"estimated peak {row['est_peak_bytes'] / 2**30:.2f} GiB exceeds the "
                            f"memory limit {mem_limit / 2**30:.2f} GiB"
                        ),
                    )
                elif 2 * row["floor_s"] > cfg.max_seconds_per_case:
                    row.update(
                        status="skipped",
                        note=(
                            f"2 calls at the floor ({row['floor_s']:.2f} s each) exceed the "
                            f"{cfg.max_seconds_per_case:g} s budget"
                        ),
                    )
                elif (
                    last_ok is not None and _predicted(mode, T, *last_ok) > cfg.max_seconds_per_case
                ):
                    row.update(status="skipped", note=_linear_note(mode, T, *last_ok, cfg))
                if row["status"] is None:
                    key = (name, mode, row["causal"], gate_shape(s))
                    if key not in gates:
                        gates[key] = check_case(case, mode, row["causal"], s, dtype, device)
                    g = gates[key]
                    row["gate"], row["gate_max_error"] = g.status, g.max_error
                    if g.status == "failed":
                        row.update(status="failed", note=g.note)
                    elif g.status == "unavailable":
                        row.update(status="skipped", note=g.note)
                if row["status"] is None:
                    _measure(row, case, cfg, s, mode, threads, isolate)
                    if row["status"] == "skipped" and _over_time(row["note"]):
                        given_up = f"skipped: T={T} already exceeded the time budget"
                    elif row["status"] == "ok":
                        last_ok = (row["time_median_s"], T)
                elif row["status"] == "skipped" and _over_time(row["note"]):
                    given_up = row["note"]
                say(_progress(row))

    peers = list(dict.fromkeys([*(["aft-pytorch"] if cfg.compare_aft_pytorch else []), *cfg.peers]))
    compare = [row for p in peers for row in _run_compare(p, cfg, threads, isolate, esize, say, t0)]
    from .report import evaluate_targets, write_report

    result = {
        "machine": machine_info(device, argv),
        "limits": limits,
        "config": {
            k: (str(v) if isinstance(v, os.PathLike) else v)
            for k, v in dataclasses.asdict(cfg).items()
        },
        "results": rows,
        "compare": compare,
        "wall_s": time.perf_counter() - t0,
    }
    result["machine"]["threads"] = threads
    result["targets"] = evaluate_targets(result)
    if cfg.out is not None:
        for line in write_report(result, Path(cfg.out)):
            say(line)
    return result


def _spec(name: str, mode: str, causal: bool, s: Shape, cfg: BenchConfig, threads: int) -> CaseSpec:
    return CaseSpec(
        name,
        mode,
        causal,
        s,
        cfg.dtype,
        cfg.device,
        threads,
        cfg.repeats,
        cfg.warmup,
        cfg.max_seconds_per_case,
        cfg.seed,
    )


def _execute(spec: CaseSpec, case: OpCase | None, isolate: bool, budget: float) -> dict:
    builtin = (
        spec.name in COMPARE_BUILDERS
        or spec.name == MATMUL_CASE.name
        or (spec.name in CASES and CASES[spec.name] is case)
    )
    if isolate and builtin and can_isolate():
        return run_isolated(spec, timeout=3 * budget + 60)
    return run_case(spec, case)


def _measure(
    row: dict, case: OpCase, cfg: BenchConfig, s: Shape, mode: str, threads: int, isolate: bool
) -> None:
    out = _execute(
        _spec(case.name, mode, row["causal"], s, cfg, threads),
        case,
        isolate,
        cfg.max_seconds_per_case,
    )
    row["status"], row["note"] = out["status"], out.get("note", "")
    if out["status"] != "ok":
        return
    times = out["times"]
    med = statistics.median(times)
    where = "fresh process" if out.get("pid") != os.getpid() else "in-process"
    row.update(
        time_median_s=med,
        time_min_s=min(times),
        repeats=len(times),
        peak_bytes=out["peak_bytes"],
        mem_method=f"{out['mem_method']}, {where}",
        state_bytes=out.get("state_bytes"),
        ratio_to_floor=med / row["floor_s"] if row["floor_s"] else None,
    )
    if len(times) < cfg.repeats:
        row["note"] = f"{len(times)} of {cfg.repeats} repeats within the time budget"


def _run_compare(peer, cfg, threads, isolate, esize, say, t0) -> list[dict]:
    """The rows of one peer: each (ours, theirs) pair gated if it can be, then timed."""
    module, package, pairs = PEERS[peer]
    if importlib.util.find_spec(module) is None:
        say(f"{peer} comparison skipped: {package} is not installed (pip install {package})")
        return [{"peer": peer, "status": "skipped", "note": f"{package} is not installed"}]
    rows, dtype, device = [], getattr(torch, cfg.dtype), torch.device(cfg.device)
    for ours, theirs in pairs:
        for impl, variant in (("aftlab", ours), (peer, theirs)):
            name = f"cmp:{impl}:{variant}"
            s = Shape(cfg.batch, max(cfg.compare_lengths or cfg.lengths), cfg.dim, 1, esize)
            gate = check_module(COMPARE_BUILDERS[name], s, dtype, device)
            given_up = gate.note if gate.status == "failed" else ""
            for mode in [m for m in cfg.modes if m != "decode"]:
                last_ok = None
                for T in sorted(cfg.compare_lengths or [t for t in cfg.lengths if t <= 4096]):
                    s = Shape(cfg.batch, T, cfg.dim, 1, esize)
                    row = dict.fromkeys(
                        ("time_median_s", "peak_bytes", "finite", "finite_large_input", "status")
                    )
                    row.update(
                        peer=peer,
                        pair=ours,
                        impl=impl,
                        variant=variant,
                        mode=mode,
                        T=T,
                        B=cfg.batch,
                        d=cfg.dim,
                        note="",
                        gate=gate.status,
                        gate_max_error=gate.max_error,
                    )
                    rows.append(row)
                    est = (6 if mode == "train" else 3) * T * T * esize * (
                        "full" in variant.lower()
                    ) + 30 * cfg.batch * T * cfg.dim * esize
                    if given_up:
                        row.update(
                            status="failed" if gate.status == "failed" else "skipped", note=given_up
                        )
                    elif _out_of_time(cfg, t0):
                        row.update(status="skipped", note=_TOTAL_NOTE.format(cfg.max_total_minutes))
                    elif last_ok and _predicted(mode, T, *last_ok) > cfg.max_seconds_per_case:
                        row.update(status="skipped", note=_linear_note(mode, T, *last_ok, cfg))
                    elif est > _max_memory_bytes(cfg, device):
                        row.update(
                            status="skipped", note=f"estimated peak {est / 2**30:.2f} GiB too large"
                        )
                    else:
                        out = _execute(
                            _spec(name, mode, False, s, cfg, threads),
                            None,
                            isolate,
                            cfg.max_seconds_per_case,
                        )
                        row["status"], row["note"] = out["status"], out.get("note", "")
                        if out["status"] == "ok":
                            row.update(
                                time_median_s=statistics.median(out["times"]),
                                peak_bytes=out["peak_bytes"],
                                finite=out["finite"],
                                finite_large_input=out["finite_large_input"],
                            )
                            last_ok = (row["time_median_s"], T)
                        elif out["status"] == "skipped" and _over_time(row["note"]):
                            given_up = f"skipped: T={T} already exceeded the time budget"
                    say(
                        f"  compare {impl:11s} {variant:10s} {mode:7s} T={T:<6d} {_fmt_status(row)}"
                    )
    return rows


_TOTAL_NOTE = "the run reached --max-total-minutes {:g} before this case"


def _out_of_time(cfg: BenchConfig, t0: float) -> bool:
    return (
        cfg.max_total_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_total_minutes
    )


def _predicted(mode: str, T: int, t_prev: float, T_prev: int) -> float:
    """Lower bound of the seconds a case at ``T`` needs, from ``t_prev`` s per call at ``T_prev``.

    Every mixer is at least linear in ``T``: two calls (warm-up and one timed) need at least
    ``2 t_prev T / T_prev``. A decoding state built step by step passes positions ``T_prev`` to
    ``T``, each step costing at least ``t_prev`` (a step's cost does not fall with position).
    """
    if mode == "decode":
        return (T - T_prev) * t_prev
    return 2 * t_prev * T / T_prev


def _linear_note(mode: str, T: int, t_prev: float, T_prev: int, cfg: BenchConfig) -> str:
    what = "building the state" if mode == "decode" else "2 calls"
    return (
        f"{what} would take >= {_predicted(mode, T, t_prev, T_prev):.0f} s (at least linear "
        f"from {t_prev * 1e3:.3g} ms at T={T_prev}), over the {cfg.max_seconds_per_case:g} s budget"
    )


def _over_time(note: str | None) -> bool:
    return bool(note) and ("budget" in note or "time limit" in note)


def _fmt_status(row: dict) -> str:
    if row["status"] == "ok":
        mem = row.get("peak_bytes")
        mem_s = f"{mem / 2**20:9.1f} MiB" if mem is not None else "      n/a"
        return f"{row['time_median_s'] * 1e3:10.3f} ms {mem_s}"
    return f"{row['status'].upper()}: {row['note']}"


def _progress(row: dict) -> str:
    tag = "causal" if row["causal"] else "non-causal"
    extra = ""
    if row["status"] == "ok" and row.get("ratio_to_floor"):
        extra = f"  ({row['ratio_to_floor']:.1f}x floor)"
    head = f"  {row['mixer']:15s} {tag:10s} {row['mode']:7s} T={row['T']:<6d}"
    return f"{head} {_fmt_status(row)}{extra}"
