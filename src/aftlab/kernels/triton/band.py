"""Triton band kernels: aft-local and 1-D aft-conv, forward and backward.

The op is the band of :mod:`aftlab.kernels.band`: keys inside ``t - lo <= t' <= t + hi`` get
the bias ``w[tb(t), g(c), t' - t + lo]``, keys outside it bias 0::

    y_t = sigma(q_t) * sum_t' exp(k_t' + w'_{t,t'}) v_t' / sum_t' exp(k_t' + w'_{t,t'})

computed as a softmax over ``lo + hi + 3`` terms per query and channel: the ``lo + hi + 1`` keys
of the band, and two *virtual keys* that stand for everything outside it, the prefix
``t' < t - lo`` and (non-causal) the suffix ``t' > t + hi``, each with the log-sum ``L`` and
the average ``A`` of its keys from :func:`aftlab.ops.scan.stable_prefix_average` (a key
``(L, A)`` weighs ``exp(L)`` and carries the value ``A``: the sums over its keys exactly).

* ``aftlab::triton_band_core`` folds the terms of a block of ``BT`` queries x ``BD`` channels
  with the running maximum, one exponential of a non-positive number per term, in quarters
  (``z/4 = k/4 + w/4``: no overflow at keys and biases near ``finfo.max``), values scaled by
  ``2^-e``; it returns the average ``Y`` and its log-normaliser ``L4 = (log sum exp z) / 4``.
  No factorisation ``exp(w - a) exp(k - b)``, so no underflow to rescue: every term is exact.
* Its backward recomputes each weight ``p = exp(z - 4 L4) <= 1``: a pass over queries (the
  gradients of ``w``, reduced per program, and of the virtual keys) and one over keys (``dk``,
  ``dv``: the queries that see a key are the ``lo + hi + 1`` rows of its band).
* The prefix and suffix sums (float64, as the exponents), ``sigma(q)``, the padding mask
  (padded keys are ``-inf``: they weigh 0) and the broadcast of aft-conv's one key channel per
  head are PyTorch around the op, differentiated by autograd (the prefix average has its own
  custom op).
* :func:`band` runs them for aft-conv's heads (a kernel per head); with one bias row for all
  channels (aft-local, aft-conv with one head) it runs the products of :mod:`.band_dot`, whose
  exact rows come back here, as aft-full's (:mod:`.full`: the band of the whole sequence,
  ``lo = hi = T - 1``).

Work ``O(B T d (lo + hi + 1))`` exponentials; no ``(T, T)`` tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._autograd import register_autograd_once
from ._common import TL, clamp_abs, value_scale

SCHEMAS = {
    "band_core": "(Tensor k, Tensor v, Tensor w, Tensor lp, Tensor ap, Tensor? ls, Tensor? a_s,"
    " int lo, int hi) -> (Tensor, Tensor)",
    "band_core_backward": "(Tensor gy, Tensor k, Tensor v, Tensor w, Tensor lp, Tensor ap,"
    " Tensor? ls, Tensor? a_s, Tensor y, Tensor l4, int lo, int hi)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
}


@triton.jit
def _fold(z4, vs, valid, m4, n, s):
    """Fold a term (quarter log-weight ``z4``, scaled value ``vs``) into ``(m4, n, s)`` where
    ``valid``: one exponential of ``-|4 (z4 - m4)|``; the empty state is ``m4 = -inf``."""
    d4 = z4 - m4
    up = d4 > 0
    e = tl.exp((-tl.abs(4.0 * d4)).to(n.dtype))
    a = tl.where(up, e, 1.0)
    w = tl.where(up, 1.0, e)
    n = tl.where(valid, n * a + w * vs, n)
    s = tl.where(valid, s * a + w, s)
    m4 = tl.where(valid & up, z4, m4)
    return m4, n, s


@triton.jit
def _band_fwd(K, V, W, LP, AP, LS, AS, Y, L4, T, D, G, CPG, NW, lo, sc, unsc,
              PER_QUERY: tl.constexpr, SUFFIX: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)[:, None]
    c = tl.program_id(2) * BD + tl.arange(0, BD)[None, :]
    ok = (t < T) & (c < D)
    g = c // CPG
    dt = Y.dtype.element_ty
    m4 = tl.full([BT, BD], float("-inf"), tl.float64)
    n = tl.zeros([BT, BD], dt)
    s = tl.zeros([BT, BD], dt)
    vm = tl.zeros([BT, BD], dt)
    o = (b * T + t) * D + c
    # the prefix (and suffix) as one virtual key each: weight exp(L), value A
    lp4 = 0.25 * tl.load(LP + o, mask=ok, other=float("-inf")).to(tl.float64)
    ap = tl.load(AP + o, mask=ok, other=0.0) * sc
    has = ok & (lp4 != float("-inf"))
    m4, n, s = _fold(lp4, ap, has, m4, n, s)
    vm = tl.where(has, tl.maximum(vm, tl.abs(ap)), vm)
    if SUFFIX:
        ls4 = 0.25 * tl.load(LS + o, mask=ok, other=float("-inf")).to(tl.float64)
        a_s = tl.load(AS + o, mask=ok, other=0.0) * sc
        has = ok & (ls4 != float("-inf"))
        m4, n, s = _fold(ls4, a_s, has, m4, n, s)
        vm = tl.where(has, tl.maximum(vm, tl.abs(a_s)), vm)
    row = t if PER_QUERY else t * 0
    for j in range(0, NW):
        tk = t - lo + j
        inb = ok & (tk >= 0) & (tk < T)
        ok_ = (b * T + tk) * D + c
        k4 = 0.25 * tl.load(K + ok_, mask=inb, other=float("-inf")).to(tl.float64)
        vs = tl.load(V + ok_, mask=inb, other=0.0) * sc
        w4 = 0.25 * tl.load(W + (row * G + g) * NW + j, mask=inb, other=0.0).to(tl.float64)
        z4 = k4 + w4
        valid = inb & (z4 != float("-inf"))  # a padded key (-inf) weighs 0; NaN passes
        m4, n, s = _fold(z4, vs, valid, m4, n, s)
        vm = tl.where(valid, tl.maximum(vm, tl.abs(vs)), vm)
    avg = clamp_abs(n / tl.where(s == 0, 1.0, s), vm)
    tl.store(Y + o, tl.where(s == 0, 0.0, unsc * avg), mask=ok)  # NaN s stays NaN
    l4 = m4 + 0.25 * tl.log(s.to(tl.float64))
    tl.store(L4 + o, tl.where(s == 0, float("-inf"), l4), mask=ok)


@triton.jit
def _weight(z4, l4, valid, like):
    """``exp(4 (z4 - l4)) <= 1`` (float64 exponents, the weight in ``like``'s dtype) where
    ``valid`` and the row has a key, else 0."""
    use = valid & (l4 != float("-inf"))
    return tl.where(use, tl.exp((4.0 * (z4 - tl.where(use, l4, 0.0))).to(like.dtype)), 0.0)


@triton.jit
def _band_bwd_queries(GY, K, V, W, LP, AP, LS, AS, Y, L4, DWP, DLP, DAP, DLS, DAS, T, D, G, CPG,
                      NW, lo, PER_QUERY: tl.constexpr, SUFFIX: tl.constexpr, BT: tl.constexpr,
                      BD: tl.constexpr):
    # For each term with weight p of query t: dz = p G (value - Y). The virtual keys' dz is
    # dL (and dA = p G); a band key's dz goes to w here (reduced over the program's channels,
    # or its queries) and to k in the key pass.
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)[:, None]
    c = tl.program_id(2) * BD + tl.arange(0, BD)[None, :]
    ok = (t < T) & (c < D)
    g = c // CPG
    o = (b * T + t) * D + c
    gy = tl.load(GY + o, mask=ok, other=0.0)
    live = ok & (gy != 0)  # no gradient: no contribution (no 0 * NaN from a later position)
    y = tl.load(Y + o, mask=ok, other=0.0)
    l4 = tl.load(L4 + o, mask=ok, other=float("-inf"))
    lp4 = 0.25 * tl.load(LP + o, mask=ok, other=float("-inf")).to(tl.float64)
    ap = tl.load(AP + o, mask=ok, other=0.0)
    p = _weight(lp4, l4, live & (lp4 != float("-inf")), gy)
    tl.store(DLP + o, p * gy * (ap - y), mask=ok)
    tl.store(DAP + o, p * gy, mask=ok)
    if SUFFIX:
        ls4 = 0.25 * tl.load(LS + o, mask=ok, other=float("-inf")).to(tl.float64)
        a_s = tl.load(AS + o, mask=ok, other=0.0)
        p = _weight(ls4, l4, live & (ls4 != float("-inf")), gy)
        tl.store(DLS + o, p * gy * (a_s - y), mask=ok)
        tl.store(DAS + o, p * gy, mask=ok)
    row = t if PER_QUERY else t * 0
    nb = tl.num_programs(2) if PER_QUERY else tl.num_programs(1)
    part = tl.program_id(2) if PER_QUERY else tl.program_id(1)
    for j in range(0, NW):
        tk = t - lo + j
        inb = live & (tk >= 0) & (tk < T)
        ok_ = (b * T + tk) * D + c
        z4 = 0.25 * tl.load(K + ok_, mask=inb, other=float("-inf")).to(tl.float64)
        z4 += 0.25 * tl.load(W + (row * G + g) * NW + j, mask=inb, other=0.0).to(tl.float64)
        v = tl.load(V + ok_, mask=inb, other=0.0)
        p = _weight(z4, l4, inb & (z4 != float("-inf")), gy)
        dz = tl.where(p != 0, p * gy * (v - y), 0.0)
        if PER_QUERY:  # w (T, 1, NW): this program's part of dw[t, j], summed over channels
            dst = ((b * nb + part) * T + t) * NW + j
            tl.store(DWP + dst, tl.sum(dz, axis=1)[:, None], mask=t < T)
        else:  # w (1, G, NW): this program's part of dw[c, j], summed over its queries
            dst = ((b * nb + part) * D + c) * NW + j
            tl.store(DWP + dst, tl.sum(dz, axis=0)[None, :], mask=c < D)


@triton.jit
def _band_bwd_keys(GY, K, V, W, Y, L4, DK, DV, T, D, G, CPG, NW, lo,
                   PER_QUERY: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # Key t' is term j of query t = t' + lo - j: dv = sum p G, dk = sum p G (v - Y).
    b = tl.program_id(0).to(tl.int64)
    tk = tl.program_id(1) * BT + tl.arange(0, BT)[:, None]
    c = tl.program_id(2) * BD + tl.arange(0, BD)[None, :]
    ok = (tk < T) & (c < D)
    g = c // CPG
    ok_ = (b * T + tk) * D + c
    k4 = 0.25 * tl.load(K + ok_, mask=ok, other=float("-inf")).to(tl.float64)
    v = tl.load(V + ok_, mask=ok, other=0.0)
    dt = DK.dtype.element_ty
    dk = tl.zeros([BT, BD], dt)
    dv = tl.zeros([BT, BD], dt)
    for j in range(0, NW):
        t = tk + lo - j
        inb = ok & (t >= 0) & (t < T)
        o = (b * T + t) * D + c
        gy = tl.load(GY + o, mask=inb, other=0.0)
        live = inb & (gy != 0)
        y = tl.load(Y + o, mask=live, other=0.0)
        l4 = tl.load(L4 + o, mask=live, other=float("-inf"))
        row = t if PER_QUERY else t * 0
        w4 = 0.25 * tl.load(W + (row * G + g) * NW + j, mask=live, other=0.0).to(tl.float64)
        z4 = k4 + w4
        p = _weight(z4, l4, live & (z4 != float("-inf")), gy)
        pg = tl.where(p != 0, p * gy, 0.0)
        dv += pg
        dk += tl.where(p != 0, pg * (v - y), 0.0)
    tl.store(DK + ok_, dk, mask=ok)
    tl.store(DV + ok_, dv, mask=ok)


# ---------------------------------------------------------------------------- launchers
def _blocks(T: int, D: int, device: torch.device) -> tuple[int, int]:
    """``(BT, BD)``: on a GPU 64 queries x 32 channels (not yet tuned); under the interpreter
    as many as fit 2^16 elements (its cost is per program and per step)."""
    if device.type == "cuda":
        return 64, 32
    bd = min(1024, triton.next_power_of_2(max(D, 1)))
    return min(max(1, 65536 // bd), triton.next_power_of_2(max(T, 1))), bd


def _geometry(k, w):
    """``(T, D, channels per group, band width, a bias row per query)`` of ``w (1 or T, G,
    NW)``."""
    T, D = k.shape[1], k.shape[2]
    per_query = w.shape[0] > 1
    if per_query and w.shape[1] != 1:
        raise ValueError(
            f"triton_band_core: a bias row per query needs one group, got w {tuple(w.shape)}"
        )
    return T, D, D // w.shape[1], w.shape[2], per_query


def band_core(k, v, w, lp, ap, ls, a_s, lo, hi):
    if k.dtype not in TL:
        raise TypeError(f"aftlab::triton_band_core: float32 or float64 tensors, got {k.dtype}")
    k, v, lp, ap = (x.contiguous() for x in (k, v, lp, ap))
    w = w.to(k.dtype).contiguous()
    B = k.shape[0]
    T, D, cpg, nw, per_query = _geometry(k, w)
    y, l4 = torch.empty_like(k), torch.empty_like(k, dtype=torch.float64)
    if k.numel():
        bt, bd = _blocks(T, D, k.device)
        sc = value_scale(nw + 2)
        suffix = ls is not None
        ls, a_s = (ls.contiguous(), a_s.contiguous()) if suffix else (lp, ap)
        grid = (B, triton.cdiv(T, bt), triton.cdiv(D, bd))
        _band_fwd[grid](k, v, w, lp, ap, ls, a_s, y, l4, T, D, D // cpg, cpg, nw, lo, sc, 1.0 / sc,
                        PER_QUERY=per_query, SUFFIX=suffix, BT=bt, BD=bd)
    return y, l4


def band_core_backward(gy, k, v, w, lp, ap, ls, a_s, y, l4, lo, hi):
    gy, k, v, lp, ap, y, l4 = (x.contiguous() for x in (gy, k, v, lp, ap, y, l4))
    w = w.to(k.dtype).contiguous()
    B = k.shape[0]
    T, D, cpg, nw, per_query = _geometry(k, w)
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    dlp, dap = torch.empty_like(k), torch.empty_like(k)
    suffix = ls is not None
    dls, das = (torch.empty_like(k), torch.empty_like(k)) if suffix else (k.new_empty(0),) * 2
    if not k.numel():
        return dk, dv, torch.zeros_like(w), dlp, dap, dls, das
    bt, bd = _blocks(T, D, k.device)
    grid = (B, triton.cdiv(T, bt), triton.cdiv(D, bd))
    if per_query:
        dwp = k.new_zeros(B, grid[2], T, nw)
    else:
        dwp = k.new_zeros(B, grid[1], D, nw)
    ls_, as_ = (ls.contiguous(), a_s.contiguous()) if suffix else (lp, ap)
    _band_bwd_queries[grid](gy, k, v, w, lp, ap, ls_, as_, y, l4, dwp, dlp, dap,
                            dls if suffix else dlp, das if suffix else dap, T, D, D // cpg, cpg,
                            nw, lo,
                            PER_QUERY=per_query, SUFFIX=suffix, BT=bt, BD=bd)
    _band_bwd_keys[grid](gy, k, v, w, y, l4, dk, dv, T, D, D // cpg, cpg, nw, lo,
                         PER_QUERY=per_query,
                         BT=bt, BD=bd)
    dw = dwp.sum((0, 1))
    dw = dw[:, None, :] if per_query else dw.view(w.shape[1], cpg, nw).sum(1)[None]
    return dk, dv, dw.to(w.dtype), dlp, dap, dls, das


IMPLS = {"band_core": band_core, "band_core_backward": band_core_backward}


def fake_grads(k, w, ls):
    """The fake gradients ``(dk, dv, dw, dlp, dap, dls, das)`` of a band op's inputs
    ``(k, v, w, lp, ap, ls, a_s)`` (``dls, das`` empty without a suffix)."""
    like = [k.new_empty(k.shape) for _ in range(4)]
    rest = [k.new_empty(k.shape if ls is not None else (0,)) for _ in range(2)]
    return like[0], like[1], w.new_empty(w.shape), like[2], like[3], *rest


def setup_band(ctx, inputs, output):
    """Save a band op's inputs ``(k, v, w, lp, ap, ls, a_s, lo, hi)`` and its outputs."""
    k, v, w, lp, ap, ls, a_s, ctx.lo, ctx.hi = inputs
    ctx.suffix = ls is not None
    ctx.save_for_backward(k, v, w, lp, ap, ls, a_s, *output)


def register() -> None:
    """The fakes and autograd of ``aftlab::triton_band_core`` (once, after it is defined)."""

    @torch.library.register_fake("aftlab::triton_band_core")
    def _(k, v, w, lp, ap, ls, a_s, lo, hi):
        return k.new_empty(k.shape), k.new_empty(k.shape, dtype=torch.float64)

    @torch.library.register_fake("aftlab::triton_band_core_backward")
    def _(gy, k, v, w, lp, ap, ls, a_s, y, l4, lo, hi):
        return fake_grads(k, w, ls)

    def backward(ctx, gy, _gl4):
        k, v, w, lp, ap, ls, a_s, y, l4 = ctx.saved_tensors
        dk, dv, dw, dlp, dap, dls, das = torch.ops.aftlab.triton_band_core_backward(
            gy, k, v, w, lp, ap, ls, a_s, y, l4, ctx.lo, ctx.hi
        )
        if not ctx.suffix:
            dls = das = None
        return dk, dv, dw, dlp, dap, dls, das, None, None

    register_autograd_once("aftlab::triton_band_core", backward, setup_band, what="Triton kernel")


# ---------------------------------------------------------------------------- the op
def band(q, k, v, w, lo: int, hi: int, causal: bool, padding_mask):
    """The band op of :mod:`aftlab.kernels.band` on the Triton kernels: ``q, v (B, T, D)``,
    ``k (B, T, D or G)``, ``w (1 or T, G, lo + hi + 1)``; float16/bfloat16 computed in
    float32 and returned in their dtype."""
    from ...ops.scan import _stable_prefix_average

    out_dtype = q.dtype
    cdt = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    q, k, v, w = (x.to(cdt) for x in (q, k, v, w))
    B, T, D = q.shape
    if k.shape[-1] != D:  # aft-conv's one key channel per head
        k = k.repeat_interleave(D // k.shape[-1], dim=-1)
    if padding_mask is not None:
        pad = ~padding_mask[:, :, None]
        k, v = k.masked_fill(pad, float("-inf")), v.masked_fill(pad, 0.0)
    # The prefix and suffix sums in float64, as the band's exponents: their log-sums reach
    # keys of any size (near 1e4, a float32 log-sum is 1e-3 off).
    k64, v64 = k.double(), v.double()
    s = lo + 1  # the prefix of query t: keys t' <= t - s (none when s >= T)
    if s < T:
        L, A = _stable_prefix_average(k64, v64)
        A = A.to(cdt)
        lp = torch.cat([L.new_full((B, s, D), float("-inf")), L[:, : T - s]], 1)
        ap = torch.cat([A.new_zeros(B, s, D), A[:, : T - s]], 1)
    else:
        lp, ap = k64.new_full((B, T, D), float("-inf")), k.new_zeros(B, T, D)
    ls = a_s = None
    if not causal and hi + 1 < T:  # the suffix of query t: keys t' >= t + hi + 1
        r = hi + 1
        L, A = _stable_prefix_average(k64, v64, reverse=True)
        A = A.to(cdt)
        ls = torch.cat([L[:, r:], L.new_full((B, r, D), float("-inf"))], 1)
        a_s = torch.cat([A[:, r:], A.new_zeros(B, r, D)], 1)
    if w.shape[1] == 1:  # one bias row for every channel: the products (band_dot.py)
        y = torch.ops.aftlab.triton_band_dot(k, v, w, lp, ap, ls, a_s, lo, hi)[0]
    else:  # a kernel per head (aft-conv): the terms
        y, _ = torch.ops.aftlab.triton_band_core(k, v, w, lp, ap, ls, a_s, lo, hi)
    return (torch.sigmoid(q) * y).to(out_dtype)

