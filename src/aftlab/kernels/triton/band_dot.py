"""Triton band on ``tl.dot``: aft-local (one bias row per query, or one row for all, shared by
the channels), as aft-full's products (:mod:`.full`) restricted to the band.

The op is :mod:`.band`'s: keys inside ``t - lo <= t' <= t + hi`` get the bias
``w[tb(t), 0, t' - t + lo]``, the keys before the band (and, non-causal, after it) enter as
the virtual keys ``(lp, ap)`` and ``(ls, a_s)``, their log-sums and averages. A program takes
``BM`` queries x ``BD`` channels; the keys its queries' bands reach, ``[i0 - lo, i0 + BM + hi)``,
are walked in blocks of ``BN``, and the band's sums are two ``tl.dot`` per block::

    [num | den]_t = sum_t' exp(w_{t,t'} - a_t) [exp(k_t' - b) v_t' | exp(k_t' - b)]

with ``exp(w - a) = 0`` outside the band (a dense ``BM x BN`` tile of the band's diagonals).
``a_t`` is the largest bias of row ``t``'s band; ``b`` per channel the largest key of the
block's span, or, causal (``hi = 0``), of the keys ``[i0 - lo, i0]`` that the block's first
query sees, so no output depends on a key it must not see (a block without a key takes 0). The
band's log-sum ``a_t + b + log den`` then joins the virtual keys in float64 (as the term
kernel's exponents): ``y = (w_b num / den + w_p ap + w_s a_s) / (w_b + w_p + w_s)``.

Exact rows, as :mod:`.full`'s (same ``MARGIN``, value bound and ``sqrt(finfo.tiny)``): a row that
sees an unsafe key (causal: one of its own block more than ``MARGIN`` above the block's shift;
anywhere: a NaN or ``+inf`` key, a value beyond the bound or not finite), whose ``a_t`` is not
finite, or whose band has a key while ``den`` underflows, takes the terms of
:func:`aftlab.kernels.triton.band.band_core`, forward and backward (run over the whole problem
only when some row needs it).

The backward is :mod:`.full`'s with ``R = g w_b / ((w_b + w_p + w_s) den)``: ``dk``, ``dv`` per
key block over the query blocks that reach it, ``dw`` per (query block, key block) tile over the
batch and channels, stored per query and band diagonal (summed over the queries for one shared
row); the virtual keys get ``dL = p g (A - y)``, ``dA = p g`` with their weights ``p``.
Work ``2 B T d (BM + lo + hi)`` multiply-adds forward (half on zeros off the band), against the
terms' ``B T d (lo + hi + 1)`` float64 exponentials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import full
from ._common import TL
from .band import band_core, band_core_backward, fake_grads, setup_band
from .full import MARGIN, factors, limits, mm

SCHEMAS = {
    "band_dot": "(Tensor k, Tensor v, Tensor w, Tensor lp, Tensor ap, Tensor? ls, Tensor? a_s,"
    " int lo, int hi) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "band_dot_backward": "(Tensor gy, Tensor k, Tensor v, Tensor w, Tensor lp, Tensor ap,"
    " Tensor? ls, Tensor? a_s, Tensor y, Tensor den, Tensor exact, Tensor a, Tensor b, int lo,"
    " int hi) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
}


@triton.jit
def _band_weights(W, A_ROW, t, tk, T, NW, lo, PER_QUERY: tl.constexpr):
    """``exp(w - a)`` for queries ``t`` x keys ``tk``: the band's diagonals, 0 off the band."""
    jj = tk[None, :] - t[:, None] + lo
    inb = (jj >= 0) & (jj < NW) & (tk[None, :] < T) & (t[:, None] < T)
    row = t if PER_QUERY else t * 0
    a = tl.load(A_ROW + t, mask=t < T, other=0.0)
    wt = tl.load(W + row[:, None] * NW + jj, mask=inb, other=float("-inf"))
    e = tl.exp(wt - a[:, None])
    return tl.where(inb & (e == e), e, 0.0), jj, inb


@triton.jit
def _tile(X, tk, c, T, D, other):
    ok = (tk[:, None] < T) & (c[None, :] < D)
    return tl.load(X + tk[:, None] * D + c[None, :], mask=ok, other=other), ok


@triton.jit
def _dot_fwd(K, V, W, A_ROW, BSH, Y, DEN, T, D, NW, NQ, lo, hi, vbig, margin,
             PER_QUERY: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    c = tl.program_id(2) * BD + tl.arange(0, BD)
    t = i * BM + tl.arange(0, BM)
    kb, vb = K + b * T * D, V + b * T * D
    first = tl.maximum(i * BM - lo, 0)
    end = tl.minimum(i * BM + BM + hi, T)
    # the shift: the span's largest key; causal, the largest the block's first query sees
    last = tl.where(hi == 0, i * BM + 1, end)
    m = tl.full([BD], float("-inf"), Y.dtype.element_ty)
    for j0 in range(first, last, BN):
        tk = j0 + tl.arange(0, BN)
        k = _tile(kb, tk, c, last, D, float("-inf"))[0]
        m = tl.maximum(m, tl.max(tl.where(k == k, k, float("-inf")), 0))
    sh = tl.where(m == float("-inf"), 0.0, m)
    tl.store(BSH + (b * NQ + i) * D + c, sh, mask=c < D)
    dt = Y.dtype.element_ty
    num = tl.zeros([BM, BD], dt)
    den = tl.zeros([BM, BD], dt)
    for j0 in range(first, end, BN):
        tk = j0 + tl.arange(0, BN)
        ew = _band_weights(W, A_ROW, t, tk, T, NW, lo, PER_QUERY)[0]
        k, ok = _tile(kb, tk, c, T, D, float("-inf"))
        v = _tile(vb, tk, c, T, D, 0.0)[0]
        e, ev = factors(k, v, sh, ok, vbig, margin)
        num = mm(ew.to(dt), ev, num, IEEE)
        den = mm(ew.to(dt), e, den, IEEE)
    o = (b * T + t[:, None]) * D + c[None, :]
    ok = (t[:, None] < T) & (c[None, :] < D)
    tl.store(Y + o, num / tl.where(den > 0, den, 1.0), mask=ok)
    tl.store(DEN + o, den, mask=ok)


@triton.jit
def _dot_bwd_kv(K, V, W, A_ROW, BSH, R, S, DK, DV, T, D, NW, NQ, lo, hi, vbig, margin,
                PER_QUERY: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tk = tl.program_id(1) * BN + tl.arange(0, BN)
    c = tl.program_id(2) * BD + tl.arange(0, BD)
    k, ok = _tile(K + b * T * D, tk, c, T, D, float("-inf"))
    v = _tile(V + b * T * D, tk, c, T, D, 0.0)[0]
    dt = DK.dtype.element_ty
    dk = tl.zeros([BN, BD], dt)
    dv = tl.zeros([BN, BD], dt)
    j0 = tl.program_id(1) * BN
    i_first = tl.maximum(j0 - hi, 0) // BM  # the query blocks whose bands reach these keys
    i_end = tl.minimum(tl.minimum(j0 + BN - 1 + lo, T - 1) // BM + 1, NQ)
    for i in range(i_first, i_end):
        t = i * BM + tl.arange(0, BM)
        ew = _band_weights(W, A_ROW, t, tk, T, NW, lo, PER_QUERY)[0]
        r = _tile(R + b * T * D, t, c, T, D, 0.0)[0]
        s = _tile(S + b * T * D, t, c, T, D, 0.0)[0]
        sh = tl.load(BSH + (b * NQ + i) * D + c, mask=c < D, other=0.0)
        e = factors(k, v, sh, ok, vbig, margin)[0]
        er = mm(tl.trans(ew.to(dt)), r, tl.zeros([BN, BD], dt), IEEE)
        es = mm(tl.trans(ew.to(dt)), s, tl.zeros([BN, BD], dt), IEEE)
        dv += tl.where(e > 0, e * er, 0.0)
        dk += tl.where(e > 0, e * (v * er - es), 0.0)
    o = (b * T + tk[:, None]) * D + c[None, :]
    tl.store(DK + o, dk, mask=ok)
    tl.store(DV + o, dv, mask=ok)


@triton.jit
def _dot_bwd_w(K, V, W, A_ROW, BSH, R, S, DWQ, B, T, D, NW, NQ, lo, hi, vbig, margin,
               PER_QUERY: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BD: tl.constexpr):
    i = tl.program_id(0)
    t = i * BM + tl.arange(0, BM)
    j0 = tl.maximum(i * BM - lo, 0) + tl.program_id(1) * BN
    tk = j0 + tl.arange(0, BN)
    dt = DWQ.dtype.element_ty
    acc = tl.zeros([BM, BN], dt)
    nb = tl.where(j0 < tl.minimum(i * BM + BM + hi, T), B, 0)  # past the span: nothing
    for b in range(0, nb):
        sho = (b * NQ + i) * D
        for c0 in range(0, D, BD):
            c = c0 + tl.arange(0, BD)
            r = _tile(R + b * T * D, t, c, T, D, 0.0)[0]
            s = _tile(S + b * T * D, t, c, T, D, 0.0)[0]
            k, ok = _tile(K + b * T * D, tk, c, T, D, float("-inf"))
            v = _tile(V + b * T * D, tk, c, T, D, 0.0)[0]
            sh = tl.load(BSH + sho + c, mask=c < D, other=0.0)
            e, ev = factors(k, v, sh, ok, vbig, margin)
            acc = mm(r, tl.trans(ev), acc, IEEE)
            acc = mm(-s, tl.trans(e), acc, IEEE)
    ew, jj, inb = _band_weights(W, A_ROW, t, tk, T, NW, lo, PER_QUERY)
    tl.store(DWQ + t[:, None] * NW + jj, tl.where(ew > 0, ew.to(dt) * acc, 0.0), mask=inb)


# ---------------------------------------------------------------------------- launchers
def _row_shift(w, lo: int, T: int):
    """``a (T,)``: the largest bias of each query's band (its keys inside ``[0, T)``)."""
    nw = w.shape[2]
    t = torch.arange(T, device=w.device)[:, None]
    tk = t - lo + torch.arange(nw, device=w.device)[None, :]
    rows = w[:, 0, :].expand(T, nw)
    return rows.masked_fill((tk < 0) | (tk >= T), float("-inf")).amax(1).contiguous()


def _window_any(x, lo: int, hi: int):
    """Whether ``x (B, T, D)`` (bool) holds anywhere in ``[t - lo, t + hi]``, per ``t``."""
    B, T, D = x.shape
    cs = x.int().cumsum(1, dtype=torch.int32)
    cs = torch.cat([cs.new_zeros(B, 1, D), cs], 1)
    t = torch.arange(T, device=x.device)
    top = (t + hi).clamp(max=T - 1) + 1
    return cs.index_select(1, top) - cs.index_select(1, (t - lo).clamp(min=0)) > 0


def _weights(den, a, b, lp, ls, bm: int):
    """The weights ``(p_b, p_p, p_s)`` of the band, the prefix and the suffix in each output
    (float64, summing to 1; all 0 where there is no key): the band's log-sum
    ``a_t + b + log den`` beside the virtual keys' ``lp``, ``ls``."""
    T = den.shape[1]
    s = a.double()[None, :, None] + b.double().repeat_interleave(bm, 1)[:, :T]
    lb = torch.where(den > 0, s + den.double().log(), float("-inf"))
    ls = torch.full_like(lp, float("-inf")) if ls is None else ls
    m = torch.maximum(torch.maximum(lb, lp), ls)
    m = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    wb, wp, ws = (lb - m).exp(), (lp - m).exp(), (ls - m).exp()
    om = wb + wp + ws
    om = torch.where(om == 0, 1.0, om)
    return wb / om, wp / om, ws / om


def _exact_rows(k, v, a, b, den, lo: int, hi: int, bm: int, vbig: float, thr: float):
    """The rows ``(B, T, D)`` that take the exact terms: see the module docstring."""
    T = k.shape[1]
    ninf = float("-inf")
    anywhere = (torch.isnan(k) | (k == float("inf")) | ~(v.abs() <= vbig)) & (k != ninf)
    exact = _window_any(anywhere, lo, hi)
    if hi == 0:  # a key of its own block above the block's shift by more than the margin
        own = b.repeat_interleave(bm, 1)[:, :T]
        high = ((k - own) > MARGIN) & (k != ninf)
        n = b.shape[1] * bm
        high = torch.nn.functional.pad(high, (0, 0, 0, n - T))
        seen = high.view(k.shape[0], -1, bm, k.shape[2]).cumsum(2) > 0
        exact |= seen.view(k.shape[0], n, k.shape[2])[:, :T]
    has = _window_any(k != ninf, lo, hi)
    return exact | ~torch.isfinite(a)[None, :, None] | (has & ~(den >= thr))


def band_dot(k, v, w, lp, ap, ls, a_s, lo, hi):
    if k.dtype not in TL:
        raise TypeError(f"aftlab::triton_band_dot: float32 or float64 tensors, got {k.dtype}")
    if w.shape[1] != 1:
        raise ValueError(f"aftlab::triton_band_dot: one bias group, got w {tuple(w.shape)}")
    k, v, lp, ap = (x.contiguous() for x in (k, v, lp, ap))
    w = w.to(k.dtype).contiguous()
    B, T, D = k.shape
    nw = w.shape[2]
    bm, bn, bd = full.blocks(T, D, k.device)
    nq = triton.cdiv(T, bm)
    a = _row_shift(w, lo, T)
    b = k.new_zeros(B, nq, D)
    yb, den = torch.zeros_like(k), torch.zeros_like(k)
    exact = torch.zeros_like(k, dtype=torch.bool)
    if not k.numel():
        return yb, den, exact, a, b
    vbig, thr = limits(k.dtype, nw)
    _dot_fwd[(B, nq, triton.cdiv(D, bd))](
        k, v, w, a, b, yb, den, T, D, nw, nq, lo, hi, vbig, MARGIN, PER_QUERY=w.shape[0] > 1,
        IEEE=full.ieee(k.device), BM=bm, BN=bn, BD=bd)
    pb, pp, ps = _weights(den, a, b, lp, ls, bm)
    y = pb * yb.double() + pp * ap.double()
    y = (y if a_s is None else y + ps * a_s.double()).to(k.dtype)
    exact = _exact_rows(k, v, a, b, den, lo, hi, bm, vbig, thr)
    if bool(exact.any()):
        ye, _ = band_core(k, v, w, lp, ap, ls, a_s, lo, hi)
        y = torch.where(exact, ye, y)
    return y, den, exact, a, b


def band_dot_backward(gy, k, v, w, lp, ap, ls, a_s, y, den, exact, a, b, lo, hi):
    gy, k, v, lp, ap, y = (x.contiguous() for x in (gy, k, v, lp, ap, y))
    w = w.to(k.dtype).contiguous()
    B, T, D = k.shape
    nw = w.shape[2]
    suffix = ls is not None
    dk, dv = torch.zeros_like(k), torch.zeros_like(k)
    zeros = torch.zeros_like(k) if suffix else k.new_empty(0)
    if not k.numel():
        return dk, dv, torch.zeros_like(w), torch.zeros_like(k), torch.zeros_like(k), zeros, zeros
    bm, bn, bd = full.blocks(T, D, k.device)
    nq = b.shape[1]
    vbig, _ = limits(k.dtype, nw)
    pb, pp, ps = _weights(den, a, b, lp, ls, bm)
    live = ~exact & (gy != 0)
    g = gy.double()
    r = torch.where(live & (den > 0), g * pb / torch.where(den > 0, den, 1).double(), 0.0)
    r = r.to(k.dtype)
    s = torch.where(r == 0, 0.0, r * y)
    dlp = torch.where(live, pp * g * (ap.double() - y.double()), 0.0).to(k.dtype)
    dap = torch.where(live, pp * g, 0.0).to(k.dtype)
    dls = das = zeros
    if suffix:
        dls = torch.where(live, ps * g * (a_s.double() - y.double()), 0.0).to(k.dtype)
        das = torch.where(live, ps * g, 0.0).to(k.dtype)
    per_query = w.shape[0] > 1
    exact_mm = full.ieee(k.device)
    _dot_bwd_kv[(B, triton.cdiv(T, bn), triton.cdiv(D, bd))](
        k, v, w, a, b, r, s, dk, dv, T, D, nw, nq, lo, hi, vbig, MARGIN, PER_QUERY=per_query,
        IEEE=exact_mm, BM=bm, BN=bn, BD=bd)
    dwq = k.new_zeros(T, nw)
    _dot_bwd_w[(nq, triton.cdiv(bm + lo + hi, bn))](
        k, v, w, a, b, r, s, dwq, B, T, D, nw, nq, lo, hi, vbig, MARGIN, PER_QUERY=per_query,
        IEEE=exact_mm, BM=bm, BN=bn, BD=bd)
    dw = dwq[:, None, :] if per_query else dwq.sum(0)[None, None, :]
    ge = torch.where(exact, gy, 0.0)
    if bool((ge != 0).any()):  # the exact rows' gradients from the band kernel's terms
        ye, l4 = band_core(k, v, w, lp, ap, ls, a_s, lo, hi)
        ex = band_core_backward(ge, k, v, w, lp, ap, ls, a_s, ye, l4, lo, hi)
        dk, dv, dw, dlp, dap = dk + ex[0], dv + ex[1], dw + ex[2], dlp + ex[3], dap + ex[4]
        if suffix:
            dls, das = dls + ex[5], das + ex[6]
    return dk, dv, dw.to(w.dtype), dlp, dap, dls, das


IMPLS = {"band_dot": band_dot, "band_dot_backward": band_dot_backward}


def register() -> None:
    """The fakes and autograd of ``aftlab::triton_band_dot`` (once, after it is defined)."""
    from ..._autograd import register_autograd_once

    @torch.library.register_fake("aftlab::triton_band_dot")
    def _(k, v, w, lp, ap, ls, a_s, lo, hi):
        B, T, D = k.shape
        n = triton.cdiv(T, full.blocks(T, D, k.device)[0])
        return (k.new_empty(k.shape), k.new_empty(k.shape),
                k.new_empty(k.shape, dtype=torch.bool), k.new_empty(T), k.new_empty(B, n, D))

    @torch.library.register_fake("aftlab::triton_band_dot_backward")
    def _(gy, k, v, w, lp, ap, ls, a_s, y, den, exact, a, b, lo, hi):
        return fake_grads(k, w, ls)

    def backward(ctx, gy, *_):
        k, v, w, lp, ap, ls, a_s, y, den, exact, a, b = ctx.saved_tensors
        dk, dv, dw, dlp, dap, dls, das = torch.ops.aftlab.triton_band_dot_backward(
            gy, k, v, w, lp, ap, ls, a_s, y, den, exact, a, b, ctx.lo, ctx.hi
        )
        if not ctx.suffix:
            dls = das = None
        return dk, dv, dw, dlp, dap, dls, das, None, None

    register_autograd_once("aftlab::triton_band_dot", backward, setup_band, what="Triton kernel")
