"""The run of ``aftlab bench``: its options (:class:`BenchConfig`), then for every case: skip
what cannot fit, gate, measure; then the report. See docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from .cases import MATMUL, MODES, PEERS, Op, Shape
from .cases import cases as all_cases
from .gate import check_case, check_module, gate_shape
from .measure import Spec, execute, machine_info, measure_limits, mem_available
from .report import ROW_FIELDS, cell, ratios, write_report

DTYPES = ("float32", "float64", "bfloat16", "float16")
INTS = "lengths decode_positions compare_lengths batch dim heads threads repeats warmup".split()
FLOATS = ["max_seconds_per_case", "max_memory_gb", "max_total_minutes"]


def _opt(default, help: str):
    """A field of :class:`BenchConfig` that is also an ``aftlab bench`` option."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class BenchConfig:
    """Options of one run; each with a help is the ``aftlab bench`` option of the same name."""

    mixers: list[str] = _opt([], "cases, comma-separated (default: every registered mixer)")
    lengths: list[int] = _opt([256, 1024, 4096, 16384], "T for forward and train")
    decode_positions: list[int] | None = _opt(None, "positions of the decoding step (the lengths)")
    batch: int = _opt(4, "batch size B")
    dim: int = _opt(256, "width d")
    heads: int = _opt(4, "heads of attention and aft-conv")
    modes: list[str] = _opt(list(MODES), "some of forward,train,decode")
    causal: bool = _opt(False, "causal mixers (default: non-causal)")
    also_noncausal: list[str] = _opt([], "with --causal, mixers also run non-causal")
    device: str = _opt("cpu", "cpu or cuda")
    dtype: str = _opt("float32", f"one of {', '.join(DTYPES)}")
    threads: int | None = _opt(None, "torch threads (default: torch's)")
    repeats: int = _opt(5, "timed calls per case, median reported")
    warmup: int = _opt(1, "untimed calls first")
    max_seconds_per_case: float = _opt(60.0, "time budget of one case")
    max_memory_gb: float | None = _opt(None, "skip cases estimated above it (default: 60% free)")
    isolate: bool = True  # on CPU, each case in a fresh process (--no-isolate: False)
    peers: list[str] = _opt([], f"implementations beside ours: {', '.join(PEERS)}")
    compare_lengths: list[int] | None = _opt(None, "lengths of the peers (the lengths <= 4096)")
    max_total_minutes: float | None = _opt(None, "then skip the remaining cases (no limit)")
    limits_size: str = "full"  # "tiny" (tests): machine limits measured small, meaningless
    seed: int = _opt(0, "seed of the inputs")
    out: str | os.PathLike | None = _opt(None, "directory of the report (none: print only)")

    def validate(self, table: dict[str, Op | None]) -> None:
        """Fill the defaults; raise ``ValueError`` (one line, naming the option) on a bad one."""
        self.mixers = self.mixers or [n for n in table if table[n] is not MATMUL]
        self.peers = list(dict.fromkeys(self.peers))
        out = Path(self.out) if self.out is not None else None
        checks = [
            (n, _positive(getattr(self, n), n in INTS), "integers > 0" if n in INTS else "> 0")
            for n in INTS + FLOATS
        ]
        checks += [
            ("mixers", set(self.mixers) <= set(table), f"some of {list(table)}"),
            ("also_noncausal", set(self.also_noncausal) <= set(self.mixers), "among --mixers"),
            ("modes", self.modes and set(self.modes) <= set(MODES), f"some of {list(MODES)}"),
            ("peers", set(self.peers) <= set(PEERS), f"some of {list(PEERS)}"),
            ("dim", self.dim % self.heads == 0, f"divisible by --heads {self.heads}"),
            ("dtype", self.dtype in DTYPES, f"one of {list(DTYPES)}"),
            ("device", self.device in ("cpu", "cuda"), "'cpu' or 'cuda'"),
            ("device", self.device != "cuda" or torch.cuda.is_available(), "a device torch sees"),
            ("out", out is None or not out.exists() or out.is_dir(), "a directory"),
        ]
        for name, ok, want in checks:
            if not ok:
                flag = name.replace("_", "-")
                raise ValueError(f"bench: --{flag} must be {want}, got {getattr(self, name)!r}")


def _positive(v, integer: bool) -> bool:
    """``v`` is None, or a finite number above 0 (a list: not empty, each)."""
    kind = int if integer else (int, float)

    def ok(x) -> bool:
        return isinstance(x, kind) and not isinstance(x, bool) and 0 < x < math.inf

    return v is None or (v != [] and all(map(ok, v if isinstance(v, list) else [v])))


def run_bench(
    cfg: BenchConfig,
    *,
    cases: dict[str, Op | None] | None = None,
    argv: list[str] | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Run the benchmark described by ``cfg``; write the report into ``cfg.out`` if set.

    Args:
        cfg: the options.
        cases: the case table (default :func:`aftlab.bench.cases.cases`): the hook for adding or
            replacing a case (e.g. a wrong op, which the gate must refuse); a case that is not
            the built-in one runs in this process, not isolated.
        argv: the command line recorded in the report (default ``sys.argv``).
        log: called with one line per case as the run progresses (None: silent).

    Returns:
        ``{"machine", "limits", "config", "results": [rows], "compare": [rows], "ratios",
        "wall_s"}``; each row's ``status`` is ``"ok"``, ``"failed"`` (gate), ``"skipped"`` or
        ``"error"``, with a ``note`` for all but ``"ok"``.
    """
    table = all_cases() if cases is None else {"aft-full-matmul": MATMUL, **cases}
    cfg.validate(table)
    run = _Run(cfg, log or (lambda _line: None))
    run.say(f"measuring machine limits on {run.device} ({cfg.dtype}, {cfg.threads} threads)...")
    lim = run.limits = measure_limits(run.device, run.dtype, size=cfg.limits_size)
    run.say(
        f"  GEMM {lim['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, bandwidth "
        f"{lim['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; each case: median time / peak memory "
        "above the inputs / time over its floor"
    )
    variants = []
    for name in cfg.mixers:  # aft-full's matrix products right after it
        variants.append((name, cfg.causal))
        if cfg.causal and name in cfg.also_noncausal:
            variants.append((name, False))
        if name == "aft-full" and "aft-full-matmul" not in cfg.mixers:
            variants.append(("aft-full-matmul", False))
    result = {
        "machine": machine_info(run.device, argv),
        "limits": lim,
        "config": {k: str(v) if isinstance(v, os.PathLike) else v for k, v in vars(cfg).items()},
        "results": [r for n, c in variants for m in cfg.modes for r in run.case(n, table[n], c, m)],
        "compare": [r for peer in cfg.peers for r in run.peer(peer)],
    }
    result.update(wall_s=time.perf_counter() - run.t0, ratios=ratios(result))
    if cfg.out is not None:
        for line in write_report(result, Path(cfg.out)):
            run.say(line)
    return result


class _Run:
    """One run's settings and clock; each case and peer becomes rows through :meth:`_sweep`."""

    def __init__(self, cfg: BenchConfig, say: Callable[[str], None]):
        self.cfg, self.say, self.t0, self.gates = cfg, say, time.perf_counter(), {}
        self.device, self.dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        cfg.threads = torch.get_num_threads()  # the case processes use the same
        self.isolate = cfg.isolate and self.device.type == "cpu"
        self.esize = torch.empty((), dtype=self.dtype).element_size()
        free = torch.cuda.mem_get_info(self.device)[0] if cfg.device == "cuda" else mem_available()
        self.mem_limit = 2**30 * cfg.max_memory_gb if cfg.max_memory_gb else 0.6 * free

    def row(self, mode: str, T: int, **kw) -> dict:
        """A result row (:data:`ROW_FIELDS`, unset: None) of this run."""
        c = self.cfg
        base = dict(mode=mode, T=T, B=c.batch, d=c.dim, dtype=c.dtype, device=c.device)
        return {**dict.fromkeys(ROW_FIELDS), **base, "threads": c.threads, **kw}

    def case(self, name: str, op: Op | None, causal: bool, mode: str) -> list[dict]:
        """The rows of one case in one mode, over the lengths (decode: the positions)."""
        causal, cfg, items, why = causal or mode == "decode", self.cfg, [], ""
        if mode == "decode" and op is MATMUL:
            return []
        if op is None and mode != "decode":
            why = f"{name} has no op-level entry (aftlab.bench.cases.OPS)"
        elif op is not None and op.causal_only and not causal:
            why = f"{name} is causal only (use --causal)"
        for T in (cfg.decode_positions or cfg.lengths) if mode == "decode" else cfg.lengths:
            s = Shape(cfg.batch, T, cfg.dim, cfg.heads, self.esize)
            row = self.row(mode, T, mixer=name, causal=causal, heads=s.h)
            if op is not None and (mode != "decode" or op.step is not None):
                row.update(op.floors(mode, s, causal, self.limits))
            gate = partial(check_case, name, op, mode, causal, s, self.dtype, self.device)
            key = (name, mode, causal, gate_shape(s))  # gated once per gate shape
            items.append((row, why, key, gate, Spec(name, mode, causal, s, cfg), op))
        return self._sweep(mode, items)

    def peer(self, peer: str) -> list[dict]:
        """The rows of one peer: each module of each pair gated once, then timed."""
        module, package, pairs = PEERS[peer]
        if importlib.util.find_spec(module) is None:
            self.say(f"{peer} skipped: {package} is not installed (pip install {package})")
            return [{"peer": peer, "status": "skipped", "note": f"{package} is not installed"}]
        cfg, rows = self.cfg, []
        lengths = cfg.compare_lengths or [T for T in cfg.lengths if T <= 4096]
        shape = partial(Shape, cfg.batch, d=cfg.dim, h=1, esize=self.esize)
        for ours, build, theirs, their_build in pairs:
            for impl, variant, b in (("aftlab", ours, build), (peer, theirs, their_build)):
                gate = partial(check_module, b, shape(max(lengths)), self.dtype, self.device)
                for mode in [m for m in cfg.modes if m != "decode"]:
                    items = []
                    for T in lengths:  # aft-pytorch's AFTFull has two T x T temporaries
                        est = (6 if mode == "train" else 3) * T * T * ("full" in variant.lower())
                        est = (est + 30 * cfg.batch * T * cfg.dim) * self.esize
                        row = self.row(mode, T, peer=peer, pair=ours, impl=impl, variant=variant)
                        spec = Spec(f"{peer}:{impl}:{variant}", mode, False, shape(T), cfg)
                        row["est_peak_bytes"] = est
                        items.append((row, "", (peer, impl, variant), gate, spec, None))
                    rows += self._sweep(mode, items)
        return rows

    def _sweep(self, mode: str, items: list[tuple]) -> list[dict]:
        """The rows of ``items`` by ascending T, each skipped (with the reason), refused by the
        gate or measured. An item: ``(row, reason to skip, gate key, gate, spec, case)``."""
        cfg, given_up, last = self.cfg, "", None
        budget, minutes = cfg.max_seconds_per_case, cfg.max_total_minutes
        items = sorted(items, key=lambda item: item[0]["T"])
        for row, note, key, gate, spec, op in items:
            T, floor = row["T"], row.get("floor_s") or 0.0
            if note or given_up:
                note = note or given_up
            elif minutes and time.perf_counter() - self.t0 > 60 * minutes:
                note = f"the run reached --max-total-minutes {minutes:g} before this case"
            elif (row["est_peak_bytes"] or 0) > self.mem_limit:
                note = (
                    f"estimated peak {row['est_peak_bytes'] / 2**30:.2f} GiB exceeds the "
                    f"memory limit {self.mem_limit / 2**30:.2f} GiB"
                )
            elif 2 * floor > budget:
                note = f"2 calls at the floor ({floor:.2f} s each) exceed the {budget:g} s budget"
            elif last and _predicted(mode, T, *last) > budget:
                note = (
                    f"{'building the state' if mode == 'decode' else '2 calls'} would take >= "
                    f"{_predicted(mode, T, *last):.0f} s (at least linear from "
                    f"{last[0] * 1e3:.3g} ms at T={last[1]}), over the {budget:g} s budget"
                )
            g = None if note else self.gates.get(key) or self.gates.setdefault(key, gate())
            if g is not None:
                row.update(gate=g.status, gate_max_error=g.max_error)
                note = g.note if g.status in ("failed", "unavailable") else ""
            if note:
                row.update(status="failed" if g and g.status == "failed" else "skipped", note=note)
            else:
                row.update(execute(spec, op, self.isolate))
                if row["status"] == "ok" and row["floor_s"]:
                    row["ratio_to_floor"] = row["time_median_s"] / row["floor_s"]
            if row["status"] == "ok":
                last = (row["time_median_s"], T)
            elif row["status"] == "skipped" and re.search("budget|time limit", row["note"]):
                given_up = given_up or f"T={T} already exceeded the time budget"
            self.say(_progress(row))
        return [item[0] for item in items]


def _predicted(mode: str, T: int, t_prev: float, T_prev: int) -> float:
    """Seconds a case at ``T`` needs at least, from ``t_prev`` per call at ``T_prev``: every mixer
    is at least linear in ``T`` (2 calls; a decoding state passes positions ``T_prev .. T``)."""
    return (T - T_prev) * t_prev if mode == "decode" else 2 * t_prev * T / T_prev


def _progress(row: dict) -> str:
    what = (
        f"compare {row['impl']:11s} {row['variant']:10s}"
        if row.get("peer")
        else f"{row['mixer']:15s} {'causal' if row['causal'] else 'non-causal':10s}"
    )
    note = f": {row['note']}" if row["status"] != "ok" else ""
    return f"  {what} {row['mode']:7s} T={row['T']:<6d} {cell(row)}{note}"
