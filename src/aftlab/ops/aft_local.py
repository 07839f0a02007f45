"""AFT-local (Zhai et al. 2021, eq. 4): a local window of learned biases, global connectivity kept.

With window ``s``, the bias is ``w'_{t,t'} = w_{t,t'}`` where ``|t - t'| < s`` and **0**
elsewhere (not -inf: every position still sees every other), elementwise over channels::

    Y_t = sigma(Q_t) * sum_t' exp(K_t' + w'_{t,t'}) V_t' / sum_t' exp(K_t' + w'_{t,t'})

(causal: ``t' <= t``). The sum over ``t'`` splits into three disjoint parts, each kept as a
log-sum-exp ``L`` and a softmax average ``A`` (so that nothing overflows and nothing cancels):

* the band ``|t - t'| < s``: ``L^band, A^band`` from the banded two-matmul kernel
  :func:`aftlab.ops.lse_average.lse_average` (blocks of 64 queries against the ``64 + 2s - 2``
  keys they see), whose bias is stored by diagonal offset, ``w_band[t, j] = w_{t, t + j - (s-1)}``;
* the keys ``t' <= t - s`` (bias 0): the prefix primitive
  :func:`aftlab.ops.scan.stable_prefix_average` read at ``t - s``;
* the keys ``t' >= t + s`` (bias 0; non-causal only): the reverse primitive read at ``t + s``.

They are combined with a per-``(t, c)`` maximum ``M = max_p L^p``::

    Y_t = sigma(Q_t) * sum_p exp(L^p_t - M_t) A^p_t / sum_p exp(L^p_t - M_t)

(``M`` plus the headroom ``log 4``, so that the sum of at most three averages never overflows)
in float64 for the ``L^p`` (the band's reaches ``2 * finfo(float32).max`` for the largest
float32 keys and biases); a NaN input stays NaN. Causal, every part sees only ``t' <= t``
(the band's blocks as causal AFT-full's, see :mod:`aftlab.ops.lse_average`), so an output never
depends on a later input, bit for bit.

This is the paper's "global sum plus local correction ``exp(w) - 1``" without its subtraction,
which cancels catastrophically when a band key dominates and ``w`` is very negative. Time
``O(B T s d)``, memory ``O(B T d + T s)``. ``s = 0`` is AFT-simple; ``s >= T`` is AFT-full.
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import check_compatible, check_positive_int, check_qkv, check_tensor
from ._numerics import compute_dtype, headroom, shift_along
from .aft_full import check_aft_inputs
from .lse_average import Geometry, lse_average
from .reference import biased_average_reference
from .scan import _stable_prefix_average

__all__ = ["aft_local", "aft_local_band", "aft_local_reference", "band_geometry", "band_of"]


def band_geometry(T: int, window: int, *, causal: bool) -> Geometry:
    """Geometry of the band ``|t - t'| < s`` (``s = min(window, T) >= 1``), stored by offset.

    Column ``j`` of ``w_band`` holds key ``t' = t + j - (s - 1)``; ``W = 2s - 1`` (``s`` causal).
    """
    s = min(window, T)
    return Geometry(T, s if causal else 2 * s - 1, 1, s - 1, bool(causal))


def band_of(w: torch.Tensor, T: int, window: int, *, causal: bool = False) -> torch.Tensor:
    """Gather ``w_band (T, W)``, ``w_band[t, j] = w[t, t + j - (s - 1)]``, from ``w (T', T')``.

    Entries whose key falls outside ``[0, T)`` are filled with 0 (never used).
    """
    geo = band_geometry(T, window, causal=causal)
    t = torch.arange(T, device=w.device)[:, None]
    cols = t + torch.arange(geo.W, device=w.device)[None, :] - geo.beta
    inside = (cols >= 0) & (cols < T)
    return w[:T, :T].gather(1, cols.clamp(0, T - 1)).masked_fill(~inside, 0.0)


def aft_local_band(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_band: torch.Tensor,
    window: int,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """AFT-local with the bias given as its band only (what the mixer uses; no ``T x T`` tensor).

    Args:
        q, k, v: ``(B, T, d)``.
        w_band: ``(T, W)`` with ``w_band[t, j] = w_{t, t + j - (s - 1)}``, ``s = min(window, T)``,
            ``W = 2s - 1`` (``s`` when causal); see :func:`band_of`. Ignored when ``window == 0``.
        window: ``s >= 0``.
        causal: restrict to ``t' <= t``.
        padding_mask: optional bool ``(B, T)``, True for real tokens.

    Returns:
        ``(B, T, d)`` in the dtype of ``q``.
    """
    where = "aft_local"
    check_qkv(where, q, k, v, padding_mask)
    check_positive_int(where, "window", window, allow_zero=True)
    T = q.shape[1]
    if T and window:
        geo = band_geometry(T, window, causal=causal)
        check_tensor(where, "w_band", w_band, shape=(T, geo.W), floating=True)
        check_compatible(where, {"q": q, "w_band": w_band})
    return _aft_local_band(q, k, v, w_band, window, causal=causal, padding_mask=padding_mask)


def _aft_local_band(q, k, v, w_band, window: int, *, causal: bool, padding_mask):
    """:func:`aft_local_band` without the checks (the mixer's call: its input is validated)."""
    if q.shape[1] == 0:
        return q * 0.0  # empty, still connected to the graph
    if kernels.enabled(q):
        return kernels.band.local(q, k, v, w_band, window, causal=causal, padding_mask=padding_mask)
    return _aft_local_torch(q, k, v, w_band, window, causal=causal, padding_mask=padding_mask)


def _aft_local_torch(q, k, v, w_band, window: int, *, causal: bool, padding_mask):
    """The pure-PyTorch implementation of :func:`aft_local_band` (inputs already validated)."""
    T = q.shape[1]
    cd = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc = (x.to(cd) for x in (q, k, v))
        parts = []
        s = min(window, T)
        if s > 0:
            geo = band_geometry(T, window, causal=causal)
            parts.append(lse_average(kc, vc, w_band.to(cd), geo, padding_mask))
        if s < T:
            # keys t' <= t - s: prefix sums read at t - s
            L, A = _stable_prefix_average(kc, vc, padding_mask=padding_mask)
            parts.append((shift_along(L, s, 1, float("-inf")), shift_along(A, s, 1, 0.0)))
            if not causal:  # keys t' >= t + max(s, 1): reverse sums read there
                L, A = _stable_prefix_average(kc, vc, reverse=True, padding_mask=padding_mask)
                r = max(s, 1)
                parts.append((shift_along(L, -r, 1, float("-inf")), shift_along(A, -r, 1, 0.0)))
        if len(parts) == 1:
            avg = parts[0][1]
        else:
            # log-sums in float64: the band's reaches 2 * finfo(float32).max for the largest
            # float32 keys and biases. M = -inf (no key at all) -> 0; a NaN stays NaN; the
            # headroom keeps num below the largest value.
            M = parts[0][0].detach().double()
            for L, _ in parts[1:]:
                M = torch.maximum(M, L.detach())
            M = M.masked_fill_(M == float("-inf"), 0.0).add_(headroom(len(parts)))
            num = den = 0.0
            for L, A in parts:
                e = torch.exp((L - M).to(cd))  # L - M <= 0 (or NaN): exact enough in cd
                num, den = num + e * A, den + e
            empty = den == 0  # no key at all: 0; a NaN den (NaN input) stays NaN
            avg = torch.where(empty, 0.0, num / torch.where(empty, 1.0, den))
        return (torch.sigmoid(qc) * avg).to(q.dtype)


def aft_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    window: int,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """AFT-local (causal: ``t' <= t``)::

        Y_t = sigma(Q_t) * sum_t' exp(K_t' + w'_{t,t'}) V_t' / sum_t' exp(K_t' + w'_{t,t'})

    ``w'_{t,t'} = w_{t,t'}`` if ``|t - t'| < window`` else 0 (global connectivity kept).
    ``window = 0`` is AFT-simple, ``window >= T`` is AFT-full. Exact and stable for any finite
    key and bias, finite for values up to ``finfo.max / 2`` on every path (up to ``finfo.max``
    on the kernel); ``O(B T s d)`` time, ``O(B T d + T s)`` memory (only the band of ``w`` is
    read).

    Args:
        q, k, v: ``(B, T, d)``.
        w: ``(T', T')`` position biases with ``T' >= T``; only its band is used.
        window: ``s >= 0``.
        causal: restrict every sum to ``t' <= t``.
        padding_mask: optional bool ``(B, T)``, True for real tokens.

    Returns:
        ``(B, T, d)`` in the dtype of ``q``.

    Raises:
        ValueError: ``window < 0``, or shapes that do not match.

    Example:
        >>> q, k, v = torch.randn(3, 2, 9, 4).unbind(0)
        >>> aft_local(q, k, v, torch.randn(9, 9), 3, causal=True).shape
        torch.Size([2, 9, 4])
    """
    check_aft_inputs("aft_local", q, k, v, w, padding_mask)
    check_positive_int("aft_local", "window", window, allow_zero=True)
    T = q.shape[1]
    if T == 0:
        return q * 0.0
    w_band = band_of(w, T, max(window, 1), causal=causal)
    return _aft_local_band(q, k, v, w_band, window, causal=causal, padding_mask=padding_mask)


def aft_local_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    window: int,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow float64 AFT-local: builds ``w'`` (``w`` inside ``|t - t'| < window``, 0 outside) and
    loops over query positions. Returns ``(B, T, d)`` float64."""
    check_positive_int("aft_local_reference", "window", window, allow_zero=True)
    T = q.shape[1]
    t = torch.arange(T, device=q.device)
    inside = (t[:, None] - t[None, :]).abs() < window
    w_local = torch.where(inside, w[:T, :T].double(), 0.0).unsqueeze(-1)  # (T, T, 1)
    return biased_average_reference(
        q, k, v, w_local.__getitem__, causal=causal, padding_mask=padding_mask
    )
