"""The subcommands of ``aftlab``: each ``add_*`` registers one, each ``cmd_*`` runs it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..train.errors import UsageError

#: Fields that may change when a run is resumed (they do not change what is learned).
RESUMABLE_CHANGES = (
    "steps",
    "eval_interval",
    "eval_batches",
    "eval_batch_size",
    "test_batches",
    "checkpoint_interval",
    "keep_last",
    "log_interval",
    "sample_tokens",
    "device",
    "compile",
    "out",
    "data",
)


def _config_args(p: argparse.ArgumentParser, *, out_help: str) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="TOML config file (see configs/ and docs/training.md)"
    )
    p.add_argument(
        "--task",
        help="task name: text (default), enwik8, text8, digits, digits-classify, "
        "cifar10, recall, ...",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="data file or folder of the task (text: any UTF-8 file or "
        "folder; default: the .py sources of Python's standard library)",
    )
    p.add_argument("--out", metavar="DIR", help=out_help)
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.d_model=256 --set lr=3e-4 "
        "(repeatable; VALUE is a TOML literal or a bare string)",
    )


def _shortcut_overrides(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            out.append(f"{name}={json.dumps(value)}")
    return out


# --------------------------------------------------------------------------- train


def add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model",
        description="Train a model with any mixer on a task. Without arguments: a small byte-level "
        "Transformer on the .py sources of Python's standard library (a few minutes on 2 CPU "
        "cores), "
        "then print the test bpc and a sample. Multi-process: torchrun --nproc_per_node=N -m "
        "aftlab train ...",
        epilog="example: aftlab train --mixer aft-local --set mixer_options.window=32 --steps "
        "200 --out runs/local",
    )
    _config_args(
        p,
        out_help="run folder (default runs/<task>-<mixer>-<date>-<time>); must not exist "
        "unless --resume",
    )
    p.add_argument(
        "--mixer",
        help="token mixer: attention, aft-full, aft-local, aft-simple, aft-conv, aft-decay",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its newest checkpoint"
    )
    p.set_defaults(func=cmd_train)


def _default_out(cfg) -> str:
    return os.path.join("runs", f"{cfg.task}-{cfg.mixer}-{time.strftime('%Y%m%d-%H%M%S')}")


def resolve_train_config(args: argparse.Namespace):
    """The config ``aftlab train`` runs: file, shortcuts, ``--set``.

    With ``--resume`` it is checked against the run's saved config (see ``RESUMABLE_CHANGES``).
    """
    from ..train.config import TrainConfig, apply_overrides, load_config

    overrides = _shortcut_overrides(args, ("task", "mixer", "data", "out", "steps")) + list(
        args.overrides
    )
    if not args.resume:
        return load_config(args.config, overrides)
    out = args.out
    if out is None and args.config is not None:
        out = load_config(args.config).out
    if out is None:
        raise UsageError("--resume needs the run folder: aftlab train --resume --out RUN_DIR")
    saved_path = Path(out) / "config.toml"
    if not saved_path.is_file():
        raise UsageError(
            f"nothing to resume in {out!r}: it has no config.toml (start it without --resume)"
        )
    saved = load_config(saved_path)
    if args.config is not None:
        cfg = load_config(args.config, overrides)
    else:
        cfg = TrainConfig.from_dict(apply_overrides(saved.to_dict(), overrides))
    old, new = saved.to_dict(), cfg.to_dict()
    for key in old:
        if key in RESUMABLE_CHANGES or old[key] == new[key]:
            continue
        if isinstance(old[key], dict):
            sub_keys = sorted(set(old[key]) | set(new[key]))
            diff = next(k for k in sub_keys if old[key].get(k) != new[key].get(k))
            key, was, now = f"{key}.{diff}", old[key].get(diff), new[key].get(diff)
        else:
            was, now = old[key], new[key]
        raise UsageError(
            f"the config does not match the run in {out!r}: {key} is {was!r} there but {now!r} "
            "here "
            "(drop that change to resume, or train into a new --out)"
        )
    return cfg.replace(out=str(out))


def cmd_train(args: argparse.Namespace) -> int:
    from ..train.trainer import Trainer

    cfg = resolve_train_config(args)
    if cfg.out is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("with torchrun, give the run folder explicitly: --out DIR")
        cfg = cfg.replace(out=_default_out(cfg))
    run_dir = Path(cfg.out)
    if not args.resume and run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UsageError(
            f"run folder {str(run_dir)!r} already exists; continue it with --resume, or choose "
            "another --out"
        )
    summary = Trainer(cfg, run_dir=run_dir, resume=args.resume).fit()
    return 130 if summary.get("interrupted") else 0


# --------------------------------------------------------------------------- eval, sample


def add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run on its validation or test split",
        description="Print the task's metric (bpc, bpb, bits/dim or accuracy) of a run's newest "
        "checkpoint.",
        epilog="example: aftlab eval runs/text-attention-20260101-120000 --split test",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by aftlab train")
    p.add_argument(
        "--split", choices=("val", "test"), default="test", help="split to evaluate (default test)"
    )
    p.add_argument(
        "--batches", type=int, metavar="N", help="evaluate only the first N batches (default: all)"
    )
    p.add_argument(
        "--batch-size", type=int, default=64, metavar="B", help="sequences per batch (default 64)"
    )
    p.add_argument(
        "--data", metavar="PATH", help="read the data from PATH instead of the run's data path"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from ..train.run import load_run
    from ..train.trainer import evaluate, resolve_device

    for name in ("batches", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    device = resolve_device(args.device)
    run = load_run(args.run_dir, device=device, data=args.data)
    res = evaluate(
        run.model,
        run.task,
        args.split,
        batch_size=args.batch_size,
        max_batches=args.batches,
        device=device,
        precision=run.config.precision,
    )
    metric = run.task.metric
    print(
        f"{args.split} {metric}: {res[metric]:.4f}  (loss {res['loss']:.4f} nats over "
        f"{res['targets']:,} "
        f"targets; step {run.step}, {run.config.mixer} on {run.config.task})"
    )
    return 0


def add_sample(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="stream text from a trained language model",
        description="Generate text token by token with the mixer's decoding state "
        "(KV cache for attention, the running sums for AFT).",
        epilog='example: aftlab sample RUN_DIR --prompt "def main(" --tokens 300 --top-k 20',
    )
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="a folder written by aftlab train on a text task"
    )
    p.add_argument("--prompt", help="text to continue (default: the start of the test split)")
    p.add_argument(
        "--tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="X",
        help="softmax temperature (default 0.8)",
    )
    p.add_argument(
        "--top-k", type=int, metavar="K", help="sample among the K most likely tokens (default all)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    from ..train.run import load_run
    from ..train.sampling import sample_text
    from ..train.trainer import resolve_device

    device = resolve_device(args.device)
    run = load_run(args.run_dir, device=device)
    if (
        run.task.kind != "lm"
        or getattr(run.task, "image_shape", None) is not None
        or not hasattr(run.task, "decode")
    ):
        raise UsageError(
            f"run {args.run_dir!r} was trained on {run.config.task!r}, not a text task; "
            "sample needs a language model (e.g. --task text)"
        )
    sample_text(
        run.model,
        run.task,
        prompt=args.prompt,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        out=sys.stdout,
    )
    return 0


# --------------------------------------------------------------------------- compare, plot


def add_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="train one model per mixer on equal budgets and tabulate",
        description="Train one model per mixer with the same size, data and budget, then write "
        "results.md (mixer, parameters, test metric, training tokens/s, peak memory; a "
        "unigram baseline "
        "for text tasks), results.json and loss_curves.png into the output folder, and print "
        "the table.",
        epilog="example: aftlab compare --task text --mixers attention,aft-local,aft-simple "
        "--steps 200",
    )
    _config_args(
        p,
        out_help="output folder (default runs/compare-<task>-<date>-<time>); an existing one "
        "is continued: finished models are kept, unfinished ones resumed",
    )
    p.add_argument(
        "--mixers", help="comma-separated mixers (default: attention and every AFT variant)"
    )
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from ..train.compare import DEFAULT_MIXERS, run_compare
    from ..train.config import load_config

    overrides = _shortcut_overrides(args, ("task", "data", "steps")) + list(args.overrides)
    base = load_config(args.config, overrides)
    mixers = [m.strip() for m in args.mixers.split(",")] if args.mixers else list(DEFAULT_MIXERS)
    if not all(mixers):
        raise UsageError(
            f"--mixers {args.mixers!r} has an empty name; expected e.g. attention,aft-local"
        )
    out = Path(
        args.out or os.path.join("runs", f"compare-{base.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    table = run_compare(base, mixers, out)
    print(table)
    return 0


def add_plot(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="draw loss curves and learned position biases / kernels of a run",
        description="Write loss.png (train and validation loss), and for AFT-full/local runs "
        "position_bias.png (the learned pairwise biases w, one heat map per layer), for AFT-conv "
        "conv_kernels.png. Needs matplotlib: pip install 'aftlab[plot]'.",
        epilog="example: aftlab plot runs/text-aft-full-20260101-120000",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by aftlab train")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default RUN_DIR/plots)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from ..train.plot import plot_run

    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)
    return 0


# --------------------------------------------------------------------------- bench


def add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="speed and memory benchmarks of the mixers (see docs/benchmarks.md)",
        description="Benchmarks of the mixers and models (aftlab.bench).",
    )
    try:
        from ..bench import cli as bench_cli
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_arguments(p)
    p.set_defaults(func=cmd_bench, _bench=bench_cli)


def cmd_bench(args: argparse.Namespace) -> int:
    if args._bench is None:
        raise UsageError(
            "the benchmarks are not available in this installation (aftlab.bench.cli is missing)"
        )
    return int(args._bench.run(args))
