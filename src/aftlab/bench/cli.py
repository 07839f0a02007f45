"""Command line of the benchmark: ``aftlab bench ...`` and ``python -m aftlab.bench ...``.

``aftlab.cli`` delegates its ``bench`` subcommand here through :func:`add_arguments` and
:func:`run`; bad input raises a one-line ``ValueError`` (the CLI prints it and exits 2).
"""

from __future__ import annotations

import argparse
import sys

from .cases import CASES, MODES
from .runner import DTYPES, BenchConfig, run_bench

__all__ = ["add_arguments", "run", "config_from_args", "main"]


def _int_list(opt: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bench: --{opt} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"bench: --{opt} must be comma-separated positive integers, got {text!r}")
    return vals


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser``."""
    parser.add_argument(
        "--mixers",
        default=",".join(CASES),
        help=f"comma-separated cases (default: all): {', '.join(CASES)}",
    )
    parser.add_argument(
        "--lengths",
        default="256,1024,4096,16384",
        help="sequence lengths T for forward and train (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-positions",
        default=None,
        help="positions of the decoding step (default: the lengths)",
    )
    parser.add_argument("--batch", type=int, default=4, help="batch size B (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=256, help="width d (default: %(default)s)")
    parser.add_argument(
        "--heads",
        type=int,
        default=4,
        help="heads of attention and aft-conv (default: %(default)s)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="forward,train,decode (default: all)"
    )
    parser.add_argument("--causal", action="store_true", help="causal mixers (default: non-causal)")
    parser.add_argument(
        "--also-noncausal",
        default="",
        help="with --causal, mixers also run non-causal (e.g. aft-full)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument(
        "--dtype", default="float32", help=f"one of {', '.join(DTYPES)} (default: %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed calls per case (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed calls first (default: %(default)s)"
    )
    parser.add_argument(
        "--max-seconds-per-case",
        type=float,
        default=60.0,
        help="time budget of one case (default: %(default)s)",
    )
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=None,
        help="skip cases estimated above this peak (default: 60%% of available)",
    )
    parser.add_argument(
        "--no-isolate",
        action="store_true",
        help="run CPU cases in this process instead of a fresh one each",
    )
    parser.add_argument(
        "--compare-aft-pytorch",
        action="store_true",
        help="add aft-pytorch's AFTFull and AFTSimple beside ours (same as --peers aft-pytorch)",
    )
    parser.add_argument(
        "--peers",
        default="",
        help="comma-separated peers beside ours: aft-pytorch (AFTFull, AFTSimple), hf-rwkv "
        "(transformers' RWKV CPU path beside aft-decay); each needs its package",
    )
    parser.add_argument(
        "--max-total-minutes",
        type=float,
        default=None,
        help="skip the remaining cases once the run has taken this long (default: no limit)",
    )
    parser.add_argument(
        "--compare-lengths",
        default=None,
        help="lengths of the peer comparison (default: the lengths up to 4096)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the inputs (default: %(default)s)"
    )
    parser.add_argument(
        "--out", default=None, help="directory for results.json/csv, summary.md, plots"
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build a validated :class:`BenchConfig` from parsed arguments (``ValueError`` if bad)."""
    cfg = BenchConfig(
        mixers=_str_list(args.mixers),
        lengths=_int_list("lengths", args.lengths),
        decode_positions=None
        if args.decode_positions is None
        else _int_list("decode-positions", args.decode_positions),
        batch=args.batch,
        dim=args.dim,
        heads=args.heads,
        modes=_str_list(args.modes),
        causal=args.causal,
        also_noncausal=_str_list(args.also_noncausal),
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        max_seconds_per_case=args.max_seconds_per_case,
        max_memory_gb=args.max_memory_gb,
        isolate=False if args.no_isolate else None,
        peers=_str_list(args.peers),
        compare_aft_pytorch=args.compare_aft_pytorch,
        max_total_minutes=args.max_total_minutes,
        compare_lengths=None
        if args.compare_lengths is None
        else _int_list("compare-lengths", args.compare_lengths),
        seed=args.seed,
        out=args.out,
    )
    cfg.validate()
    return cfg


def _usage_error(message: str) -> ValueError:
    """The ``ValueError`` subclass ``aftlab``'s CLI prints as one line (exit 2), if present."""
    try:
        from ..train.errors import UsageError
    except ImportError:  # pragma: no cover - the train package ships with aftlab
        return ValueError(message)
    return UsageError(message)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every case ran or was skipped with a note, 1 if any failed.

    Raises:
        ValueError: bad options (one line, naming the option).
    """
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise _usage_error(str(e)) from None
    result = run_bench(cfg, argv=argv)
    return 1 if any(r["status"] in ("failed", "error") for r in result["results"]) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m aftlab.bench``: parse, run, print a one-line error and exit 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m aftlab.bench", description="Benchmark the sequence mixers of aftlab."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(
            args, ["python", "-m", "aftlab.bench", *(sys.argv[1:] if argv is None else argv)]
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
