"""AFT-simple (Zhai et al. 2021, Sec. 3.2): ``w = 0``, linear in ``T``.

Elementwise over the channel ``c``, for ``Q, K, V`` of shape ``(B, T, d)``::

    Y_t = sigma(Q_t) * sum_t' softmax_t'(K)_t' * V_t'
        = sigma(Q_t) * sum_t' exp(K_t') V_t' / sum_t' exp(K_t')

Non-causal: one sum over all ``t'`` (a single weighted average per sequence and channel,
shared by every ``t``), shifted by the per-channel maximum key. Causal: ``t' <= t``, computed
by :func:`aftlab.ops.scan.stable_prefix_average` (a running log-sum-exp; no maximum over
future keys). Time and memory ``O(B T d)``.

On CPU tensors the op runs the fused C++ kernel ``torch.ops.aftlab.simple_causal`` /
``simple_global`` (one pass over T forward, one reverse pass backward; :mod:`aftlab.kernels`)
when it is available, on CUDA tensors its Triton twin (``triton_simple_causal``, ...), else the
PyTorch implementation below; all compute the same formula.

Causal, the op continues a :class:`~aftlab.ops.state.RunningSums` (``initial_state``), returns
the one after its last position (``return_state``) and restarts at the documents of
``cu_seqlens`` (:mod:`aftlab.ops._scan_state`, docs/aft.md "State across calls").
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import check_qkv
from ._numerics import compute_dtype, finite_shift
from ._scan_state import run_scan
from ._state_checks import check_state_keywords
from .reference import biased_average_reference, running_sums_past
from .scan import _stable_prefix_average
from .state import RunningSums

__all__ = ["aft_simple", "aft_simple_reference"]


def aft_simple(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    initial_state: RunningSums | None = None,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, RunningSums]:
    """AFT-simple: ``Y_t = sigma(Q_t) * sum_t' softmax_t'(K)_t' V_t'`` (``t' <= t`` if causal).

    Args:
        q: queries ``Q``, ``(B, T, d)``.
        k: keys ``K``, ``(B, T, d)``; any finite magnitude.
        v: values ``V``, ``(B, T, d)``.
        causal: restrict the sum to ``t' <= t``.
        padding_mask: bool ``(B, T)``, True for real tokens; padded keys contribute nothing and a
            query with no valid key gets 0.
        initial_state: causal only: the :class:`~aftlab.ops.state.RunningSums` ``(B, d)`` of
            the keys before this call (``t' < 0``), as one more term of every sum; None: none.
        return_state: causal only: also return the state after the last position.
        cu_seqlens: causal only: int32 offsets ``[0, n_1, ..., T]`` of documents packed into a
            batch of one row; each restarts from the empty state (``initial_state`` continues
            the first, the state returned is the last's).

    Returns:
        ``Y``, ``(B, T, d)`` in the input dtype (float16/bfloat16 are computed in float32);
        ``(Y, state)`` with ``return_state``, the state in the compute dtype, its ``position``
        advanced by ``T``.

    Raises:
        ValueError / TypeError: wrong ranks, shapes, dtypes or devices (naming the argument);
            a state of another type or shape, bad ``cu_seqlens``; any of the three state
            arguments with ``causal=False``.
    """
    check_qkv("aft_simple", q, k, v, padding_mask)
    return _aft_simple(q, k, v, causal=causal, padding_mask=padding_mask,
                       initial_state=initial_state, return_state=return_state,
                       cu_seqlens=cu_seqlens)


def _aft_simple(q, k, v, *, causal: bool, padding_mask, initial_state=None, return_state=False,
                cu_seqlens=None, check_state=True):
    """:func:`aft_simple` without the checks of ``q, k, v`` (the mixer's call: its input is
    validated); the state (unless ``check_state=False``: the mixer's caller checked it) and
    ``cu_seqlens`` are checked (attributes, and ``cu_seqlens`` read on the host)."""
    if check_state_keywords("aft_simple", causal, initial_state, return_state, cu_seqlens):
        return run_scan(
            "aft_simple", _causal_core, q, k, v, None, padding_mask=padding_mask,
            initial_state=initial_state, return_state=return_state, cu_seqlens=cu_seqlens,
            check_state=check_state,
        )
    impl = kernels.implementation("aft_simple", q)
    if impl != "torch":
        return kernels.scan.aft_simple(q, k, v, causal=causal, padding_mask=padding_mask,
                                       backend=impl)
    return _aft_simple_torch(q, k, v, causal=causal, padding_mask=padding_mask)


def _causal_core(q, k, v, padding_mask):
    """Causal :func:`aft_simple` from the empty state (what :func:`run_scan` continues)."""
    return _aft_simple(q, k, v, causal=True, padding_mask=padding_mask)


def _aft_simple_torch(q, k, v, *, causal: bool, padding_mask):
    """The pure-PyTorch implementation of :func:`aft_simple` (inputs already validated)."""
    out_dtype, cdt = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    if causal:
        # A_t = sum_{t'<=t} exp(K_t' - L_t) V_t', L_t = log sum_{t'<=t} exp(K_t')
        _, A = _stable_prefix_average(k, v, padding_mask=padding_mask)
    elif k.shape[1] == 0:  # no position: nothing to average (and no maximum to take)
        A = v
    else:
        if padding_mask is not None:
            k = k.masked_fill(~padding_mask[:, :, None], float("-inf"))
        # m_c = max_t' K_t'c (all t' are visible); exp(K - m) <= 1 and the largest term is 1.
        m = k.detach().amax(1, keepdim=True)
        m = finite_shift(m)
        e = torch.exp(k - m)  # padded keys: exp(-inf) = 0
        if padding_mask is not None:
            v = v.masked_fill(~padding_mask[:, :, None], 0.0)
        # den >= 1 whenever a key is valid; a row without one has e = 0 and gets A = 0. The
        # normalised weights e / den sum to 1, so no partial sum exceeds max |V| (unlike
        # sum e V, which overflows for values near the largest float).
        den = e.sum(1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
        A = (e / den * v).sum(1, keepdim=True)
        # The sum's rounding may leave [min V, max V] (to inf for values at the largest
        # float): clamp to it (NaN passes; the bounds carry no gradient).
        hi, lo = v.detach().amax(1, keepdim=True), v.detach().amin(1, keepdim=True)
        A = torch.where(A > hi, hi, torch.where(A < lo, lo, A))
    return (torch.sigmoid(q) * A).to(out_dtype)


def aft_simple_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    padding_mask: torch.Tensor | None = None,
    initial_state: RunningSums | None = None,
) -> torch.Tensor:
    """Float64 per-position loop straight from the formula (slow; for tests).

    ``Y_t = sigma(Q_t) * sum_{t' in S_t} exp(K_t') V_t' / sum_{t' in S_t} exp(K_t')`` with ``S_t``
    the valid ``t'`` (``<= t`` if causal): :func:`~aftlab.ops.reference.biased_average_reference`
    with no bias. ``Y_t = 0`` when ``S_t`` is empty. Causal, an ``initial_state`` adds the keys
    ``t' < 0`` it summarises: ``exp(L)`` to the denominator and ``exp(L) A`` to the numerator,
    ``L = p + log b``, ``A = a / b``. Returns float64 ``(B, T, d)``.
    """
    if initial_state is not None and not causal:
        raise ValueError("aft_simple_reference: 'initial_state' needs causal=True")
    past = None if initial_state is None else running_sums_past(initial_state)
    return biased_average_reference(q, k, v, causal=causal, padding_mask=padding_mask, past=past)
