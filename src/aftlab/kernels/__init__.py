"""Fused C++ CPU kernels for the AFT ops, compiled on first use (see docs/kernels.md).

Each public op (:func:`aftlab.ops.aft_simple`, :func:`aftlab.ops.aft_decay`,
:func:`aftlab.ops.aft_local`, 1-D :func:`aftlab.ops.aft_conv` and :func:`aftlab.ops.aft_full`)
asks :func:`enabled` whether to run its kernel (``torch.ops.aftlab.*``) or its pure-PyTorch
implementation. The kernels run when all of these hold:

* they are not switched off: ``use_kernels(False)`` (a context manager, or a setter for the
  rest of the process) or the environment variable ``AFTLAB_KERNELS=0`` (read at each call);
* the tensors are on the CPU (CUDA keeps the PyTorch path);
* the library compiles (or is already in the cache): a C++ compiler and ninja are present. A
  cached library that does not match its build record, or that fails to load, is rebuilt once.

When they cannot run (no compiler, a failed build, ``AFTLAB_KERNELS=0``) the PyTorch ops run,
with one warning per process. ``status()`` says, per op, which implementation runs and why.

One module per C++ source, with its ops' callers (its ``__all__``, what the ops call), fakes
and autograd: :mod:`.scan` (``csrc/scan.cpp``), :mod:`.band` (``band.cpp``), :mod:`.full`
(``full.cpp``), :mod:`.rwkv4` (``rwkv4.cpp``: RWKV-4's decoding step, which
:class:`aftlab.models.RWKV4LM` runs); :mod:`._common` what they share, :mod:`._build` the build
and cache.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from .._system import env_off
from . import _build, band, full, rwkv4, scan

__all__ = [
    "use_kernels", "enabled", "load", "status", "OPS", "band", "full", "rwkv4", "scan"
]

#: The public ops that have a kernel.
OPS = ("aft_simple", "aft_decay", "aft_local", "aft_conv", "aft_full")

_forced: bool | None = None  # set by use_kernels
_loaded: bool | None = None  # None: not tried yet
_error: str = ""  # why the kernels could not be loaded
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"aftlab: running the pure-PyTorch ops: {reason}", stacklevel=4)


def _why_not_buildable() -> str:
    """Empty if a build can be attempted, else why not."""
    if _build.compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')} not found; set CXX)"
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return "not a POSIX system (the build lock needs fcntl)"
    return ""


def load(*, verbose: bool = False) -> bool:
    """Compile (if the cache lacks it) and load the kernel library; True if it is loaded.

    Tried once per process; the reason of a failure is kept for :func:`status`.
    """
    global _loaded, _error
    if _loaded is None:
        _error = _why_not_buildable()
        if not _error:
            try:
                _load_library(_build.build(verbose=verbose), verbose)
                for module in (scan, band, full, rwkv4):
                    module.register()
            except Exception as e:  # a compiler error, a broken cache entry, ...
                _error = f"the kernels failed to build or load ({_last_line(e)})"
        _loaded = not _error
    return _loaded


def _last_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]


def _load_library(lib: Path, verbose: bool) -> None:
    """Load ``lib``; if the loader refuses it, rebuild it once (one line says why) and retry."""
    if hasattr(torch.ops.aftlab, "simple_causal"):  # loaded already (a build loads its library)
        return
    stale = _build.stamp(lib)
    try:
        torch.ops.load_library(str(lib))
    except OSError as e:
        lib = _build.build(verbose=verbose, failed=f"failed to load ({_last_line(e)})", stale=stale)
        if not hasattr(torch.ops.aftlab, "simple_causal"):
            torch.ops.load_library(str(lib))


@contextlib.contextmanager
def use_kernels(on: bool | None) -> Iterator[None]:
    """Force the kernels on (``True``, an error if they cannot load), off (``False``), or back
    to automatic (``None``) inside a ``with`` block::

        with aftlab.kernels.use_kernels(False):
            y = aft_simple(q, k, v)   # the pure-PyTorch op
    """
    global _forced
    if on and not load():
        raise RuntimeError(f"aftlab kernels requested but unavailable: {_error}")
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


def _kernels_on() -> bool:
    if _forced is not None:
        return _forced
    if env_off("AFTLAB_KERNELS"):
        _warn_once("AFTLAB_KERNELS=0")
        return False
    if not load():
        _warn_once(_error)
        return False
    return True


@torch.compiler.assume_constant_result
def _kernels_on_traced() -> bool:
    # torch.compile evaluates this once while tracing and keeps the answer in the graph.
    return _kernels_on()


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether an op on ``tensors`` runs its kernel (CPU tensors, kernels on and loaded)."""
    if any(t.device.type != "cpu" for t in tensors):
        return False
    return _kernels_on_traced()


def status() -> dict[str, tuple[str, str]]:
    """``{op: (implementation, reason)}`` for CPU tensors, building the kernels if needed."""
    if _forced is False:
        impl, why = "pytorch", "switched off by use_kernels(False)"
    elif _forced is None and env_off("AFTLAB_KERNELS"):
        impl, why = "pytorch", "switched off by AFTLAB_KERNELS=0"
    elif load():
        impl, why = "kernel", f"compiled library {_build.library_path()}"
    else:
        impl, why = "pytorch", _error
    return {op: (impl, why) for op in OPS}
