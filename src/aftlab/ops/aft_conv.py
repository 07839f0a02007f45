r"""AFT-conv: AFT-local with a per-head convolution kernel as position bias, 1-D and 2-D.

Per head ``i`` (``h`` heads of ``c`` channels; the key may have one channel per head, broadcast
over the head's channels), with kernel ``w^i`` of size ``s`` (the paper, Zhai et al. 2021):

.. math::

    Y^i_t = \sigma(Q^i_t) \odot
      \frac{\mathrm{conv}(e^{K^i} \odot V^i, e^{w^i} - 1)_t + \sum_{t'} e^{K^i_{t'}} V^i_{t'}}
           {\mathrm{conv}(e^{K^i}, e^{w^i} - 1)_t + \sum_{t'} e^{K^i_{t'}}}
    = \sigma(Q^i_t) \odot \sum_{t'} \mathrm{softmax}_{t'}(K^i_{t'} + w^i_{t,t'})\, V^i_{t'}

where ``w^i_{t,t'}`` is the kernel entry acting on ``t'`` inside the kernel footprint and 0
outside it (AFT-local with a Toeplitz bias). Kernel alignment follows ``F.conv1d``
(cross-correlation): non-causal (odd ``s``), ``w[:, j]`` acts on ``t' = t + j - s//2``; causal,
``w[:, j]`` acts on ``t' = t + j - (s - 1)`` (``w[:, -1]`` is the current token) and every sum
runs over ``t' <= t`` only. In 2-D, ``w[:, a, b]`` acts on ``(i + a - s//2, j + b - s//2)``.

How it is computed, exactly for any finite key and kernel, and finite for values up to
``finfo.max / 2`` (no ``exp`` of an unshifted quantity, no "global sum minus in-footprint sum"
cancellation):

* **Outside the footprint** the bias is 0, so the terms are plain prefix/suffix sums of
  ``e^{K} V``, taken with the stable scan :func:`aftlab.ops.scan.stable_prefix_average` (a
  log-sum ``L`` and a bounded weighted average ``A``) and read at the footprint's edges:
  causal, the prefix at ``t - s``; non-causal 1-D, the prefix at ``t - s//2 - 1`` and the
  suffix at ``t + s//2 + 1``; 2-D, rows above/below the box (scans over whole rows) plus, in
  each of the box's rows, the row prefix/suffix left/right of the box.
* **Inside the footprint** (``s`` or ``s^2`` offsets) each term ``K_{t'} + w_{t,t'}`` is
  shifted by the per-(t, channel) maximum ``m_t`` over the footprint and the outside log-sum,
  plus the headroom ``log(n + 1)`` for the ``n`` terms (``_numerics.headroom``), so every
  exponential is at most ``1 / (n + 1)``, the largest is that (the denominator is positive),
  and the value-weighted sum stays below the largest ``|V|``.
* The backward pass is written by hand with the same structure (forward and backward are the
  custom ops ``aftlab::aft_conv`` and ``aftlab::aft_conv_backward``, called whole by
  ``torch.compile``):
  with ``P_{t,t'} = e^{K_{t'} + w_{t,t'} - Z_t}`` (``Z_t`` the log of the denominator) and
  ``dO = dY \odot \sigma(Q)``, ``D_t = dO_t \cdot O_t``:
  ``dV_{t'} = \sum_t P_{t,t'} dO_t``, ``dK_{t'} = \sum_t P_{t,t'} (dO_t \cdot V_{t'} - D_t)``,
  ``dw_j = \sum_{(t,t') \text{ at } j} P_{t,t'} (dO_t \cdot V_{t'} - D_t)``; the outside part
  is again a stable scan with keys ``-Z_t`` and values ``[dO_t, D_t]`` (the transposed edge).

Cost: time ``O(T s d)`` (``O(HW s^2 d)`` in 2-D), memory ``O(T d)``: loops over the ``s``
kernel offsets on ``(B, T, h, c)`` tensors; nothing of size ``T x s x d`` is ever stored.
Log-domain quantities (keys, kernel, shifts, log-sums and the scans: ``ck`` channels per head)
are carried in float64, so ``K + w - m`` is exact even at ``|K|, |w| ~ 1e4`` (in float32 it would
already be off by ~1e-3); value-weighted sums are in float32 for fp16/bf16/float32 inputs and
float64 for float64 ones. The result has ``q``'s dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .._autograd import register_autograd_once
from .._checks import check_compatible, check_padding_mask, check_tensor
from ._band_state import (
    check_band_state,
    continue_band,
    reference_inputs,
    run_band,
)
from ._numerics import compute_dtype, finite_shift, headroom, lse_merge, shift_along
from ._state_checks import check_state_keywords
from .reference import biased_average_reference
from .scan import _stable_prefix_average
from .state import BandState

__all__ = ["aft_conv", "aft_conv2d", "aft_conv_reference", "aft_conv2d_reference"]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- helpers
def _scan(
    keys: torch.Tensor, vals: torch.Tensor, *, reverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable prefix (or suffix) log-sum and average over dim 1 of ``(N, T, D)`` tensors.

    Runs in the dtype of ``keys`` (float64 here: log-sums of magnitude 1e4 need it).

    ``-inf`` keys mean "absent"; they are always absent for all ``D`` channels of a position
    together (padding, or a query with no valid key), so they go to the scan as its padding mask.
    """
    present = torch.isfinite(keys[..., 0])
    k = torch.where(present[..., None], keys, torch.zeros_like(keys))
    return _stable_prefix_average(k, vals.to(k.dtype), reverse=reverse, padding_mask=present)


def _outside_box(
    keys: torch.Tensor, vals: torch.Tensor, half: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum and average of ``e^{keys} vals`` over the positions **outside** each position's box.

    ``keys``, ``vals``: ``(B, H, W, D)``; the box of ``(i, j)`` is ``|r - i| <= half`` and
    ``|col - j| <= half``. Outside = rows above the box + rows below the box + in each of the
    box's rows, the columns left and right of it; each part is a stable scan read at the box
    edge. The relation "outside the box" is symmetric, so this also computes its transpose.
    """
    B, H, W, D = keys.shape
    k2, v2 = keys.reshape(B * H, W, D), vals.reshape(B * H, W, D)
    Lp, Ap = (x.reshape(B, H, W, D) for x in _scan(k2, v2, reverse=False))
    Ls, As = (x.reshape(B, H, W, D) for x in _scan(k2, v2, reverse=True))
    # in the same row: columns < j - half (prefix at j - half - 1) and > j + half (suffix)
    row = lse_merge(
        [
            (shift_along(Lp, half + 1, 2, _NEG_INF), shift_along(Ap, half + 1, 2, 0.0)),
            (shift_along(Ls, -(half + 1), 2, _NEG_INF), shift_along(As, -(half + 1), 2, 0.0)),
        ]
    )
    # ... summed over the box's rows i - half .. i + half
    terms = [
        (shift_along(row[0], -di, 1, _NEG_INF), shift_along(row[1], -di, 1, 0.0))
        for di in range(-min(half, H - 1), min(half, H - 1) + 1)
    ]
    if H > half + 1:
        # whole rows above (prefix over rows, read at i - half - 1) and below (suffix, i + half + 1)
        Lr, Ar = Lp[:, :, -1], Ap[:, :, -1]  # (B, H, D): each row's total
        Lu, Au = _scan(Lr, Ar, reverse=False)
        Ld, Ad = _scan(Lr, Ar, reverse=True)
        for L, A, by in ((Lu, Au, half + 1), (Ld, Ad, -(half + 1))):
            L, A = shift_along(L, by, 1, _NEG_INF), shift_along(A, by, 1, 0.0)
            terms.append((L[:, :, None], A[:, :, None]))
    L, A = lse_merge(terms)
    return L.expand(B, H, W, D), A.expand(B, H, W, D)


def _outside_causal(
    keys: torch.Tensor, vals: torch.Tensor, s: int, *, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal outside part over ``(B, T, D)``: sum over ``t' <= t - s`` (the prefix read at
    ``t - s``); with ``transpose``, over ``t' >= t + s`` (the suffix read at ``t + s``)."""
    L, A = _scan(keys, vals, reverse=transpose)
    by = -s if transpose else s
    return shift_along(L, by, 1, _NEG_INF), shift_along(A, by, 1, 0.0)


@dataclass(frozen=True)
class _Geometry:
    """Where the kernel acts. Grid ``(H, W)`` (1-D: ``H = 1``); ``offsets[n] = (di, dj)`` is the
    offset of the key acted on by flattened kernel entry ``n``; pads are the grid margins."""

    H: int
    W: int
    s: int
    causal: bool
    offsets: tuple[tuple[int, int, int], ...]  # (di, dj, flat kernel index), in-range ones only
    pad_h: int
    pad_w_left: int
    pad_w_right: int

    @staticmethod
    def make(H: int, W: int, s: int, *, causal: bool, two_d: bool) -> _Geometry:
        if causal:
            lo, hi = s - 1, 0
        else:
            lo = hi = s // 2
        offs = []
        if two_d:
            P = s // 2
            for a in range(s):
                for b in range(s):
                    di, dj = a - P, b - P
                    if abs(di) < H and abs(dj) < W:
                        offs.append((di, dj, a * s + b))
            ph = min(P, H - 1)
        else:
            for j in range(s):
                dj = j - lo
                if abs(dj) < W:
                    offs.append((0, dj, j))
            ph = 0
        return _Geometry(H, W, s, causal, tuple(offs), ph, min(lo, W - 1), min(hi, W - 1))

    def pad(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """``(B, H, W, ...)`` -> ``(B, H + 2 pad_h, W + pad_w_left + pad_w_right, ...)``."""
        B, H, W = x.shape[:3]
        shape = (B, H + 2 * self.pad_h, W + self.pad_w_left + self.pad_w_right, *x.shape[3:])
        y = x.new_full(shape, fill)
        y[:, self.pad_h : self.pad_h + H, self.pad_w_left : self.pad_w_left + W] = x
        return y

    def window(self, xp: torch.Tensor, di: int, dj: int) -> torch.Tensor:
        """View of a padded tensor at the keys ``(i + di, j + dj)`` of every query ``(i, j)``."""
        i0, j0 = self.pad_h + di, self.pad_w_left + dj
        return xp[:, i0 : i0 + self.H, j0 : j0 + self.W]

    def interior(self, xp: torch.Tensor) -> torch.Tensor:
        return self.window(xp, 0, 0)

    def outside(
        self, keys: torch.Tensor, vals: torch.Tensor, *, transpose: bool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Outside-footprint log-sum and average of ``e^{keys} vals``.

        ``keys: (B, H, W, h, ck)`` (log domain), ``vals: (B, H, W, h, C)`` with ``C`` a multiple
        of ``ck``; key channel ``n`` weighs value channels ``n, n + ck, ...`` (``ck = 1``: all).
        Returns ``L: (B, H, W, h, ck)`` in ``keys``' dtype and ``A: (B, H, W, h, C)`` in
        ``dtype``. Runs a quarter of the heads at a time to bound the scans' temporaries.
        """
        B, H, W, h, C = vals.shape
        ck = keys.shape[-1]
        group = -(-h // 4)
        Ls, As = [], []
        for h0 in range(0, h, group):
            vg = vals[:, :, :, h0 : h0 + group].to(keys.dtype)
            kg = keys[:, :, :, h0 : h0 + group]
            kg = kg.expand(vg.shape) if ck == 1 else kg.repeat(1, 1, 1, 1, C // ck)
            D = vg.shape[3] * C
            if self.causal:
                L, A = _outside_causal(
                    kg.reshape(B, W, D), vg.reshape(B, W, D), self.s, transpose=transpose
                )
            else:  # symmetric relation: its transpose is itself
                L, A = _outside_box(kg.reshape(B, H, W, D), vg.reshape(B, H, W, D), self.s // 2)
            Ls.append(L.reshape(vg.shape)[..., :ck])
            As.append(A.reshape(vg.shape).to(dtype))
        return torch.cat(Ls, 3), torch.cat(As, 3)


def _empty(q, k, v, w) -> torch.Tensor:
    """The empty output of an empty input, connected to every input (whose gradients are 0)."""
    return torch.sigmoid(q) * v + (k.sum() + w.sum()) * 0.0


def _reduce_to(x: torch.Tensor, ck: int) -> torch.Tensor:
    """Sum a head's channels when the key has one channel per head (``ck == 1``)."""
    return x.sum(-1, keepdim=True) if ck == 1 else x


def _compute_inputs(q, k, v, w, mask):
    """``q, v`` in the compute dtype; ``k, w`` in float64, the log domain (so ``K + w - m`` is
    exact even at ``|K|, |w| ~ 1e4``), padded keys ``-inf`` (``e^{-inf} = 0``)."""
    cdt, ldt = compute_dtype(q.dtype), torch.float64
    q, v = q.to(cdt), v.to(cdt)
    k, w = k.to(ldt), w.to(ldt)
    if mask is not None:
        k = k.masked_fill(~mask[..., None, None], _NEG_INF)
    return q, k, v, w


def _conv_forward(q, k, v, w, mask, s: int, causal: bool, two_d: bool):
    """Grid form ``q, v: (B, H, W, h, c)``, ``k: (B, H, W, h, ck)``, ``w: (h, n)`` flattened
    kernel, ``mask: (B, H, W)`` bool or None. Returns ``(Y, Z, O)``: ``Y`` in ``q``'s dtype, and
    for the backward ``Z`` (the log of the denominator) and ``O`` (the average)."""
    geom = _Geometry.make(q.shape[1], q.shape[2], s, causal=causal, two_d=two_d)
    out_dtype = q.dtype
    q, k, v, w = _compute_inputs(q, k, v, w, mask)
    cdt = v.dtype
    # outside the footprint: stable scans read at the footprint edges
    L_out, A_out = geom.outside(k, v, transpose=False, dtype=cdt)
    kp, vp = geom.pad(k, _NEG_INF), geom.pad(v, 0.0)
    wb = w.view(1, 1, 1, *w.shape, 1)  # (1, 1, 1, h, n, 1)
    # pass 1: per-(t, channel) shift m_t = max(L_out, max_j K_{t+j} + w_j)
    m = L_out
    for di, dj, n in geom.offsets:
        m = torch.maximum(m, geom.window(kp, di, dj) + wb[..., n, :])
    m = finite_shift(m) + headroom(len(geom.offsets) + 1)  # num never overflows
    # pass 2: den = sum e^{K + w - m}, num = sum e^{K + w - m} V (every exponent < 0)
    den = torch.exp(L_out - m)
    num = den.to(cdt) * A_out
    for di, dj, n in geom.offsets:
        p = torch.exp(geom.window(kp, di, dj) + wb[..., n, :] - m)
        den = den + p
        num.addcmul_(p.to(cdt), geom.window(vp, di, dj))
    valid = den > 0  # False only for a query with no valid key
    O = num / torch.where(valid, den, torch.ones_like(den)).to(cdt)  # num = 0 where not valid
    # Z_t = m_t + log(den_t): the log of the denominator (-inf for a query with no key)
    Z = torch.where(valid, m + torch.log(den), torch.full_like(den, _NEG_INF))
    return (torch.sigmoid(q) * O).to(out_dtype), Z, O


def _conv_backward(gY, q, k, v, w, mask, Z, O, s: int, causal: bool, two_d: bool):
    """``(dq, dk, dv, dw)`` of :func:`_conv_forward`, each in its input's dtype."""
    geom = _Geometry.make(q.shape[1], q.shape[2], s, causal=causal, two_d=two_d)
    dq_t, dk_t, dv_t, dw_t = q.dtype, k.dtype, v.dtype, w.dtype
    q, k, v, w = _compute_inputs(q, k, v, w, mask)
    c, ck, cdt = v.shape[-1], k.shape[-1], v.dtype
    gY = gY.to(cdt)
    sig = torch.sigmoid(q)
    dq = gY * O * sig * (1 - sig)
    dO = gY * sig
    Dt = _reduce_to(dO * O, ck)  # D_t = dO_t . O_t (over the channels sharing a key)
    # outside part: key t' gets sum over queries t whose footprint excludes t' of
    # e^{K_t' - Z_t} [dO_t, D_t]: a stable scan with keys -Z_t, read at the transposed edge
    Lb, Ab = geom.outside(-Z, torch.cat([dO, Dt], -1), transpose=True, dtype=cdt)
    f = torch.exp(k + Lb)  # <= T: K_t' - Z_t <= 0 for every t
    dv = (f * Ab[..., :c]).to(cdt)
    dk = _reduce_to(v * dv, ck).to(k.dtype) - f * Ab[..., c:]
    # inside the footprint: P_{t,j} = e^{K_{t+j} + w_j - Z_t}, accumulated in the query frame
    Zs = torch.where(torch.isfinite(Z), Z, torch.zeros_like(Z))
    kp, vp = geom.pad(k, _NEG_INF), geom.pad(v, 0.0)
    dkp, dvp = geom.pad(dk, 0.0), geom.pad(dv, 0.0)
    dw = torch.zeros_like(w)
    wb = w.view(1, 1, 1, *w.shape, 1)
    for di, dj, n in geom.offsets:
        p = torch.exp(geom.window(kp, di, dj) + wb[..., n, :] - Zs)
        geom.window(dvp, di, dj).addcmul_(p.to(cdt), dO)
        da = p * (_reduce_to(dO * geom.window(vp, di, dj), ck) - Dt)
        geom.window(dkp, di, dj).add_(da)
        dw[:, n] = da.sum(dim=(0, 1, 2, 4))
    dk, dv = geom.interior(dkp), geom.interior(dvp)
    return dq.to(dq_t), dk.to(dk_t), dv.to(dv_t), dw.to(dw_t)


# One opaque operator forward and backward, like the scan, lse_average and the C++ kernels:
# torch.compile calls it whole. Its fakes are the computation itself on fake tensors (strides
# exact whatever the inputs' layout; a value read on the host, a sync on a GPU, fails there).
@torch.library.custom_op("aftlab::aft_conv", mutates_args=())
def _conv_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
    mask: torch.Tensor | None, s: int, causal: bool, two_d: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _conv_forward(q, k, v, w, mask, s, causal, two_d)


_conv_op.register_fake(_conv_forward)


@torch.library.custom_op("aftlab::aft_conv_backward", mutates_args=())
def _conv_backward_op(
    gY: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
    mask: torch.Tensor | None, Z: torch.Tensor, O: torch.Tensor, s: int, causal: bool,
    two_d: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _conv_backward(gY, q, k, v, w, mask, Z, O, s, causal, two_d)


_conv_backward_op.register_fake(_conv_backward)


def _conv_setup(ctx, inputs, output):
    q, k, v, w, mask, *ctx.geom = inputs
    _, Z, O = output
    ctx.save_for_backward(q, k, v, w, mask, Z, O)


def _conv_grad(ctx, gY, _gZ, _gO):
    q, k, v, w, mask, Z, O = ctx.saved_tensors
    gY = torch.zeros_like(q) if gY is None else gY
    dq, dk, dv, dw = _conv_backward_op(gY, q, k, v, w, mask, Z, O, *ctx.geom)
    return dq, dk, dv, dw, None, None, None, None


register_autograd_once("aftlab::aft_conv", _conv_grad, _conv_setup, what="PyTorch")


def _conv(q, k, v, w, mask, s: int, *, causal: bool, two_d: bool) -> torch.Tensor:
    """:func:`_conv_forward`'s ``Y``, differentiable (once) in ``q, k, v, w``."""
    return _conv_op(q, k, v, w, mask, s, causal, two_d)[0]


# --------------------------------------------------------------------------- validation
def _check_inputs(where: str, q, k, v, w, padding_mask, *, grid: bool):
    lead = "(B, H, W, h, c)" if grid else "(B, T, h, c)"
    nd = 5 if grid else 4
    check_tensor(where, "q", q, ndim=nd, floating=True)
    check_tensor(where, "k", k, ndim=nd, floating=True)
    check_tensor(where, "v", v, ndim=nd, floating=True)
    check_tensor(where, "w", w, ndim=3 if grid else 2, floating=True)
    if v.shape != q.shape:
        raise ValueError(
            f"{where}: 'v' must have the shape {lead} = {tuple(q.shape)} of 'q', "
            f"got {tuple(v.shape)}"
        )
    h, c = q.shape[-2:]
    if k.shape[:-1] != q.shape[:-1] or k.shape[-1] not in (1, c):
        raise ValueError(
            f"{where}: 'k' must have shape {tuple(q.shape[:-1]) + (1,)} or {tuple(q.shape)} "
            f"(one key channel per head, or one per channel) given 'q' {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if w.shape[0] != h:
        raise ValueError(
            f"{where}: 'w' must have one kernel per head, shape ({h}, ...) for 'q' "
            f"{tuple(q.shape)}, "
            f"got {tuple(w.shape)}"
        )
    s = w.shape[-1]
    if s < 1:
        raise ValueError(f"{where}: kernel 'w' must have size s >= 1, got shape {tuple(w.shape)}")
    if grid and w.shape[1] != w.shape[2]:
        raise ValueError(f"{where}: 'w' must be square (h, s, s), got {tuple(w.shape)}")
    check_compatible(where, {"q": q, "k": k, "v": v, "w": w})
    if padding_mask is not None:
        check_padding_mask(where, padding_mask, tuple(q.shape[: nd - 2]), "q", q)
    return s


# --------------------------------------------------------------------------- public ops
def aft_conv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    initial_state: BandState | None = None,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, BandState]:
    r"""AFT-conv over a sequence: a per-head conv kernel as AFT position bias.

    .. math::

        Y^i_t = \sigma(Q^i_t) \odot
          \frac{\sum_{t'} e^{K^i_{t'} + w^i_{t,t'}} V^i_{t'}}{\sum_{t'} e^{K^i_{t'} + w^i_{t,t'}}},
        \qquad w^i_{t,t'} = \begin{cases} w^i_j & t' = t + j - \ell \\
                                       0 & \text{otherwise}\end{cases}

    with ``l = s // 2`` (non-causal, odd ``s``) or ``l = s - 1`` (causal, sums over ``t' <= t``);
    this equals the paper's ``[conv(e^K V, e^w - 1) + sum e^K V] / [conv(e^K, e^w - 1) + sum e^K]``
    with ``F.conv1d`` (cross-correlation) alignment.

    Args:
        q: queries ``(B, T, h, c)``.
        k: keys ``(B, T, h, 1)`` (one per head, broadcast over its ``c`` channels) or
            ``(B, T, h, c)``.
        v: values ``(B, T, h, c)``.
        w: kernels ``(h, s)``; ``s`` odd unless ``causal``.
        causal: restrict every sum to ``t' <= t``.
        padding_mask: bool ``(B, T)``, True for real tokens; padded keys contribute nothing and a
            query with no valid key gets 0.
        initial_state: (causal) a :class:`~aftlab.ops.state.BandState` to continue: the ring of
            the last ``s - 1`` keys ``(B, s - 1, h, ck)`` and values ``(B, s - 1, h, c)`` and
            the running sums of the keys before them (``gone.p, gone.b (B, h, ck)``); None: the
            empty state.
        return_state: (causal) also return the state after the last position.
        cu_seqlens: (causal) int32 offsets ``[0, n_1, ..., T]`` of documents packed into a batch
            of one row, each restarting from the empty state (the first continuing
            ``initial_state``); the state returned is the last document's.

    Returns:
        ``Y``: ``(B, T, h, c)`` in ``q``'s dtype (computed in float32 for fp16/bf16); with
        ``return_state``, ``(Y, state)``, the state in the compute dtype.

    Raises:
        ValueError: wrong ranks/shapes, an even kernel for non-causal, a device mismatch, a
            state keyword on a non-causal call, bad ``cu_seqlens``, a state of another shape.
        TypeError: non-float or mismatched dtypes, a non-bool mask, a state not a BandState.

    Example:
        >>> q = v = torch.randn(2, 10, 4, 8); k = torch.randn(2, 10, 4, 1)
        >>> aft_conv(q, k, v, torch.randn(4, 5)).shape
        torch.Size([2, 10, 4, 8])
    """
    where = "aft_conv"
    s = _check_inputs(where, q, k, v, w, padding_mask, grid=False)
    stateful = check_state_keywords(where, causal, initial_state, return_state, cu_seqlens)
    if not causal and s % 2 == 0:
        raise ValueError(
            f"{where}: a non-causal kernel must have odd size s (centred), "
            f"got 'w' of shape {tuple(w.shape)}"
        )
    if not stateful:
        return _aft_conv(q, k, v, w, causal=causal, padding_mask=padding_mask)
    _, _, h, c = q.shape
    if initial_state is not None:
        check_band_state(
            where, initial_state, q, window=s, window_name="kernel size",
            value_shape=(h, c), key_shape=(h, k.shape[-1]),
        )

    def chunk(a: int, b: int, state: BandState | None, want: bool):
        mask = None if padding_mask is None else padding_mask[:, a:b]
        return _conv_chunk(q[:, a:b], k[:, a:b], v[:, a:b], w, state, want, mask)

    return run_band(
        where, q, chunk, initial_state=initial_state, return_state=return_state,
        cu_seqlens=cu_seqlens,
    )


def _conv_chunk(q, k, v, w, state: BandState | None, want: bool, padding_mask):
    """Causal 1-D :func:`aft_conv` on one chunk ``(B, T, h, c)`` continuing ``state`` (None:
    the empty one), unchecked (the mixer's call): ``y``, or ``(y, state after)`` with ``want``
    (:func:`~aftlab.ops._band_state.continue_band`)."""

    def call(qx, kx, vx, mx, n):
        return _aft_conv(qx, kx, vx, w.to(qx.dtype), causal=True, padding_mask=mx)

    def empty() -> BandState:
        B, _, h, c = q.shape
        return BandState.empty(
            B, w.shape[-1], (h, c), key_shape=(h, k.shape[-1]), device=q.device, dtype=q.dtype
        )

    return continue_band(call, q, k, v, padding_mask, state, want, empty)


def _aft_conv(q, k, v, w, *, causal: bool, padding_mask):
    """:func:`aft_conv` without the checks (the mixer's call: its input is validated)."""
    s = w.shape[-1]
    if q.numel() == 0:  # no batch, positions, heads or channels
        return _empty(q, k, v, w)
    impl = kernels.implementation("aft_conv", q)
    if impl != "torch":
        return kernels.band.conv1d(q, k, v, w, causal=causal, padding_mask=padding_mask,
                                   backend=impl)
    mask = None if padding_mask is None else padding_mask[:, None]
    y = _conv(q[:, None], k[:, None], v[:, None], w, mask, s, causal=bool(causal), two_d=False)
    return y[:, 0]


def aft_conv2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""AFT-conv over an image grid with a centred ``s x s`` kernel per head (non-causal).

    .. math::

        Y^i_{x} = \sigma(Q^i_x) \odot
          \frac{\sum_{x'} e^{K^i_{x'} + w^i_{x,x'}} V^i_{x'}}{\sum_{x'} e^{K^i_{x'} + w^i_{x,x'}}},
        \qquad w^i_{(r,c),(r',c')} = w^i[r' - r + s/\!/2,\ c' - c + s/\!/2]
        \text{ in the box, else } 0

    i.e. the global sum over all ``H W`` positions plus the 2-D conv correction with
    ``e^{w^i} - 1`` (the paper's ImageNet form), computed exactly (see the module docstring).

    Args:
        q: queries ``(B, H, W, h, c)``.
        k: keys ``(B, H, W, h, 1)`` or ``(B, H, W, h, c)``.
        v: values ``(B, H, W, h, c)``.
        w: kernels ``(h, s, s)``, odd ``s``; ``w[:, a, b]`` acts on
            ``(r + a - s//2, c + b - s//2)``.
        padding_mask: bool ``(B, H, W)``, True for real positions.

    Returns:
        ``Y``: ``(B, H, W, h, c)`` in ``q``'s dtype.

    Example:
        >>> q = v = torch.randn(2, 8, 8, 4, 8); k = torch.randn(2, 8, 8, 4, 1)
        >>> aft_conv2d(q, k, v, torch.randn(4, 3, 3)).shape
        torch.Size([2, 8, 8, 4, 8])
    """
    where = "aft_conv2d"
    s = _check_inputs(where, q, k, v, w, padding_mask, grid=True)
    if s % 2 == 0:
        raise ValueError(
            f"{where}: the kernel must have odd size s (centred), got 'w' of shape {tuple(w.shape)}"
        )
    return _aft_conv2d(q, k, v, w, padding_mask=padding_mask)


def _aft_conv2d(q, k, v, w, *, padding_mask):
    """:func:`aft_conv2d` without the checks (the mixer's call: its input is validated)."""
    s = w.shape[-1]
    if q.numel() == 0:  # no batch, positions, heads or channels
        return _empty(q, k, v, w)
    w = w.reshape(w.shape[0], s * s)
    return _conv(q, k, v, w, padding_mask, s, causal=False, two_d=True)


# --------------------------------------------------------------------------- references
def aft_conv_reference(
    q, k, v, w, *, causal: bool = False, padding_mask=None, initial_state=None
) -> torch.Tensor:
    """Float64 per-position loop straight from the formula of :func:`aft_conv` (slow; for tests).

    Builds each query's Toeplitz bias row ``w_{t,t'} = w[:, t' - t + l]`` inside the kernel and
    0 outside, then ``sigma(q_t) * sum_{t'} softmax_{t'}(k_{t'} + w_{t,t'}) v_{t'}``. With
    ``initial_state`` (causal): the ring's ``s - 1`` keys are real keys just before the chunk
    (kernel entries by their offsets) and ``gone`` is every row's ``past``.
    """
    if initial_state is not None and not causal:
        raise ValueError("aft_conv_reference: 'initial_state' needs causal=True, got causal=False")
    q, k, v, padding_mask, past, r = reference_inputs(initial_state, q, k, v, padding_mask)
    B, T = q.shape[:2]
    h, s = w.shape
    lo = s - 1 if causal else s // 2
    idx = torch.arange(T)
    j = idx[None, :] - idx[:, None] + lo  # (t, t') kernel index
    inside = (j >= 0) & (j < s)
    bias = torch.where(inside[None], w.double()[:, j.clamp(0, s - 1)], 0.0)  # (h, T, T)
    rows = [b.T[:, :, None] for b in bias.unbind(1)]  # (T, h, 1) per query; unbind: one backward
    if past is not None:
        L, A = (x.cpu() for x in past(0))
        past = lambda t: (L, A)  # noqa: E731
    y = biased_average_reference(
        q.cpu(), k.cpu(), v.cpu(), rows.__getitem__,
        causal=causal, padding_mask=None if padding_mask is None else padding_mask.cpu(),
        past=past,
    )
    return y[:, r:]


def aft_conv2d_reference(q, k, v, w, *, padding_mask=None) -> torch.Tensor:
    """Float64 per-position loop straight from the formula of :func:`aft_conv2d` (for tests)."""
    B, H, W, h, c = q.shape
    s = w.shape[-1]
    P = s // 2
    r, col = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    r, col = r.flatten(), col.flatten()
    a = r[None, :] - r[:, None] + P  # (x, x') kernel row
    b = col[None, :] - col[:, None] + P
    inside = (a >= 0) & (a < s) & (b >= 0) & (b < s)
    bias = torch.where(inside[None], w.double()[:, a.clamp(0, s - 1), b.clamp(0, s - 1)], 0.0)
    flat = [x.cpu().reshape(B, H * W, *x.shape[3:]) for x in (q, k, v)]
    mask = None if padding_mask is None else padding_mask.cpu().reshape(B, H * W)
    rows = [b.T[:, :, None] for b in bias.unbind(1)]
    return biased_average_reference(*flat, rows.__getitem__, padding_mask=mask).reshape(
        B, H, W, h, c
    )
