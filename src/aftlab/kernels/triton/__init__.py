"""Triton kernels: the AFT ops on GPUs (CUDA tensors), and on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``, how the tests prove them on a machine without a GPU).

They are ``torch.library`` ops ``aftlab::triton_<name>`` with the schemas of the C++ ops
``aftlab::<name>``, defined from Python (they need no compiler, so a GPU machine without one
still runs them) with implementations for the CPU (the interpreter) and CUDA; their callers,
fakes and autograd are those of the C++ ops (:mod:`aftlab.kernels.scan`), so
``torch.compile(fullgraph=True)`` traces through them as through the C++ ones.

:func:`aftlab.kernels.implementation` says which implementation an op runs; see
docs/kernels.md, "Triton kernels". Triton reads ``TRITON_INTERPRET`` when it compiles a kernel
module, so set it before the first op runs.
"""

from __future__ import annotations

import os

import torch

__all__ = ["OPS", "load", "error", "interpreting"]

#: The public ops that have a Triton kernel.
OPS = ("aft_simple", "aft_decay", "aft_local", "aft_conv", "aft_full")

_loaded: bool | None = None  # None: not tried yet
_error = ""
_lib = None  # the torch.library.Library that holds the ops (kept alive)


_interpreted: bool | None = None  # TRITON_INTERPRET when the kernels were defined


def interpreting() -> bool:
    """Whether the kernels run on Triton's interpreter (``TRITON_INTERPRET=1``): on CPU tensors.
    Triton reads the variable when it defines a kernel, so once loaded this is the value then."""
    if _interpreted is not None:
        return _interpreted
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def load() -> bool:
    """Import triton and define the ``aftlab::triton_*`` ops (once per process); True if they
    are defined. Why not is kept for :func:`error`."""
    global _loaded, _error, _lib, _interpreted
    if _loaded is None:
        _interpreted = interpreting()
        try:
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError as e:
            _error = f"triton is not installed ({e}; pip install triton)"
        else:
            if _interpreted and not isinstance(tl.zeros, InterpretedFunction):
                _error = (
                    "TRITON_INTERPRET=1 was set after triton was imported (torch._dynamo, "
                    "which aftlab imports, imports it): set it before importing aftlab"
                )
                _loaded = False
                return False
            try:
                from .. import scan as callers
                from . import band, band_dot, full, scan

                lib = torch.library.Library("aftlab", "FRAGMENT")
                for module in (scan, band, band_dot, full):
                    for name, schema in module.SCHEMAS.items():
                        lib.define(f"triton_{name}{schema}")
                        for key in ("CPU", "CUDA"):
                            lib.impl(f"triton_{name}", module.IMPLS[name], key)
                _lib = lib
                callers.register("triton")
                band.register()
                band_dot.register()
                full.register()
            except Exception as e:  # a triton that does not fit this torch, ...
                _error = f"the Triton kernels failed to load ({type(e).__name__}: {e})"[:300]
        _loaded = not _error
    return _loaded


def error() -> str:
    """Why the Triton kernels cannot run (empty if they can, or if not tried yet)."""
    return _error
