"""The log-sum-exp average of AFT-full and AFT-local's band: the PyTorch engine behind both.

For keys and values ``K, V`` of shape ``(B, T, d)`` and biases ``w`` laid out as a
:class:`Geometry` says (which keys ``t'`` query ``t`` sees), elementwise over the channel ``c``::

    L_t = log sum_t' exp(K_t' + w_{t,t'}),   A_t = sum_t' P_{t,t'} V_t'

with ``P_{t,t',c} = exp(K_{t',c} + w_{t,t'} - L_{t,c})`` (:func:`lse_average`). AFT-full is
``Y = sigma(Q) * A`` over every key (:mod:`aftlab.ops.aft_full`); AFT-local's band is the same
over ``|t - t'| < s``, its bias stored per diagonal offset (:mod:`aftlab.ops.aft_local`). This
is the PyTorch implementation (CUDA, ``AFTLAB_KERNELS=0``); on CPU tensors with the kernels on,
the C++ kernels ``aftlab::full`` and ``aftlab::band`` run instead (:mod:`aftlab.kernels`).

How it computes them (see docs/aft.md):

* **Fast path: two matrix products.** With a row shift ``m^w_t = max_t' w_{t,t'}`` (over the
  keys ``t'`` that query ``t`` sees) and a per-channel key shift ``m^K_c``, the factors
  ``E^w = exp(w - m^w)`` and ``E^K = exp(K - m^K)`` give ``num = E^w @ (E^K * V)``,
  ``den = E^w @ E^K``; ``A = num / den``, ``L = log(den) + m^w + m^K``. Non-causal: one block,
  ``m^K`` the max of all keys. ``m^K`` also holds the headroom ``log(n + 1)`` for the block's
  ``n`` keys (``_numerics.headroom``), so every ``E^K`` below the max is at most
  ``1 / (n + 1)`` and ``num`` stays below the largest ``|V|``: values up to ``finfo.max`` give
  a finite average, as on the kernels.
* **Causal: exact causality, bit for bit.** Query blocks ``[i0, i1)`` of 256-512 rows multiply
  the keys ``[0, i1)`` (the triangle above the block's diagonal is skipped); unseen biases
  are -inf, so ``E^w = 0`` there. The key shift ``m^K`` is the max of the keys ``[0, i0]``,
  which every query of the block sees, never a key in some query's future (the earlier key
  blocks are exponentiated once, with their own max ``m_j``, and rescaled by
  ``exp(m_j - m^K) <= 1``). The block's own
  (*diagonal*) keys ``[i0, i1)`` may then have ``E^K > 1``; one with ``E^K > e^44``,
  ``|E^K V| > finfo.max / (n + 1)`` or a non-finite ``E^K`` or ``E^K V`` (a NaN or inf input, or
  an overflow) is *unsafe*: it is
  zeroed, so that the queries before it multiply a finite 0 with their ``E^w = 0``. A query
  that sees an unsafe key gets NaN in that channel if the key or value there is non-finite,
  and is recomputed exactly (below) otherwise. So an output depends only on the keys,
  values and biases it sees: a NaN, an inf or any other change at position ``p`` leaves every
  output before ``p`` bit-identical (up to the sign of a zero).
* **Exact rescue.** The factorised shift ``m^w_t + m^K`` can exceed the true
  ``max_t' (K_t' + w_{t,t'})`` by a lot when the two maximisers differ, and ``den`` then
  underflows (0/0) or loses precision. Every row ``(b, t)`` with a ``den`` below
  ``sqrt(finfo.tiny)`` (or an unsafe diagonal key with finite inputs) is recomputed exactly,
  in float64, with its own per-``(t, c)`` maximum over the keys it sees. Typical inputs never
  take this path; adversarial ones (keys and biases ~1e4) still get the exact answer.
* **One operator.** Forward and backward are the custom ops ``aftlab::lse_average`` and
  ``aftlab::lse_average_backward`` (``torch.library.custom_op``): ``torch.compile`` calls them
  opaquely, as it calls the C++ kernels. What it reads back to the host (a sync on a GPU) is
  read at one point per call: in the forward after its products (whether a diagonal key was
  unsafe, the rows to rescue), in the backward before them (which sequences have gradient in
  which block, the rescued rows); the rescue, when it runs, also reads each chunk's last row.
* **Backward** (custom autograd): with ``R = dA / den`` and ``S = (dA * A - dL) / den``::

      dV = E^K * (E^w^T @ R)
      dK = E^K * (V * (E^w^T @ R) - E^w^T @ S)
      dw = E^w * sum_b ([R, -S] @ [E^K V, E^K]^T)

  i.e. ``dV_t' = sum_t dA_t P_{t,t'}``, ``dK_t' = sum_t P_{t,t'} (dA_t (V_t' - A_t) + dL_t)``,
  ``dw_{t,t'} = sum_c P_{t,t',c} (dA_{t,c} (V_{t',c} - A_{t,c}) + dL_{t,c})``; rescued rows use
  the same formulas with ``P`` computed exactly. Outputs without upstream gradient
  contribute exactly 0 (``R = S = 0``; a block none reaches is skipped, a sequence none of
  whose queries in a block has gradient gets that block's factors zeroed), so the gradients
  of inputs before ``p`` from outputs before ``p`` are bit-identical whatever comes at ``p``.
  Every accumulation is deterministic for a fixed thread count (``scatter_add_`` along the
  bias rows, ``index_add_`` for the rescue; no ``index_put_(accumulate=True)``).

Memory is ``O(B T d + T^2)`` for AFT-full: nothing of size ``B x T x T x d`` is ever formed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._autograd import register_autograd_once
from ._numerics import headroom

__all__ = ["Geometry", "causal_block_size", "lse_average"]

_CAUSAL_BLOCK = (256, 512)  # rows per block of the causal block-triangular product: T//4, clamped
_BAND_BLOCK = 64  # query rows per block of a banded (AFT-local) product
_RESCUE_ELEMS = 1 << 21  # elements of one (rows, keys, d) float64 chunk of the exact rescue
_SAFE = math.exp(44.0)  # largest factor exp(K_t' - m^K) of a causal diagonal key (den stays finite)


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


# ----------------------------------------------------------------------------- blocks
def causal_block_size(T: int, bounds: tuple[int, int] | None = None) -> int:
    """Query rows per causal block: ``T // 4`` clamped to ``bounds`` (:data:`_CAUSAL_BLOCK`)."""
    lo, hi = bounds or _CAUSAL_BLOCK
    return min(hi, max(lo, T // 4))


def _query_block(geo: Geometry) -> int:
    """Query rows per block of :func:`_blocks` (every block starts at a multiple of it)."""
    if geo.alpha:
        return _BAND_BLOCK
    return causal_block_size(geo.T) if geo.causal else geo.T


def _blocks(geo: Geometry) -> list[tuple[int, int, int, int]]:
    """Query blocks ``[i0, i1)`` with the key range ``[lo, hi)`` they are multiplied with.

    Non-causal AFT-full is one block; causal AFT-full is cut in blocks of 256-512 queries
    (:data:`_CAUSAL_BLOCK`) against the keys ``[0, i1)``; AFT-local's band in blocks of
    ``_BAND_BLOCK`` queries. Causal blocks always end their keys at ``hi = i1``: the keys
    ``[i0, i1)`` are the block's *diagonal*, in the future of some of its queries.
    """
    T, size = geo.T, _query_block(geo)
    if geo.alpha == 0:
        return [(i0, min(T, i0 + size), 0, min(T, i0 + size)) for i0 in range(0, T, size)]
    out = []
    for i0 in range(0, T, size):
        i1 = min(T, i0 + size)
        lo = max(0, geo.alpha * i0 - geo.beta)
        hi = min(T, geo.alpha * (i1 - 1) + geo.W - geo.beta)
        if geo.causal:
            hi = min(hi, i1)
        out.append((i0, i1, lo, hi))
    return out


def _block_bias(wb, geo, i0, i1, lo, hi):
    """Bias ``w_{t,t'}`` for ``t in [i0, i1)``, ``t' in [lo, hi)``, -inf where not seen.

    Returns ``(bias (nq, nk), col)``; ``col`` is the gather index into ``wb`` (None for full).
    Unseen entries are overwritten (``masked_fill``), so a NaN bias there never enters.
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


def _floor(m: torch.Tensor) -> torch.Tensor:
    """A shift with -inf (nothing seen) replaced by 0, so that ``exp(x - m)`` is 0, not NaN.

    NaN and +inf are kept: they come from a NaN or +inf input the queries see, and make
    exactly those outputs NaN.
    """
    return m.masked_fill(m == float("-inf"), 0.0)


class _Factors(NamedTuple):
    """One block's factors: ``P_{t,t'} ∝ E^w_{t,t'} E^K_{t'}``, shifted by ``m^w_t + m^K``."""

    bias: torch.Tensor  # (nq, nk), -inf where not seen
    col: torch.Tensor | None  # gather index into wb (band), None for full
    ew: torch.Tensor  # (nq, nk) exp(bias - m^w), 0 where not seen
    mw: torch.Tensor  # (nq, 1)
    x: torch.Tensor  # (B, nk, 2d): [E^K V | E^K], E^K = exp(K - m^K), 0 at unsafe diagonal keys
    mk: torch.Tensor  # (B, 1, d)
    unsafe: torch.Tensor | None  # causal: (B, nq, d) bool, diagonal keys zeroed above, or None


def _key_blocks(k, v, geo) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal AFT-full's keys in blocks of the query block size, each with its own shift.

    Returns ``X (B, n, S, 2d) = [E V | E]`` with ``E_j = exp(K_j - m_j)`` and ``m (B, n, 1, d)``
    the raw max of block ``j``'s keys (-inf for an all-padded block), computed once and
    rescaled by ``exp(m_j - m^K) <= 1`` for each later query block; None for other geometries.
    """
    if not (geo.causal and geo.alpha == 0):
        return None
    B, T, d = k.shape
    S = causal_block_size(T)
    n = -(-T // S)
    kp = torch.nn.functional.pad(k, (0, 0, 0, n * S - T), value=float("-inf")).view(B, n, S, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, n * S - T)).view(B, n, S, d)
    m = kp.amax(2, keepdim=True)
    x = kp.new_empty(B, n, S, 2 * d)
    torch.exp(torch.sub(kp, _floor(m), out=x[..., d:]), out=x[..., d:])
    torch.mul(x[..., d:], vp, out=x[..., :d])
    return x, m


def _factors(k, v, wb, geo, blk, kb=None) -> _Factors:
    """The factors of block ``blk`` (``k``: padded keys already -inf, ``v``: padded values 0;
    ``kb``: :func:`_key_blocks` for causal AFT-full).

    ``m^w_t`` is the max of the biases query ``t`` sees. ``m^K`` is, non-causal, the max of the
    block's keys; causal, the max of the keys ``[lo, i0]``, which every query of the block
    sees (so nothing a query must not see sets its shift). Causal diagonal keys may then exceed
    ``m^K``: a factor ``E^K > e^44`` (``den`` could overflow) or a non-finite ``E^K`` or
    ``E^K V`` makes the key *unsafe*; it is zeroed here (so that the queries before it multiply
    a finite 0, never a NaN or inf), and the queries from it on are handled by the caller.
    """
    i0, i1, lo, hi = blk
    bias, col = _block_bias(wb, geo, i0, i1, lo, hi)
    mw = _floor(bias.amax(1, keepdim=True))
    B, d = k.shape[0], k.shape[2]
    x = k.new_empty(B, hi - lo, 2 * d)
    room = headroom(hi - lo)  # E^K <= 1 / (n + 1) below the key shift: num never overflows
    if kb is not None and i0 > 0:  # causal AFT-full: the earlier key blocks, rescaled
        X, m = kb
        i = i0 // X.shape[2]
        mk = _floor(torch.maximum(m[:, :i].amax(1), k[:, i0 : i0 + 1])) + room
        sc = torch.exp(m[:, :i] - mk[:, None])  # (B, i, 1, d), at most 1 / (n + 1)
        torch.mul(X[:, :i], torch.cat([sc, sc], -1), out=x[:, :i0].view(B, i, -1, 2 * d))
        js = i0  # keys computed below: the diagonal
    else:
        mk = _floor(k[:, lo : (i0 + 1 if geo.causal else hi)].amax(1, keepdim=True)) + room
        js = 0
    ev, ek = x[:, js:, :d], x[:, js:, d:]
    torch.exp(torch.sub(k[:, lo + js : hi], mk, out=ek), out=ek)
    torch.mul(ek, v[:, lo + js : hi], out=ev)
    unsafe = None
    if geo.causal:  # the diagonal keys [i0, hi)
        dv, dk = x[:, i0 - lo :, :d], x[:, i0 - lo :, d:]
        # True for NaN, inf, E^K > e^44, or |E^K V| > finfo.max / (n + 1) (num could overflow)
        unsafe = ~((dk <= _SAFE) & (dv.abs() <= torch.finfo(dv.dtype).max / (hi - lo + 1)))
        dk.masked_fill_(unsafe, 0.0)
        dv.masked_fill_(unsafe, 0.0)
    return _Factors(bias, col, torch.exp(bias - mw), mw, x, mk, unsafe)


def _by_block(x: torch.Tensor, size: int) -> torch.Tensor:
    """Bool ``x (B, T, ...)`` as uint8 ``(B, n, size, ...)``: blocks of ``size`` positions, the
    last padded with False."""
    B, T = x.shape[:2]
    n = -(-T // size)
    pad = (0, 0) * (x.dim() - 2) + (0, n * size - T)
    return torch.nn.functional.pad(x.to(torch.uint8), pad).view(B, n, size, *x.shape[2:])


def _block_cumany(x: torch.Tensor, size: int) -> torch.Tensor:
    """``out[:, t] = any(x[:, i0 : t + 1])`` for bool ``(B, T, d)``, ``i0`` the start of the
    block of ``size`` positions that holds ``t``."""
    B, T, d = x.shape
    return torch.cummax(_by_block(x, size), 2).values.view(B, -1, d)[:, :T].bool()


# ----------------------------------------------------------------------------- exact rescue
def _rescue_rows(k, v, wb, geo, rows):
    """Yield ``(b, t, j, kpos, valid, s, m)`` chunks: scores ``s = K_t' + w_{t,t'}`` in float64.

    ``j`` are the columns of ``wb`` read (``W'`` of them: all ``W``, or causal AFT-full the
    keys up to the chunk's last row), ``kpos`` ``(R, W')`` their key positions; ``s`` is
    ``(R, W', d)`` with -inf at keys the row does not see (padded keys are -inf in ``k``);
    ``valid`` ``(R, W')`` marks the keys the row sees; ``m`` is the per-(t, c) max.
    """
    T, d = k.shape[1], k.shape[2]
    chunk = max(1, _RESCUE_ELEMS // max(1, geo.W * d))
    full_causal = geo.alpha == 0 and geo.causal
    if full_causal:  # rows by position: a chunk reads the keys up to its last row only
        rows = rows[torch.sort(rows[:, 1], stable=True).indices]
    for start in range(0, rows.shape[0], chunk):
        b, t = rows[start : start + chunk].unbind(1)
        j = torch.arange(int(t.max()) + 1 if full_causal else geo.W, device=k.device)
        kpos = geo.alpha * t[:, None] + j[None, :] - geo.beta
        valid = (kpos >= 0) & (kpos < T)
        if geo.causal:
            valid &= kpos <= t[:, None]
        kpos = kpos.clamp(0, T - 1)
        s = k[b[:, None], kpos].double() + wb[t[:, None], j[None, :]].double()[:, :, None]
        s = s.masked_fill(~valid[:, :, None], float("-inf"))
        # the headroom of the widest row, W: not of the columns this chunk reads, which depend
        # on the chunk's last row (a later row rescued would change an earlier row's rounding)
        m = _floor(s.amax(1, keepdim=True)) + headroom(geo.W)
        yield b, t, j, kpos, valid, s, m


def _seen_values(v, b, kpos, valid):
    """``V_t'`` in float64 at the keys a rescued row sees, 0 elsewhere (no future NaN enters)."""
    return v[b[:, None], kpos].double().masked_fill(~valid[:, :, None], 0.0)


def _rescue_forward(k, v, wb, geo, rows, L, A):
    for b, t, _, kpos, valid, s, m in _rescue_rows(k, v, wb, geo, rows):
        e = torch.exp(s - m)
        den = e.sum(1)
        num = (e * _seen_values(v, b, kpos, valid)).sum(1)
        A[b, t] = torch.where(den == 0, 0.0, num / torch.where(den == 0, 1.0, den)).to(A.dtype)
        if L is not None:
            L[b, t] = torch.log(den) + m[:, 0]


def _rescue_backward(k, v, wb, geo, rows, A, gA, gL, quiet, dk, dv, dwb):
    """Gradients of the rescued rows, accumulated with ``index_add_`` (deterministic on CPU,
    unlike ``index_put_(accumulate=True)``) over whole slices: one call per chunk for AFT-full,
    whose rows all read the keys ``j``; one per band offset for AFT-local."""
    T = k.shape[1]
    for b, t, j, kpos, valid, s, m in _rescue_rows(k, v, wb, geo, rows):
        e = torch.exp(s - m)
        den = e.sum(1, keepdim=True)
        p = e / torch.where(den == 0, 1.0, den)  # P_{t,t',c}, 0 at unseen keys
        ga, gl = gA[b, t].double()[:, None], gL[b, t].double()[:, None]
        a = A[b, t].double()[:, None]
        vr = _seen_values(v, b, kpos, valid)
        # no upstream gradient, or a key not seen: contributes exactly nothing (not 0 * NaN)
        off = quiet[b, t][:, None] | ~valid[:, :, None]
        g = (p * (ga * (vr - a) + gl)).masked_fill(off, 0.0).to(dk.dtype)  # d/d(K + w)
        gv = (p * ga).masked_fill(off, 0.0).to(dv.dtype)
        dwb[:, : j.numel()].index_add_(0, t, g.sum(-1).to(dwb.dtype))
        if geo.alpha == 0:  # every row reads the keys kpos = j
            dk[:, : j.numel()].index_add_(0, b, g)
            dv[:, : j.numel()].index_add_(0, b, gv)
        else:
            for c in range(j.numel()):
                at = b * T + kpos[:, c]
                dk.view(-1, k.shape[2]).index_add_(0, at, g[:, c])
                dv.view(-1, k.shape[2]).index_add_(0, at, gv[:, c])


# ----------------------------------------------------------------------------- autograd op
def _tau(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).tiny)


def _lse_forward(k, v, wb, pad, geo, with_log):
    """The forward of :func:`lse_average`: ``(L, A, den, redo)``; ``redo`` (``(B, T)`` bool)
    marks the rows computed exactly (the rescue)."""
    B, T, d = k.shape
    if pad is not None:  # padded keys contribute exp(-inf) = 0, padded values 0
        k = k.masked_fill(~pad[..., None], float("-inf"))
        v = v.masked_fill(~pad[..., None], 0.0)
    L = k.new_empty((B, T, d) if with_log else (0,), dtype=torch.float64)  # else not formed
    A, den = torch.empty_like(k), torch.empty_like(k)
    redo = torch.zeros(B, T, dtype=torch.bool, device=k.device)  # rows to compute exactly
    unsafe, shifts = [], []  # causal: each block's unsafe diagonal keys (B, nq, d), m^K
    kb = _key_blocks(k, v, geo)
    for blk in _blocks(geo):
        i0, i1, lo, hi = blk
        f = _factors(k, v, wb, geo, blk, kb)
        out = torch.bmm(f.ew.expand(B, -1, -1), f.x)  # [num | den]
        den[:, i0:i1] = dn = out[..., d:]
        torch.div(out[..., :d], dn, out=A[:, i0:i1])
        if with_log:  # log(den) + m^w + m^K, the last sum in float64
            torch.add(torch.log(dn).add_(f.mw), f.mk.double(), out=L[:, i0:i1])
        if geo.causal:
            unsafe.append(f.unsafe)
            shifts.append(f.mk.expand(B, i1 - i0, d))
    # den < tau: the factorised shift m^w + m^K was far above max(K + w) (NaN: not taken)
    redo |= (den < _tau(den.dtype)).any(-1)
    # Host syncs (on a GPU), once per call and back to back, after all the products: whether a
    # diagonal key was unsafe, and (below) which rows to recompute.
    if unsafe and bool((u := torch.cat(unsafe, 1)).any()):
        # queries from an unsafe diagonal key of their block on, per channel: NaN if an input
        # they see is NaN or inf (also in the shift), else recomputed exactly
        size = _query_block(geo)
        hit = _block_cumany(u, size)
        bad = _block_cumany(torch.isnan(k) | (k == float("inf")) | ~torch.isfinite(v), size)
        bad |= ~torch.isfinite(torch.cat(shifts, 1))
        A.masked_fill_(hit & bad, float("nan"))
        redo |= (hit & ~bad).any(-1)
    rows = redo.nonzero()
    if rows.numel():
        _rescue_forward(k, v, wb, geo, rows, L if with_log else None, A)
    return L, A, den, redo


def _lse_backward(gL, gA, k, v, wb, pad, A, den, redo, geo):
    """The backward of :func:`lse_average`: ``(dK, dV, dwb)``."""
    B, T, d = k.shape
    if pad is not None:
        k = k.masked_fill(~pad[..., None], float("-inf"))
        v = v.masked_fill(~pad[..., None], 0.0)
    gL = torch.zeros_like(k) if gL.shape != k.shape else gL.to(k.dtype)
    gA = gA.to(k.dtype)
    # outputs without upstream gradient contribute exactly 0 (not 0 * NaN from a NaN row);
    # rescued rows are handled exactly below, not by the fast path
    quiet = (gA == 0) & (gL == 0)
    off = quiet | redo[..., None]
    R = (gA / den).masked_fill_(off, 0.0)
    S = ((gA * A - gL) / den).masked_fill_(off, 0.0)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dwb = torch.zeros(wb.shape, dtype=wb.dtype, device=wb.device)
    # A sequence none of whose queries in a block has gradient gets exactly nothing from the
    # block (its factors may hold a NaN from its shift m^K, which 0 must not turn into NaN):
    # the block is skipped if that holds for every sequence, else their factors are zeroed.
    # Host reads (on a GPU, syncs), once per call and back to back, before the products: which
    # (sequence, block) has gradient, and the rescued rows.
    live = _by_block(~off, _query_block(geo)).any(-1).any(-1).bool()  # (B, n)
    live_host = live.t().tolist()
    rows = redo.nonzero()
    kb = _key_blocks(k, v, geo)
    for j, (blk, live_b) in enumerate(zip(_blocks(geo), live_host, strict=True)):
        i0, i1, lo, hi = blk
        if not any(live_b):
            continue
        rs = torch.cat([R[:, i0:i1], S[:, i0:i1]], -1)  # (B, nq, 2d)
        f = _factors(k, v, wb, geo, blk, kb)
        x = f.x if all(live_b) else torch.where(live[:, j, None, None], f.x, 0.0)
        nq, nk = i1 - i0, hi - lo
        y = torch.bmm(f.ew.t().expand(B, -1, -1), rs)  # (B, nk, 2d)
        yr, ys = y[..., :d], y[..., d:]
        ev, ek = x[..., :d], x[..., d:]
        dv[:, lo:hi] += ek * yr
        dk[:, lo:hi] += ev * yr - ek * ys
        left = torch.cat([R[:, i0:i1], -S[:, i0:i1]], -1).transpose(0, 1)
        right = x.transpose(0, 1)
        g = f.ew * (left.reshape(nq, B * 2 * d) @ right.reshape(nk, B * 2 * d).t())
        g = g.masked_fill(f.bias == float("-inf"), 0.0)  # unseen biases: exactly 0
        if f.col is None:
            dwb[i0:i1, lo:hi] += g
        else:
            dwb[i0:i1].scatter_add_(1, f.col, g)
    if rows.numel():
        _rescue_backward(k, v, wb, geo, rows, A, gA, gL, quiet, dk, dv, dwb)
    return dk, dv, dwb


# The PyTorch implementation is one opaque operator, forward and backward, like the C++ kernels:
# torch.compile traces around it (its rescue picks rows by value) and autograd calls its backward.
@torch.library.custom_op("aftlab::lse_average", mutates_args=())
def _lse_op(
    k: torch.Tensor, v: torch.Tensor, wb: torch.Tensor, pad: torch.Tensor | None,
    W: int, alpha: int, beta: int, causal: bool, with_log: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    geo = Geometry(k.shape[1], W, alpha, beta, causal)
    return _lse_forward(k, v, wb, pad, geo, with_log)


@_lse_op.register_fake
def _(k, v, wb, pad, W, alpha, beta, causal, with_log):
    L = k.new_empty(k.shape if with_log else (0,), dtype=torch.float64)
    return L, k.new_empty(k.shape), k.new_empty(k.shape), k.new_empty(k.shape[:2], dtype=torch.bool)


@torch.library.custom_op("aftlab::lse_average_backward", mutates_args=())
def _lse_backward_op(
    gL: torch.Tensor, gA: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wb: torch.Tensor,
    pad: torch.Tensor | None, A: torch.Tensor, den: torch.Tensor, redo: torch.Tensor,
    W: int, alpha: int, beta: int, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    geo = Geometry(k.shape[1], W, alpha, beta, causal)
    return _lse_backward(gL, gA, k, v, wb, pad, A, den, redo, geo)


@_lse_backward_op.register_fake
def _(gL, gA, k, v, wb, pad, A, den, redo, W, alpha, beta, causal):
    return k.new_empty(k.shape), v.new_empty(v.shape), wb.new_empty(wb.shape)  # contiguous


def _lse_setup(ctx, inputs, output):
    k, v, wb, pad, *ctx.geo = inputs[:8]
    _, A, den, redo = output
    ctx.save_for_backward(k, v, wb, pad, A, den, redo)


def _lse_grad(ctx, gL, gA, _gden, _gredo):
    k, v, wb, pad, A, den, redo = ctx.saved_tensors
    gL = k.new_zeros(0) if gL is None else gL
    gA = torch.zeros_like(k) if gA is None else gA
    dk, dv, dwb = _lse_backward_op(gL, gA, k, v, wb, pad, A, den, redo, *ctx.geo)
    return dk, dv, dwb, None, None, None, None, None, None


register_autograd_once("aftlab::lse_average", _lse_grad, _lse_setup, what="PyTorch")


def lse_average(
    k: torch.Tensor,
    v: torch.Tensor,
    wb: torch.Tensor,
    geo: Geometry,
    padding_mask: torch.Tensor | None = None,
    *,
    with_log: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-biased log-sum-exp and softmax average over the keys each query sees.

    For every ``(b, t, c)`` and the keys ``t'`` of ``geo`` (see :class:`Geometry`)::

        L_t = log sum_t' exp(K_t' + w_{t,t'}),   A_t = sum_t' exp(K_t' + w_{t,t'} - L_t) V_t'

    with ``L = -inf`` and ``A = 0`` where a query sees no (unpadded) key. Differentiable in
    ``k``, ``v`` and ``wb``. Causal: each output depends on the keys and values it sees only,
    bit for bit (a NaN or inf at ``t'`` leaves every ``t < t'`` unchanged).

    Args:
        k, v: ``(B, T, d)``, same dtype (float32 or float64; callers upcast half precision).
        wb: ``(T, W)`` biases laid out as ``geo`` says.
        geo: the key geometry.
        padding_mask: optional bool ``(B, T)``, True for real keys.
        with_log: False: ``L`` is not formed (an empty tensor is returned in its place).

    Returns:
        ``(L, A)``, each ``(B, T, d)``; ``L`` in float64 (it reaches ``2 * finfo(float32).max``
        for the largest float32 keys and biases), ``A`` in the dtype of ``k``.
    """
    if k.numel() == 0:  # empty batch or channels: empty outputs, still connected to the graph
        z = k * 0.0 + v * 0.0 + wb.sum() * 0.0
        return z.double(), z
    with torch.autocast(k.device.type, enabled=False):
        L, A, _, _ = _lse_op(
            k.contiguous(), v.contiguous(), wb, padding_mask, geo.W, geo.alpha, geo.beta,
            geo.causal, with_log,
        )
        return L, A

