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
        "cached library does not match its build record) and print, per op and device (cpu, "
        "cuda), the implementation that runs (cpp, triton or torch) and why. Exit status 0 "
        "when every op runs a kernel on CPU tensors, 1 when a pure-PyTorch op runs instead.",
    )
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")


def cmd_kernels(args: argparse.Namespace) -> int:
    """Build (if needed), then print ``<op> (<device>): <implementation> (<reason>)`` per op
    and device."""
    from .. import kernels

    kernels.load(verbose=args.verbose)
    rows = {device: kernels.status(device) for device in ("cpu", "cuda")}
    for device, ops in rows.items():
        for op, (impl, why) in ops.items():
            print(f"{op} ({device}): {impl} ({why})")
    return 0 if all(impl != "torch" for impl, _ in rows["cpu"].values()) else 1
