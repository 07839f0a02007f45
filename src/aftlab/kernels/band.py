"""Callers of the fused band kernel (``aftlab::band``, ``csrc/band.cpp``): aft-local, aft-conv 1-D,
with its fake and autograd.

One kernel serves both: keys inside the band ``t - lo <= t' <= t + hi`` get the bias
``w[tb(t), g, t' - t + lo]``, keys outside it bias 0 (their prefix and, non-causal, suffix
sums are folded in the same pass)::

    y_t = sigma(q_t) * sum_t' exp(k_t' + w'_{t,t'}) v_t' / sum_t' exp(k_t' + w'_{t,t'})

* aft-local: ``w (T, 1, W)`` (a bias row per query, shared by the channels), ``lo = s - 1``,
  ``hi = s - 1`` (``0`` causal);
* aft-conv: ``w (1, h, s)`` (one Toeplitz kernel per head), ``lo = hi = s // 2``
  (causal: ``lo = s - 1, hi = 0``); keys with one channel per head are read once per head.

``backend="triton"`` runs the same band on the Triton kernels
(:func:`aftlab.kernels.triton.band.band`). The backend must be loaded
(:func:`aftlab.kernels.load`, :func:`aftlab.kernels.triton.load`); inputs are validated by the
public ops. float16/bfloat16 are computed in float32 and returned in their dtype.
"""

from __future__ import annotations

import torch

from ._common import LOW, needs_grad, register_autograd

__all__ = ["local", "conv1d"]


def register() -> None:
    """Register the fake and autograd of ``aftlab::band`` (once, after the library is loaded)."""

    @torch.library.register_fake("aftlab::band")
    def _(q, k, v, w, lo, hi, causal, mask, save):
        stats = k.shape if save else (0,)
        return q.new_empty(q.shape), k.new_empty(stats, dtype=torch.float64), k.new_empty(stats)

    @torch.library.register_fake("aftlab::band_backward")
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

    register_autograd("band", backward_band, setup_band)


def _band(q, k, v, w, lo: int, hi: int, causal: bool, padding_mask, backend: str):
    """``q, v (B, T, D)``, ``k (B, T, D or G)``, ``w (1 or T, G, lo + hi + 1)``."""
    if backend == "triton":
        from .triton.band import band

        return band(q, k, v, w, lo, hi, causal, padding_mask)
    out_dtype = q.dtype
    if out_dtype in LOW:
        q, k, v = q.float(), k.float(), v.float()
    save = needs_grad(q, k, v, w)
    y, _, _ = torch.ops.aftlab.band(q, k, v, w, lo, hi, causal, padding_mask, save)
    return y.to(out_dtype)


def local(q, k, v, w_band, window: int, *, causal: bool = False, padding_mask=None,
          backend: str = "cpp"):
    """Kernel of :func:`aftlab.ops.aft_local.aft_local_band`: the same arguments, shapes and
    result (inputs already validated there); ``window == 0`` runs as AFT-simple."""
    T = q.shape[1]
    if T == 0:
        return q * 0.0
    s = min(window, T)
    if s == 0:  # AFT-simple: a band of the query itself with bias 0
        w, lo, hi = q.new_zeros(1, 1, 1), 0, 0
    else:
        w, lo, hi = w_band[:, None, :], s - 1, (0 if causal else s - 1)
    return _band(q, k, v, w, lo, hi, bool(causal), padding_mask, backend)


def conv1d(q, k, v, w, *, causal: bool = False, padding_mask=None, backend: str = "cpp"):
    """Kernel of 1-D :func:`aftlab.ops.aft_conv.aft_conv`: the same arguments, shapes and
    result (inputs already validated there): ``q, v (B, T, h, c)``, ``k (B, T, h, 1 or c)``,
    ``w (h, s)``."""
    B, T, h, c = q.shape
    s = w.shape[-1]
    if not causal and s % 2 == 0:
        raise ValueError(
            f"conv1d: a non-causal kernel must have odd size, got 'w' {tuple(w.shape)}"
        )
    if T == 0:
        return torch.sigmoid(q) * v
    lo, hi = (s - 1, 0) if causal else (s // 2, s // 2)
    y = _band(
        q.reshape(B, T, h * c),
        k.reshape(B, T, h * k.shape[-1]),
        v.reshape(B, T, h * c),
        w[None],
        lo,
        hi,
        bool(causal),
        padding_mask,
        backend,
    )
    return y.view(B, T, h, c)
