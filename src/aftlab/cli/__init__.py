"""The ``aftlab`` command line: train, eval, sample, generate, compare, plot, bench, kernels,
export.

Every subcommand has ``--help``. Bad input (a missing data path, an unknown key, a damaged
checkpoint, ...) prints one line ``aftlab: error: <what is wrong> (<what to do>)`` to stderr and
exits with status 2, without a traceback; nothing already written is overwritten.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (status 2) instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"aftlab: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``aftlab`` and its subcommands."""
    from . import commands, export, generate, kernels

    parser = _Parser(
        prog="aftlab",
        description="Train, evaluate, sample and compare Transformers and Attention Free "
        "Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"aftlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    commands.add_train(sub)
    commands.add_eval(sub)
    commands.add_sample(sub)
    generate.add_generate(sub)
    commands.add_compare(sub)
    commands.add_plot(sub)
    commands.add_bench(sub)
    kernels.add_kernels(sub)
    export.add_export(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``aftlab`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    from ..errors import UsageError

    args = build_parser().parse_args(argv)
    user_errors: tuple[type[BaseException], ...] = (UsageError,)
    try:
        from ..data import DataError

        user_errors += (DataError,)
    except ImportError:  # pragma: no cover - the data package is always there once written
        pass
    try:
        return int(args.func(args) or 0)
    except user_errors as e:
        print(f"aftlab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aftlab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `aftlab sample RUN | head`
        return 0
