"""Caller of the aft-full kernel (``csrc/full.cpp``): ``aftlab::full``, with its fake and
autograd.

The library must be loaded (:func:`aftlab.kernels.load`); inputs are validated by the public
op. float16/bfloat16 are computed in float32 and returned in their dtype.
"""

from __future__ import annotations

import torch

from ._common import LOW, needs_grad, register_autograd

__all__ = ["aft_full"]


def register() -> None:
    """Register the fake and autograd of ``aftlab::full`` (once, after the library is loaded)."""

    @torch.library.register_fake("aftlab::full")
    def _(q, k, v, w, mask, causal, block, save):
        B, T, d = q.shape
        n = (T + block - 1) // block if causal else 1
        saved = q.shape if save else (0,)
        return (
            q.new_empty(q.shape),
            q.new_empty(saved),
            q.new_empty(saved),
            q.new_empty(B, T, dtype=torch.bool),
            q.new_empty(B, d, dtype=torch.long),
            q.new_empty(n, B, d),
        )

    @torch.library.register_fake("aftlab::full_backward")
    def _(gy, q, k, v, w, mask, a, inv, fb, sh, causal, block):
        return tuple(x.new_empty(x.shape) for x in (q, k, v, w))

    def setup_full(ctx, inputs, output):
        q, k, v, w, mask, ctx.causal, ctx.block, _ = inputs
        _, a, inv, fb, _, sh = output
        ctx.save_for_backward(q, k, v, w, mask, a, inv, fb, sh)

    def backward_full(ctx, gy, *_):
        q, k, v, w, mask, a, inv, fb, sh = ctx.saved_tensors
        dq, dk, dv, dw = torch.ops.aftlab.full_backward(
            gy, q, k, v, w, mask, a, inv, fb, sh, ctx.causal, ctx.block
        )
        return dq, dk, dv, dw, None, None, None, None

    register_autograd("full", backward_full, setup_full)


def aft_full(q, k, v, w, *, causal: bool, padding_mask, block: int, backend: str = "cpp"):
    """Kernel of :func:`aftlab.ops.aft_full` (inputs already validated, ``T >= 1``); ``block``:
    query rows per causal block (C++). ``backend="triton"``: the Triton kernels' factorised
    products (:func:`aftlab.kernels.triton.full.full`)."""
    if backend == "triton":
        from .triton.full import full

        return full(q, k, v, w, bool(causal), padding_mask)
    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in LOW else out_dtype
    T = q.shape[1]
    q, k, v, w = (t.to(cdt) for t in (q, k, v, w[:T, :T]))
    save = needs_grad(q, k, v, w)
    y = torch.ops.aftlab.full(q, k, v, w, padding_mask, bool(causal), block, save)[0]
    return y.to(out_dtype)
