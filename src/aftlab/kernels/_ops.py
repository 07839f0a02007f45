"""Fake (meta) implementations and autograd of the ``aftlab::`` kernels, and their callers.

The ops themselves are defined and implemented in C++ (``csrc/*.cpp``); :func:`register`
runs once, after the library is loaded. Callers convert float16/bfloat16 to float32 (the
kernels run float32 and float64) and ask the kernel to save what the backward needs only when
a gradient will be taken.
"""

from __future__ import annotations

import torch

from .._autograd import register_autograd_once

_LOW = (torch.float16, torch.bfloat16)


def _empty_or_like(x: torch.Tensor, save: bool) -> torch.Tensor:
    """A contiguous tensor shaped like ``x`` (what the C++ ops return), or empty."""
    return x.new_empty(x.shape) if save else x.new_empty(0)


def register() -> None:
    """Register fake implementations and autograd for every ``aftlab::`` op (once).

    The fakes return contiguous tensors, as the C++ ops do (``new_empty``, not ``empty_like``,
    which keeps the strides of a transposed input: the compiler then mis-strides the result).
    """
    lib = "aftlab::"

    @torch.library.register_fake(lib + "simple_causal")
    def _(q, k, v, mask, save):
        return q.new_empty(q.shape), _empty_or_like(q, save)

    @torch.library.register_fake(lib + "simple_causal_backward")
    def _(gy, q, v, y, r):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)

    @torch.library.register_fake(lib + "simple_global")
    def _(q, k, v, mask):
        return q.new_empty(q.shape), q.new_empty(3, q.shape[0], q.shape[2])

    @torch.library.register_fake(lib + "simple_global_backward")
    def _(gy, q, k, v, stats, mask):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)

    @torch.library.register_fake(lib + "decay")
    def _(q, k, v, decay, bonus, mask, save):
        return q.new_empty(q.shape), _empty_or_like(q, save), _empty_or_like(q, save)

    @torch.library.register_fake(lib + "decay_backward")
    def _(gy, q, v, y, r, w):
        d = q.shape[2]
        like = q.new_empty(q.shape)
        return like, q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(d), q.new_empty(d)

    def setup_simple_causal(ctx, inputs, output):
        q, _, v, _, _ = inputs
        ctx.save_for_backward(q, v, output[0], output[1])

    def backward_simple_causal(ctx, gy, _gr):
        q, v, y, r = ctx.saved_tensors
        dq, dk, dv = torch.ops.aftlab.simple_causal_backward(gy, q, v, y, r)
        return dq, dk, dv, None, None

    def setup_simple_global(ctx, inputs, output):
        q, k, v, mask = inputs
        ctx.save_for_backward(q, k, v, output[1], mask)

    def backward_simple_global(ctx, gy, _gstats):
        q, k, v, stats, mask = ctx.saved_tensors
        dq, dk, dv = torch.ops.aftlab.simple_global_backward(gy, q, k, v, stats, mask)
        return dq, dk, dv, None

    def setup_decay(ctx, inputs, output):
        q, _, v, _, _, _, _ = inputs
        ctx.save_for_backward(q, v, output[0], output[1], output[2])

    def backward_decay(ctx, gy, _gr, _gw):
        q, v, y, r, w = ctx.saved_tensors
        dq, dk, dv, dlam, du = torch.ops.aftlab.decay_backward(gy, q, v, y, r, w)
        return dq, dk, dv, dlam, du, None, None

    _register_autograd("simple_causal", backward_simple_causal, setup_simple_causal)
    _register_autograd("simple_global", backward_simple_global, setup_simple_global)
    _register_autograd("decay", backward_decay, setup_decay)

    @torch.library.register_fake(lib + "band")
    def _(q, k, v, w, lo, hi, causal, mask, save):
        stats = k.shape if save else (0,)
        return q.new_empty(q.shape), k.new_empty(stats, dtype=torch.float64), k.new_empty(stats)

    @torch.library.register_fake(lib + "band_backward")
    def _(gy, q, k, v, w, y, mx, iv, lo, hi, causal, mask):
        return tuple(x.new_empty(x.shape) for x in (q, k, v, w))

    def setup_band(ctx, inputs, output):
        q, k, v, w, ctx.lo, ctx.hi, ctx.causal, mask, _ = inputs
        ctx.save_for_backward(q, k, v, w, output[0], output[1], output[2], mask)

    def backward_band(ctx, gy, _gmx, _giv):
        q, k, v, w, y, mx, iv, mask = ctx.saved_tensors
        dq, dk, dv, dw = torch.ops.aftlab.band_backward(
            gy, q, k, v, w, y, mx, iv, ctx.lo, ctx.hi, ctx.causal, mask
        )
        return dq, dk, dv, dw, None, None, None, None, None

    _register_autograd("band", backward_band, setup_band)

    @torch.library.register_fake(lib + "full")
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

    @torch.library.register_fake(lib + "full_backward")
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

    _register_autograd("full", backward_full, setup_full)


def _register_autograd(name: str, backward, setup) -> None:
    """Register ``backward`` for ``aftlab::name``, differentiable once (the backward kernels
    have no derivative of their own; a second derivative raises, see :mod:`aftlab._autograd`)."""
    register_autograd_once("aftlab::" + name, backward, setup, what="C++ kernel")


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def aft_simple(q, k, v, *, causal: bool, padding_mask):
    """Kernel of :func:`aftlab.ops.aft_simple` (inputs already validated)."""
    out_dtype = q.dtype
    if out_dtype in _LOW:
        q, k, v = q.float(), k.float(), v.float()
    if causal:
        y, _ = torch.ops.aftlab.simple_causal(q, k, v, padding_mask, _needs_grad(q, k, v))
    else:
        y, _ = torch.ops.aftlab.simple_global(q, k, v, padding_mask)
    return y.to(out_dtype)


def aft_decay(q, k, v, decay, bonus, *, padding_mask):
    """Kernel of :func:`aftlab.ops.aft_decay` (inputs already validated)."""
    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in _LOW else out_dtype
    q, k, v, decay, bonus = (t.to(cdt) for t in (q, k, v, decay, bonus))
    save = _needs_grad(q, k, v, decay, bonus)
    y, _, _ = torch.ops.aftlab.decay(q, k, v, decay, bonus, padding_mask, save)
    return y.to(out_dtype)


def aft_full(q, k, v, w, *, causal: bool, padding_mask, block: int):
    """Kernel of :func:`aftlab.ops.aft_full` (inputs already validated, ``T >= 1``); ``block``:
    query rows per causal block."""
    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in _LOW else out_dtype
    T = q.shape[1]
    q, k, v, w = (t.to(cdt) for t in (q, k, v, w[:T, :T]))
    save = _needs_grad(q, k, v, w)
    y = torch.ops.aftlab.full(q, k, v, w, padding_mask, bool(causal), block, save)[0]
    return y.to(out_dtype)
