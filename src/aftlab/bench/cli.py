"""``aftlab bench`` (and ``python -m aftlab.bench``): an option per field of
:class:`~aftlab.bench.runner.BenchConfig` that has a help, plus ``--compare-aft-pytorch``. See
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

from .._checks import comma_separated
from ..errors import UsageError
from .cases import cases
from .runner import BenchConfig, kind, run_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser`` (each defaults to None: the field's default)."""
    defaults = BenchConfig()
    for f in (f for f in dataclasses.fields(BenchConfig) if "help" in f.metadata):
        (is_list, kind_), default = kind(f), getattr(defaults, f.name)
        shown = ",".join(map(str, default)) if is_list and default else default
        hidden = shown is None or isinstance(shown, bool) or shown in ("", [])
        more = "" if hidden else f" (default: {shown})"
        more += f"; of {', '.join(cases())}" * (f.name == "mixers")
        kw = {"type": partial(comma_separated, kind_) if is_list else kind_}
        if kind_ is bool:  # --causal, --no-isolate
            kw = {"action": argparse.BooleanOptionalAction}
        help = (f.metadata["help"] + more).replace("%", "%%")
        parser.add_argument("--" + f.name.replace("_", "-"), default=None, help=help, **kw)
    help = "the same as --peers aft-pytorch"
    parser.add_argument("--compare-aft-pytorch", action="store_true", help=help)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The validated :class:`BenchConfig` of parsed options (bad: ``UsageError``, one line)."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(BenchConfig)}
    cfg = BenchConfig(**{k: v for k, v in given.items() if v is not None})
    if args.compare_aft_pytorch:
        cfg.peers.insert(0, "aft-pytorch")
    try:
        cfg.validate(cases())
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run the benchmark: exit status 1 if a case failed its gate or crashed, else 0."""
    results = run_bench(config_from_args(args))["results"]
    return int(any(r["status"] in ("failed", "error") for r in results))
