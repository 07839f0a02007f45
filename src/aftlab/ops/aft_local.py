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
from ._band_state import (
    check_band_state,
    continue_band,
    reference_inputs,
    run_band,
)
from ._numerics import compute_dtype, headroom, shift_along
from ._state_checks import check_state_keywords
from .aft_full import check_aft_inputs
from .lse_average import Geometry, lse_average
from .reference import biased_average_reference
from .scan import _stable_prefix_average
from .state import BandState

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
    return _band_rows(w, 0, T, geo.W, geo.beta)


def _band_rows(w: torch.Tensor, start: int, T: int, W: int, beta: int) -> torch.Tensor:
    """``(T, W)``: ``out[t, j] = w[start + t, start + t + j - beta]``, 0 where that key falls
    outside ``[0, start + T)``: the band of the absolute rows ``start .. start + T - 1``."""
    n = start + T
    t = torch.arange(start, n, device=w.device)[:, None]
    cols = t + torch.arange(W, device=w.device)[None, :] - beta
    inside = (cols >= 0) & (cols < n)
    return w[start:n, :n].gather(1, cols.clamp(0, n - 1)).masked_fill(~inside, 0.0)


def aft_local_band(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_band: torch.Tensor,
    window: int,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    initial_state: BandState | None = None,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, BandState]:
    """AFT-local with the bias given as its band only (what the mixer uses; no ``T x T`` tensor).

    Args:
        q, k, v: ``(B, T, d)``.
        w_band: ``(T, W)`` with ``w_band[t, j] = w_{t, t + j - (s - 1)}``, ``s = min(window, T)``,
            ``W = 2s - 1`` (``s`` when causal); see :func:`band_of`. Ignored when ``window == 0``.
            With a state keyword the band is ``window`` wide, ``(T, window)``: row ``t`` holds
            the biases of the chunk's position ``t`` (absolute position
            ``initial_state.position + t``), its column ``j`` key ``t + j - (window - 1)``,
            reaching back into the state's ring. With ``cu_seqlens``, ``(R, window)``, one row
            per in-document position: document ``i`` uses rows ``0 .. n_i - 1`` (the first,
            continuing ``initial_state``, rows ``position .. position + n_1 - 1``).
        window: ``s >= 0``.
        causal: restrict to ``t' <= t``.
        padding_mask: optional bool ``(B, T)``, True for real tokens.
        initial_state, return_state, cu_seqlens: as for :func:`aft_local` (causal only).

    Returns:
        ``(B, T, d)`` in the dtype of ``q``; with ``return_state``, ``(y, state)``.
    """
    where = "aft_local"
    check_qkv(where, q, k, v, padding_mask)
    check_positive_int(where, "window", window, allow_zero=True)
    T = q.shape[1]
    if not check_state_keywords(where, causal, initial_state, return_state, cu_seqlens):
        if T and window:
            geo = band_geometry(T, window, causal=causal)
            check_tensor(where, "w_band", w_band, shape=(T, geo.W), floating=True)
            check_compatible(where, {"q": q, "w_band": w_band})
        return _aft_local_band(q, k, v, w_band, window, causal=causal, padding_mask=padding_mask)
    if window:
        check_tensor(where, "w_band", w_band, ndim=2, floating=True)
        if w_band.shape[1] != window or (cu_seqlens is None and w_band.shape[0] != T):
            rows = f"T = {T}" if cu_seqlens is None else "R >= the longest document"
            raise ValueError(
                f"{where}: with a state or cu_seqlens 'w_band' must have shape ({rows}, "
                f"window = {window}) (the band is window wide: the state's ring holds the keys "
                f"before the chunk), got {tuple(w_band.shape)}"
            )
        check_compatible(where, {"q": q, "w_band": w_band})
    _check_state(where, initial_state, q, window)

    def chunk(a: int, b: int, state: BandState | None, want: bool):
        rows = w_band
        if window and b > a:
            r0 = 0 if state is None or cu_seqlens is None else state.position
            if r0 + b - a > w_band.shape[0]:
                raise ValueError(
                    f"{where}: 'w_band' holds one row per in-document position, "
                    f"{w_band.shape[0]} rows, but a document reaches position {r0 + b - a - 1}"
                )
            rows = w_band[r0 : r0 + b - a]
        return _local_chunk(q, k, v, rows, window, a, b, state, want, padding_mask)

    return run_band(
        where, q, chunk, initial_state=initial_state, return_state=return_state,
        cu_seqlens=cu_seqlens,
    )


def _check_state(where: str, state: object, q: torch.Tensor, window: int) -> None:
    """Validate an aft-local ``initial_state`` (None passes): :func:`check_band_state`."""
    if state is not None:
        d = q.shape[2:]
        check_band_state(
            where, state, q, window=window, window_name="window", value_shape=d, key_shape=d
        )


def _local_chunk(q, k, v, rows, window: int, a: int, b: int, state, want: bool, padding_mask):
    """Causal AFT-local on positions ``a .. b - 1`` continuing ``state`` (None: empty), unchecked
    (also the mixer's call).

    ``rows`` ``(b - a, window)`` are the band rows of those positions, ``window`` wide (the
    state's ring supplies the keys before the chunk); prepended positions get zero rows.
    """
    q, k, v = q[:, a:b], k[:, a:b], v[:, a:b]
    mask = None if padding_mask is None else padding_mask[:, a:b]
    T = b - a
    if window and T == 0:
        rows = rows.new_zeros(0, window)

    def call(qx, kx, vx, mx, n):
        wb = rows
        if window and n:
            wb = torch.cat([rows.new_zeros(n, window), rows], 0).to(qx.dtype)
        elif window:  # the chunk alone: its band is min(window, T) wide
            wb = rows[:, window - min(window, T) :]
        return _aft_local_band(qx, kx, vx, wb, window, causal=True, padding_mask=mx)

    def empty() -> BandState:
        return BandState.empty(q.shape[0], window, q.shape[2], device=q.device, dtype=q.dtype)

    return continue_band(call, q, k, v, mask, state, want, empty)


def _aft_local_band(q, k, v, w_band, window: int, *, causal: bool, padding_mask):
    """:func:`aft_local_band` without the checks (the mixer's call: its input is validated)."""
    if q.shape[1] == 0:
        return q * 0.0  # empty, still connected to the graph
    impl = kernels.implementation("aft_local", q)
    if impl != "torch":
        return kernels.band.local(q, k, v, w_band, window, causal=causal,
                                  padding_mask=padding_mask, backend=impl)
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
    initial_state: BandState | None = None,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, BandState]:
    """AFT-local (causal: ``t' <= t``)::

        Y_t = sigma(Q_t) * sum_t' exp(K_t' + w'_{t,t'}) V_t' / sum_t' exp(K_t' + w'_{t,t'})

    ``w'_{t,t'} = w_{t,t'}`` if ``|t - t'| < window`` else 0 (global connectivity kept).
    ``window = 0`` is AFT-simple, ``window >= T`` is AFT-full. Exact and stable for any finite
    key and bias, finite for values up to ``finfo.max / 2`` on every path (up to ``finfo.max``
    on the kernel); ``O(B T s d)`` time, ``O(B T d + T s)`` memory (only the band of ``w`` is
    read).

    Causal, a call continues a :class:`~aftlab.ops.state.BandState` (the ring of the last
    ``window - 1`` keys and values and the running sums of the keys that left the window): a
    sequence run in chunks with the state passed along gives the one-pass outputs and state.

    Args:
        q, k, v: ``(B, T, d)``.
        w: ``(T', T')`` position biases with ``T' >= T``; only its band is used. Indexed by
            absolute position: a chunk continuing ``initial_state`` has the rows (and its keys
            the columns) ``position .. position + T - 1``, so ``T' >= position + T``.
        window: ``s >= 0``.
        causal: restrict every sum to ``t' <= t``.
        padding_mask: optional bool ``(B, T)``, True for real tokens.
        initial_state: (causal) the state to continue; None: the empty state at position 0.
        return_state: (causal) also return the state after the last position.
        cu_seqlens: (causal) int32 offsets ``[0, n_1, ..., T]`` of documents packed into a batch
            of one row; each restarts from the empty state at position 0 (``w``'s rows and
            columns ``0 .. n_i - 1``), the first continuing ``initial_state`` if given, and the
            state returned is the last document's (:mod:`aftlab.ops._packed`).

    Returns:
        ``(B, T, d)`` in the dtype of ``q``; with ``return_state``, ``(y, state)`` (the state
        in the compute dtype: float32 for float16/bfloat16).

    Raises:
        ValueError: ``window < 0``, shapes that do not match, a ``w`` smaller than
            ``position + T``, a state keyword on a non-causal call, bad ``cu_seqlens``.
        TypeError: an ``initial_state`` that is not a BandState.

    Example:
        >>> q, k, v = torch.randn(3, 2, 9, 4).unbind(0)
        >>> aft_local(q, k, v, torch.randn(9, 9), 3, causal=True).shape
        torch.Size([2, 9, 4])
    """
    where = "aft_local"
    if not check_state_keywords(where, causal, initial_state, return_state, cu_seqlens):
        check_aft_inputs(where, q, k, v, w, padding_mask)
        check_positive_int(where, "window", window, allow_zero=True)
        T = q.shape[1]
        if T == 0:
            return q * 0.0
        w_band = band_of(w, T, max(window, 1), causal=causal)
        return _aft_local_band(q, k, v, w_band, window, causal=causal, padding_mask=padding_mask)
    check_qkv(where, q, k, v, padding_mask)
    check_positive_int(where, "window", window, allow_zero=True)
    check_tensor(where, "w", w, ndim=2, floating=True)
    check_compatible(where, {"q": q, "w": w})
    _check_state(where, initial_state, q, window)

    def chunk(a: int, b: int, state: BandState | None, want: bool):
        P = 0 if state is None else state.position
        if min(w.shape) < P + b - a:
            raise ValueError(
                f"{where}: 'w' must have shape (T', T') with T' >= position + T = {P} + "
                f"{b - a} = {P + b - a} (its rows and columns are absolute positions), "
                f"got {tuple(w.shape)}"
            )
        rows = _band_rows(w, P, b - a, window, window - 1) if window and b > a else w
        return _local_chunk(q, k, v, rows, window, a, b, state, want, padding_mask)

    return run_band(
        where, q, chunk, initial_state=initial_state, return_state=return_state,
        cu_seqlens=cu_seqlens,
    )


def aft_local_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    window: int,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    initial_state: BandState | None = None,
) -> torch.Tensor:
    """Slow float64 AFT-local: builds ``w'`` (``w`` inside ``|t - t'| < window``, 0 outside) and
    loops over query positions. Returns ``(B, T, d)`` float64.

    With ``initial_state`` (causal): the ring's keys are real keys before the chunk, at their
    absolute positions ``position - r .. position - 1`` with their biases ``w`` (the chunk's
    rows ``position .. position + T - 1``), and ``gone`` is every row's ``past``."""
    where = "aft_local_reference"
    check_positive_int(where, "window", window, allow_zero=True)
    if initial_state is not None and not causal:
        raise ValueError(f"{where}: 'initial_state' needs causal=True, got causal=False")
    P = 0 if initial_state is None else initial_state.position
    q, k, v, padding_mask, past, r = reference_inputs(initial_state, q, k, v, padding_mask)
    t = torch.arange(P - r, P + q.shape[1] - r, device=q.device)  # absolute positions
    inside = ((t[:, None] - t[None, :]).abs() < window) & (t[:, None] >= 0) & (t[None, :] >= 0)
    tc = t.clamp_min(0)
    w_local = torch.where(inside, w.double()[tc][:, tc], 0.0).unsqueeze(-1)  # (T, T, 1)
    y = biased_average_reference(
        q, k, v, w_local.__getitem__, causal=causal, padding_mask=padding_mask, past=past
    )
    return y[:, r:]
