"""Plots of a run: time and peak memory against T, log-log, one line per mixer, per mode.

Needs matplotlib (the ``plot`` or ``bench`` extra); without it the plots are skipped with a note.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_plots"]

_TITLES = {
    "forward": "forward",
    "train": "forward + backward",
    "decode": "one decoding step at position T",
}


def _series(rows: list[dict], mode: str, key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["T"]):
        if r["status"] != "ok" or not r.get(key):
            continue
        label = r["mixer"] + (
            ""
            if r["causal"] or mode == "decode" or r["mixer"].endswith("matmul")
            else " (non-causal)"
        )
        xs, ys = out.setdefault(label, ([], []))
        xs.append(r["T"])
        ys.append(r[key])
    return out


def write_plots(result: dict, out: Path) -> tuple[list[Path], str]:
    """Write ``bench_<mode>.png`` (time and memory panels); return (paths, note if skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'aftlab[plot]')"
    m, cfg = result["machine"], result["config"]
    made = []
    panels = (
        ("time_median_s", 1e3, "median time (ms)"),
        ("peak_bytes", 2**-20, "peak memory above inputs (MiB)"),
    )
    for mode in ("forward", "train", "decode"):
        data = [(_series(result["results"], mode, key), scale, unit) for key, scale, unit in panels]
        if not data[0][0]:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, (series, scale, unit) in zip(axes, data, strict=True):
            for label, (xs, ys) in series.items():
                ax.plot(xs, [max(y * scale, 1e-6) for y in ys], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("position T" if mode == "decode" else "sequence length T")
            ax.set_ylabel(unit)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(
            f"{_TITLES[mode]}: B={cfg['batch']}, d={cfg['dim']}, {cfg['dtype']}, "
            f"{m['device']}, {m['threads']} threads",
            fontsize=10,
        )
        path = out / f"bench_{mode}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made, "" if made else "no measured case to plot"
