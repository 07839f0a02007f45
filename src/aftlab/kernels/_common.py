"""What the kernels' callers share, as ``csrc/common.h`` for the kernels: the dtypes computed
in float32, whether a gradient will be taken, and the autograd registration.

Each of :mod:`.scan`, :mod:`.band` and :mod:`.full` mirrors its ``csrc/*.cpp``: the callers of
its ops and a ``register()`` that gives the ops (defined and implemented in C++) fake (meta)
implementations and autograd, run once after the library is loaded. The fakes return contiguous
tensors, as the C++ ops do (``new_empty``, not ``empty_like``, which keeps the strides of a
transposed input: the compiler then mis-strides the result).
"""

from __future__ import annotations

import torch

from .._autograd import register_autograd_once

#: Computed in float32 (the kernels run float32 and float64), returned in their own dtype.
LOW = (torch.float16, torch.bfloat16)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether a gradient will be taken (the kernel then saves what the backward needs)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def register_autograd(name: str, backward, setup, what: str = "C++ kernel") -> None:
    """Register ``backward`` for ``aftlab::name``, differentiable once (the backward kernels
    have no derivative of their own; a second derivative raises, see :mod:`aftlab._autograd`).

    The kernels' extra outputs are saved statistics: marked non-differentiable, so ``backward``
    runs on the main output's gradient alone.
    """

    def setup_stats(ctx, inputs, output):
        setup(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])

    register_autograd_once("aftlab::" + name, backward, setup_stats, what=what)
