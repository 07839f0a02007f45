"""Triton aft-full: the factorised products on ``tl.dot``, blocked like FlashAttention, with an
exact fallback per row.

For ``k, v (B, T, D)`` and biases ``w (T, T)`` shared by the channels, the average (``Y``
before ``sigma(q)``)::

    A_t = sum_t' exp(k_t' + w_{t,t'}) v_t' / sum_t' exp(k_t' + w_{t,t'})    (causal: t' <= t)

factorises with a row shift ``a_t`` and a key shift ``b_c``::

    [num | den]_t = sum_t' exp(w_{t,t'} - a_t) [exp(k_t' - b) v_t' | exp(k_t' - b)]

two ``tl.dot`` per block of ``BM`` queries x ``BN`` keys x ``BD`` channels, as ``csrc/full.cpp``
(docs/kernels.md, "The aft-full kernel") does with BLAS, and ``A = num / den``.

* ``a_t``: the largest bias row ``t`` may see (causal: ``t' <= t``), so every
  ``E^w = exp(w - a) <= 1``.
* ``b``: per channel, the largest key; causal, per query block ``[i0, i0 + BM)``, the largest
  key ``t' <= i0`` (every query of the block sees those), so no output depends on a key it must
  not see. The block's own keys may lie above ``b``: up to ``MARGIN = 44`` they enter with
  ``E^K <= e^44``; a key beyond that (or NaN, or ``+inf``), or a value above ``vbig`` (or not
  finite), is *unsafe*: left out of the products, and every row that sees it is exact.
* **Exact rows**: a row that sees an unsafe key, whose ``a_t`` is not finite, or whose ``den``
  is below ``sqrt(finfo.tiny)`` while it sees a key (the two maximisers disagree: a large key
  that its bias kills; no factorisation can see that in advance) takes the exact terms of the
  band kernel (:func:`aftlab.kernels.triton.band.band_core`, ``lo = T - 1``), forward and
  backward. That kernel runs over the whole problem only when some row needs it.
* ``vbig``: values up to ``finfo.max / e^44 / (T + 1)`` keep ``num`` below the largest float
  without scaling; larger ones are exact rows.

The backward is the transposed products with ``R = g / den``, ``S = R A`` (``g`` the upstream
gradient; 0 on exact rows and where ``g`` is 0, so no ``0 * NaN`` from a later position)::

    dv_t' = E^K_t' (E^w^T R)_t',   dk_t' = E^K_t' (v_t' (E^w^T R)_t' - (E^w^T S)_t'),
    dw_{t,t'} = E^w_{t,t'} sum_{b,c} (R_t E^K_t' v_t' - S_t E^K_t')

one program per key block (``dk``, ``dv``: its query blocks in a loop) and one per
``(query block, key block)`` tile of ``dw`` (the batch and channels in a loop). Not value
scaled: the gradients are finite wherever those sums are (always at ordinary magnitudes).

float32 products use ``input_precision="ieee"``: TF32's 10-bit mantissa would cost three digits.
Work: ``2 B T^2 D`` multiply-adds forward (two products; about half causal), ``4 B T^2 D``
backward; memory ``O(B T D + T^2)``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..._autograd import register_autograd_once
from ._common import TL
from .band import band_core, band_core_backward

SCHEMAS = {
    "full_core": "(Tensor k, Tensor v, Tensor w, bool causal)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "full_core_backward": "(Tensor gy, Tensor k, Tensor v, Tensor w, Tensor y, Tensor inv,"
    " Tensor exact, Tensor a, Tensor b, bool causal) -> (Tensor, Tensor, Tensor)",
}

#: How far a causal block's own key may lie above the block's shift and still enter the products.
MARGIN = 44.0


def limits(dtype: torch.dtype, T: int) -> tuple[float, float]:
    """``(vbig, den threshold)``: values up to ``vbig`` keep ``num`` finite; a ``den`` below the
    threshold is an exact row."""
    fi = torch.finfo(dtype)
    return fi.max / math.exp(MARGIN) / (T + 1), math.sqrt(fi.tiny)


@triton.jit
def _weights(W, A_ROW, t, tk, T, CAUSAL: tl.constexpr):
    """``E^w = exp(w - a)`` for queries ``t`` x keys ``tk`` (0 where not seen, and where a
    row's shift is not finite: such a row is exact)."""
    seen = (t[:, None] < T) & (tk[None, :] < T)
    if CAUSAL:
        seen = seen & (tk[None, :] <= t[:, None])
    a = tl.load(A_ROW + t, mask=t < T, other=0.0)
    wt = tl.load(W + t[:, None] * T + tk[None, :], mask=seen, other=float("-inf"))
    e = tl.exp(wt - a[:, None])
    return tl.where(seen & (e == e), e, 0.0)  # NaN (a NaN or infinite row) -> 0


@triton.jit
def factors(k, v, sh, ok, vbig, margin):
    """``(E^K, E^K v)`` of key and value tiles under the per-channel shift ``sh``: 0 where not
    ``ok`` (a padded key is ``-inf``) and for an unsafe key (above the shift by more than the
    margin, NaN, a value beyond ``vbig`` or not finite)."""
    ek = k - sh[None, :]
    safe = ok & (ek <= margin) & (tl.abs(v) <= vbig)
    e = tl.where(safe, tl.exp(tl.minimum(ek, margin)), 0.0)
    return e, e * tl.where(safe, v, 0.0)


@triton.jit
def _key_factors(K, V, BSH, bo, tk, c, T, D, vbig, margin):
    """:func:`factors` of keys ``tk`` x channels ``c`` under the shift at ``BSH + bo``, and the
    values."""
    ok = (tk[:, None] < T) & (c[None, :] < D)
    o = tk[:, None] * D + c[None, :]
    k = tl.load(K + o, mask=ok, other=float("-inf"))
    v = tl.load(V + o, mask=ok, other=0.0)
    sh = tl.load(BSH + bo + c, mask=c < D, other=0.0)
    e, ev = factors(k, v, sh, ok, vbig, margin)
    return e, ev, v


@triton.jit
def mm(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in ``acc``'s dtype (a float64 product stays float64); float32 in full
    precision on a GPU (``IEEE``)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _full_fwd(K, V, W, A_ROW, BSH, Y, DEN, T, D, NBS, vbig, margin, CAUSAL: tl.constexpr,
              IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    t = i * BM + tl.arange(0, BM)
    c = tl.program_id(2) * BD + tl.arange(0, BD)
    bo = (b * NBS + (i if CAUSAL else 0)) * D
    dt = Y.dtype.element_ty
    num = tl.zeros([BM, BD], dt)
    den = tl.zeros([BM, BD], dt)
    end = T
    if CAUSAL:
        end = tl.minimum((i + 1) * BM, T)
    for j0 in range(0, end, BN):
        tk = j0 + tl.arange(0, BN)
        ew = _weights(W, A_ROW, t, tk, T, CAUSAL).to(dt)
        e, ev, _ = _key_factors(K + b * T * D, V + b * T * D, BSH, bo, tk, c, T, D, vbig, margin)
        num = mm(ew, ev, num, IEEE)
        den = mm(ew, e, den, IEEE)
    o = (b * T + t[:, None]) * D + c[None, :]
    ok = (t[:, None] < T) & (c[None, :] < D)
    tl.store(Y + o, num / tl.where(den > 0, den, 1.0), mask=ok)
    tl.store(DEN + o, den, mask=ok)


@triton.jit
def _full_bwd_kv(K, V, W, A_ROW, BSH, R, S, DK, DV, T, D, NBS, NQ, vbig, margin,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BN
    tk = j0 + tl.arange(0, BN)
    c = tl.program_id(2) * BD + tl.arange(0, BD)
    dt = DK.dtype.element_ty
    dk = tl.zeros([BN, BD], dt)
    dv = tl.zeros([BN, BD], dt)
    first = 0
    if CAUSAL:
        first = j0 // BM  # the query blocks that reach key j0
    for i in range(first, NQ):
        t = i * BM + tl.arange(0, BM)
        ew = _weights(W, A_ROW, t, tk, T, CAUSAL).to(dt)
        o = (b * T + t[:, None]) * D + c[None, :]
        okq = (t[:, None] < T) & (c[None, :] < D)
        r = tl.load(R + o, mask=okq, other=0.0)
        s = tl.load(S + o, mask=okq, other=0.0)
        bo = (b * NBS + (i if CAUSAL else 0)) * D
        e, _, v = _key_factors(K + b * T * D, V + b * T * D, BSH, bo, tk, c, T, D, vbig, margin)
        er = mm(tl.trans(ew), r, tl.zeros([BN, BD], dt), IEEE)
        es = mm(tl.trans(ew), s, tl.zeros([BN, BD], dt), IEEE)
        dv += tl.where(e > 0, e * er, 0.0)
        dk += tl.where(e > 0, e * (v * er - es), 0.0)
    o = (b * T + tk[:, None]) * D + c[None, :]
    ok = (tk[:, None] < T) & (c[None, :] < D)
    tl.store(DK + o, dk, mask=ok)
    tl.store(DV + o, dv, mask=ok)


@triton.jit
def _full_bwd_w(K, V, W, A_ROW, BSH, R, S, DW, B, T, D, NBS, vbig, margin, CAUSAL: tl.constexpr,
                IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0)
    t = i * BM + tl.arange(0, BM)
    j0 = tl.program_id(1) * BN
    tk = j0 + tl.arange(0, BN)
    dt = DW.dtype.element_ty
    acc = tl.zeros([BM, BN], dt)
    nb = B
    if CAUSAL:
        nb = tl.where(j0 < (i + 1) * BM, B, 0)  # no tile above the diagonal
    for b in range(0, nb):
        bo = (b * NBS + (i if CAUSAL else 0)) * D
        for c0 in range(0, D, BD):
            c = c0 + tl.arange(0, BD)
            o = (b * T + t[:, None]) * D + c[None, :]
            okq = (t[:, None] < T) & (c[None, :] < D)
            r = tl.load(R + o, mask=okq, other=0.0)
            s = tl.load(S + o, mask=okq, other=0.0)
            e, ev, _ = _key_factors(K + b * T * D, V + b * T * D, BSH, bo, tk, c, T, D,
                                    vbig, margin)
            acc = mm(r, tl.trans(ev), acc, IEEE)
            acc = mm(-s, tl.trans(e), acc, IEEE)
    ew = _weights(W, A_ROW, t, tk, T, CAUSAL).to(dt)
    ok = (t[:, None] < T) & (tk[None, :] < T)
    tl.store(DW + t[:, None] * T + tk[None, :], tl.where(ew > 0, ew * acc, 0.0), mask=ok)


# ---------------------------------------------------------------------------- launchers
def blocks(T: int, D: int, device: torch.device) -> tuple[int, int, int]:
    """``(BM, BN, BD)``: queries, keys and channels of a block; ``tl.dot`` needs 16 or more. On
    a GPU 64 x 64 x 32 (not yet tuned); under the interpreter, whose cost is per program and per
    step, up to 64 x 64 x 256."""
    bt = max(16, min(64, triton.next_power_of_2(max(T, 1))))
    if device.type == "cuda":
        return bt, bt, 32
    return bt, bt, max(16, min(256, triton.next_power_of_2(max(D, 1))))


def _shifts(k, w, causal: bool, bm: int):
    """``a (T,)``: each row's largest seen bias; ``b (B, n, D)``: the key shift, one per query
    block (causal: the largest key ``t' <= i0``) or one for all (the largest key); 0 where
    there is no key."""
    T = k.shape[1]
    if causal:
        seen = torch.ones(T, T, dtype=torch.bool, device=w.device).tril()
        a = w.masked_fill(~seen, float("-inf")).amax(1)
        b = torch.cummax(k, 1).values[:, ::bm]
    else:
        a = w.amax(1)
        b = k.amax(1, keepdim=True)
    # no key yet (padding): any constant keeps the products causal; 0 keeps ordinary keys safe
    b = b.masked_fill(b == float("-inf"), 0.0)
    return a.contiguous(), b.contiguous()


def _exact_rows(k, v, a, b, den, causal: bool, bm: int, vbig: float, thr: float):
    """The rows (as ``(B, T, D)`` bools) that take the exact terms: see the module docstring."""
    T = k.shape[1]
    own = b.repeat_interleave(bm, 1)[:, :T] if causal else b  # each key's own block's shift
    unsafe = ~(((k - own) <= MARGIN) & (v.abs() <= vbig)) & (k != float("-inf"))
    has = k != float("-inf")
    if causal:
        unsafe, has = unsafe.cumsum(1) > 0, has.cumsum(1) > 0
    else:
        unsafe, has = unsafe.any(1, keepdim=True), has.any(1, keepdim=True)
    return unsafe | ~torch.isfinite(a)[None, :, None] | (has & ~(den >= thr))


def _band_args(k, w, causal: bool):
    """The band kernel's arguments for aft-full: ``w`` as band rows and empty prefix sums."""
    B, T, D = k.shape
    lo, hi = T - 1, (0 if causal else T - 1)
    t = torch.arange(T, device=k.device)[:, None]
    idx = (t - lo + torch.arange(lo + hi + 1, device=k.device)[None, :]).clamp(0, T - 1)
    wb = torch.gather(w, 1, idx)[:, None, :].contiguous()
    lp = torch.full((B, T, D), float("-inf"), dtype=torch.float64, device=k.device)
    return wb, lp, torch.zeros_like(k), lo, hi, idx


def ieee(device) -> bool:
    """``input_precision="ieee"`` for float32 products: on a GPU (the interpreter's products are
    numpy's, in the dtype)."""
    return device.type == "cuda"


def full_core(k, v, w, causal):
    if k.dtype not in TL:
        raise TypeError(f"aftlab::triton_full_core: float32 or float64 tensors, got {k.dtype}")
    k, v, w = k.contiguous(), v.contiguous(), w.to(k.dtype).contiguous()
    B, T, D = k.shape
    bm, bn, bd = blocks(T, D, k.device)
    a, b = _shifts(k, w, causal, bm)
    y, den = torch.empty_like(k), torch.empty_like(k)
    if not k.numel():
        return y, den, torch.zeros_like(k, dtype=torch.bool), a, b
    vbig, thr = limits(k.dtype, T)
    grid = (B, triton.cdiv(T, bm), triton.cdiv(D, bd))
    _full_fwd[grid](k, v, w, a, b, y, den, T, D, b.shape[1], vbig, MARGIN, CAUSAL=causal,
                    IEEE=ieee(k.device), BM=bm, BN=bn, BD=bd)
    exact = _exact_rows(k, v, a, b, den, causal, bm, vbig, thr)
    inv = torch.where(exact | (den == 0), 0.0, 1.0 / den)
    y = torch.where(den == 0, 0.0, y)  # a row that sees no key: 0
    if bool(exact.any()):
        wb, lp, ap, lo, hi, _ = _band_args(k, w, causal)
        ye, _ = band_core(k, v, wb, lp, ap, None, None, lo, hi)
        y = torch.where(exact, ye, y)
    return y, inv, exact, a, b


def full_core_backward(gy, k, v, w, y, inv, exact, a, b, causal):
    gy, k, v, y = (x.contiguous() for x in (gy, k, v, y))
    w = w.to(k.dtype).contiguous()
    B, T, D = k.shape
    dk, dv, dw = torch.zeros_like(k), torch.zeros_like(k), torch.zeros_like(w)
    if not k.numel():
        return dk, dv, dw
    bm, bn, bd = blocks(T, D, k.device)
    vbig, _ = limits(k.dtype, T)
    r = torch.where(exact | (gy == 0) | (inv == 0), 0.0, gy * inv)
    s = torch.where(r == 0, 0.0, r * y)
    nq = triton.cdiv(T, bm)
    exact_mm = ieee(k.device)
    _full_bwd_kv[(B, triton.cdiv(T, bn), triton.cdiv(D, bd))](
        k, v, w, a, b, r, s, dk, dv, T, D, b.shape[1], nq, vbig, MARGIN, CAUSAL=causal,
        IEEE=exact_mm, BM=bm, BN=bn, BD=bd)
    _full_bwd_w[(nq, triton.cdiv(T, bn))](
        k, v, w, a, b, r, s, dw, B, T, D, b.shape[1], vbig, MARGIN, CAUSAL=causal, IEEE=exact_mm,
        BM=bm, BN=bn, BD=bd)
    ge = torch.where(exact, gy, 0.0)
    if bool((ge != 0).any()):  # the exact rows' gradients from the band kernel's terms
        wb, lp, ap, lo, hi, idx = _band_args(k, w, causal)
        ye, l4 = band_core(k, v, wb, lp, ap, None, None, lo, hi)
        dke, dve, dwb = band_core_backward(ge, k, v, wb, lp, ap, None, None, ye, l4, lo, hi)[:3]
        dk, dv = dk + dke, dv + dve
        dw = dw.scatter_add(1, idx, dwb[:, 0, :])  # band entries outside [0, T) are 0
    return dk, dv, dw


IMPLS = {"full_core": full_core, "full_core_backward": full_core_backward}


def register() -> None:
    """The fakes and autograd of ``aftlab::triton_full_core`` (once, after it is defined)."""

    @torch.library.register_fake("aftlab::triton_full_core")
    def _(k, v, w, causal):
        B, T, D = k.shape
        n = triton.cdiv(T, blocks(T, D, k.device)[0]) if causal else 1
        return (k.new_empty(k.shape), k.new_empty(k.shape),
                k.new_empty(k.shape, dtype=torch.bool), k.new_empty(T), k.new_empty(B, n, D))

    @torch.library.register_fake("aftlab::triton_full_core_backward")
    def _(gy, k, v, w, y, inv, exact, a, b, causal):
        return k.new_empty(k.shape), k.new_empty(k.shape), k.new_empty(w.shape)

    def setup(ctx, inputs, output):
        k, v, w, ctx.causal = inputs
        ctx.save_for_backward(k, v, w, *output)

    def backward(ctx, gy, *_):
        k, v, w, y, inv, exact, a, b = ctx.saved_tensors
        dk, dv, dw = torch.ops.aftlab.triton_full_core_backward(
            gy, k, v, w, y, inv, exact, a, b, ctx.causal
        )
        return dk, dv, dw, None

    register_autograd_once("aftlab::triton_full_core", backward, setup, what="Triton kernel")


# ---------------------------------------------------------------------------- the op
def full(q, k, v, w, causal: bool, padding_mask):
    """aft-full on the Triton kernels: ``q, k, v (B, T, D)``, ``w (T', T')`` with ``T' >= T``;
    float16/bfloat16 computed in float32 and returned in their dtype."""
    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    T = q.shape[1]
    q, k, v, w = (x.to(cdt) for x in (q, k, v, w[:T, :T]))
    if padding_mask is not None:
        pad = ~padding_mask[:, :, None]
        k, v = k.masked_fill(pad, float("-inf")), v.masked_fill(pad, 0.0)
    y = torch.ops.aftlab.triton_full_core(k, v, w, bool(causal))[0]
    return (torch.sigmoid(q) * y).to(out_dtype)
