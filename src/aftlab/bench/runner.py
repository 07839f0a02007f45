"""The run of ``aftlab bench``: its options (:class:`BenchConfig`), then for every case: skip
what cannot fit, gate, measure; then the report. See docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from itertools import product
from pathlib import Path

import torch

from .._system import available_memory, machine_info
from . import rwkv4_peers
from .cases import MATMUL, MODES, PEERS, Op, Shape, Spec
from .cases import cases as all_cases
from .measure import MIN_CALLS, check, execute, gate_shape, measure_limits
from .report import ROW_FIELDS, cell, ratios, state_table, target_table, write_report
from .states import state_sizes

#: the default lengths of the decoding-state table: 4k, 64k and 1M tokens
STATE_TOKENS = (4096, 65536, 2**20)

DTYPES = ("float32", "float64", "bfloat16", "float16")

#: what ``aftlab bench`` measures: the ops of the mixers, or RWKV-4 models beside their peers
SUITES = ("mixers", "rwkv4-peers")


def _opt(default, help: str):
    """A field of :class:`BenchConfig` that is also an ``aftlab bench`` option."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def kind(f: Field) -> tuple[bool, type]:
    """``(is a list, element type)`` of a :class:`BenchConfig` field, e.g. ``list[int] | None``."""
    is_list, name = re.match(r"(list\[)?(\w+)", f.type).groups()
    return bool(is_list), {"int": int, "float": float, "bool": bool}.get(name, str)


@dataclass
class BenchConfig:
    """Options of one run; each with a help is the ``aftlab bench`` option of the same name."""

    suite: str = _opt("mixers", "mixers (the op of every mixer) or rwkv4-peers (RWKV-4 models "
                      "beside transformers and ChatRWKV: docs/rwkv.md)")
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
    isolate: bool = _opt(True, "on CPU, each case in a fresh process (default: yes)")
    peers: list[str] = _opt([], f"implementations beside ours: {', '.join(PEERS)}")
    compare_lengths: list[int] | None = _opt(None, "lengths of the peers (the lengths <= 4096)")
    state_tokens: list[int] = _opt(list(STATE_TOKENS), "T of the decoding-state sizes")
    state_sizes_only: bool = _opt(False, "print the decoding-state sizes only: nothing timed")
    max_total_minutes: float | None = _opt(None, "then skip the remaining cases (no limit)")
    limits_size: str = "full"  # "tiny" (tests): machine limits measured small, meaningless
    shapes: list[str] = _opt(["169m", "430m"], f"rwkv4-peers: of {', '.join(rwkv4_peers.SHAPES)}")
    parts: list[str] = _opt(list(rwkv4_peers.PARTS), "rwkv4-peers: what is measured")
    seed: int = _opt(0, "seed of the inputs")
    out: str | os.PathLike | None = _opt(None, "directory of the report (none: print only)")

    def validate(self, table: dict[str, Op | None]) -> None:
        """Fill the defaults; raise ``ValueError`` (one line, naming the option) on a bad one."""
        self.mixers = self.mixers or [n for n in table if table[n] is not MATMUL]
        self.peers = list(dict.fromkeys(self.peers))
        out = Path(self.out) if self.out is not None else None
        checks = [  # every number (the seed: any int) finite and above 0
            (f.name, _positive(getattr(self, f.name), k), "integers > 0" if k is int else "> 0")
            for f in fields(self)
            if (k := kind(f)[1]) in (int, float) and f.name != "seed"
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
            ("suite", self.suite in SUITES, f"one of {list(SUITES)}"),
        ]
        if self.suite == "rwkv4-peers":  # on CPU, in float32 (bfloat16: its part)
            checks += [
                ("suite", importlib.util.find_spec("transformers") is not None,
                 "a suite whose peers are installed (pip install transformers rwkv)"),
                ("device", self.device == "cpu", "cpu with --suite rwkv4-peers"),
                ("dtype", self.dtype == "float32", "float32 with --suite rwkv4-peers"),
            ]
        for name, ok, want in checks:
            if not ok:
                flag = name.replace("_", "-")
                raise ValueError(f"bench: --{flag} must be {want}, got {getattr(self, name)!r}")
        if self.suite == "rwkv4-peers":
            try:
                rwkv4_peers.check_options(self.shapes, self.parts)
            except ValueError as e:
                raise ValueError(f"bench: {e}") from None


def _positive(v, kind: type) -> bool:
    """``v`` is None, or a finite number above 0 of ``kind`` (a list: not empty, each)."""
    kinds, vs = int if kind is int else (int, float), v if isinstance(v, list) else [v]
    ok = [isinstance(x, kinds) and not isinstance(x, bool) and 0 < x < math.inf for x in vs]
    return v is None or (vs != [] and all(ok))


def run_bench(
    cfg: BenchConfig,
    *,
    cases: dict[str, Op | None] | None = None,
    argv: list[str] | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Run the benchmark of ``cfg``; write the report into ``cfg.out`` if set; return
    ``{"machine", "limits", "config", "state_sizes", "results", "compare", "ratios", "wall_s"}``.

    ``state_sizes`` (:func:`~aftlab.bench.states.state_sizes`, printed at the end, in the report)
    costs nothing; with ``cfg.state_sizes_only`` it is all that is done: the result has no
    ``limits``, ``compare`` or ``ratios``, its ``results`` are empty, and no report is written.

    Args:
        cases: the case table (default :func:`aftlab.bench.cases.cases`), to add or replace a
            case (e.g. a wrong op, which the gate must refuse); one not built in runs here.
        argv: the command line recorded in the report (default ``sys.argv``).
        log: called with one line per case as the run progresses (None: silent).
    """
    table = all_cases() if cases is None else {"aft-full-matmul": MATMUL, **cases}
    cfg.validate(table)
    if cfg.suite == "rwkv4-peers":
        return _rwkv4_peers(cfg, argv, log)
    run = _Run(cfg, log or (lambda _line: None))
    shape = Shape(1, 1, cfg.dim, cfg.heads, run.esize)
    sizes = state_sizes(table, cfg.mixers, cfg.state_tokens, shape, run.dtype)
    if cfg.state_sizes_only:
        for line in state_table(sizes, cfg.dim, cfg.heads, cfg.dtype):
            run.say(line)
        machine = machine_info(run.device, argv)
        return {"machine": machine, "config": _config(cfg), "state_sizes": sizes, "results": []}
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
        "config": _config(cfg),
        "state_sizes": sizes,
        "results": [r for n, c in variants for m in cfg.modes for r in run.case(n, table[n], c, m)],
        "compare": [r for peer in cfg.peers for r in run.peer(peer)],
    }
    result.update(wall_s=time.perf_counter() - run.t0, ratios=ratios(result))
    if cfg.out is not None:
        for line in write_report(result, Path(cfg.out)):
            run.say(line)
    else:
        for line in ["", *target_table(result), *state_table(sizes, cfg.dim, cfg.heads, cfg.dtype)]:
            run.say(line)
    return result


def _rwkv4_peers(cfg: BenchConfig, argv: list[str] | None, log) -> dict:
    """``--suite rwkv4-peers``: :func:`aftlab.bench.rwkv4_peers.run` with the run's shapes,
    parts, threads and repeats; into ``cfg.out``: ``rwkv4-peers.json`` and ``rwkv4-peers.md``
    (the table). Returns its result with ``config``, ``machine`` (with ``argv``) and empty
    ``results`` (no case of the mixers ran)."""
    t0 = time.perf_counter()
    out = Path(cfg.out) if cfg.out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    threads = cfg.threads or torch.get_num_threads()
    result = rwkv4_peers.run(cfg.shapes, cfg.parts, threads=threads, repeats=cfg.repeats,
                             log=log)
    result.update(machine=machine_info(torch.device("cpu"), argv), config=_config(cfg),
                  results=[], wall_s=time.perf_counter() - t0)
    if out is not None:
        (out / "rwkv4-peers.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / "rwkv4-peers.md").write_text(rwkv4_peers.table(result["rows"]) + "\n")
    return result


def _config(cfg: BenchConfig) -> dict:
    """``cfg``'s fields for the report (a path as text)."""
    return {k: str(v) if isinstance(v, os.PathLike) else v for k, v in vars(cfg).items()}


class _Run:
    """One run's settings and clock; each case and peer becomes rows through :meth:`sweep`."""

    def __init__(self, cfg: BenchConfig, say: Callable[[str], None]):
        self.cfg, self.say, self.t0, self.gates = cfg, say, time.perf_counter(), {}
        self.device, self.dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        cfg.threads = torch.get_num_threads()  # the case processes use the same
        self.isolate = cfg.isolate and self.device.type == "cpu"
        self.esize = torch.empty((), dtype=self.dtype).element_size()
        free = available_memory(self.device)[0] or 8 * 2**30  # unknown: 8 GiB
        self.mem_limit = 2**30 * cfg.max_memory_gb if cfg.max_memory_gb else 0.6 * free

    def costs(self, spec: Spec, op: Op | None) -> dict:
        """The floors (:meth:`Op.floors`) and estimated peak of ``spec``, as far as known."""
        s, variant = spec.shape, spec.name.split(":")[-1]
        if ":" in spec.name:  # a peer's module; aft-pytorch's AFTFull has two T x T temporaries
            est = (6 if spec.mode == "train" else 3) * s.T**2 * ("full" in variant.lower())
            return {"est_peak_bytes": (est + 30 * s.n) * s.esize}
        if op is None or (spec.mode == "decode" and op.step is None):
            return {}
        return op.floors(spec.mode, s, spec.causal, self.limits)

    def case(self, name: str, op: Op | None, causal: bool, mode: str) -> list[dict]:
        """The rows of one case in one mode, over the lengths (decode: the positions)."""
        causal, cfg, note = causal or mode == "decode", self.cfg, ""
        if mode == "decode" and op is MATMUL:
            return []
        if op is None and mode != "decode":
            note = f"{name} has no op-level entry (aftlab.bench.cases.OPS)"
        elif op is not None and op.causal_only and not causal:
            note = f"{name} is causal only (use --causal)"
        Ts = (cfg.decode_positions or cfg.lengths) if mode == "decode" else cfg.lengths
        shapes = [Shape(cfg.batch, T, cfg.dim, cfg.heads, self.esize) for T in Ts]
        specs = [Spec(name, mode, causal, s, cfg) for s in shapes]
        label = f"{name:15s} {'causal' if causal else 'non-causal':10s}"
        return self.sweep(specs, op, label, note, mixer=name, causal=causal, heads=cfg.heads)

    def peer(self, peer: str) -> list[dict]:
        """The rows of one peer: each of its modules and ours beside it, in each mode."""
        package, module, pairs = PEERS[peer]
        if importlib.util.find_spec(module) is None:
            self.say(f"{peer} skipped: {package} is not installed (pip install {package})")
            return [{"peer": peer, "status": "skipped", "note": f"{package} is not installed"}]
        cfg, rows = self.cfg, []
        Ts = cfg.compare_lengths or [T for T in cfg.lengths if T <= 4096]
        modes = [m for m in cfg.modes if m != "decode"]
        for (ours, theirs), impl, mode in product(pairs.items(), ("aftlab", peer), modes):
            variant = ours if impl == "aftlab" else theirs
            shapes = [Shape(cfg.batch, T, cfg.dim, 1, self.esize) for T in Ts]
            specs = [Spec(f"{peer}:{impl}:{variant}", mode, False, s, cfg) for s in shapes]
            kw = dict(peer=peer, pair=ours, impl=impl, variant=variant)
            rows += self.sweep(specs, None, f"compare {impl:11s} {variant:10s}", **kw)
        return rows

    def over_limits(self, spec: Spec, row: dict, last: tuple[float, int] | None) -> str:
        """Why ``spec`` is not run (the total time, its memory, its time budget), or ``""``.

        A case makes at least :data:`MIN_CALLS` calls (a warm-up, a timed call, the memory call),
        and every case is at least linear in ``T``: from ``t0`` per call at ``T0`` they need at
        least ``MIN_CALLS t0 T / T0``, and a decoding state at least ``(T - T0) t0``."""
        budget, minutes = self.cfg.max_seconds_per_case, self.cfg.max_total_minutes
        floor, T, (t0, T0) = row["floor_s"] or 0.0, spec.shape.T, last or (0.0, 1)
        t = (T - T0) * t0 if spec.mode == "decode" else MIN_CALLS * t0 * T / T0
        if minutes and time.perf_counter() - self.t0 > 60 * minutes:
            return f"the run reached --max-total-minutes {minutes:g} before this case"
        if (row["est_peak_bytes"] or 0) > self.mem_limit:
            return (
                f"estimated peak {row['est_peak_bytes'] / 2**30:.2f} GiB exceeds the "
                f"memory limit {self.mem_limit / 2**30:.2f} GiB"
            )
        if MIN_CALLS * floor > budget:
            return (
                f"{MIN_CALLS} calls at the floor ({floor:.2f} s each) exceed the {budget:g} s "
                "budget"
            )
        if t > budget:
            calls = f"{MIN_CALLS} calls"
            return (
                f"{'building the state' if spec.mode == 'decode' else calls} would take >= "
                f"{t:.0f} s (at least linear from {t0 * 1e3:.3g} ms at T={T0}), over the "
                f"{budget:g} s budget"
            )
        return ""

    def sweep(self, specs: list[Spec], op: Op | None, label: str, note="", **fields) -> list[dict]:
        """The rows of one case in one mode (``fields`` in each) by ascending T, each skipped
        (``note``, or the reason), refused by the gate (once per gate shape) or measured."""
        cfg, given_up, last, rows = self.cfg, "", None, []
        for spec in sorted(specs, key=lambda spec: spec.shape.T):
            T, mode = spec.shape.T, spec.mode
            base = dict(mode=mode, T=T, B=cfg.batch, d=cfg.dim, dtype=cfg.dtype, device=cfg.device)
            row = {**dict.fromkeys(ROW_FIELDS), **base, "threads": cfg.threads, **fields}
            row.update(self.costs(spec, op))
            why = note or given_up or self.over_limits(spec, row, last)
            if not why:  # gated once per gate shape
                key = (spec.name, mode, spec.causal, gate_shape(spec.shape))
                g = self.gates[key] = self.gates.get(key) or check(
                    spec, op, self.dtype, self.device
                )
                row.update(gate=g.status, gate_max_error=g.max_error)
                why = g.note if g.status in ("failed", "unavailable") else ""
            if why:
                row.update(status="failed" if row["gate"] == "failed" else "skipped", note=why)
            else:
                row.update(execute(spec, op, self.isolate))
                if row["status"] == "ok" and row["floor_s"]:
                    row["ratio_to_floor"] = row["time_median_s"] / row["floor_s"]
            if row["status"] == "ok":
                last = (row["time_median_s"], T)
            elif row["status"] == "skipped" and re.search("budget|time limit", row["note"]):
                given_up = given_up or f"T={T} already exceeded the time budget"
            why = f": {row['note']}" if row["status"] != "ok" else ""
            self.say(f"  {label} {mode:7s} T={T:<6d} {cell(row)}{why}")
            rows.append(row)
        return rows
