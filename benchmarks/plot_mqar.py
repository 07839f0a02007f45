"""Table and plot of an MQAR grid: test accuracy against T, one line per mixer and width.

    python benchmarks/plot_mqar.py runs/mqar --out runs/mqar/accuracy_vs_T.png

Reads ``OUT/d<D>-T<T>/results.json`` (``aftlab compare`` runs of benchmarks/mqar.sh; a cell split
over several runs as ``d<D>-T<T>-<anything>/`` is read as one, a mixer in several of them at its
best validation accuracy; a folder without ``results.json``, a compare stopped before its table,
is read from its runs' ``<mixer>/summary.json``), prints a
markdown table (rows mixer and d_model, columns T, the chosen rate's test accuracy) and writes
one PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def rows_of(cell: Path) -> list[dict]:
    """The compare rows of one cell folder: its ``results.json``, else its runs' ``summary.json``.

    A run read from ``summary.json`` has no validation accuracy (``val_metric`` None): it counts
    only where no run of the same mixer in the cell has one.
    """
    table = cell / "results.json"
    if table.is_file():
        return json.loads(table.read_text())["rows"]
    rows = []
    for summary in sorted(cell.glob("*/summary.json")):
        run = json.loads(summary.read_text())
        rows.append({"mixer": run["mixer"], "val_metric": None,
                     "test_metric": run.get(f"test_{run.get('metric', 'accuracy')}")})
    return rows


def collect(root: Path) -> dict[tuple[str, int], dict[int, float]]:
    """``{(mixer, d_model): {T: test accuracy}}`` of every ``d<D>-T<T>[-*]/`` cell folder.

    A mixer run more than once in a cell (another rate in another folder) counts once: the run
    with the best validation accuracy, as ``aftlab compare --lrs`` chooses (never the test split).
    """
    best: dict[tuple[str, int, int], tuple[float, float]] = {}
    for cell in sorted(root.glob("d*-T*/")):
        m = re.fullmatch(r"d(\d+)-T(\d+)(-.*)?", cell.name)
        if m is None:
            continue
        d, t = int(m[1]), int(m[2])
        for row in rows_of(cell):
            if row.get("test_metric") is None:
                continue
            val = row["val_metric"] if row.get("val_metric") is not None else float("-inf")
            key = (row["mixer"], d, t)
            if key not in best or val > best[key][0]:
                best[key] = (val, row["test_metric"])
    acc: dict[tuple[str, int], dict[int, float]] = {}
    for (mixer, d, t), (_, test) in sorted(best.items()):
        acc.setdefault((mixer, d), {})[t] = test
    return acc


def value_set_level(root: Path) -> dict[int, float]:
    """``{T: 1 / P}``: the accuracy of a model that knows the P values shown, not which one."""
    level = {}
    for path in root.glob("d*-T*/results.json"):
        config = json.loads(path.read_text())["config"]
        level[config["seq_len"]] = 1 / config["task_options"]["num_pairs"]
    return level


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the grid's output folder (OUT of benchmarks/mqar.sh)")
    p.add_argument("--out", required=True, help="PNG to write")
    a = p.parse_args()
    acc = collect(a.root)
    if not acc:
        sys.exit(f"plot_mqar: no d<D>-T<T>/results.json with results under {a.root}")
    ts = sorted({t for row in acc.values() for t in row})
    print("| mixer | d_model | " + " | ".join(f"T={t}" for t in ts) + " |")
    print("|---|---:|" + "---:|" * len(ts))
    for (mixer, d), row in sorted(acc.items()):
        cells = " | ".join(f"{row[t]:.3f}" if t in row else "" for t in ts)
        print(f"| {mixer} | {d} | {cells} |")
    level = value_set_level(a.root)
    print("| 1/P (the value set) | | " + " | ".join(f"{level.get(t, 0):.3f}" for t in ts) + " |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({d for _, d in acc})
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 3.6), squeeze=False)
    for ax, d in zip(axes[0], widths, strict=True):
        for (mixer, dd), row in sorted(acc.items()):
            if dd == d:
                x = sorted(row)
                ax.plot(x, [row[t] for t in x], marker="o", label=mixer)
        ax.plot(ts, [level.get(t) for t in ts], "k--", lw=1, label="1/P (the value set)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"MQAR, d_model = {d}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
