"""The report of a run: results.json, results.csv, summary.md (tables, measured ratios, peers)
and the plots (time and peak memory against T; matplotlib, else skipped with a note)."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

from .._json import dumps
from .._plotting import pyplot
from .._system import format_bytes
from ..errors import UsageError

__all__ = [
    "ratios", "targets", "target_table", "summary_markdown", "state_table", "write_report",
    "ROW_FIELDS", "CSV_FIELDS", "TARGETS",
]  # fmt: skip

#: One result row (a case); the CSV adds the machine columns to each.
ROW_FIELDS = (
    "mixer", "causal", "mode", "T", "B", "d", "heads", "dtype", "device", "threads", "status",
    "note", "gate", "gate_max_error", "time_median_s", "time_min_s", "repeats", "peak_bytes",
    "est_peak_bytes", "mem_method", "state_bytes", "flops", "bytes", "floor_bandwidth_s",
    "floor_flops_s", "floor_s", "floor_bound", "ratio_to_floor",
)  # fmt: skip
MACHINE_FIELDS = ("cpu_model", "gpu", "torch", "date", "command")
CSV_FIELDS = (*ROW_FIELDS, *MACHINE_FIELDS)
TITLES = {
    "forward": "Forward",
    "train": "Forward + backward",
    "decode": "One decoding step at position T (module level)",
}
NC = " (non-causal)"

#: The project's speed targets that are measured ratios: ``(ratio, mode, T, device type) ->
#: (">=" or "<=", bound)``; ``T = None``: every measured ``T >= 256`` without a target of its
#: own. In the regime :data:`TARGET_REGIME` (and 2 threads on CPU); docs/benchmarks.md,
#: "Targets", lists these and the ones read from other columns (floors, growth, peers).
TARGETS: dict[tuple[str, str, int | None, str], tuple[str, float]] = {
    ("attention / aft-simple", "train", 4096, "cpu"): (">=", 30.0),
    ("attention / aft-decay", "train", 4096, "cpu"): (">=", 25.0),
    ("attention / aft-local", "train", 256, "cpu"): (">=", 1.5),
    ("attention / aft-local", "train", 4096, "cpu"): (">=", 12.0),
    ("attention / aft-local", "train", None, "cpu"): (">=", 1.0),
    ("attention / aft-conv", "train", 256, "cpu"): (">=", 1.5),
    ("attention / aft-conv", "train", 4096, "cpu"): (">=", 10.0),
    ("attention / aft-conv", "train", None, "cpu"): (">=", 1.0),
    ("aft-full (non-causal) / aft-full-matmul", "train", None, "cpu"): ("<=", 1.2),
    ("aft-full: causal / non-causal", "train", None, "cpu"): ("<=", 0.6),
    ("attention / aft-local", "train", 8192, "cuda"): (">=", 8.0),
    ("aft-full (non-causal) / aft-full-matmul", "train", None, "cuda"): ("<=", 1.5),
}
TARGET_REGIME = {"batch": 4, "dim": 256, "dtype": "float32"}


def _label(r: dict) -> str:
    causal = r["causal"] or r["mode"] == "decode" or r["mixer"] == "aft-full-matmul"
    return r["mixer"] + ("" if causal else NC)


def ratios(result: dict) -> list[dict]:
    """The measured ratios of forward and forward+backward, each ``{ratio, mode, T, value}``:

    * ``<m>: attention / <m>``: the speed-up of ``m`` over attention (same causality);
    * ``aft-full (non-causal) / aft-full-matmul``: aft-full over the products it cannot avoid;
    * ``<m>: causal / non-causal``;
    * ``<m>: growth exponent``: ``log(t(T) / t(T')) / log(T / T')`` from the previous length
      ``T'`` measured (1: linear, 2: quadratic).
    """
    ok = [r for r in result["results"] if r["status"] == "ok" and r["mode"] != "decode"]
    t = {(_label(r), r["mode"], r["T"]): r["time_median_s"] for r in ok}
    out, prev = [], {}
    for (lab, mode, T), time in sorted(t.items(), key=lambda kv: kv[0][2]):
        pairs = [(f"{lab}: causal / non-causal", lab, lab + NC)]
        if lab == "aft-full" + NC:
            pairs.append(("aft-full (non-causal) / aft-full-matmul", lab, "aft-full-matmul"))
        if not lab.startswith(("attention", "aft-full-matmul")):
            pairs.append((f"attention / {lab}", "attention" + NC * lab.endswith(NC), lab))
        for name, a, b in pairs:
            if (a, mode, T) in t and (b, mode, T) in t:
                out.append((name, mode, T, t[a, mode, T] / t[b, mode, T]))
        if (lab, mode) in prev:
            T0, t0 = prev[lab, mode]
            out.append((f"{lab}: growth exponent", mode, T, math.log(time / t0) / math.log(T / T0)))
        prev[lab, mode] = (T, time)
    return [dict(zip(("ratio", "mode", "T", "value"), x, strict=True)) for x in out]


def targets(result: dict) -> list[dict]:
    """The measured ratios that have a target in :data:`TARGETS` on this run's device, each
    ``{ratio, mode, T, value, target, verdict}``: ``verdict`` is ``"met"`` or ``"missed by
    1.34x"`` (the factor the ratio is short of its bound). None outside the targets' regime."""
    cfg = result.get("config", {})
    device = str(cfg.get("device", "cpu")).split(":")[0]
    regime = {**TARGET_REGIME, **({"threads": 2} if device == "cpu" else {})}
    if any(cfg.get(k) != v for k, v in regime.items()):
        return []
    out = []
    for x in result["ratios"]:
        key = (x["ratio"], x["mode"])
        bound = TARGETS.get((*key, x["T"], device))
        if bound is None and x["T"] >= 256:
            bound = TARGETS.get((*key, None, device))
        if bound is None:
            continue
        op, b = bound
        v = x["value"]
        short = b / v if op == ">=" else v / b
        verdict = "met" if short <= 1.0 else f"missed by {short:.2f}x"
        out.append({**x, "target": f"{op} {b:g}", "verdict": verdict})
    return out


def target_table(result: dict) -> list[str]:
    """:func:`targets` as a Markdown section (none: nothing)."""
    rows = targets(result)
    if not rows:
        return []
    lines = ["## Targets", "", "| ratio (mode) | T | measured | target | verdict |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['ratio']} ({r['mode']}) | {r['T']} | {r['value']:.3g} | {r['target']} | "
              f"{r['verdict']} |" for r in rows]
    return [*lines, ""]


def cell(r: dict) -> str:
    """``median time / peak memory / time over floor`` (a peer's: ``/ finite on x, on 1000 x``),
    or the status of a row not measured."""
    if r["status"] != "ok":
        return r["status"]
    t, mem = r["time_median_s"], r["peak_bytes"]
    floor = f" / {r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else ""
    finite = f" / finite {r['finite']}, {r['finite_large_input']}" if "finite" in r else ""
    time = f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"
    return f"{time} / {'n/a' if mem is None else format_bytes(mem)}{floor}{finite}"


def _grid(rows, label: Callable[[dict], Any], value: Callable[[dict], Any]) -> dict[Any, dict]:
    """``{label(r): {T: value(r)}}`` over ``rows``, in their order."""
    grid: dict[Any, dict] = {}
    for r in rows:
        grid.setdefault(label(r), {})[r["T"]] = value(r)
    return grid


def _table(title: str, head: str, rows: dict[str, dict[int, str]]) -> list[str]:
    """``## title`` and a Markdown table: a row per key of ``rows``, a column per T (no rows:
    nothing)."""
    Ts = sorted({T for cells in rows.values() for T in cells})
    lines = [f"## {title}", "", f"| {head} | " + " | ".join(f"T={T}" for T in Ts) + " |"]
    lines += ["|---|" + "---|" * len(Ts)]
    lines += [f"| {k} | " + " | ".join(c.get(T, "") for T in Ts) + " |" for k, c in rows.items()]
    return [*lines, ""] if rows else []


def state_table(sizes: list[dict], dim: int, heads: int, dtype: str) -> list[str]:
    """The decoding-state sizes (:func:`~aftlab.bench.states.state_sizes`) as a Markdown table:
    a row per mixer, attention's KV cache first, a column per ``T``; each cell the bytes and,
    in brackets, the fraction of attention's KV cache at the same ``T`` they are."""
    kv = {r["T"]: r["state_bytes"] for r in sizes if r["mixer"] == "attention"}

    def text(r: dict) -> str:
        n, att = r["state_bytes"], kv.get(r["T"])
        if n is None:
            return r["note"]
        if not att or r["mixer"] == "attention":
            return format_bytes(n)
        share = " (1/1)" if n == att else f" (1/{att / n:,.0f})" if n < att else ""
        return format_bytes(n) + share

    label = {"attention": "attention (KV cache)"}
    first = sorted(sizes, key=lambda r: r["mixer"] != "attention")  # stable: else as given
    rows = _grid(first, lambda r: label.get(r["mixer"], r["mixer"]), text)
    title = f"Decoding state per layer, one sequence after T tokens (d={dim}, {heads} heads"
    title += f", {dtype} inputs; in brackets: the fraction of attention's KV cache)"
    return _table(title, "mixer", rows)


def summary_markdown(result: dict) -> str:
    """The run as Markdown: machine, limits, a table per mode, what was not measured and why,
    the measured ratios and the peers."""
    m, lim, rows, cfg = result["machine"], result["limits"], result["results"], result["config"]
    gpu = f" {m['gpu']}" if m.get("gpu") else ""
    lines = [
        "# aftlab bench", "",
        f"- command: `{m['command']}`",
        f"- machine: {m['cpu_model']} ({m['cpu_usable']} usable of {m['cpu_count']} CPUs), "
        f"{m['device']}{gpu}; torch {m['torch']}, {m['threads']} threads; {m['date']}",
        f"- measured limits ({lim['dtype']}): GEMM {lim['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"(n={lim['gemm_n']}), bandwidth {lim['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(copy {lim['copy_bytes_per_s'] / 1e9:.1f}, add {lim['add_bytes_per_s'] / 1e9:.1f})",
        f"- B={cfg['batch']}, d={cfg['dim']}, heads={cfg['heads']}, dtype {cfg['dtype']}; cells: "
        "median time / peak memory above the inputs / time over floor", "",
    ]  # fmt: skip
    for mode, title in TITLES.items():
        lines += _table(title, "mixer", _grid([r for r in rows if r["mode"] == mode], _label, cell))
    bad = [r for r in rows if r["status"] != "ok"]
    notes = _grid(bad, lambda r: (_label(r), r["mode"], r["status"], r["note"]), lambda r: 0)
    lines += ["## Not measured", ""] if notes else []
    for (lab, mode, status, note), Ts in notes.items():
        lines.append(f"- {lab} {mode} T={','.join(map(str, Ts))}: **{status}**: {note}")
    lines += [""] if notes else []
    ratio = _grid(
        result["ratios"], lambda x: f"{x['ratio']} ({x['mode']})", "{0[value]:.3g}".format
    )
    lines += _table("Measured ratios", "ratio (mode)", ratio) + target_table(result)
    lines += _peers(result["compare"])
    sizes = result.get("state_sizes", [])
    return "\n".join(lines + state_table(sizes, cfg["dim"], cfg["heads"], cfg["dtype"]))


def _peers(rows: list[dict]) -> list[str]:
    """The peers' table: a row per module and mode, and for theirs how much faster ours is."""
    ours = {
        (r["peer"], r["pair"], r["mode"], r["T"]): r["time_median_s"]
        for r in rows
        if r.get("impl") == "aftlab" and r["status"] == "ok"
    }

    def text(r: dict) -> str:
        mine = ours.get((r["peer"], r["pair"], r["mode"], r["T"]))
        if r["status"] != "ok":
            return f"{r['status']}: {r['note']}"
        faster = r["impl"] != "aftlab" and mine
        return cell(r) + (f" / aftlab {r['time_median_s'] / mine:.3g}x faster" if faster else "")

    cells = {f"{r['peer']}: {r['note']}": {} for r in rows if not r.get("impl")}
    modules = [r for r in rows if r.get("impl")]
    cells |= _grid(modules, lambda r: f"{r['peer']} {r['impl']} {r['variant']} ({r['mode']})", text)
    head = "Against peers (module level; aft-pytorch non-causal, hf-rwkv causal)"
    return _table(head, "peer implementation (mode)", cells)


def write_plots(result: dict, out: Path) -> tuple[list[Path], str]:
    """``bench_<mode>.png``: time and peak memory against T, log-log, a line per mixer."""
    try:
        plt = pyplot()
    except UsageError as e:
        return [], str(e)
    m, cfg, made = result["machine"], result["config"], []
    panels = (
        ("time_median_s", 1e3, "median time (ms)"),
        ("peak_bytes", 2**-20, "peak memory above inputs (MiB)"),
    )
    for mode, title in TITLES.items():
        ok = [r for r in result["results"] if r["mode"] == mode and r["status"] == "ok"]
        if not ok:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, (key, scale, unit) in zip(axes, panels, strict=True):
            for lab, pts in _grid(ok, _label, itemgetter(key)).items():
                pts = sorted((T, max(v * scale, 1e-6)) for T, v in pts.items() if v)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=lab)
            xlabel = "position T" if mode == "decode" else "sequence length T"
            ax.set(yscale="log", ylabel=unit, xlabel=xlabel)
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(
            f"{title}: B={cfg['batch']}, d={cfg['dim']}, {cfg['dtype']}, {m['device']}, "
            f"{m['threads']} threads",
            fontsize=10,
        )
        made.append(out / f"bench_{mode}.png")
        fig.savefig(made[-1], dpi=100)
        plt.close(fig)
    return made, "" if made else "no measured case to plot"


def write_report(result: dict, out: Path) -> list[str]:
    """Write results.json, results.csv, summary.md and the plots; return the lines to print."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(dumps(result, indent=2, default=str))
    machine = {k: result["machine"].get(k) for k in MACHINE_FIELDS}
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, **machine} for r in result["results"])
    text = summary_markdown(result)
    (out / "summary.md").write_text(text)
    made, note = write_plots(result, out)
    return [
        "",
        text,
        f"wrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.md'}",
        f"plots: {', '.join(p.name for p in made)}" if made else f"plots skipped: {note}",
    ]
