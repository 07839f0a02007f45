"""The report of a run: results.json, results.csv, summary.md, plots, and the issue's targets."""

from __future__ import annotations

import csv
import math
from functools import partial
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


def _find(rows, mixer, mode, T, causal=True):
    key = (mixer, mode, T, causal, "ok")
    return next(
        (r for r in rows if (r["mixer"], r["mode"], r["T"], r["causal"], r["status"]) == key), None
    )


def _ratio(res, a, b, T, *, T_b=None, causal_a=True, causal_b=True):
    """Train time of ``a`` at ``T`` over train time of ``b`` at ``T_b`` (default ``T``)."""
    T_b = T if T_b is None else T_b
    x = _find(res["results"], a, "train", T, causal_a)
    y = _find(res["results"], b, "train", T_b, causal_b)
    where = f"T={T}" if T_b == T else f"T={T} / T={T_b}"
    if x is None or y is None:
        return None, f"needs {a if a == b else f'{a} and {b}'} train measured at {where}"
    return x["time_median_s"] / y["time_median_s"], where


def _vs_sdpa_every_t(res, m):
    Ts = sorted({r["T"] for r in res["results"] if r["T"] >= 256})
    got = [(_ratio(res, "attention-sdpa", m, T)[0], T) for T in Ts]
    got = [g for g in got if g[0] is not None]
    if not got:
        return None, f"needs {m} and attention-sdpa train measured at some T >= 256"
    return min(got)[0], f"slowest at T={min(got)[1]} of T={','.join(str(T) for _, T in got)}"


def _near_floor(res, m, mode):
    rows = [r for r in res["results"] if (r["mixer"], r["mode"], r["status"]) == (m, mode, "ok")]
    rows = [r for r in rows if r["causal"] and r.get("bytes")]
    if not rows:
        return None, f"needs {m} causal {mode} measured"
    r = max(rows, key=lambda x: x["T"])
    return r["time_median_s"] * res["limits"]["copy_bytes_per_s"] / r["bytes"], f"T={r['T']}"


def _full(res, b, causal_a, causal_b):
    """aft-full train over ``b`` train at the largest T where both were measured."""
    for T in sorted({r["T"] for r in res["results"] if r["mixer"] == "aft-full"}, reverse=True):
        r = _ratio(res, "aft-full", b, T, causal_a=causal_a, causal_b=causal_b)
        if r[0] is not None:
            return r
    return None, f"needs aft-full (causal={causal_a}) and {b} (causal={causal_b}) train"


def _vs_peer(res, peer, pair, mode=None, T=None):
    """Peer time / our time, the smallest over the matching (mode, T) of the comparison."""
    rows = [r for r in res.get("compare", []) if r.get("impl") and r["status"] == "ok"]
    rows = [r for r in rows if (r["peer"], r["pair"]) == (peer, pair)]
    rows = [r for r in rows if mode in (None, r["mode"]) and T in (None, r["T"])]
    ours = {(r["mode"], r["T"]): r for r in rows if r["impl"] == "aftlab"}
    got = [
        (r["time_median_s"] / ours[(r["mode"], r["T"])]["time_median_s"], r["mode"], r["T"])
        for r in rows
        if r["impl"] == peer and (r["mode"], r["T"]) in ours
    ]
    if not got:
        return None, f"needs --peers {peer} with both measured"
    r, mode, T = min(got)
    return r, f"slowest {mode} T={T} of {len(got)} cases"


def _finite(res):
    rows = [r for r in res.get("compare", []) if r.get("impl") == "aftlab" and r["status"] == "ok"]
    if not rows:
        return None, "needs --peers with ours measured"
    bad = sum(not (r["finite"] and r["finite_large_input"]) for r in rows)
    return bad, f"non-finite in {bad} of {len(rows)} cases, inputs x1 and x1000"


def _targets() -> list[tuple]:
    sdpa = [("aft-simple", 30), ("aft-decay", 25), ("aft-local", 12), ("aft-conv", 10)]
    return [
        *(
            (
                f"{m} causal train at T=4096 >= {n}x faster than attention-sdpa",
                partial(_ratio, a="attention-sdpa", b=m, T=4096),
                ">=",
                n,
            )
            for m, n in sdpa
        ),
        *(
            (
                f"{m} causal train faster than attention-sdpa at every T >= 256",
                partial(_vs_sdpa_every_t, m=m),
                ">=",
                1,
            )
            for m in ("aft-local", "aft-conv")
        ),
        *(
            (
                f"{m} train t(16384) / t(2048) <= 9 (linear: 8)",
                partial(_ratio, a=m, b=m, T=16384, T_b=2048),
                "<=",
                9,
            )
            for m in LINEAR_OPS
        ),
        *(
            (
                f"{m} causal {mode} <= {n}x its memory-traffic floor (bytes / copy bandwidth, "
                "largest T)",
                partial(_near_floor, m=m, mode=mode),
                "<=",
                n,
            )
            for m in ("aft-simple", "aft-decay")
            for mode, n in (("forward", 2), ("train", 3))
        ),
        (
            "aft-full (non-causal) train <= 1.2x its matrix products",
            partial(_full, b="aft-full-matmul", causal_a=False, causal_b=False),
            "<=",
            1.2,
        ),
        (
            "causal aft-full train <= 0.6x non-causal",
            partial(_full, b="aft-full", causal_a=True, causal_b=False),
            "<=",
            0.6,
        ),
        *(
            (
                f"aftlab {m} >= 3x faster than aft-pytorch {p} at every length",
                partial(_vs_peer, peer="aft-pytorch", pair=m),
                ">=",
                3,
            )
            for m, p in (("aft-full", "AFTFull"), ("aft-simple", "AFTSimple"))
        ),
        (
            "aft-decay train at T=2048 >= 150x faster than transformers' rwkv_linear_attention_cpu",
            partial(_vs_peer, peer="hf-rwkv", pair="aft-decay", mode="train", T=2048),
            ">=",
            150,
        ),
        ("aftlab finite in every peer case (finite where a peer is not)", _finite, "<=", 0),
    ]


#: The speed targets that bench measures (docs/benchmarks.md, "Targets"):
#: (target, how, ">=" or "<=", threshold);
#: ``how(result)`` returns ``(value, where)``, or ``(None, why)`` when it cannot be read.
TARGETS = _targets()


def evaluate_targets(result: dict, targets: list[tuple] = TARGETS) -> list[dict]:
    """Each target ``met``, ``missed`` or ``n/a`` (with why), with its value and shortfall.

    ``shortfall``: how far a missed target is off, the factor the value must improve by
    (``threshold / value`` for ``>=``, ``value / threshold`` for ``<=``; ``value - threshold``
    for a threshold of 0); None unless missed.
    """
    out = []
    for what, how, op, need in targets:
        value, where = how(result)
        row = {"target": what, "value": value, "threshold": need, "shortfall": None, "note": ""}
        if value is None:
            out.append({**row, "status": "n/a", "measured": "n/a", "note": where})
            continue
        ok = value >= need if op == ">=" else value <= need
        x = "" if need == 0 else "x"
        if not ok:
            if need == 0:
                row["shortfall"] = value - need
            else:
                row["shortfall"] = (
                    (need / value if value > 0 else math.inf) if op == ">=" else value / need
                )
        miss = "" if ok else f"; missed by {row['shortfall']:.3g}{x}"
        out.append(
            {
                **row,
                "status": "met" if ok else "missed",
                "measured": f"{value:.3g}{x} ({where}){miss}",
            }
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
    lines += ["## Targets", "", "| target | measured | status |", "|---|---|---|"]
    for t in result.get("targets", []):
        meas = t["measured"] if t["status"] != "n/a" else f"n/a: {t['note']}"
        lines.append(f"| {t['target']} | {meas} | {t['status']} |")
    lines.append("")
    cmp_rows = result.get("compare", [])
    if cmp_rows:
        lines += [
            "## Against peers (module level; aft-pytorch non-causal, hf-rwkv causal)",
            "",
            "| peer | impl | variant | mode | T | time | peak memory | finite | finite (x1000) "
            "| aftlab faster by |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in cmp_rows:
        if not r.get("impl"):
            lines.append(f"| {r['peer']} | {r['status']}: {r['note']} |||||||||")
        elif r["status"] != "ok":
            lines.append(
                f"| {r['peer']} | {r['impl']} | {r['variant']} | {r['mode']} | {r['T']} | "
                f"{r['status']}: {r['note']} |||||"
            )
        else:
            ours = next(
                (
                    o
                    for o in cmp_rows
                    if o.get("impl") == "aftlab"
                    and o["status"] == "ok"
                    and (o["peer"], o["pair"], o["mode"], o["T"])
                    == (r["peer"], r["pair"], r["mode"], r["T"])
                ),
                None,
            )
            faster = (
                ""
                if r["impl"] == "aftlab" or ours is None
                else (f"{r['time_median_s'] / ours['time_median_s']:.3g}x")
            )
            lines.append(
                f"| {r['peer']} | {r['impl']} | {r['variant']} | {r['mode']} | {r['T']} | "
                f"{_ms(r['time_median_s'])} | {_mib(r['peak_bytes'])} | {r['finite']} | "
                f"{r['finite_large_input']} | {faster} |"
            )
    lines.append("")
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
