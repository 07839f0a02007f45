"""``aftlab compare``: one model per mixer on equal budgets, over seeds and learning rates.

Each model is trained by a child process (``python -m aftlab train``) with the same config
except ``mixer``: the same data, model width/depth, context, batch and steps (the AFT paper's
Table 4 protocol). A child process per model gives each its own peak memory (CPU: peak RSS
above the RSS at the start of training; CUDA: ``max_memory_allocated``). Mixer options of the
base config are not passed on: each mixer runs with its defaults, or with the options of its
``--mixers`` entry (``aft-local:window=8``).

Fair comparisons (docs/results.md, "aftlab compare"):

* ``seeds=n``: every (mixer, rate) is trained with seeds ``seed, ..., seed + n - 1``; the
  table shows the mean and the sample standard deviation (``n - 1`` in the denominator) over
  them, and their minimum and maximum.
* ``lrs``: every mixer is trained at every rate (``min_lr`` scaled by ``lr / base lr``); the
  rate with the best mean **validation** metric over the seeds is chosen, and only the
  chosen rate's test metric is read and reported.
* ``equal_params``: each mixer's feed-forward width ``d_ff`` is set so that its parameter count
  is the one nearest attention's (at most half a ``d_ff`` unit, ``N (2 d + 1) / 2`` parameters
  with biases, away).
"""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import numpy as np
import torch

from .._checks import did_you_mean
from .._json import dumps
from .._system import format_bytes
from ..errors import READ_ERRORS, UsageError, reason
from ..mixers import available_mixers, get_mixer_class
from ..models.decoding import decoding_cost
from .build import build_model, build_task, model_config_for
from .checkpoint import atomic_write_text
from .config import TrainConfig, parse_override, to_toml
from .outcome import outcome_of, read_outcome
from .plot import plot_loss_curves, plot_throughput

__all__ = [
    "default_mixers",
    "MixerSpec",
    "parse_mixer_spec",
    "parse_lrs",
    "count_parameters",
    "match_parameters",
    "run_compare",
    "unigram_baseline",
    "format_table",
    "check_sample",
    "sample_best",
]

def default_mixers() -> list[str]:
    """The mixers compared by default: every registered one but the references kept to check a
    fast implementation (``SequenceMixer.reference``, e.g. ``attention-naive``), sorted."""
    return [name for name in available_mixers() if not get_mixer_class(name).reference]


@dataclass(frozen=True)
class MixerSpec:
    """One ``--mixers`` entry: ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``.

    Attributes:
        label: the entry as given (the table's row, the run folder's name).
        name: the registered mixer.
        options: its keyword options (VALUE is a TOML literal or a bare string).
    """

    label: str
    name: str
    options: dict[str, Any]


def parse_mixer_spec(spec: str) -> MixerSpec:
    """``"aft-local:window=8"`` -> ``MixerSpec("aft-local:window=8", "aft-local", {"window": 8})``.

    Raises:
        UsageError: an empty name, or an option without ``=``.
    """
    name, *parts = (t.strip() for t in spec.split(":"))
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, _ = part.partition("=")
        if not name or not sep or not key.strip() or "." in key:
            raise UsageError(
                f"--mixers entry {spec!r}: expected NAME or NAME:KEY=VALUE[:KEY=VALUE], "
                "e.g. aft-local:window=8"
            )
        options[key.strip()] = parse_override(part)[1]
    if not name:
        raise UsageError(f"--mixers entry {spec!r} has an empty name; expected e.g. aft-local")
    return MixerSpec(spec.strip(), name, options)


def parse_lrs(text: str) -> list[float]:
    """``"1e-3,3e-3"`` -> ``[0.001, 0.003]``: distinct positive finite rates.

    Raises:
        UsageError: an entry that is not a positive finite number, or a repeated rate.
    """
    rates = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise UsageError(
                f"--lrs {text!r}: {item.strip()!r} is not a positive finite number; "
                "expected comma-separated rates, e.g. 1e-3,3e-3"
            )
        rates.append(value)
    if len(set(rates)) != len(rates):
        raise UsageError(f"--lrs {text!r} repeats a rate; give each rate once")
    return rates


def count_parameters(config: TrainConfig, task: Any) -> int:
    """Parameters of the model ``config`` trains on ``task`` (built on the meta device: no memory).

    Counted as the trainer counts them (a tied head once).

    Raises:
        UsageError: the mixer rejects its options.
    """
    with torch.device("meta"):
        model = build_model(model_config_for(config, task), task.info())
    return sum(p.numel() for p in model.parameters())


def match_parameters(config: TrainConfig, task: Any, target: int) -> tuple[TrainConfig, int]:
    """``config`` with the ``d_ff`` whose parameter count is nearest ``target``, and that count.

    The count is affine in ``d_ff`` (each hidden unit adds a row of ``W_1``, a column of ``W_2``
    and a bias of ``b_1`` per block: ``step = N (2 d + 1)`` with biases), so
    ``d_ff = d_ff_0 + round((target - P(d_ff_0)) / step)`` lands within ``step / 2`` of it.

    Raises:
        UsageError: even ``d_ff = 1`` has more parameters than ``target``.
    """

    def with_d_ff(d_ff: int) -> TrainConfig:
        return config.replace(model={"d_ff": d_ff})

    d_ff0 = max(model_config_for(config, task).resolved_d_ff, 1)  # affine from 1 (0: no FF)
    p0 = count_parameters(with_d_ff(d_ff0), task)
    step = count_parameters(with_d_ff(d_ff0 + 1), task) - p0
    d_ff = d_ff0 + round((target - p0) / step)
    if d_ff < 1:
        raise UsageError(
            f"--equal-params: {config.mixer} has {p0:,} parameters at d_ff={d_ff0}, attention "
            f"{target:,}; no d_ff >= 1 matches (make the model wider, or leave out "
            "--equal-params)"
        )
    return with_d_ff(d_ff), count_parameters(with_d_ff(d_ff), task)


def spread(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (``n - 1``; None for one value), min, max, the values."""
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if a.size > 1 else None,
        "min": float(a.min()),
        "max": float(a.max()),
        "values": [float(v) for v in a],
    }


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


def _fmt_value(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def format_table(
    rows: list[dict[str, Any]], metric: str, device: str, *, seeds: int = 1, d_ff: bool = False
) -> str:
    """The Markdown table of :func:`run_compare` rows.

    Columns: mixer, parameters, (``d_ff`` with ``d_ff=True``), the chosen learning rate, the
    validation and test metric (``mean ± sample std`` when ``seeds > 1``, then the test
    metric's min-max), training tokens/s, peak memory.
    """
    head = ["mixer", "parameters", *(["d_ff"] if d_ff else []), "lr", f"val {metric}"]
    head += [f"test {metric}", *([f"test {metric} min–max"] if seeds > 1 else [])]
    head += ["train tokens/s", f"peak memory ({device})"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        baseline = r["mixer"].startswith("(")
        speed = r.get("tokens_per_s")
        cells = [r["mixer"], f"{r['parameters']:,}"]
        if d_ff:
            cells.append("" if r.get("d_ff") is None else str(r["d_ff"]))
        cells.append("" if r.get("lr") is None else f"{r['lr']:g}")
        cells.append("" if baseline else _fmt_value(r.get("val_metric"), r.get("val_metric_std")))
        cells.append(_fmt_value(r.get("test_metric"), r.get("test_metric_std")))
        if seeds > 1:
            lo, hi = r.get("test_metric_min"), r.get("test_metric_max")
            cells.append("" if baseline or lo is None else f"{lo:.4f}–{hi:.4f}")
        cells.append("" if speed is None else f"{speed:,.0f}")
        peak = r.get("peak_memory_bytes")
        cells.append("" if baseline else "n/a" if peak is None else format_bytes(peak))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_CSV_FIELDS = (
    "mixer",
    "parameters",
    "d_ff",
    "lr",
    "val_metric",
    "val_metric_std",
    "test_metric",
    "test_metric_std",
    "test_metric_min",
    "test_metric_max",
    "test_loss",
    "tokens_per_s",
    "peak_memory_bytes",
)


def format_csv(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV (the columns of ``_CSV_FIELDS``; empty where a row has no value)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if r.get(k) is None else r[k] for k in _CSV_FIELDS})
    return buf.getvalue()


def _read_json(path: Path) -> Any:
    """A JSON file an earlier compare wrote; a damaged one is a one-line error naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except READ_ERRORS as e:
        raise UsageError(
            f"{str(path)!r} is unreadable ({reason(e)}); delete it and rerun the same compare "
            "command to compute it again"
        ) from None
_FAILED = {
    "crashed": "crashed",
    "out_of_memory": "ran out of memory",
    "disk_full": "ran out of disk space",
    "usage_error": "stopped with an error",
}


def _train_one(config: TrainConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train ``config`` into ``run_dir`` in a child process; its summary, None if it diverged.

    A finished run (``summary.json``) is read back, a diverged one (``compare-diverged.json``)
    skipped, an interrupted or failed one resumed. The child's outcome is its exit status and
    its ``--outcome`` record (:mod:`aftlab.train.outcome`); only a divergence is recorded.

    Raises:
        UsageError: the run crashed, ran out of memory or disk space, or stopped with an error:
            one line with its cause.
        KeyboardInterrupt: the run, or this process, was interrupted.
    """
    summary_path, diverged_path = run_dir / "summary.json", run_dir / "compare-diverged.json"
    if summary_path.is_file():  # finished in an earlier invocation
        return _read_json(summary_path)
    if (read_outcome(diverged_path) or {}).get("outcome") == "diverged":
        return None
    cfg_path = run_dir.parent / f"{run_dir.name}.toml"
    record_path = run_dir.parent / f"{run_dir.name}.outcome.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cfg_path, to_toml(config.replace(out=str(run_dir))))
    record_path.unlink(missing_ok=True)  # a record of an earlier attempt
    cmd = [sys.executable, "-m", "aftlab", "train", "--config", str(cfg_path)]
    cmd += ["--outcome", str(record_path)]
    if (run_dir / "config.toml").is_file():
        cmd.append("--resume")
    what = f"{config.model_label} (lr {config.lr:g}, seed {config.seed})"
    print(f"aftlab compare: training {what} -> {run_dir}", file=sys.stderr, flush=True)
    status, stopped = _run_child(cmd)
    outcome, cause = outcome_of(status, read_outcome(record_path))
    if outcome == "completed" and not summary_path.is_file():
        outcome, cause = "crashed", f"it ended with status 0 but wrote no {summary_path}"
    if outcome == "diverged":
        atomic_write_text(
            diverged_path,
            dumps({"outcome": "diverged", "lr": config.lr, "seed": config.seed, "error": cause}),
        )
    if stopped or outcome == "interrupted":
        print(
            f"aftlab compare: interrupted while training {what}"
            f"{f' ({cause})' if cause else ''}; rerun the same compare command to continue "
            f"(finished runs are kept, an unfinished one resumes from its newest checkpoint in "
            f"{run_dir})",
            file=sys.stderr,
            flush=True,
        )
        raise KeyboardInterrupt
    if outcome in _FAILED:
        raise UsageError(
            f"training {what} {_FAILED[outcome]}: {cause or status} (output above, record "
            f"{record_path}); not a divergence: once fixed, rerun the same compare command to "
            "retry it (finished runs are kept)"
        )
    if outcome == "diverged":
        return None
    return _read_json(summary_path)


def _run_child(cmd: list[str]) -> tuple[int, bool]:
    """Run ``cmd``, its stdout passed on to stderr: its exit status, and whether Ctrl-C came.

    Ctrl-C reaches the child too (one process group), which saves a checkpoint and exits
    (a second Ctrl-C aborts it at once); this process waits for it rather than killing it.
    """
    stopped = False
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        while True:
            try:
                for line in proc.stdout:
                    sys.stderr.write(line)
                proc.wait()
                break
            except KeyboardInterrupt:
                stopped = True
    sys.stderr.flush()
    return proc.returncode, stopped


def _val_metric(summary: dict[str, Any], config: TrainConfig, run_dir: Path, metric: str) -> Any:
    """A finished run's validation ``metric``: its summary's ``val_<metric>``, or for a summary
    without one (aftlab 0.1.0) :func:`_validate`'s."""
    key = f"val_{metric}"
    return summary[key] if key in summary else _validate(config, run_dir)[metric]


def _validate(config: TrainConfig, run_dir: Path) -> dict[str, float]:
    """Validation loss and metric of a finished run's final checkpoint (cached in ``val.json``).

    The first ``eval_batches`` batches of the validation split, as the trainer's final
    evaluation reads them (``summary.json``'s ``val_<metric>``); never the test split.
    """
    path = run_dir / "val.json"
    if path.is_file():
        return _read_json(path)
    from .run import load_run
    from .trainer import evaluate, resolve_device

    device = resolve_device(config.device)
    run = load_run(run_dir, device=device)
    res = evaluate(
        run.model,
        run.task,
        "val",
        batch_size=config.eval_batch_size or config.batch_size,
        max_batches=config.eval_batches,
        device=device,
        precision=config.precision,
    )
    atomic_write_text(path, dumps(res))
    return res


def _folder(label: str) -> str:
    return label.replace(":", "_").replace("/", "_")


@dataclass(frozen=True)
class _Plan:
    """What a compare trains: ``configs``, one per ``--mixers`` entry (by label, before its rate
    and seed), at every rate of ``lrs`` and seed of ``seeds``; ``target`` is attention's
    parameter count with ``--equal-params``, else None."""

    base: TrainConfig
    specs: list[MixerSpec]
    configs: dict[str, TrainConfig]
    task: Any
    lrs: list[float]
    seeds: list[int]
    out_dir: Path
    target: int | None
    decode_positions: list[int]

    @property
    def higher_better(self) -> bool:
        return self.task.metric == "accuracy"

    def run(self, label: str, lr: float, seed: int) -> tuple[TrainConfig, Path]:
        """The config and run folder of entry ``label`` at rate ``lr`` and ``seed``."""
        base, folder = self.base, self.out_dir / _folder(label)
        single = len(self.lrs) == 1 and len(self.seeds) == 1
        run_dir = folder if single else folder / f"lr{lr:g}-seed{seed}"
        min_lr = base.min_lr if lr == base.lr else base.min_lr * (lr / base.lr)
        cfg = self.configs[label].replace(lr=lr, min_lr=min_lr, seed=seed, out=str(run_dir))
        return cfg, run_dir


class _Run(NamedTuple):
    """A finished run: its summary, validation metric and folder."""

    summary: dict[str, Any]
    val: Any
    run_dir: Path


def _parse_mixers(mixers: list[str]) -> list[MixerSpec]:
    """The ``--mixers`` entries; an unknown mixer or a repeated entry is a :class:`UsageError`."""
    specs = [parse_mixer_spec(m) for m in mixers]
    names = available_mixers()
    unknown = [sp.name for sp in specs if sp.name not in names]
    if unknown:
        raise UsageError(
            f"unknown mixer {unknown[0]!r} in --mixers; {did_you_mean(unknown[0], names)}"
            f"known mixers: {', '.join(names)}"
        )
    labels = [sp.label for sp in specs]
    if len(set(map(_folder, labels))) != len(labels):
        raise UsageError(f"--mixers {','.join(labels)} names a mixer twice")
    return specs


def _entry_config(base: TrainConfig, spec: MixerSpec) -> TrainConfig:
    """The config of one ``--mixers`` entry: ``base`` with its mixer and options. The option
    ``architecture`` (``rwkv4:architecture=rwkv4``) trains that model instead of a
    Transformer (``model.architecture``), with the ``[model]`` sizes the two share
    (``d_model``, ``n_layers``, ``d_ff``, ``layer_norm_eps``) and its own defaults for the rest.
    """
    options = dict(spec.options)
    arch = options.pop("architecture", base.architecture)
    if arch == base.architecture:
        return base.replace(mixer=spec.name, mixer_options=options, sample_tokens=0)
    shared = ("d_model", "n_layers", "d_ff", "layer_norm_eps")
    model = {k: v for k, v in base.model.items() if k in shared}
    try:
        return base.replace(
            model={**model, "architecture": arch},
            mixer=spec.name,
            mixer_options=options,
            sample_tokens=0,
        )
    except UsageError as e:
        raise UsageError(
            f"--mixers entry {spec.label!r}: {str(e).removeprefix('config: ')}"
        ) from None


def _plan(
    base: TrainConfig,
    mixers: list[str],
    out_dir: str | Path,
    *,
    seeds: int,
    lrs: list[float] | None,
    equal_params: bool,
    sample: int,
    decode_positions: list[int] | None,
) -> _Plan:
    """Check every option and build every model (on the meta device) before any training."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise UsageError(f"--seeds must be a positive integer, got {seeds!r}")
    lrs = list(lrs) if lrs else [base.lr]
    specs = _parse_mixers(mixers)
    task = build_task(base)  # fails early on bad data, before any training
    check_sample(sample, task)
    positions = check_decode_positions(decode_positions, task)
    configs = {}
    target = None
    if equal_params:
        target = count_parameters(base.replace(mixer="attention", mixer_options={}), task)
    for sp in specs:
        cfg = _entry_config(base, sp)
        if equal_params:
            cfg, _ = match_parameters(cfg, task, target)
        else:
            count_parameters(cfg, task)
        configs[sp.label] = cfg
    seed_list = [base.seed + i for i in range(seeds)]
    return _Plan(base, specs, configs, task, lrs, seed_list, Path(out_dir), target, positions)


def _train_rates(plan: _Plan, label: str) -> dict[float, list[_Run] | None]:
    """Train entry ``label`` at every rate and seed: each rate's runs, None where one diverged."""
    runs: dict[float, list[_Run] | None] = {}
    for lr in plan.lrs:
        done: list[_Run] | None = []
        for seed in plan.seeds:
            cfg, run_dir = plan.run(label, lr, seed)
            summary = _train_one(cfg, run_dir)
            if summary is None:
                done = None  # a diverged seed: this rate is out
                continue
            if done is not None:
                val = _val_metric(summary, cfg, run_dir, plan.task.metric)
                done.append(_Run(summary, val, run_dir))
        runs[lr] = done
    return runs


def _train_and_select(plan: _Plan, spec: MixerSpec) -> tuple[dict[str, Any], Path]:
    """Train ``spec`` at every rate, choose the rate on validation: its row and first run folder.

    Raises:
        UsageError: it diverged at every rate.
    """
    runs = _train_rates(plan, spec.label)
    val_by_lr = {
        lr: (None if r is None else spread([run.val for run in r])["mean"])
        for lr, r in runs.items()
    }
    # a rate whose seeds diverged, or whose validation metric is not finite, is not chosen
    scored = [lr for lr in plan.lrs if val_by_lr[lr] is not None and math.isfinite(val_by_lr[lr])]
    if not scored:
        raise UsageError(
            f"{spec.label} diverged at every learning rate {plan.lrs}; try lower --lrs "
            f"(runs in {plan.out_dir / _folder(spec.label)})"
        )
    sign = -1.0 if plan.higher_better else 1.0
    best = min(scored, key=lambda lr: sign * val_by_lr[lr])  # first of equals
    chosen = runs[best]
    summaries = [run.summary for run in chosen]
    test = spread([s[f"test_{s['metric']}"] for s in summaries])
    val = spread([run.val for run in chosen])
    row = {
        "mixer": spec.label,
        "parameters": summaries[0]["parameters"],
        "d_ff": model_config_for(plan.configs[spec.label], plan.task).resolved_d_ff,
        "lr": best,
        "seeds": plan.seeds,
        "val_by_lr": {f"{lr:g}": v for lr, v in val_by_lr.items()},
        "val_metric": val["mean"],
        "val_metric_std": val["std"],
        "test_metric": test["mean"],
        "test_metric_std": test["std"],
        "test_metric_min": test["min"],
        "test_metric_max": test["max"],
        "test_metric_values": test["values"],
        "test_loss": spread([s["test_loss"] for s in summaries])["mean"],
        "tokens_per_s": spread([s.get("train_tokens_per_s") or 0.0 for s in summaries])["mean"],
        "peak_memory_bytes": max(
            (s.get("peak_memory_bytes") or 0 for s in summaries), default=None
        ),
        "device": summaries[0].get("device"),
    }
    return row, chosen[0].run_dir


def _baseline_rows(plan: _Plan) -> list[dict[str, Any]]:
    """The unigram baseline's row on a bits task (:func:`unigram_baseline`), else none."""
    task, base = plan.task, plan.base
    if task.metric not in ("bpc", "bpb"):
        return []
    nats = unigram_baseline(
        task,
        train_batches=min(base.steps, 200),
        batch_size=base.batch_size,
        test_batches=base.test_batches or None,
    )
    return [
        {
            "mixer": "(unigram baseline)",
            "parameters": task.vocab_size - 1,
            "test_metric": nats / math.log(2),
            "test_loss": nats,
            "tokens_per_s": None,
            "peak_memory_bytes": None,
        }
    ]


def _notes(plan: _Plan) -> str:
    """The paragraph above the table: the command, and how rates, seeds and sizes were set."""
    base, lrs, seeds, metric = plan.base, plan.lrs, plan.seeds, plan.task.metric
    labels = [sp.label for sp in plan.specs]
    cmd = ["aftlab compare", f"--task {base.task}", f"--mixers {','.join(labels)}"]
    cmd.append(f"--steps {base.steps}")
    if len(seeds) > 1:
        cmd.append(f"--seeds {len(seeds)}")
    if len(lrs) > 1:
        cmd.append(f"--lrs {','.join(f'{lr:g}' for lr in lrs)}")
    if plan.target is not None:
        cmd.append("--equal-params")
    notes = [f"Made with `{' '.join(cmd)}` (full config in results.json)."]
    if len(lrs) > 1:
        notes.append(
            f"Each mixer was trained at every rate of {', '.join(f'{lr:g}' for lr in lrs)}; "
            f"`lr` is the one with the best mean validation {metric}, and the test "
            f"{metric} is that rate's only."
        )
    if len(seeds) > 1:
        notes.append(
            f"Mean ± sample standard deviation (n − 1 in the denominator) over the {len(seeds)} "
            f"seeds {', '.join(map(str, seeds))}; min–max beside it."
        )
    if plan.target is not None:
        notes.append(
            f"Equal parameters: each mixer's `d_ff` is the one whose count is nearest "
            f"attention's ({plan.target:,}), within half a `d_ff` unit."
        )
    return " ".join(notes)


def _write_results(plan: _Plan, rows: list[dict[str, Any]], run_dirs: dict[str, Path]) -> str:
    """Write ``results.json``, ``results.csv``, the plots and ``results.md``; return what is
    printed: the table, the line on its regime and (``decode_positions``) the decoding table."""
    out_dir, metric, equal_params = plan.out_dir, plan.task.metric, plan.target is not None
    device = rows[0]["device"] if rows else "cpu"
    rows = rows + _baseline_rows(plan)
    table = format_table(rows, metric, device, seeds=len(plan.seeds), d_ff=equal_params)
    options = {
        "seeds": len(plan.seeds),
        "lrs": plan.lrs,
        "equal_params": equal_params,
        "reference": plan.target,
        "decode_positions": plan.decode_positions,
    }
    best = _best_model(rows, run_dirs, metric, plan.higher_better)
    results = {"rows": rows, "best": best, "options": options, "config": plan.base.to_dict()}
    atomic_write_text(out_dir / "results.json", dumps(results, indent=2))
    atomic_write_text(out_dir / "results.csv", format_csv(rows))
    curves = {label: run_dir / "metrics.jsonl" for label, run_dir in run_dirs.items()}
    png = _plot(plot_loss_curves, curves, out_dir / "loss_curves.png")
    speed_png = _plot(plot_throughput, rows, out_dir / "throughput.png", device=device)
    figures = [f"![loss curves]({png.name})", ""] if png is not None else []
    if speed_png is not None:
        figures += [f"![tokens/s and peak memory]({speed_png.name})", ""]
    text = [table, "", _regime(plan)]
    head = [f"# aftlab compare: {plan.base.task}", "", _notes(plan), ""]
    atomic_write_text(out_dir / "results.md", "\n".join([*head, *text, "", *figures]))
    if plan.decode_positions:  # after the results are written: a failure here loses none
        results["decoding"] = decoding = _decoding_rows(plan)
        text += ["", format_decoding_table(decoding)]
        atomic_write_text(out_dir / "results.json", dumps(results, indent=2))
        atomic_write_text(out_dir / "results.md", "\n".join([*head, *text, "", *figures]))
    return "\n".join(text)


def run_compare(
    base: TrainConfig,
    mixers: list[str],
    out_dir: str | Path,
    *,
    seeds: int = 1,
    lrs: list[float] | None = None,
    equal_params: bool = False,
    sample: int = 0,
    decode_positions: list[int] | None = None,
    dry_run: bool = False,
) -> str:
    """Train every mixer of ``mixers`` with ``base`` and write the comparison into ``out_dir``.

    Three stages: plan (check every option, build every model on the meta device), train and
    select (per entry, every rate and seed; the rate with the best mean validation metric,
    read from each run's ``summary.json``), write the results.

    Args:
        base: the shared config (its ``mixer`` and ``mixer_options`` are replaced).
        mixers: ``--mixers`` entries, ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE]``.
        out_dir: the output folder: ``<mixer>/`` per mixer, ``<mixer>/lr<lr>-seed<s>/`` per run
            when there are several rates or seeds.
        seeds: ``n >= 1``: seeds ``base.seed .. base.seed + n - 1`` for every (mixer, rate).
        lrs: the learning rates tried (default ``[base.lr]``); ``min_lr`` is scaled alike.
        equal_params: set each mixer's ``d_ff`` to match attention's parameter count
            (:func:`match_parameters`).
        sample: tokens the caller samples afterwards with :func:`sample_best`; checked here
            (:func:`check_sample`), before any training.
        decode_positions: after training, measure every entry decoding one sequence at these
            positions (:func:`~aftlab.models.decoding.decoding_cost`: ms per token and the state's
            bytes, on a same-shaped model with random weights), tabulated below the table and
            kept in ``results.json``'s ``decoding``; a language-model task only.
        dry_run: stop after the plan (every check made before the first run: the options, the
            data, every model on the meta device); nothing is trained or written
            (``aftlab compare --dry-run``).

    Writes ``results.md`` (the table, with the command), ``results.json`` (every row, with the
    validation metric at every rate, and the config), ``results.csv`` and, when matplotlib is
    installed, ``loss_curves.png`` (the chosen rate's first seed) and ``throughput.png``
    (:func:`~aftlab.train.plot.plot_throughput`). ``results.json``'s ``best`` names the
    model with the best test metric (its run folder, metric and value). An existing ``out_dir`` is
    continued: finished runs are read back, interrupted ones resumed. A run that diverges
    (``aftlab train`` exit status 3) removes its rate from the choice and is recorded; any
    other failure stops the comparison (:func:`_train_one`: the child's ``RUN.outcome.json``
    says why) and is never cached: a rerun retries it.

    Returns:
        The Markdown table, the line on its regime (budget and context) and the decoding table;
        with ``dry_run``, one line saying what would be trained.

    Raises:
        UsageError: an unknown mixer or bad entry, ``seeds < 1``, a bad rate, a bad ``sample``,
            a mixer that diverged at every rate, a failed run (its cause).
        KeyboardInterrupt: a run, or this process, was interrupted.
    """
    plan = _plan(
        base,
        mixers,
        out_dir,
        seeds=seeds,
        lrs=lrs,
        equal_params=equal_params,
        sample=sample,
        decode_positions=decode_positions,
    )
    if dry_run:
        runs = len(plan.specs) * len(plan.lrs) * len(plan.seeds)
        return (
            f"aftlab compare: would train {', '.join(plan.configs)} at lr "
            f"{', '.join(f'{lr:g}' for lr in plan.lrs)} with {len(plan.seeds)} seed(s): {runs} "
            f"run(s) of {base.steps} steps on {base.task}, into {plan.out_dir}"
        )
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    rows, run_dirs = [], {}
    for sp in plan.specs:
        row, run_dirs[sp.label] = _train_and_select(plan, sp)
        rows.append(row)
    return _write_results(plan, rows, run_dirs)


def _best_model(
    rows: list[dict[str, Any]], run_dirs: dict[str, Path], metric: str, higher_better: bool
) -> dict[str, Any] | None:
    """The trained model with the best finite mean test metric (the first of equals), or None.

    Its ``run_dir`` is the chosen rate's first seed.
    """
    sign = -1.0 if higher_better else 1.0
    scored = [r for r in rows if r["mixer"] in run_dirs and math.isfinite(r["test_metric"])]
    if not scored:
        return None
    r = min(scored, key=lambda r: sign * r["test_metric"])
    return {
        "mixer": r["mixer"],
        "run_dir": str(run_dirs[r["mixer"]]),
        "metric": metric,
        "test_metric": r["test_metric"],
        "device": r.get("device"),
    }


def check_sample(tokens: int, task: Any) -> None:
    """``--sample N``: ``N >= 0`` tokens (0: no sample), ``N > 0`` only on a text task.

    Raises:
        UsageError: ``N`` is not an integer ``>= 0``, or the task has no text to sample.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise UsageError(f"--sample must be an integer >= 0 (0: no sample), got {tokens!r}")
    if tokens and not (task.kind == "lm" and hasattr(task, "decode")):
        raise UsageError(
            f"--sample needs a text task (text, enwik8, text8), got {task.name!r}, which has no "
            "text to sample; leave out --sample"
        )


def check_decode_positions(positions: list[int] | None, task: Any) -> list[int]:
    """``--decode-positions``: positions ``>= 1``, each once, on a causal language-model task.

    Raises:
        UsageError: a position that is not an integer ``>= 1``, a repeated one, or a task whose
            models do not decode (a classifier).
    """
    positions = list(positions or [])
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise UsageError(f"--decode-positions must be integers >= 1, got {p!r}")
    if len(set(positions)) != len(positions):
        raise UsageError(f"--decode-positions {positions} repeats a position; give each once")
    if positions and task.kind != "lm":
        raise UsageError(
            f"--decode-positions needs a causal language-model task, got {task.name!r} "
            f"(kind {task.kind!r}), whose models do not decode; leave out --decode-positions"
        )
    return sorted(positions)


def _regime(plan: _Plan) -> str:
    """One line: the budget and context the quality table ranks the models at, and what it is
    not."""
    b = plan.base
    tokens = b.steps * b.batch_size * b.seq_len
    seeds = f"{len(plan.seeds)} seed{'s' if len(plan.seeds) > 1 else ''}"
    return (
        f"The table ranks the models after {b.steps} steps of {b.batch_size} x {b.seq_len} = "
        f"{tokens:,} training tokens at context {b.seq_len} ({seeds}): what they learn at this "
        "budget and context, not how they rank converged or at longer contexts "
        '(docs/results.md, "Budget scaling").'
    )


def _decoding_rows(plan: _Plan, steps: int = 16, warmup: int = 4) -> list[dict[str, Any]]:
    """:func:`~aftlab.models.decoding.decoding_cost` of every entry at every decode position:
    its model's shape, random weights, ``max_seq_len`` raised to reach the last position."""
    reach = max(plan.decode_positions) + warmup + steps
    rows = []
    for label, cfg in plan.configs.items():
        mc = model_config_for(cfg, plan.task)
        torch.manual_seed(cfg.seed)
        model = build_model(replace(mc, max_seq_len=reach), plan.task.info())
        for p in plan.decode_positions:
            row = decoding_cost(model, p, steps=steps, warmup=warmup, seed=cfg.seed)
            rows.append({"mixer": label, **row, "threads": torch.get_num_threads()})
        del model
    return rows


def format_decoding_table(rows: list[dict[str, Any]]) -> str:
    """The :func:`~aftlab.models.decoding.decoding_cost` rows (each with its ``mixer``) as a
    Markdown table, a row per mixer: the state and the ms per token at each position, under a
    line saying what was measured."""
    positions = sorted({r["position"] for r in rows})
    by = {(r["mixer"], r["position"]): r for r in rows}
    head = ["mixer"]
    head += [f"state at {p:,}" for p in positions]
    head += [f"ms/token at {p:,}" for p in positions]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (2 * len(positions))]
    for m in dict.fromkeys(r["mixer"] for r in rows):
        cells = [m]
        cells += [format_bytes(by[m, p]["state_bytes"]) if (m, p) in by else "" for p in positions]
        cells += [f"{by[m, p]['ms_per_token']:.2f}" if (m, p) in by else "" for p in positions]
        lines.append("| " + " | ".join(cells) + " |")
    threads = rows[0]["threads"] if rows else torch.get_num_threads()
    title = (
        "Decoding one sequence on this machine (same-shaped models, random weights, "
        f"{threads} threads): the state a model keeps per sequence and ms per token at each "
        "position."
    )
    return "\n".join([title, "", *lines])


def sample_best(
    out_dir: str | Path, tokens: int, *, out: TextIO, temperature: float = 0.8, seed: int = 0
) -> str:
    """Write one header line naming the best model of a finished compare, then a sample from it.

    The model is ``results.json``'s ``best`` (the best mean test metric); the sample is
    ``tokens`` tokens (bytes, on the byte-level text tasks) after the first 16 of the test
    split, as ``aftlab sample RUN_DIR --tokens N`` writes them.

    Returns:
        The best model's ``--mixers`` entry.

    Raises:
        UsageError: no model with a finite test metric, or a run that cannot be loaded.
    """
    from .run import load_run
    from .sampling import sample_text
    from .trainer import resolve_device

    results = _read_json(Path(out_dir) / "results.json")
    best = results.get("best")
    if best is None:
        raise UsageError(f"no model in {str(out_dir)!r} has a finite test metric to sample from")
    run = load_run(best["run_dir"], device=resolve_device(best.get("device") or "cpu"))
    print(
        f"--- sample from {best['mixer']} (best test {best['metric']} "
        f"{best['test_metric']:.4f}): {tokens} bytes after a prompt from the test split ---",
        file=out,
        flush=True,
    )
    sample_text(
        run.model, run.task, prompt=None, tokens=tokens, temperature=temperature, seed=seed, out=out
    )
    return best["mixer"]


def _plot(plot: Callable[..., Path], data: Any, out_png: Path, **kw) -> Path | None:
    """``plot(data, out_png, **kw)``, or None with a line on stderr when it cannot plot."""
    try:
        return plot(data, out_png, **kw)
    except UsageError as e:
        print(f"aftlab compare: no {out_png.name}: {e}", file=sys.stderr)
        return None
