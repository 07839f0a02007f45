"""The subcommands of ``aftlab``: each ``add_*`` registers one, each ``cmd_*`` runs it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from ..data.base import check_input_path
from ..errors import UsageError
from ..train.outcome import EXIT_STATUS, reports_outcome, write_outcome


def _config_args(p: argparse.ArgumentParser, *, out_help: str) -> None:
    from ..data import available_tasks

    p.add_argument(
        "--config", metavar="FILE", help="TOML config file (see configs/ and docs/training.md)"
    )
    p.add_argument("--task", help=f"task name: {', '.join(available_tasks())} (default text)")
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


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, object]:
    """The config fields given by the flags ``names`` (``--mixer``, ``--steps``, ...), as given."""
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return {name: check_text(value, f"--{name}") for name, value in given.items()}


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set KEY=VALUE`` strings."""
    return [check_text(o, "--set") for o in args.overrides]


def add_command(
    sub, name: str, func, *, help: str, description: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """Register subcommand ``name``, run by ``func(args) -> exit status``; return its parser."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog)
    p.set_defaults(func=func)
    return p


# --------------------------------------------------------------------------- argument checks
# One check per kind of argument, shared by every command (bad input: one line, exit 2).


def check_text(value: object, arg: str) -> object:
    """``value`` unless it is a string that is not UTF-8 text, which ``arg`` gets as surrogates.

    Python hands command-line bytes that are not UTF-8 over as lone surrogates
    (``'\\udcff'``); no text file (config.toml) and no byte-level prompt can hold them.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise UsageError(
                f"{arg} is not valid UTF-8 (undecodable byte at character {err.start}); give "
                "UTF-8 text"
            ) from None
    return value


def check_config_file(path: str | None) -> None:
    """``--config FILE`` must be a regular file of UTF-8 text (a pipe is refused unopened)."""
    if path is None:
        return
    p = check_input_path(path, what="config file", arg="--config", error=UsageError)
    try:
        p.read_bytes().decode("utf-8")
    except OSError as err:
        raise UsageError(
            f"cannot read config file {path!r} ({err.strerror}); check --config"
        ) from None
    except UnicodeDecodeError as err:
        raise UsageError(
            f"config file {path!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
            f"offset {err.start}); save it as UTF-8 or check --config"
        ) from None


def check_out_dir(path: str | os.PathLike, *, arg: str = "--out") -> Path:
    """``path`` as a folder that exists or can be created; creates nothing.

    Refuses a broken symbolic link, a file, a path below a file, and a place where this process
    cannot create a folder (tried with a temporary folder, removed at once).
    """
    p = Path(path)
    try:
        if p.is_symlink() and not p.exists():
            raise UsageError(
                f"{arg} {str(p)!r} is a symbolic link to {os.readlink(p)!r}, which does not "
                f"exist; remove the link or choose another {arg}"
            )
        if p.exists():
            if not p.is_dir():
                raise UsageError(f"{arg} {str(p)!r} is a file, not a folder; choose another {arg}")
            if not os.access(p, os.W_OK | os.X_OK):
                raise UsageError(f"{arg} {str(p)!r} is not writable; choose another {arg}")
            return p
        base = next(a for a in p.absolute().parents if os.path.lexists(a))
        if not base.is_dir():
            raise UsageError(
                f"{arg} {str(p)!r} lies under {str(base)!r}, which is not a folder; choose "
                f"another {arg}"
            )
        os.rmdir(tempfile.mkdtemp(prefix=".aftlab-probe-", dir=base))
    except OSError as err:
        raise UsageError(
            f"{arg} {str(p)!r} cannot be created ({err.strerror}); choose a writable {arg}"
        ) from None
    return p


def check_device(name: str, *, arg: str = "--device"):
    """The ``torch.device`` of ``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, one this
    machine has (:func:`~aftlab.train.trainer.resolve_device`)."""
    from ..train.trainer import resolve_device

    if not (name in ("auto", "cpu", "cuda") or (name[:5] == "cuda:" and name[5:].isdigit())):
        raise UsageError(f"{arg} must be auto, cpu, cuda or cuda:N, got {name!r}")
    return resolve_device(name, arg=arg)


def check_finite_weights(run) -> None:
    """A loaded run whose weights hold NaN or inf (a diverged run) is refused."""
    import torch

    for name, param in run.model.named_parameters():
        if not torch.isfinite(param).all():
            raise UsageError(
                f"the weights in {str(run.checkpoint)!r} are not finite (NaN or inf in {name}): "
                "the run diverged; train again, e.g. with a smaller lr"
            )


# --------------------------------------------------------------------------- train


def add_train(sub) -> None:
    p = add_command(
        sub,
        "train",
        cmd_train,
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
    from ..mixers import available_mixers

    p.add_argument(
        "--mixer", help=f"token mixer: {', '.join(available_mixers())} (default attention)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its newest checkpoint"
    )
    p.add_argument(
        "--log",
        choices=("jsonl", "tensorboard"),
        help="jsonl (default): metrics.jsonl; tensorboard: also TensorBoard event files in "
        "RUN_DIR/tb (pip install 'aftlab[tensorboard]')",
    )
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        help="under torchrun: ddp (default; a full model per process) or fsdp (FSDP2: weights, "
        "gradients and optimizer state sharded over the processes; docs/training.md)",
    )
    p.add_argument(
        "--outcome",
        metavar="FILE",
        help="also write how the run ended to FILE as JSON (outcome, exit_status, error; "
        "docs/training.md, 'Exit status'); aftlab compare reads it",
    )


def _default_out(cfg) -> str:
    return os.path.join("runs", f"{cfg.task}-{cfg.mixer}-{time.strftime('%Y%m%d-%H%M%S')}")


def resolve_train_config(args: argparse.Namespace):
    """The config ``aftlab train`` runs: file, shortcuts, ``--set``.

    With ``--resume`` the run's ``config.toml`` is the base; the :class:`Trainer` checks the
    result against the checkpoint's own config (``aftlab.train.config.RESUMABLE_CHANGES``).
    """
    from ..train.config import TrainConfig, apply_overrides, load_config

    check_config_file(args.config)
    flags = _flags(args, ("task", "mixer", "data", "out", "steps", "log", "parallel"))
    overrides = _overrides(args)
    if not args.resume:
        return load_config(args.config, overrides, values=flags)
    out = args.out
    if out is None and args.config is not None:
        out = load_config(args.config).out
    if out is None:
        raise UsageError("--resume needs the run folder: aftlab train --resume --out RUN_DIR")
    saved_path = Path(out) / "config.toml"
    if not saved_path.is_file():
        from ..train.checkpoint import LOCK_FILE, lock_holder, run_started

        why = "it has no config.toml"
        if os.path.lexists(Path(out) / LOCK_FILE) and not run_started(out):
            why = (
                f"it holds only the lock (and temporary files) of a run that never began, by "
                f"process {lock_holder(out)}"
            )
        raise UsageError(f"nothing to resume in {out!r}: {why} (start it without --resume)")
    saved = load_config(saved_path, stored=True)
    if args.config is not None:
        cfg = load_config(args.config, overrides, values=flags)
    else:
        cfg = TrainConfig.from_dict(apply_overrides(saved.to_dict(), overrides, values=flags))
    return cfg.replace(out=str(out))


@reports_outcome
def cmd_train(args: argparse.Namespace) -> int:
    from ..train.trainer import Trainer

    cfg = resolve_train_config(args)
    if cfg.out is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("with torchrun, give the run folder explicitly: --out DIR")
        cfg = cfg.replace(out=_default_out(cfg))
    run_dir = check_out_dir(cfg.out)
    try:  # the Trainer checks the device, then (without --resume) refuses a run that exists
        summary = Trainer(cfg, run_dir=run_dir, resume=args.resume).fit()
    finally:
        distributed = _leave_process_group()
    # diverged: the trainer printed the one line saying where and why
    outcome = "diverged" if summary.get("diverged") else "completed"
    outcome = "interrupted" if summary.get("interrupted") else outcome
    error = f"training diverged at step {summary.get('step')}" if outcome == "diverged" else None
    write_outcome(args.outcome, outcome, error)
    rc = EXIT_STATUS[outcome]
    if distributed:
        # torch 2.13's gloo backend (FSDP2 on CPU) now and then aborts in exit-time destructors
        # ("terminate called without an active exception") after all work is done and the
        # group destroyed: a torchrun worker ends here, its files closed and streams flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _leave_process_group() -> bool:
    """Destroy the torchrun process group if this process joined one; True if it did."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


# --------------------------------------------------------------------------- eval, sample


def add_eval(sub) -> None:
    p = add_command(
        sub,
        "eval",
        cmd_eval,
        help="evaluate a run on its validation or test split",
        description="Print the task's metric (bpc, bpb, bits/dim or accuracy) of a run's newest "
        "checkpoint. With --stream, a text split is read as one stream: a model whose state has a "
        "fixed size carries it through chunks of seq_len (every byte sees the whole split before "
        "it); any other reads sliding windows of max_seq_len (docs/training.md).",
        epilog="example: aftlab eval runs/text-attention-20260101-120000 --split test --stream",
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
    p.add_argument(
        "--stream",
        action="store_true",
        help="score the split as one continuous stream: the state carried through chunks of "
        "seq_len, or sliding windows of max_seq_len for attention, aft-full, absolute aft-local "
        "and learned positions (text tasks)",
    )
    p.add_argument(
        "--stride",
        type=int,
        metavar="N",
        help="with --stream, new tokens per sliding window (1 .. max_seq_len; default "
        "max_seq_len // 2)",
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from ..data import DataError
    from ..train.run import load_run
    from ..train.streams import evaluate_stream, stream_refusal
    from ..train.trainer import evaluate

    for name in ("batches", "batch_size", "stride"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.stream and args.batches is not None:
        raise UsageError("--batches does not apply to --stream, which scores the whole split")
    if args.stride is not None and not args.stream:
        raise UsageError("--stride applies to --stream only (the sliding windows' step)")
    device = check_device(args.device)
    run = load_run(args.run_dir, device=device, data=args.data)
    check_finite_weights(run)
    if args.stride is not None and args.stride > run.model_config.max_seq_len:
        raise UsageError(
            f"--stride must be at most max_seq_len = {run.model_config.max_seq_len} (a window "
            f"scores at most its own tokens), got {args.stride}"
        )
    if args.stride is not None and stream_refusal(run.model) is None:
        raise UsageError(
            "--stride applies to the sliding windows of a model that cannot carry its state; "
            "this one streams its state through chunks of seq_len"
        )
    common = {"batch_size": args.batch_size, "device": device, "precision": run.config.precision}
    if args.stream:
        try:
            res = evaluate_stream(run.model, run.task, args.split, stride=args.stride, **common)
        except DataError as e:
            raise UsageError(str(e)) from None
    else:
        res = evaluate(run.model, run.task, args.split, max_batches=args.batches, **common)
    metric = run.task.metric
    how = f"; streamed: {res['context']}" if args.stream else ""
    print(
        f"{args.split} {metric}: {res[metric]:.4f}  (loss {res['loss']:.4f} nats over "
        f"{res['targets']:,} "
        f"targets; step {run.step}, {run.config.model_label} on {run.config.task}{how})"
    )
    return 0


def add_sample(sub) -> None:
    p = add_command(
        sub,
        "sample",
        cmd_sample,
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
    p.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="sample among the most likely tokens whose probabilities sum to at least P, in "
        "(0, 1] (nucleus sampling, after --top-k; default all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")


def cmd_sample(args: argparse.Namespace) -> int:
    from ..train.run import load_run
    from ..train.sampling import sample_text

    check_text(args.prompt, "--prompt")
    device = check_device(args.device)
    run = load_run(args.run_dir, device=device)
    check_finite_weights(run)
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
        top_p=args.top_p,
        seed=args.seed,
        out=sys.stdout,
    )
    return 0


# --------------------------------------------------------------------------- compare, plot


def add_compare(sub) -> None:
    from functools import partial

    from .._checks import comma_separated
    from ..mixers import available_mixers
    from ..train.compare import default_mixers

    p = add_command(
        sub,
        "compare",
        cmd_compare,
        help="train one model per mixer on equal budgets and tabulate",
        description="Train one model per mixer with the same size, data and budget, then write "
        "results.md (mixer, parameters, chosen lr, validation and test metric as mean ± sample "
        "std over seeds, training tokens/s, peak memory; a unigram baseline for text tasks), "
        "results.json, results.csv, loss_curves.png and throughput.png (tokens/s, peak "
        "memory) into the output folder, and print the table. With --lrs the rate is chosen "
        "on the validation split, never the test split.",
        epilog="example: aftlab compare --task text --mixers attention,aft-local:window=16 "
        "--steps 200 --seeds 2 --lrs 1e-3,2e-3,4e-3 --equal-params",
    )
    _config_args(
        p,
        out_help="output folder (default runs/compare-<task>-<date>-<time>); an existing one "
        "is continued: finished models are kept, unfinished ones resumed",
    )
    p.add_argument(
        "--mixers",
        help="comma-separated mixers, each NAME or NAME:KEY=VALUE[:KEY=VALUE] with mixer options "
        f"(e.g. aft-local:window=8); NAME: {', '.join(available_mixers())}; default: "
        f"{','.join(default_mixers())}",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="train every mixer (at every rate) with N seeds: seed, seed+1, ...; report mean ± "
        "sample std and min-max (default 1)",
    )
    p.add_argument(
        "--lrs",
        metavar="A,B,...",
        help="train every mixer at each of these learning rates and keep, per mixer, the one "
        "with the best mean validation metric (default: the config's lr)",
    )
    p.add_argument(
        "--equal-params",
        action="store_true",
        help="set each mixer's feed-forward width d_ff so its parameter count is nearest "
        "attention's (within half a d_ff unit)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=0,
        metavar="N",
        help="after the table, print N bytes sampled from the model with the best test metric "
        "(text tasks; default 0: none)",
    )
    p.add_argument(
        "--decode-positions",
        type=partial(comma_separated, int),
        metavar="P,P,...",
        help="after the table, measure each model decoding one sequence at these positions "
        "(e.g. 4096,65536): ms per token and the state it keeps (KV cache or fixed-size sums), "
        "on a same-shaped model with random weights (language-model tasks; default: none)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check every option, the data and every model (built on the meta device), print "
        "what would be trained, and train and write nothing",
    )


def cmd_compare(args: argparse.Namespace) -> int:
    from ..train.compare import default_mixers, parse_lrs, run_compare, sample_best
    from ..train.config import load_config

    if args.seeds < 1:
        raise UsageError(f"--seeds must be a positive integer, got {args.seeds}")
    lrs = parse_lrs(check_text(args.lrs, "--lrs")) if args.lrs is not None else None
    check_config_file(args.config)
    flags = _flags(args, ("task", "data", "steps"))
    base = load_config(args.config, _overrides(args), values=flags)
    mixers = [m.strip() for m in args.mixers.split(",")] if args.mixers else default_mixers()
    if not all(mixers):
        raise UsageError(
            f"--mixers {args.mixers!r} has an empty name; expected e.g. attention,aft-local"
        )
    out = check_out_dir(
        args.out or os.path.join("runs", f"compare-{base.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    table = run_compare(
        base,
        mixers,
        out,
        seeds=args.seeds,
        lrs=lrs,
        equal_params=args.equal_params,
        sample=args.sample,
        decode_positions=args.decode_positions,
        dry_run=args.dry_run,
    )
    print(table, flush=True)
    if args.dry_run:
        return 0
    if args.sample:
        sample_best(out, args.sample, out=sys.stdout, seed=base.seed)
    plots = [n for n in ("loss_curves.png", "throughput.png") if (out / n).is_file()]
    plots_text = f"plots ({', '.join(plots)})" if plots else "no plots (pip install 'aftlab[plot]')"
    print(f"results.md, {plots_text} and a run folder per model: {out}{os.sep}")
    return 0


def add_plot(sub) -> None:
    p = add_command(
        sub,
        "plot",
        cmd_plot,
        help="draw loss curves and learned position biases / kernels of a run",
        description="Write loss.png (train and validation loss), and for AFT-full/local runs "
        "position_bias.png (the learned pairwise biases w, one heat map per layer), for AFT-conv "
        "conv_kernels.png. Needs matplotlib: pip install 'aftlab[plot]'.",
        epilog="example: aftlab plot runs/text-aft-full-20260101-120000",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by aftlab train")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default RUN_DIR/plots)")


def cmd_plot(args: argparse.Namespace) -> int:
    from ..train.plot import plot_run

    if args.out is not None:
        check_out_dir(args.out)
    for path in plot_run(args.run_dir, out_dir=args.out):
        print(path)
    return 0


# --------------------------------------------------------------------------- bench


def add_bench(sub) -> None:
    p = add_command(
        sub,
        "bench",
        cmd_bench,
        help="speed and memory benchmarks of the mixers (see docs/benchmarks.md)",
        description="Benchmarks of the mixers and models (aftlab.bench).",
    )
    try:
        from ..bench import cli as bench_cli
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_arguments(p)
    p.set_defaults(_bench=bench_cli)


def cmd_bench(args: argparse.Namespace) -> int:
    if args._bench is None:
        raise UsageError(
            "the benchmarks are not available in this installation (aftlab.bench.cli is missing)"
        )
    return int(args._bench.run(args))
