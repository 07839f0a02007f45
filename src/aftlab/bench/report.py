"""The report of a run: results.json, results.csv, summary.md (tables, measured ratios, peers)
and the plots (time and peak memory against T; matplotlib, else skipped with a note)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .._json import dumps

__all__ = ["ratios", "summary_markdown", "write_report", "ROW_FIELDS", "CSV_FIELDS"]

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


def cell(r: dict) -> str:
    """``median time / peak memory / time over floor``, or the status of a row not measured."""
    if r["status"] != "ok":
        return r["status"]
    t, mem = r["time_median_s"], r["peak_bytes"]
    floor = f" / {r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else ""
    time = f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"
    return f"{time} / {'n/a' if mem is None else f'{mem / 2**20:.3g} MiB'}{floor}"


def _table(head: str, rows: dict[str, dict[int, str]]) -> list[str]:
    """A Markdown table: one row per key of ``rows``, a column per T."""
    Ts = sorted({T for cells in rows.values() for T in cells})
    lines = [f"| {head} | " + " | ".join(f"T={T}" for T in Ts) + " |", "|---|" + "---|" * len(Ts)]
    lines += [f"| {k} | " + " | ".join(c.get(T, "") for T in Ts) + " |" for k, c in rows.items()]
    return [*lines, ""]


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
        cells: dict[str, dict[int, str]] = {}
        for r in (r for r in rows if r["mode"] == mode):
            cells.setdefault(_label(r), {})[r["T"]] = cell(r)
        lines += [f"## {title}", "", *_table("mixer", cells)] if cells else []
    notes: dict[tuple, list[int]] = {}
    for r in (r for r in rows if r["status"] != "ok"):
        notes.setdefault((_label(r), r["mode"], r["status"], r["note"]), []).append(r["T"])
    if notes:
        lines += ["## Not measured", ""]
        lines += [
            f"- {lab} {mode} T={','.join(map(str, Ts))}: **{status}**: {note}"
            for (lab, mode, status, note), Ts in notes.items()
        ]
        lines.append("")
    ratio_cells: dict[str, dict[int, str]] = {}
    for x in result.get("ratios", []):
        ratio_cells.setdefault(f"{x['ratio']} ({x['mode']})", {})[x["T"]] = f"{x['value']:.3g}"
    if ratio_cells:
        lines += ["## Measured ratios", "", *_table("ratio (mode)", ratio_cells)]
    lines += _peers(result.get("compare", []))
    return "\n".join(lines)


def _peers(rows: list[dict]) -> list[str]:
    """The peers' table: a row per module and mode, cells ``time / peak memory / finite on x, on
    1000 x`` and, for theirs, how much faster ours is."""
    ours = {
        (r["peer"], r["pair"], r["mode"], r["T"]): r["time_median_s"]
        for r in rows
        if r.get("impl") == "aftlab" and r["status"] == "ok"
    }
    cells: dict[str, dict[int, str]] = {}
    for r in rows:
        if not r.get("impl"):
            cells[f"{r['peer']}: {r['note']}"] = {}
            continue
        mine = ours.get((r["peer"], r["pair"], r["mode"], r["T"]))
        text = (
            f"{r['status']}: {r['note']}"
            if r["status"] != "ok"
            else (f"{cell(r)} / finite {r['finite']}, {r['finite_large_input']}")
        )
        if r["impl"] != "aftlab" and mine and r["status"] == "ok":
            text += f" / aftlab {r['time_median_s'] / mine:.3g}x faster"
        cells.setdefault(f"{r['peer']} {r['impl']} {r['variant']} ({r['mode']})", {})[r["T"]] = text
    head = "## Against peers (module level; aft-pytorch non-causal, hf-rwkv causal)"
    return [head, "", *_table("peer implementation (mode)", cells)] if cells else []


def write_plots(result: dict, out: Path) -> tuple[list[Path], str]:
    """``bench_<mode>.png``: time and peak memory against T, log-log, a line per mixer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'aftlab[plot]')"
    m, cfg, made = result["machine"], result["config"], []
    for mode, title in TITLES.items():
        ok = sorted(
            (r for r in result["results"] if r["mode"] == mode and r["status"] == "ok"),
            key=lambda r: r["T"],
        )
        if not ok:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        panels = (
            ("time_median_s", 1e3, "median time (ms)"),
            ("peak_bytes", 2**-20, "peak memory above inputs (MiB)"),
        )
        for ax, (key, scale, unit) in zip(axes, panels, strict=True):
            for lab in dict.fromkeys(_label(r) for r in ok):
                pts = [
                    (r["T"], max(r[key] * scale, 1e-6)) for r in ok if _label(r) == lab and r[key]
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=lab)
            ax.set(
                yscale="log",
                ylabel=unit,
                xlabel="position T" if mode == "decode" else "sequence length T",
            )
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
