"""Figures of a run: loss curves, AFT-full/local position biases ``w``, AFT-conv kernels.

matplotlib is an optional extra (``pip install 'aftlab[plot]'``); without it every function here
raises :class:`UsageError` with that instruction.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._plotting import pyplot
from ..errors import UsageError
from .checkpoint import _write_error, atomic_write_bytes, run_subdir

__all__ = [
    "plot_run",
    "plot_loss_curves",
    "plot_throughput",
    "position_biases",
    "conv_kernels",
    "read_metrics",
]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a line cut short by a kill, or damaged, is skipped)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f"{str(path)!r} does not exist (is this a run folder written by aftlab train?)"
        )
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


_RETRY = "run the command again"


def _save_png(plt, fig, out_png: str | Path) -> Path:
    """Write ``fig`` to ``out_png`` atomically (a link there is replaced, not written through)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out_png, buf.getvalue(), retry=_RETRY)
    return Path(out_png)


def _ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else (1 - alpha) * m + alpha * v
        out.append(m)
    return out


def plot_loss_curves(runs: dict[str, str | Path], out_png: str | Path) -> Path:
    """One figure: training loss (smoothed, exponential moving average 0.1) and validation loss
    (markers) against the step, one colour per run.

    Args:
        runs: label -> ``metrics.jsonl`` path.
        out_png: the PNG to write.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, path) in enumerate(runs.items()):
        recs = read_metrics(path)
        train = [r for r in recs if r.get("split") == "train"]
        val = [r for r in recs if r.get("split") == "val"]
        color = f"C{i % 10}"
        if train:
            ax.plot(
                [r["step"] for r in train],
                _ema([r["loss"] for r in train]),
                color=color,
                label=f"{label} train",
            )
        if val:
            ax.plot(
                [r["step"] for r in val],
                [r["loss"] for r in val],
                "o--",
                color=color,
                ms=4,
                label=f"{label} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per target)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save_png(plt, fig, out_png)


def plot_throughput(rows: list[dict[str, Any]], out_png: str | Path, *, device: str) -> Path:
    """One figure, two bar charts: training tokens/s and peak memory (MiB) per model.

    Args:
        rows: one dict per model with ``"mixer"``, ``"tokens_per_s"`` and ``"peak_memory_bytes"``
            (rows without a speed, such as a baseline, are left out).
        out_png: the PNG to write.
        device: the device the figures were measured on (in the axis labels).
    """
    plt = pyplot()
    rows = [r for r in rows if r.get("tokens_per_s") is not None]
    if not rows:
        raise UsageError("no model has a measured speed to plot")
    names = [r["mixer"] for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(9, 0.45 * len(rows) + 1.5), sharey=True)
    speed.barh(names, [r["tokens_per_s"] for r in rows], color="C0")
    speed.set_xlabel(f"training tokens/s ({device})")
    memory.barh(names, [(r.get("peak_memory_bytes") or 0) / 2**20 for r in rows], color="C1")
    memory.set_xlabel(f"peak memory, MiB ({device})")
    speed.invert_yaxis()  # the table's order, top to bottom
    for ax in (speed, memory):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _save_png(plt, fig, out_png)


@torch.no_grad()
def position_biases(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The effective ``w`` of every AFT-full/local layer: ``(name, (T, T))`` in layer order.

    AFT-local keeps ``w_{t,t'}`` only where ``|t - t'| < s`` (``s`` = window); entries that a
    layer never uses (outside the window, or ``t' > t`` when causal) are NaN, shown blank.
    """
    out = []
    for name, m in model.named_modules():
        pb = getattr(m, "pos_bias", None)
        if pb is None or not hasattr(pb, "matrix"):
            continue
        T = pb.max_seq_len
        w = pb.matrix(T).detach().float().cpu().clone()
        t = torch.arange(T)
        unused = torch.zeros(T, T, dtype=torch.bool)
        if getattr(m, "causal", False):
            unused |= t[None, :] > t[:, None]
        window = getattr(m, "window", None)
        if window is not None:
            unused |= (t[None, :] - t[:, None]).abs() >= window
        out.append(
            (f"{name} ({getattr(m, 'name', type(m).__name__)})", w.masked_fill(unused, math.nan))
        )
    return out


@torch.no_grad()
def conv_kernels(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The learned kernels of every AFT-conv layer: ``(name, (heads, ...))``.

    A kernel is a parameter the mixer owns outside its ``nn.Linear`` projections with a last
    dimension > 1 (per-head scalars, such as a reparameterisation's gain and shift, are left out).
    """
    out = []
    for name, m in model.named_modules():
        if getattr(m, "name", "") != "aft-conv":
            continue
        linear = {
            id(p) for sub in m.modules() if isinstance(sub, nn.Linear) for p in sub.parameters()
        }
        for pname, p in m.named_parameters():
            if id(p) not in linear and p.dim() >= 2 and p.shape[-1] > 1:  # not scalar gains
                out.append((f"{name}.{pname}", p.detach().float().cpu()))
    return out


def _heatmaps(plt, items: list[tuple[str, torch.Tensor]], out_png: Path, title: str) -> Path:
    n = len(items)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, (label, mat) in zip(axes.flat, items, strict=False):
        im = ax.imshow(mat.numpy(), cmap="RdBu_r", interpolation="nearest", aspect="auto")
        ax.set_title(label, fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save_png(plt, fig, out_png)


def plot_run(run_dir: str | Path, *, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures of a run; return their paths.

    * ``loss.png``: training and validation loss;
    * ``position_bias.png`` (AFT-full/local): each layer's learned ``w`` (rows ``t``, columns
      ``t'``); ``exp(w_{t,t'})`` multiplies the weight of key ``t'`` for query ``t``;
    * ``conv_kernels.png`` (AFT-conv): each layer's kernels, one panel per head.
    """
    from .run import load_run

    plt = pyplot()
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    metrics = run_dir / "metrics.jsonl"
    read_metrics(metrics)  # a clear error for a folder that is not a run
    try:
        if out_dir is None:
            run_subdir(out)  # never a link planted in the run folder
        else:
            out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(repr(str(out)), e, _RETRY) from None
    paths = [plot_loss_curves({run_dir.name: metrics}, out / "loss.png")]
    run = load_run(run_dir, load_task=False)
    biases = position_biases(run.model)
    if biases:
        paths.append(
            _heatmaps(
                plt,
                biases,
                out / "position_bias.png",
                "learned position bias w (row t: query, column t': key)",
            )
        )
    kernels = []
    for label, k in conv_kernels(run.model):
        k = k.reshape(-1, *k.shape[-2:]) if k.dim() > 2 else k[None]
        kernels += [(f"{label}[{h}]", k[h]) for h in range(k.shape[0])]
    if kernels:
        paths.append(
            _heatmaps(plt, kernels, out / "conv_kernels.png", "AFT-conv kernels (one per head)")
        )
    return paths
