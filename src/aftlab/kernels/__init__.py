"""Fused kernels for the AFT ops: C++ for CPU tensors, compiled on first use, and Triton for
CUDA tensors (see docs/kernels.md).

Each public op (:func:`aftlab.ops.aft_simple`, :func:`aftlab.ops.aft_decay`,
:func:`aftlab.ops.aft_local`, 1-D :func:`aftlab.ops.aft_conv` and :func:`aftlab.ops.aft_full`)
asks :func:`implementation` which implementation runs on its tensors:

* ``"torch"``, the pure-PyTorch op, when the kernels are switched off: ``use_kernels(False)``
  (a context manager, or a setter for the rest of the process) or ``AFTLAB_KERNELS=0`` (read at
  each call);
* ``"triton"`` (:mod:`.triton`) for an op with a Triton kernel (:data:`.triton.OPS`) on CUDA
  tensors, when triton imports; on any device with ``AFTLAB_KERNELS=triton`` or
  ``use_kernels("triton")`` (CPU tensors then need Triton's interpreter,
  ``TRITON_INTERPRET=1``: the tests);
* ``"cpp"`` on CPU tensors when the C++ library compiles (or is already in the cache): a C++
  compiler and ninja are present. A cached library that does not match its build record, or
  that fails to load, is rebuilt once;
* ``"torch"`` otherwise (no compiler, a failed build, CUDA without triton, another device), with
  one warning per process and reason. ``status(device)`` says, per op, what runs and why.

One module per C++ source, with its ops' callers (its ``__all__``, what the ops call), fakes
and autograd: :mod:`.scan` (``csrc/scan.cpp``), :mod:`.band` (``band.cpp``), :mod:`.full`
(``full.cpp``), :mod:`.rwkv4` (``rwkv4.cpp``: RWKV-4's decoding step, which
:class:`aftlab.models.RWKV4LM` runs); :mod:`._common` what they share, :mod:`._build` the build
and cache; :mod:`.triton` the Triton kernels, whose ops share the callers of the C++ ones.
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
from . import _build, band, full, rwkv4, scan, triton

__all__ = [
    "use_kernels", "enabled", "implementation", "load", "status", "OPS", "IMPLEMENTATIONS",
    "band", "full", "rwkv4", "scan", "triton",
]

#: The public ops that have a kernel.
OPS = ("aft_simple", "aft_decay", "aft_local", "aft_conv", "aft_full")
#: What :func:`implementation` returns.
IMPLEMENTATIONS = ("cpp", "triton", "torch")

_forced: bool | str | None = None  # set by use_kernels
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
def use_kernels(on: bool | str | None) -> Iterator[None]:
    """Force the C++ kernels on (``True``, an error if they cannot load), the Triton kernels
    (``"triton"``, for the ops that have one, on any device; as ``AFTLAB_KERNELS=triton``),
    everything off (``False``), or back to automatic (``None``) inside a ``with`` block::

        with aftlab.kernels.use_kernels(False):
            y = aft_simple(q, k, v)   # the pure-PyTorch op
    """
    global _forced
    if on not in (True, False, None, "triton"):
        raise ValueError(f"use_kernels: expected True, False, None or 'triton', got {on!r}")
    if on is True and not load():
        raise RuntimeError(f"aftlab kernels requested but unavailable: {_error}")
    if on == "triton" and not triton.load():
        raise RuntimeError(f"aftlab Triton kernels requested but unavailable: {triton.error()}")
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


def _kernels_on() -> bool:
    """Whether the C++ kernels run on CPU tensors."""
    if _forced is not None:
        return _forced is not False
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
    """Whether the C++ kernels run on ``tensors`` (CPU tensors, kernels on and loaded): what
    the kernels without a Triton twin ask (RWKV-4's decoding step)."""
    if any(t.device.type != "cpu" for t in tensors):
        return False
    return _kernels_on_traced()


def _triton_forced() -> bool:
    if _forced is not None:
        return _forced == "triton"
    return os.environ.get("AFTLAB_KERNELS", "").strip().lower() == "triton"


def _choose(op: str, device: str) -> tuple[str, str]:
    """``(implementation, reason)`` of ``op`` on a tensor of ``device`` (a device type)."""
    if op not in OPS:
        raise ValueError(f"implementation: 'op' must be one of {', '.join(OPS)}, got {op!r}")
    if _forced is False:
        return "torch", "switched off by use_kernels(False)"
    if _forced is None and env_off("AFTLAB_KERNELS"):
        return "torch", "switched off by AFTLAB_KERNELS=0"
    forced = _triton_forced()
    if op in triton.OPS and (forced or device == "cuda"):
        if triton.load():
            import triton as tr

            if device == "cpu" and not triton.interpreting():
                return "torch", (
                    "the Triton kernels on CPU tensors need Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before the first op runs"
                )
            how = "interpreter" if triton.interpreting() else "compiled"
            return "triton", f"triton {tr.__version__}, {how}"
        if forced:
            return "torch", f"Triton kernels requested but unavailable: {triton.error()}"
        return "torch", triton.error()
    if device == "cuda":
        return "torch", f"no Triton kernel for {op} yet"
    if device != "cpu":
        return "torch", f"no kernel for {device} tensors"
    if load():
        return "cpp", f"compiled library {_build.library_path()}"
    return "torch", _error


@torch.compiler.assume_constant_result
def _implementation_traced(op: str, device: str) -> str:
    # torch.compile evaluates this once while tracing and keeps the answer in the graph.
    return _implementation(op, device)


def _implementation(op: str, device: str) -> str:
    impl, why = _choose(op, device)
    if impl == "torch" and not why.startswith("switched off by use_kernels"):
        if _triton_forced() and op in triton.OPS:
            raise RuntimeError(f"aftlab: {op}: {why}")
        if why.startswith("no kernel for"):
            return impl  # meta tensors and the like: nothing to warn about
        _warn_once(why.removeprefix("switched off by "))
    return impl


def implementation(op: str, *tensors: torch.Tensor) -> str:
    """Which implementation ``op`` (one of :data:`OPS`) runs on ``tensors``: ``"triton"``,
    ``"cpp"`` or ``"torch"`` (see the module docstring), building or importing the kernels on
    first use.

    Raises:
        ValueError: an unknown ``op``.
        RuntimeError: the Triton kernels are forced (``AFTLAB_KERNELS=triton``) and cannot run:
            triton does not import, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    device = tensors[0].device.type if tensors else "cpu"
    return _implementation_traced(op, device)


def status(device: str = "cpu") -> dict[str, tuple[str, str]]:
    """``{op: (implementation, reason)}`` for tensors of ``device`` (``"cpu"`` or ``"cuda"``),
    building or importing the kernels if needed."""
    return {op: _choose(op, device) for op in OPS}
