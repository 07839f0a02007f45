"""``aftlab compare``: one model per mixer, equal size and budget, one table.

Each mixer is trained by a child process (``python -m aftlab train``) with the same config
except ``mixer``: the same data, model width/depth, context, batch and steps (the AFT paper's
Table 4 protocol). A child process per model gives each its own peak memory (CPU: peak RSS
above the RSS at the start of training; CUDA: ``max_memory_allocated``). Mixer options of the
base config are not passed on (each mixer runs with its defaults).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .._json import dumps
from .build import build_task
from .checkpoint import atomic_write_text
from .config import TrainConfig, to_toml
from .errors import UsageError

__all__ = ["DEFAULT_MIXERS", "run_compare", "unigram_baseline", "format_table"]

#: The mixers compared by default: the Transformer and every AFT variant
#: (the paper's four and RWKV's decay).
DEFAULT_MIXERS = ("attention", "aft-full", "aft-local", "aft-simple", "aft-conv", "aft-decay")


def unigram_baseline(
    task: Any, *, train_batches: int, batch_size: int, test_batches: int | None
) -> float:
    """Test loss (nats per target) of a unigram model fitted on training batches.

    ``p(c) = (n_c + 1) / (n + V)`` (add-one smoothing) from the targets of ``train_batches``
    training batches; the loss is ``-mean_{test targets} ln p(y)``.
    """
    counts = np.ones(task.vocab_size, dtype=np.float64)
    for step in range(train_batches):
        y = task.train_batch(step, batch_size=batch_size)["target"].numpy().ravel()
        y = y[y >= 0]
        counts += np.bincount(y, minlength=task.vocab_size)[: task.vocab_size]
    logp = np.log(counts / counts.sum())
    total, n = 0.0, 0
    for batch in task.eval_batches("test", batch_size=batch_size, max_batches=test_batches):
        y = batch["target"].numpy().ravel()
        y = y[y >= 0]
        total -= float(logp[y].sum())
        n += y.size
    return total / max(n, 1)


def _fmt_mem(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.0f} MiB"


def format_table(rows: list[dict[str, Any]], metric: str, device: str) -> str:
    """The Markdown table of :func:`run_compare` rows."""
    lines = [
        f"| mixer | parameters | test {metric} | train tokens/s | peak memory ({device}) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        value, speed = r.get("test_metric"), r.get("tokens_per_s")
        value_s = "n/a" if value is None else f"{value:.4f}"
        speed_s = "" if speed is None else f"{speed:,.0f}"
        mem_s = "" if r["mixer"].startswith("(") else _fmt_mem(r.get("peak_memory_bytes"))
        lines.append(f"| {r['mixer']} | {r['parameters']:,} | {value_s} | {speed_s} | {mem_s} |")
    return "\n".join(lines)


def _train_one(base: TrainConfig, mixer: str, run_dir: Path) -> dict[str, Any]:
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():  # finished in an earlier invocation
        return json.loads(summary_path.read_text(encoding="utf-8"))
    cfg_path = run_dir.parent / f"{mixer}.toml"
    atomic_write_text(
        cfg_path,
        to_toml(base.replace(mixer=mixer, mixer_options={}, out=str(run_dir), sample_tokens=0)),
    )
    cmd = [sys.executable, "-m", "aftlab", "train", "--config", str(cfg_path)]
    if (run_dir / "config.toml").is_file():
        cmd.append("--resume")
    print(f"aftlab compare: training {mixer} -> {run_dir}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0 or not summary_path.is_file():
        raise UsageError(
            f"training {mixer} failed (exit status {proc.returncode}); see its output above and "
            f"{run_dir}; rerun the same compare command to continue"
        )
    return json.loads(summary_path.read_text(encoding="utf-8"))


def run_compare(base: TrainConfig, mixers: list[str], out_dir: str | Path) -> str:
    """Train every mixer of ``mixers`` with ``base`` and write the comparison into ``out_dir``.

    Writes ``results.md`` (the table, with the config), ``results.json`` and, when matplotlib is
    installed, ``loss_curves.png``. An existing ``out_dir`` is continued: finished models are
    read back, interrupted ones resumed.

    Returns:
        The Markdown table.
    """
    from ..mixers import available_mixers

    unknown = [m for m in mixers if m not in available_mixers()]
    if unknown:
        raise UsageError(
            f"unknown mixer {unknown[0]!r} in --mixers; "
            f"known mixers: {', '.join(available_mixers())}"
        )
    task = build_task(base)  # fails early on bad data, before any training
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    summaries = {}
    for mixer in mixers:
        s = _train_one(base, mixer, out_dir / mixer)
        summaries[mixer] = s
        rows.append(
            {
                "mixer": mixer,
                "parameters": s["parameters"],
                "test_metric": s.get(f"test_{s['metric']}"),
                "test_loss": s.get("test_loss"),
                "tokens_per_s": s.get("train_tokens_per_s"),
                "peak_memory_bytes": s.get("peak_memory_bytes"),
                "device": s.get("device"),
            }
        )
    device = rows[0]["device"] if rows else "cpu"
    if task.metric in ("bpc", "bpb"):
        nats = unigram_baseline(
            task,
            train_batches=min(base.steps, 200),
            batch_size=base.batch_size,
            test_batches=base.test_batches or None,
        )
        rows.append(
            {
                "mixer": "(unigram baseline)",
                "parameters": task.vocab_size - 1,
                "test_metric": nats / math.log(2),
                "test_loss": nats,
                "tokens_per_s": None,
                "peak_memory_bytes": None,
            }
        )
    table = format_table(rows, task.metric, device)
    cmd = " ".join(
        [
            "aftlab compare",
            f"--task {base.task}",
            f"--mixers {','.join(mixers)}",
            f"--steps {base.steps}",
        ]
    )
    atomic_write_text(
        out_dir / "results.json", dumps({"rows": rows, "config": base.to_dict()}, indent=2)
    )
    png = _plot_curves(out_dir, mixers)
    md = [
        f"# aftlab compare: {base.task}",
        "",
        f"Made with `{cmd}` (full config in results.json).",
        "",
        table,
        "",
    ]
    if png is not None:
        md += [f"![loss curves]({png.name})", ""]
    atomic_write_text(out_dir / "results.md", "\n".join(md))
    return table


def _plot_curves(out_dir: Path, mixers: list[str]) -> Path | None:
    try:
        from .plot import plot_loss_curves
    except ImportError:
        return None
    try:
        return plot_loss_curves(
            {m: out_dir / m / "metrics.jsonl" for m in mixers}, out_dir / "loss_curves.png"
        )
    except UsageError as e:
        print(f"aftlab compare: no loss_curves.png: {e}", file=sys.stderr)
        return None
