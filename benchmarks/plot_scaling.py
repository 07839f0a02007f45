"""Plot test bpb against training tokens and against training seconds, from the ``aftlab
compare`` runs of the budget-scaling experiment (docs/results.md, "Budget scaling").

    python benchmarks/plot_scaling.py docs/results/scaling-*/results.json \
        --out docs/results/scaling.png --table

Each results.json gives, per row (a model), a point: the budget is the run's ``steps x
batch_size x seq_len`` tokens, its seconds those tokens over the row's training tokens/s, its
test bpb the mean over seeds (min-max as error bars). A model is its ``--mixers`` entry and its
``model.positional`` (``attention`` with rotary positions is its own curve). Writes one PNG with
both panels; ``--table`` also prints the points as a Markdown table, the curves' order at each
budget and where two curves cross.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from aftlab._system import format_bytes

NAMES = {"rwkv4:architecture=rwkv4": "RWKV-4"}


def label(row: dict, config: dict) -> str:
    """The curve a row belongs to: its entry's name, with the positions of attention."""
    name = NAMES.get(row["mixer"], row["mixer"])
    if name.startswith("attention"):
        name += f" ({config.get('model', {}).get('positional', 'learned')} positions)"
    return name


def points(paths: list[str]) -> dict[str, list[dict]]:
    """``{curve: [{tokens, seconds, bpb, lo, hi, seeds, tokens_per_s, lr}, ...]}`` by tokens."""
    curves = defaultdict(list)
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        c = result["config"]
        tokens = c["steps"] * c["batch_size"] * c["seq_len"]
        for r in result["rows"]:
            if not r.get("tokens_per_s"):  # the unigram baseline
                continue
            curves[label(r, c)].append(
                {
                    "tokens": tokens,
                    "seconds": tokens / r["tokens_per_s"],
                    "bpb": r["test_metric"],
                    "lo": r["test_metric_min"],
                    "hi": r["test_metric_max"],
                    "seeds": len(r["seeds"]),
                    "tokens_per_s": r["tokens_per_s"],
                    "peak": r.get("peak_memory_bytes"),
                    "lr": r["lr"],
                }
            )
    for pts in curves.values():
        pts.sort(key=lambda p: p["tokens"])
    return dict(curves)


def crossings(curves: dict[str, list[dict]]) -> list[str]:
    """Where two curves change order between neighbouring budgets that both were run at; a
    budget where their seeds' min-max ranges overlap is named (the order there is within the
    spread)."""
    out, names = [], sorted(curves)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pa, pb = ({p["tokens"]: p for p in curves[n]} for n in (a, b))
            shared = sorted(set(pa) & set(pb))
            for lo, hi in zip(shared, shared[1:], strict=False):
                if (pa[lo]["bpb"] - pb[lo]["bpb"]) * (pa[hi]["bpb"] - pb[hi]["bpb"]) < 0:
                    level = [
                        f"{t:,}" for t in (lo, hi)
                        if pa[t]["lo"] <= pb[t]["hi"] and pb[t]["lo"] <= pa[t]["hi"]
                    ]
                    note = f" (level within the seeds' min-max at {', '.join(level)})"
                    out.append(
                        f"{a} and {b} cross between {lo:,} and {hi:,} tokens"
                        + (note if level else "")
                    )
    return out


def table(curves: dict[str, list[dict]]) -> str:
    lines = [
        "| model | tokens | lr | seeds | test bpb (min-max) | training s | tokens/s | peak memory "
        "|",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, pts in curves.items():
        for p in pts:
            spread = f" ({p['lo']:.4f}-{p['hi']:.4f})" if p["seeds"] > 1 else ""
            peak = format_bytes(p["peak"]) if p["peak"] else ""
            lines.append(
                f"| {name} | {p['tokens']:,} | {p['lr']:g} | {p['seeds']} | {p['bpb']:.4f}{spread} "
                f"| {p['seconds']:,.0f} | {p['tokens_per_s']:,.0f} | {peak} |"
            )
    by_budget = defaultdict(list)
    for name, pts in curves.items():
        for p in pts:
            by_budget[p["tokens"]].append((p["bpb"], name))
    lines.append("")
    for tokens in sorted(by_budget):
        order = " < ".join(f"{n} {b:.4f}" for b, n in sorted(by_budget[tokens]))
        lines.append(f"- {tokens:,} tokens: {order}")
    lines += [f"- {c}" for c in crossings(curves)] or ["- no two curves cross"]
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, pts in sorted(curves.items()):
        y = [p["bpb"] for p in pts]
        err = [[p["bpb"] - p["lo"] for p in pts], [p["hi"] - p["bpb"] for p in pts]]
        for ax, x in zip(axes, ("tokens", "seconds"), strict=True):
            ax.errorbar([p[x] for p in pts], y, yerr=err, marker="o", capsize=3, label=name)
    axes[0].set_xlabel("training tokens")
    axes[1].set_xlabel("training seconds on this machine")
    axes[0].set_ylabel("test bits per byte")
    for ax in axes:
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.json of aftlab compare runs")
    p.add_argument("--out", help="PNG to write (both panels)")
    p.add_argument("--table", action="store_true", help="print the points as Markdown")
    a = p.parse_args(argv)
    try:
        curves = points(a.results)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"plot_scaling: cannot read the results: {e}")
    if not curves:
        sys.exit("plot_scaling: no trained model in the results")
    if a.table:
        print(table(curves))
    if a.out:
        plot(curves, a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
