"""AFT-full (Zhai et al. 2021, eq. 2): exact, stable for any finite input, memory-linear.

For ``Q, K, V`` of shape ``(B, T, d)`` and pairwise position biases ``w`` (``T x T``, shared by
the channels), elementwise over the channel ``c``::

    Y_t = sigma(Q_t) * sum_t' exp(K_t' + w_{t,t'}) V_t' / sum_t' exp(K_t' + w_{t,t'})

(causal: ``t' <= t``). Written with ``P_{t,t',c} = exp(K_{t',c} + w_{t,t'} - L_{t,c})`` and
``L_{t,c} = log sum_t' exp(K_{t',c} + w_{t,t'})``, the bracket is the average
``A_t = sum_t' P_{t,t'} V_t'``, so ``Y = sigma(Q) * A``.

How it is computed (see docs/aft.md):

* **Fast path: two matrix products.** With a row shift ``m^w_t = max_t' w_{t,t'}`` and a
  per-channel key shift ``m^K_c = max_t' K_{t',c}`` every factor
  ``E^w = exp(w - m^w)`` and ``E^K = exp(K - m^K)`` is at most 1, and
  ``num = E^w @ (E^K * V)``, ``den = E^w @ E^K``; ``A = num / den``,
  ``L = log(den) + m^w + m^K``. Causal: rows in blocks; query block ``i`` multiplies only key
  blocks ``j <= i`` (the triangle above the diagonal blocks is skipped, not masked), each key
  block with its own shift ``m_j``, rescaled by ``exp(m_j - M_i) <= 1`` where
  ``M_i = max_{j <= i} m_j`` is the max over the keys block ``i`` may see:
  ``[num | den]_i = sum_{j <= i} exp(m_j - M_i) * (E^w_{ij} @ [E^K_j V_j | E^K_j])``.
* **Exact rescue.** The factorised shift can exceed the true ``max_t' (K_t' + w_{t,t'})`` by
  a lot when the two maximisers differ, and ``den`` then underflows (0/0) or loses precision.
  Every row ``(b, t)`` with a ``den`` below ``sqrt(finfo.tiny)`` is recomputed exactly, in
  float64, with its own per-``(t, c)`` maximum over the keys it sees. Typical inputs never
  take this path; adversarial ones (keys and biases ~1e4) still get the exact answer.
* **Backward** (custom autograd): with ``R = dA / den`` and ``S = (dA * A - dL) / den``::

      dV = E^K * (E^w^T @ R)
      dK = E^K * (V * (E^w^T @ R) - E^w^T @ S)
      dw = E^w * sum_b ([R, -S] @ [E^K V, E^K]^T)

  i.e. ``dV_t' = sum_t dA_t P_{t,t'}``, ``dK_t' = sum_t P_{t,t'} (dA_t (V_t' - A_t) + dL_t)``,
  ``dw_{t,t'} = sum_c P_{t,t',c} (dA_{t,c} (V_{t',c} - A_{t,c}) + dL_{t,c})``; rescued rows use
  the same formulas with ``P`` computed exactly.

Memory is ``O(B T d + T^2)``: nothing of size ``B x T x T x d`` is ever formed. float16 and
bfloat16 inputs are computed in float32 (autocast disabled inside) and returned in their dtype.

The same machinery (:func:`lse_average`) computes the band of AFT-local, whose bias is stored
per diagonal offset; see :mod:`aftlab.ops.aft_local`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._checks import check_compatible, check_padding_mask, check_tensor

__all__ = ["aft_full", "aft_full_reference", "lse_average"]

_CAUSAL_BLOCK = (256, 512)  # rows per block of the causal block-triangular product: T//4, clamped
_BAND_BLOCK = 64  # query rows per block of a banded (AFT-local) product
_RESCUE_ELEMS = 1 << 21  # elements of one (rows, keys, d) float64 chunk of the exact rescue


class Geometry(NamedTuple):
    """Which keys query ``t`` sees, and where its bias lives in ``wb`` (``(T, W)``).

    Column ``j`` of row ``t`` of ``wb`` is the bias of key ``t' = alpha * t + j - beta``.
    AFT-full: ``alpha = 0, beta = 0, W = T`` (``wb = w[:T, :T]``). AFT-local with window ``s``:
    ``alpha = 1, beta = s - 1`` and ``W = 2s - 1`` (``W = s`` causal), i.e. ``wb`` holds the
    band ``|t - t'| < s`` by diagonal offset. Causal additionally requires ``t' <= t``.
    """

    T: int
    W: int
    alpha: int
    beta: int
    causal: bool


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 are computed in float32; other dtypes in themselves."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ----------------------------------------------------------------------------- blocks
def _blocks(geo: Geometry) -> list[tuple[int, int, int, int]]:
    """Query blocks ``[i0, i1)`` with the key range ``[lo, hi)`` they may see.

    Non-causal AFT-full is one block; AFT-local's band is cut in blocks of ``_BAND_BLOCK``
    queries (causal AFT-full uses :func:`_causal_forward` instead).
    """
    T = geo.T
    if geo.alpha == 0:
        return [(0, T, 0, T)]
    out = []
    for i0 in range(0, T, _BAND_BLOCK):
        i1 = min(T, i0 + _BAND_BLOCK)
        lo = max(0, geo.alpha * i0 - geo.beta)
        hi = min(T, geo.alpha * (i1 - 1) + geo.W - geo.beta)
        if geo.causal:
            hi = min(hi, i1)
        out.append((i0, i1, lo, hi))
    return out


def _block_bias(wb, geo, i0, i1, lo, hi):
    """Bias ``w_{t,t'}`` for ``t in [i0, i1)``, ``t' in [lo, hi)``, -inf where not seen.

    Returns ``(bias (nq, nk), col)``; ``col`` is the gather index into ``wb`` (None for full).
    """
    dev = wb.device
    t = torch.arange(i0, i1, device=dev)[:, None]
    p = torch.arange(lo, hi, device=dev)[None, :]
    if geo.alpha == 0:
        bias, col = wb[i0:i1, lo:hi], None
        valid = (p <= t) if geo.causal and hi > i0 + 1 else None
    else:
        col = p - t + geo.beta
        valid = (col >= 0) & (col < geo.W)
        if geo.causal:
            valid = valid & (p <= t)
        col = col.clamp(0, geo.W - 1)
        bias = wb[i0:i1].gather(1, col)
    if valid is not None:
        bias = bias.masked_fill(~valid, float("-inf"))
    return bias, col


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _block_factors(k, v, pad, wb, geo, blk):
    """``E^w (nq, nk)``, ``E^K (B, nk, d)``, shifts ``m^w (nq, 1)``, ``m^K (B, 1, d)``."""
    i0, i1, lo, hi = blk
    bias, col = _block_bias(wb, geo, i0, i1, lo, hi)
    mw = _finite_or_zero(bias.amax(1, keepdim=True))
    kk = k[:, lo:hi]
    if pad is not None:
        kk = kk.masked_fill(~pad[:, lo:hi, None], float("-inf"))
    mk = _finite_or_zero(kk.amax(1, keepdim=True))
    return torch.exp(bias - mw), torch.exp(kk - mk), mw, mk, col


def _causal_factors(k, v, pad, size):
    """Causal AFT-full keys in ``n`` blocks of ``size`` (the last one padded), each with its shift.

    Returns ``X (B, n, size, 2d) = [E^K V | E^K]`` with ``E^K_j = exp(K_j - m_j)``, ``m_j`` the
    max of block ``j``'s unpadded keys; the pair scales ``exp(m_j - M_i) <= 1``
    ``(B, n_i, n_j, 2d)`` with ``M_i = max_{j <= i} m_j`` (0 for an all-padded block ``j``);
    and ``M (B, n, d)``.
    """
    B, T, d = k.shape
    n = -(-T // size)
    kp = k.new_full((B, n * size, d), float("-inf"))
    kp[:, :T] = k if pad is None else k.masked_fill(~pad[..., None], float("-inf"))
    vp = v.new_zeros((B, n * size, d))
    vp[:, :T] = v
    kp, vp = kp.view(B, n, size, d), vp.view(B, n, size, d)
    m = kp.amax(2)  # (B, n, d)
    M = _finite_or_zero(torch.cummax(m, 1).values)
    ek = torch.exp(kp - _finite_or_zero(m)[:, :, None])
    sc = torch.where(torch.isfinite(m)[:, None], torch.exp(m[:, None] - M[:, :, None]), 0.0)
    return torch.cat([ek * vp, ek], -1), torch.cat([sc, sc], -1), M


def _causal_rows(wb, geo, X, sc, i, size):
    """Query block ``i``: ``E^w (nq, kx)``, ``m^w (nq, 1)`` and the keys it sees, rescaled to its
    shift, ``X_i = [exp(m_j - M_i) X_j]_{j <= i}`` as ``(B, kx, 2d)``, ``kx = (i + 1) size``."""
    T, B = geo.T, X.shape[0]
    i0, i1, kx = i * size, min(geo.T, (i + 1) * size), (i + 1) * size
    bias, _ = _block_bias(wb, geo, i0, i1, 0, min(kx, T))
    bias = torch.nn.functional.pad(bias, (0, kx - bias.shape[1]), value=float("-inf"))
    mw = _finite_or_zero(bias.amax(1, keepdim=True))
    xs = (X[:, : i + 1] * sc[:, i, : i + 1, None]).reshape(B, kx, -1)
    return torch.exp(bias - mw), mw, xs, i0, i1, kx


def _causal_block_size(T: int) -> int:
    lo, hi = _CAUSAL_BLOCK
    return min(hi, max(lo, T // 4))


def _causal_forward(k, v, pad, wb, geo, L, A, den):
    """Block-triangular causal AFT-full: query block ``i`` times key blocks ``j <= i`` only,
    ``[num | den]_i = sum_{j <= i} exp(m_j - M_i) * (E^w_{ij} @ X_j)``."""
    B, T, d = k.shape
    size = _causal_block_size(T)
    X, sc, M = _causal_factors(k, v, pad, size)
    for i in range(X.shape[1]):
        ew, mw, xs, i0, i1, _ = _causal_rows(wb, geo, X, sc, i, size)
        out = torch.bmm(ew.expand(B, -1, -1), xs)
        den[:, i0:i1] = out[..., d:]
        A[:, i0:i1] = out[..., :d] / out[..., d:]
        L[:, i0:i1] = torch.log(out[..., d:]) + mw + M[:, i, None]


def _causal_backward(k, v, pad, wb, geo, R, S, dk, dv, dwb):
    """Backward of :func:`_causal_forward`, the same block pairs (see the module docstring)."""
    B, T, d = k.shape
    size = _causal_block_size(T)
    X, sc, _ = _causal_factors(k, v, pad, size)
    Y = torch.zeros_like(X)  # (B, n, size, 2d): E^w^T @ [R | S], per key block, key-block shift
    for i in range(X.shape[1]):
        ew, _, xs, i0, i1, kx = _causal_rows(wb, geo, X, sc, i, size)
        rs = torch.cat([R[:, i0:i1], S[:, i0:i1]], -1)
        y = torch.bmm(ew.t().expand(B, -1, -1), rs).view(B, i + 1, size, 2 * d)
        Y[:, : i + 1] += y * sc[:, i, : i + 1, None]
        left = torch.cat([R[:, i0:i1], -S[:, i0:i1]], -1).transpose(0, 1).reshape(i1 - i0, -1)
        g = ew * (left @ xs.transpose(0, 1).reshape(kx, -1).t())
        dwb[i0:i1, : min(kx, T)] = g[:, :T]
    ek, Y = X[..., d:].reshape(B, -1, d)[:, :T], Y.reshape(B, -1, 2 * d)[:, :T]
    dv.copy_(ek * Y[..., :d])
    dk.copy_(ek * (v * Y[..., :d] - Y[..., d:]))


# ----------------------------------------------------------------------------- exact rescue
def _rescue_rows(k, v, pad, wb, geo, rows):
    """Yield ``(b, t, kpos, valid, s, m)`` chunks: exact scores ``s = K_t' + w_{t,t'}`` in float64.

    ``s`` is ``(R, W, d)`` with -inf at keys the row does not see; ``m`` is its per-(t, c) max.
    """
    T, d = k.shape[1], k.shape[2]
    chunk = max(1, _RESCUE_ELEMS // max(1, geo.W * d))
    j = torch.arange(geo.W, device=k.device)
    for start in range(0, rows.shape[0], chunk):
        b, t = rows[start : start + chunk].unbind(1)
        kpos = geo.alpha * t[:, None] + j[None, :] - geo.beta
        valid = (kpos >= 0) & (kpos < T)
        if geo.causal:
            valid &= kpos <= t[:, None]
        kpos = kpos.clamp(0, T - 1)
        if pad is not None:
            valid &= pad[b[:, None], kpos]
        s = k[b[:, None], kpos].double() + wb[t].double()[:, :, None]
        s = s.masked_fill(~valid[:, :, None], float("-inf"))
        m = _finite_or_zero(s.amax(1, keepdim=True))
        yield b, t, kpos, s, m


def _rescue_forward(k, v, pad, wb, geo, rows, L, A):
    for b, t, kpos, s, m in _rescue_rows(k, v, pad, wb, geo, rows):
        e = torch.exp(s - m)
        den = e.sum(1)
        num = (e * v[b[:, None], kpos].double()).sum(1)
        ok = den > 0
        A[b, t] = torch.where(ok, num / torch.where(ok, den, 1.0), 0.0).to(A.dtype)
        L[b, t] = (torch.log(den) + m[:, 0]).to(L.dtype)


def _rescue_backward(k, v, pad, wb, geo, rows, A, gA, gL, dk, dv, dwb):
    j = torch.arange(geo.W, device=k.device)
    for b, t, kpos, s, m in _rescue_rows(k, v, pad, wb, geo, rows):
        e = torch.exp(s - m)
        den = e.sum(1, keepdim=True)
        p = e / torch.where(den > 0, den, 1.0)  # P_{t,t',c}, 0 at unseen keys
        ga, gl = gA[b, t].double()[:, None], gL[b, t].double()[:, None]
        a = A[b, t].double()[:, None]
        vr = v[b[:, None], kpos].double()
        g = p * (ga * (vr - a) + gl)  # d(loss)/d(K_t' + w_{t,t'}) per channel
        bb = b[:, None].expand_as(kpos)
        dk.index_put_((bb, kpos), g.to(dk.dtype), accumulate=True)
        dv.index_put_((bb, kpos), (p * ga).to(dv.dtype), accumulate=True)
        tt, jj = t[:, None].expand_as(kpos), j[None].expand_as(kpos)
        dwb.index_put_((tt, jj), g.sum(-1).to(dwb.dtype), accumulate=True)


# ----------------------------------------------------------------------------- autograd op
def _tau(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).tiny)


class _LSEAverage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, wb, pad, geo):
        B, T, d = k.shape
        L = torch.empty_like(k)
        A = torch.empty_like(k)
        den = torch.empty_like(k)
        causal_full = geo.alpha == 0 and geo.causal
        if causal_full:
            _causal_forward(k, v, pad, wb, geo, L, A, den)
        for blk in [] if causal_full else _blocks(geo):
            i0, i1, lo, hi = blk
            ew, ek, mw, mk, _ = _block_factors(k, v, pad, wb, geo, blk)
            out = torch.bmm(ew.expand(B, -1, -1), torch.cat([ek * v[:, lo:hi], ek], -1))
            num, dn = out[..., :d], out[..., d:]
            den[:, i0:i1] = dn
            A[:, i0:i1] = num / dn
            L[:, i0:i1] = torch.log(dn) + mw + mk
        rows = (den < _tau(den.dtype)).any(-1).nonzero()
        if rows.numel():
            _rescue_forward(k, v, pad, wb, geo, rows, L, A)
        ctx.geo = geo
        ctx.save_for_backward(k, v, wb, pad, A, den, rows)
        return L, A

    @staticmethod
    def backward(ctx, gL, gA):
        k, v, wb, pad, A, den, rows = ctx.saved_tensors
        geo = ctx.geo
        with torch.autocast(k.device.type, enabled=False):
            gL = torch.zeros_like(k) if gL is None else gL.contiguous()
            gA = torch.zeros_like(k) if gA is None else gA.contiguous()
            B, T, d = k.shape
            R, S = gA / den, (gA * A - gL) / den
            if rows.numel():  # rescued rows are handled exactly below, not by the fast path
                R[rows[:, 0], rows[:, 1]] = 0.0
                S[rows[:, 0], rows[:, 1]] = 0.0
            dk, dv, dwb = torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(wb)
            causal_full = geo.alpha == 0 and geo.causal
            if causal_full:
                _causal_backward(k, v, pad, wb, geo, R, S, dk, dv, dwb)
            for blk in [] if causal_full else _blocks(geo):
                i0, i1, lo, hi = blk
                ew, ek, _, _, col = _block_factors(k, v, pad, wb, geo, blk)
                rs = torch.cat([R[:, i0:i1], S[:, i0:i1]], -1)  # (B, nq, 2d)
                y = torch.bmm(ew.t().expand(B, -1, -1), rs)  # (B, nk, 2d)
                yr, ys = y[..., :d], y[..., d:]
                vb = v[:, lo:hi]
                dv[:, lo:hi] += ek * yr
                dk[:, lo:hi] += ek * (vb * yr - ys)
                left = torch.cat([R[:, i0:i1], -S[:, i0:i1]], -1)
                left = left.transpose(0, 1).reshape(i1 - i0, -1)  # (nq, B * 2d)
                right = torch.cat([ek * vb, ek], -1).transpose(0, 1).reshape(hi - lo, -1)
                dbias = ew * (left @ right.t())
                if col is None:
                    dwb[i0:i1, lo:hi] += dbias
                else:
                    dwb[i0:i1].scatter_add_(1, col, dbias)
            if rows.numel():
                _rescue_backward(k, v, pad, wb, geo, rows, A, gA, gL, dk, dv, dwb)
        return dk, dv, dwb, None, None


def lse_average(
    k: torch.Tensor,
    v: torch.Tensor,
    wb: torch.Tensor,
    geo: Geometry,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-biased log-sum-exp and softmax average over the keys each query sees.

    For every ``(b, t, c)`` and the keys ``t'`` of ``geo`` (see :class:`Geometry`)::

        L_t = log sum_t' exp(K_t' + w_{t,t'}),   A_t = sum_t' exp(K_t' + w_{t,t'} - L_t) V_t'

    with ``L = -inf`` and ``A = 0`` where a query sees no (unpadded) key. Differentiable in
    ``k``, ``v`` and ``wb``.

    Args:
        k, v: ``(B, T, d)``, same dtype (float32 or float64; callers upcast half precision).
        wb: ``(T, W)`` biases laid out as ``geo`` says.
        geo: the key geometry.
        padding_mask: optional bool ``(B, T)``, True for real keys.

    Returns:
        ``(L, A)``, each ``(B, T, d)``.
    """
    with torch.autocast(k.device.type, enabled=False):
        return _LSEAverage.apply(k.contiguous(), v.contiguous(), wb, padding_mask, geo)


# ----------------------------------------------------------------------------- public API
def check_aft_inputs(where, q, k, v, w, padding_mask):
    """Validate ``q, k, v (B, T, d)``, ``w (T', T')`` with ``T' >= T`` (unless None) and
    ``padding_mask (B, T)``."""
    check_tensor(where, "q", q, ndim=3, floating=True)
    B, T, d = q.shape
    check_tensor(where, "k", k, ndim=3, floating=True)
    check_tensor(where, "v", v, ndim=3, floating=True)
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(
                f"{where}: '{name}' must have shape {tuple(q.shape)} like 'q', got {tuple(x.shape)}"
            )
    named = {"q": q, "k": k, "v": v}
    if w is not None:
        check_tensor(where, "w", w, ndim=2, floating=True)
        if w.shape[0] < T or w.shape[1] < T:
            raise ValueError(
                f"{where}: 'w' must have shape (T', T') with T' >= T = {T} (the length of 'q'), "
                f"got {tuple(w.shape)}"
            )
        named["w"] = w
    check_compatible(where, named)
    if padding_mask is not None:
        check_padding_mask(where, padding_mask, (B, T), "q", q)


def aft_full(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """AFT-full (causal: ``t' <= t``)::

        Y_t = sigma(Q_t) * sum_t' exp(K_t' + w_{t,t'}) V_t' / sum_t' exp(K_t' + w_{t,t'})

    Elementwise over channels; ``w`` is shared by the channels. Exact for any finite input
    (see the module docstring for the method), ``O(B T^2 d)`` time in two matrix products
    (about half of that when causal), ``O(B T d + T^2)`` memory.

    Args:
        q, k, v: ``(B, T, d)`` (the paper's ``Q = X W^Q``, ``K``, ``V``).
        w: ``(T', T')`` pairwise position biases with ``T' >= T``; ``w[:T, :T]`` is used.
        causal: restrict every sum to ``t' <= t``.
        padding_mask: optional bool ``(B, T)``, True for real tokens; padded keys contribute
            nothing, and a query that sees no valid key gets 0.

    Returns:
        ``Y``: ``(B, T, d)`` in the dtype of ``q``.

    Example:
        >>> q, k, v = torch.randn(3, 2, 5, 4).unbind(0)
        >>> aft_full(q, k, v, torch.zeros(8, 8), causal=True).shape
        torch.Size([2, 5, 4])
    """
    check_aft_inputs("aft_full", q, k, v, w, padding_mask)
    T = q.shape[1]
    if T == 0:
        return q * 0.0  # empty, still connected to the graph
    cd = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc, wc = (x.to(cd) for x in (q, k, v, w))
        _, A = lse_average(kc, vc, wc[:T, :T], Geometry(T, T, 0, 0, bool(causal)), padding_mask)
        return (torch.sigmoid(qc) * A).to(q.dtype)


def biased_average_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 loop over query positions, straight from the formula::

        Y_t = sigma(Q_t) * sum_t' exp(K_t' + b_{t,t'}) V_t' / sum_t' exp(K_t' + b_{t,t'})

    ``bias`` is ``(T, T)``. Each row is shifted by its own maximum over the keys it sees
    (which leaves the ratio unchanged); a row with no valid key gives 0.
    """
    q, k, v, bias = (x.double() for x in (q, k, v, bias))
    B, T, d = q.shape
    rows = []
    for t in range(T):
        s = k + bias[t, :T, None]  # (B, T, d): K_t' + w_{t,t'}
        seen = torch.ones(B, T, dtype=torch.bool, device=q.device)
        if causal:
            seen[:, t + 1 :] = False
        if padding_mask is not None:
            seen &= padding_mask
        s = s.masked_fill(~seen[:, :, None], float("-inf"))
        m = s.amax(1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        den = e.sum(1)
        ok = den > 0
        avg = torch.where(ok, (e * v).sum(1) / torch.where(ok, den, torch.ones_like(den)), 0.0)
        rows.append(torch.sigmoid(q[:, t]) * avg)
    return torch.stack(rows, 1)


def aft_full_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow float64 AFT-full, one query position at a time, straight from the formula.

    Returns ``(B, T, d)`` float64 (differentiable, for checking gradients).
    """
    T = q.shape[1]
    return biased_average_reference(q, k, v, w[:T, :T], causal=causal, padding_mask=padding_mask)
