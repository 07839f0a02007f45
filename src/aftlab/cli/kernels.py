"""``aftlab kernels``: compile the C++ kernels ahead and say, per op, which implementation runs."""

from __future__ import annotations

import argparse

from .commands import add_command


def add_kernels(sub) -> None:
    """Register the ``kernels`` subcommand."""
    p = add_command(
        sub,
        "kernels",
        cmd_kernels,
        help="compile the CPU kernels now and show which implementation each op runs",
        description="Compile the fused CPU kernels into the cache (if not there yet, or if the "
        "cached library does not match its build record) and print, per op, the "
        "implementation that runs on CPU tensors and why. Exit status 0 when "
        "the kernels run, 1 when the pure-PyTorch ops run instead.",
    )
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")


def cmd_kernels(args: argparse.Namespace) -> int:
    """Build (if needed), then print ``<op>: <implementation> (<reason>)`` per op."""
    from .. import kernels

    kernels.load(verbose=args.verbose)
    rows = kernels.status()
    for op, (impl, why) in rows.items():
        print(f"{op}: {impl} ({why})")
    return 0 if all(impl == "kernel" for impl, _ in rows.values()) else 1
