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
    """Write ``time_<mode>.png`` and ``memory_<mode>.png``; return (paths, note if skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'aftlab[plot]')"
    m = result["machine"]
    made = []
    for mode in ("forward", "train", "decode"):
        for key, scale, unit, stem in (
            ("time_median_s", 1e3, "median time (ms)", "time"),
            ("peak_bytes", 2**-20, "peak memory above inputs (MiB)", "memory"),
        ):
            series = _series(result["results"], mode, key)
            if not series:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.4))
            for label, (xs, ys) in series.items():
                ax.plot(xs, [y * scale for y in ys], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("position T" if mode == "decode" else "sequence length T")
            ax.set_ylabel(unit)
            cfg = result["config"]
            ax.set_title(
                f"{_TITLES[mode]}: B={cfg['batch']}, d={cfg['dim']}, {cfg['dtype']}, "
                f"{m['device']}, {m['threads']} threads",
                fontsize=9,
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = out / f"{stem}_{mode}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path)
    return made, "" if made else "no measured case to plot"
