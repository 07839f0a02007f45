"""The report of a run: results.json, results.csv, summary.md, plots, and the issue's targets."""

from __future__ import annotations

import csv
from pathlib import Path

from .._json import dumps

__all__ = ["evaluate_targets", "write_report", "summary_markdown", "CSV_FIELDS"]

#: One result row (a case); the CSV adds the machine columns to each.
ROW_FIELDS = (
    "mixer",
    "causal",
    "mode",
    "T",
    "B",
    "d",
    "heads",
    "dtype",
    "device",
    "threads",
    "status",
    "note",
    "gate",
    "gate_max_error",
    "time_median_s",
    "time_min_s",
    "repeats",
    "peak_bytes",
    "est_peak_bytes",
    "mem_method",
    "state_bytes",
    "flops",
    "bytes",
    "floor_bandwidth_s",
    "floor_flops_s",
    "floor_s",
    "floor_bound",
    "ratio_to_floor",
)
CSV_FIELDS = (*ROW_FIELDS, "cpu_model", "gpu", "torch", "date", "command")

LINEAR_OPS = ("aft-simple", "aft-decay", "aft-local", "aft-conv")


def _find(rows, mixer, mode, T, causal):
    for r in rows:
        if (
            r["mixer"] == mixer
            and r["mode"] == mode
            and r["T"] == T
            and r["causal"] == causal
            and r["status"] == "ok"
        ):
            return r
    return None


def _target(tid, what, measured, value, threshold, ok, note=""):
    status = "n/a" if ok is None else ("met" if ok else "missed")
    return {
        "id": tid,
        "target": what,
        "measured": measured,
        "value": value,
        "threshold": threshold,
        "status": status,
        "note": note,
    }


def _na(tid, what, threshold, why):
    return _target(tid, what, "n/a", None, threshold, None, why)


def evaluate_targets(result: dict) -> list[dict]:
    """The figures issue 5 asks for, each ``met``, ``missed`` or ``n/a`` (with why)."""
    rows = result["results"]
    cfg = result["config"]
    causal = bool(cfg["causal"])
    lengths = sorted(cfg["lengths"])
    out = []

    # 1. linear growth of forward+backward: time(T_hi) / time(T_hi / 8) <= 10 (8 is ideal)
    hi = lengths[-1]
    lo = hi // 8
    for m in LINEAR_OPS:
        what = f"{m} train time T={hi} / T={lo} <= 10 (linear: 8)"
        a, b = _find(rows, m, "train", hi, causal), _find(rows, m, "train", lo, causal)
        if a is None or b is None:
            out.append(
                _na("linear-growth", what, 10, f"needs {m} train measured at T={lo} and T={hi}")
            )
        else:
            r = a["time_median_s"] / b["time_median_s"]
            out.append(_target("linear-growth", what, f"{r:.3g}x", r, 10, r <= 10))

    # 2. against SDPA at T = 4096, causal forward+backward
    for m, need in (("aft-simple", 15.0), ("aft-local", 6.0)):
        what = f"{m} causal train at T=4096 >= {need:g}x faster than attention-sdpa"
        a, b = (
            _find(rows, m, "train", 4096, True),
            _find(rows, "attention-sdpa", "train", 4096, True),
        )
        if a is None or b is None:
            out.append(_na("vs-sdpa", what, need, "needs both measured causal at T=4096"))
        else:
            r = b["time_median_s"] / a["time_median_s"]
            out.append(_target("vs-sdpa", what, f"{r:.3g}x", r, need, r >= need))
    what = "aft-local train peak memory at T=16384 <= attention-sdpa's"
    a, b = (
        _find(rows, "aft-local", "train", 16384, causal),
        _find(rows, "attention-sdpa", "train", 16384, causal),
    )
    if a is None or b is None or a["peak_bytes"] is None or b["peak_bytes"] is None:
        out.append(_na("memory-vs-sdpa", what, 1.0, "needs both measured at T=16384"))
    else:
        r = a["peak_bytes"] / max(b["peak_bytes"], 1)
        out.append(
            _target(
                "memory-vs-sdpa",
                what,
                f"{a['peak_bytes'] / 2**20:.0f} MiB vs {b['peak_bytes'] / 2**20:.0f} MiB",
                r,
                1.0,
                r <= 1.0,
            )
        )

    # 3. near the limits
    for m in ("aft-simple", "aft-decay"):
        what = f"{m} causal train within 3x of its memory-traffic floor (largest T measured)"
        cands = [
            r
            for r in rows
            if r["mixer"] == m and r["mode"] == "train" and r["causal"] and r["status"] == "ok"
        ]
        if not cands:
            out.append(_na("near-floor", what, 3.0, f"needs {m} causal train measured"))
        else:
            r = max(cands, key=lambda x: x["T"])
            out.append(
                _target(
                    "near-floor",
                    what,
                    f"{r['ratio_to_floor']:.3g}x at T={r['T']}",
                    r["ratio_to_floor"],
                    3.0,
                    r["ratio_to_floor"] <= 3.0,
                )
            )
    what = "aft-full (non-causal) train <= 1.5x its matrix products (aft-full-matmul)"
    pairs = [
        (r, _find(rows, "aft-full-matmul", "train", r["T"], False))
        for r in rows
        if r["mixer"] == "aft-full"
        and r["mode"] == "train"
        and not r["causal"]
        and r["status"] == "ok"
    ]
    pairs = [p for p in pairs if p[1] is not None]
    if not pairs:
        out.append(
            _na("full-vs-matmul", what, 1.5, "needs non-causal aft-full and aft-full-matmul train")
        )
    else:
        a, b = max(pairs, key=lambda p: p[0]["T"])
        r = a["time_median_s"] / b["time_median_s"]
        out.append(_target("full-vs-matmul", what, f"{r:.3g}x at T={a['T']}", r, 1.5, r <= 1.5))
    for mode in ("forward", "train"):
        what = f"causal aft-full {mode} <= 0.7x non-causal"
        pairs = [
            (r, _find(rows, "aft-full", mode, r["T"], False))
            for r in rows
            if r["mixer"] == "aft-full"
            and r["mode"] == mode
            and r["causal"]
            and r["status"] == "ok"
        ]
        pairs = [p for p in pairs if p[1] is not None]
        if not pairs:
            out.append(
                _na(
                    "causal-full",
                    what,
                    0.7,
                    "needs aft-full causal and non-causal (--also-noncausal)",
                )
            )
        else:
            a, b = max(pairs, key=lambda p: p[0]["T"])
            r = a["time_median_s"] / b["time_median_s"]
            out.append(_target("causal-full", what, f"{r:.3g}x at T={a['T']}", r, 0.7, r <= 0.7))

    # 4. decoding: a step at the last position against a step at the first
    for m in ("aft-simple", "aft-decay", "attention-sdpa"):
        steps = sorted(
            (r for r in rows if r["mixer"] == m and r["mode"] == "decode" and r["status"] == "ok"),
            key=lambda r: r["T"],
        )
        flat = m != "attention-sdpa"
        what = (
            f"{m} decode step at the last position <= 1.25x the first (issue: 16384 vs 128)"
            if flat
            else "attention-sdpa decode step grows with position (informational)"
        )
        if len(steps) < 2:
            out.append(
                _na("decode", what, 1.25 if flat else None, f"needs {m} decode at two positions")
            )
            continue
        a, b = steps[-1], steps[0]
        r = a["time_median_s"] / b["time_median_s"]
        meas = f"{r:.3g}x (pos {a['T']} vs {b['T']})"
        out.append(
            _target(
                "decode",
                what,
                meas,
                r,
                1.25 if flat else None,
                (r <= 1.25) if flat else None,
                "" if flat else "informational",
            )
        )

    # 5. against aft-pytorch
    cmp_rows = [r for r in result.get("compare", []) if r.get("impl")]
    for variant_ours, variant_theirs in (("aft-full", "AFTFull"), ("aft-simple", "AFTSimple")):
        what = (
            f"aftlab {variant_ours} <= aft-pytorch {variant_theirs} in time and memory, "
            "finite where it is not"
        )
        worst_t, worst_m, n, finite_ok = 0.0, 0.0, 0, True
        for r in cmp_rows:
            if r["impl"] != "aftlab" or r["variant"] != variant_ours or r["status"] != "ok":
                continue
            t = next(
                (
                    x
                    for x in cmp_rows
                    if x["impl"] == "aft-pytorch"
                    and x["variant"] == variant_theirs
                    and x["mode"] == r["mode"]
                    and x["T"] == r["T"]
                    and x["status"] == "ok"
                ),
                None,
            )
            if t is None:
                continue
            n += 1
            worst_t = max(worst_t, r["time_median_s"] / t["time_median_s"])
            if r["peak_bytes"] is not None and t["peak_bytes"]:
                worst_m = max(worst_m, r["peak_bytes"] / t["peak_bytes"])
            finite_ok &= bool(r["finite"] and r["finite_large_input"])
        if n == 0:
            out.append(
                _na("vs-aft-pytorch", what, 1.0, "needs --compare-aft-pytorch with both measured")
            )
        else:
            ok = worst_t <= 1.0 and worst_m <= 1.0 and finite_ok
            out.append(
                _target(
                    "vs-aft-pytorch",
                    what,
                    f"worst time ratio {worst_t:.2f}, worst memory ratio {worst_m:.2f}, "
                    f"ours finite: {finite_ok} ({n} cases)",
                    worst_t,
                    1.0,
                    ok,
                )
            )
    return out


# ----------------------------------------------------------------------------- formatting
def _ms(x):
    return "" if x is None else (f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s")


def _mib(x):
    return "" if x is None else f"{x / 2**20:.3g} MiB"


def _label(r) -> str:
    if r["mode"] == "decode" or r["mixer"] == "aft-full-matmul":
        return r["mixer"]
    return r["mixer"] + ("" if r["causal"] else " (non-causal)")


def summary_markdown(result: dict) -> str:
    """The run as Markdown: machine, limits, one table per mode, notes, targets, comparison."""
    m, lim, rows = result["machine"], result["limits"], result["results"]
    lines = [
        "# aftlab bench",
        "",
        f"- command: `{m['command']}`",
        f"- machine: {m['cpu_model']} ({m['cpu_usable']} usable of {m['cpu_count']} CPUs), "
        f"{m['device']}{' ' + m['gpu'] if m.get('gpu') else ''}; torch {m['torch']}, "
        f"{m['threads']} threads; {m['date']}",
        f"- measured limits ({lim['dtype']}): GEMM {lim['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"(n={lim['gemm_n']}), bandwidth {lim['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(copy {lim['copy_bytes_per_s'] / 1e9:.1f}, add {lim['add_bytes_per_s'] / 1e9:.1f})",
        f"- B={result['config']['batch']}, d={result['config']['dim']}, "
        f"heads={result['config']['heads']}, dtype {result['config']['dtype']}; "
        "cells: median time / peak memory above the inputs / time over floor",
        "",
    ]
    for mode in ("forward", "train", "decode"):
        mrows = [r for r in rows if r["mode"] == mode]
        if not mrows:
            continue
        Ts = sorted({r["T"] for r in mrows})
        title = {
            "forward": "Forward",
            "train": "Forward + backward",
            "decode": "One decoding step at position T (module level)",
        }[mode]
        lines += [
            f"## {title}",
            "",
            "| mixer | " + " | ".join(f"T={T}" for T in Ts) + " |",
            "|---|" + "---|" * len(Ts),
        ]
        labels = list(dict.fromkeys(_label(r) for r in mrows))
        for lab in labels:
            cells = []
            for T in Ts:
                r = next((x for x in mrows if _label(x) == lab and x["T"] == T), None)
                if r is None:
                    cells.append("")
                elif r["status"] == "ok":
                    ratio = f" / {r['ratio_to_floor']:.1f}x" if r.get("ratio_to_floor") else ""
                    cells.append(f"{_ms(r['time_median_s'])} / {_mib(r['peak_bytes'])}{ratio}")
                else:
                    cells.append(r["status"])
            lines.append(f"| {lab} | " + " | ".join(cells) + " |")
        lines.append("")
    notes = [r for r in rows if r["status"] != "ok"]
    if notes:
        lines += ["## Not measured", ""]
        seen = set()
        for r in notes:
            key = (_label(r), r["mode"], r["status"], r["note"])
            if key in seen:
                continue
            seen.add(key)
            Ts = [x["T"] for x in notes if (_label(x), x["mode"], x["status"], x["note"]) == key]
            lines.append(
                f"- {_label(r)} {r['mode']} T={','.join(map(str, Ts))}: "
                f"**{r['status']}**: {r['note']}"
            )
        lines.append("")
    lines += ["## Targets (issue 5)", "", "| target | measured | status |", "|---|---|---|"]
    for t in result.get("targets", []):
        meas = t["measured"] if t["status"] != "n/a" else f"n/a: {t['note']}"
        lines.append(f"| {t['target']} | {meas} | {t['status']} |")
    lines.append("")
    cmp_rows = [r for r in result.get("compare", []) if r.get("impl")]
    if cmp_rows:
        lines += [
            "## Against aft-pytorch (module level, non-causal)",
            "",
            "| impl | variant | mode | T | time | peak memory | finite | finite (x*1000) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in cmp_rows:
            if r["status"] == "ok":
                lines.append(
                    f"| {r['impl']} | {r['variant']} | {r['mode']} | {r['T']} | "
                    f"{_ms(r['time_median_s'])} | {_mib(r['peak_bytes'])} | {r['finite']} | "
                    f"{r['finite_large_input']} |"
                )
            else:
                lines.append(
                    f"| {r['impl']} | {r['variant']} | {r['mode']} | {r['T']} | "
                    f"{r['status']}: {r['note']} | | | |"
                )
        lines.append("")
    elif result.get("compare"):
        lines += [f"aft-pytorch comparison: {result['compare'][0]['note']}", ""]
    return "\n".join(lines)


def write_report(result: dict, out: Path) -> list[str]:
    """Write results.json, results.csv, summary.md and the plots; return lines to print."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(dumps(result, indent=2, default=str))
    m = result["machine"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result["results"]:
            w.writerow(
                {
                    **r,
                    "cpu_model": m["cpu_model"],
                    "gpu": m.get("gpu"),
                    "torch": m["torch"],
                    "date": m["date"],
                    "command": m["command"],
                }
            )
    text = summary_markdown(result)
    (out / "summary.md").write_text(text)
    from .plots import write_plots

    lines = ["", text, f"wrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.md'}"]
    made, note = write_plots(result, out)
    lines.append(f"plots: {', '.join(p.name for p in made)}" if made else f"plots skipped: {note}")
    return lines
