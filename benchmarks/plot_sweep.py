"""Plot a compare run's test metric against one mixer option (e.g. aft-local's window).

    python benchmarks/plot_sweep.py docs/results/window/results.json --option window \
        --out docs/results/window/bpb_vs_window.png

Reads the rows ``NAME:OPTION=VALUE`` of ``aftlab compare``'s results.json (mean over seeds, with
the min-max as error bars when there are several) and writes one PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="results.json of an aftlab compare run")
    p.add_argument("--option", required=True, help="the mixer option on the x axis")
    p.add_argument("--out", required=True, help="PNG to write")
    a = p.parse_args()
    rows = json.load(open(a.results))["rows"]
    points = []
    for r in rows:
        for part in r["mixer"].split(":")[1:]:
            key, _, value = part.partition("=")
            if key == a.option and r["test_metric"] is not None:
                lo, hi = r["test_metric_min"], r["test_metric_max"]
                points.append((float(value), r["test_metric"], lo, hi))
    if not points:
        sys.exit(f"plot_sweep: no row of {a.results} has the option {a.option!r}")
    points.sort()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(points)))
    y = [p[1] for p in points]
    err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3)
    ax.set_xticks(x, [f"{p[0]:g}" for p in points])
    ax.set_xlabel(a.option)
    ax.set_ylabel("test metric (bits per byte for text)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
