"""State across calls of the scan ops (``aft_simple`` causal, ``aft_decay``): a
:class:`~aftlab.ops.state.RunningSums` in, one out, and packed documents.

Both ops are the decayed causal average (``lambda = 0`` for aft-simple)::

    Y_t = sigma(Q_t) * [sum_{t'<t} exp(-(t-1-t') lambda + K_t') V_t' + exp(c + K_t) V_t] / [...]

(``c = u`` for aft-decay, 0 for aft-simple). A state after ``t0`` earlier tokens summarises them
as one log-sum ``L = p + log b`` and average ``A = a / b``; at query ``j`` of the next chunk
their weight is ``exp(-j lambda + L)`` (:class:`~aftlab.ops.state.RunningSums`). That is the
weight of ONE virtual token at index ``-1`` with key ``L`` and value ``A`` (its age at query
``j`` is ``j``, and the bonus only applies to ``t' = t``), so the chunk runs through the
unchanged op on ``[virtual, chunk]`` and drops the virtual token's output: exact, both
implementations, and autograd carries the gradient into the state's tensors. An empty state
(``p = -inf`` in every channel of a row) is padded out; an empty channel of a non-empty row
gets the lowest finite key (weight 0 next to any key above ``-finfo.max + 100``).

The state after the chunk is the chunk's own (:meth:`RunningSums.from_tokens` with
``z_t' = K_t' - (T - 1 - t') lambda``, padded keys ``-inf``) continuing the initial state, its
keys aged by ``T`` (:func:`continue_running_sums`): ``(p, a, b)`` merged directly, not through
the rounded ``L``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._numerics import compute_dtype
from ._packed import check_cu_seqlens, run_documents
from ._state_checks import check_running_sums
from .scan import _decayed
from .state import RunningSums

__all__ = ["continue_running_sums", "running_sums_after", "run_scan"]

#: ``core(q, k, v, padding_mask) -> y``: the op without state, inputs validated
Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def running_sums_after(
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    position: int,
) -> RunningSums:
    """The state after the tokens ``k, v: (B, T, d)`` (in the state dtype), ``decay (d,)`` or
    None, padded keys left out: ``z_t' = K_t' - (T-1-t') lambda``, then
    :meth:`RunningSums.from_tokens`. ``(T-1-t') lambda`` is formed as in the scan
    (:func:`~aftlab.ops.scan._decayed`), so that it never overflows on its own."""
    T = k.shape[1]
    if decay is not None and T > 1:
        age = torch.arange(T - 1, -1, -1, device=k.device, dtype=k.dtype)[:, None]
        span = 1 << (T - 1).bit_length()  # a power of two >= T - 1
        k = _decayed(k, decay, age, span)
    if padding_mask is not None:  # after the decay: no gradient from a padded key to lambda
        pad = ~padding_mask[:, :, None]
        k, v = k.masked_fill(pad, float("-inf")), v.masked_fill(pad, 0.0)
    return RunningSums.from_tokens(k, v, position)


def continue_running_sums(
    first: RunningSums, then: RunningSums, decay: torch.Tensor | None, steps: int
) -> RunningSums:
    """The state after ``first`` and then ``steps`` more tokens summed in ``then``
    (``(B, d)`` each, one dtype): ``first``'s keys age by ``steps`` (weight
    ``exp(-steps lambda)``), ``then``'s are already counted from the end::

        p = max(p_1 - steps lambda, p_2),   a = e^{p_1 - steps lambda - p} a_1 + e^{p_2 - p} a_2

    (``b`` likewise); two empty states give the empty one (no ``-inf - -inf``). ``position`` is
    ``first.position + steps``.
    """
    p1 = first.p
    if decay is not None and steps:
        p1 = _decayed(p1, decay, steps, 1 << (steps - 1).bit_length())
    # max(p1, p2), ties to p2: the empty state's p (-inf) takes no gradient into lambda
    p = torch.where(then.p >= p1, then.p, p1)
    shift = p.masked_fill(p == float("-inf"), 0.0)
    e1, e2 = torch.exp(p1 - shift), torch.exp(then.p - shift)
    return RunningSums(a=e1 * first.a + e2 * then.a, b=e1 * first.b + e2 * then.b, p=p,
                       position=first.position + steps)


def _with_past(q, k, v, padding_mask, state: RunningSums):
    """``q, k, v, padding_mask`` with the virtual token of ``state`` first (module docstring):
    ``(B, T + 1, d)`` and ``(B, T + 1)``."""
    B, T, d = q.shape
    L = state.log_sum().to(q.dtype)
    L = L.masked_fill(L == float("-inf"), torch.finfo(q.dtype).min)  # an empty channel: 0
    has_past = (state.p != float("-inf")).any(-1, keepdim=True)  # (B, 1): False for empty rows
    mask = q.new_ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    return (
        torch.cat([q.new_zeros(B, 1, d), q], 1),
        torch.cat([L[:, None], k], 1),
        torch.cat([state.average().to(q.dtype)[:, None], v], 1),
        torch.cat([has_past, mask], 1),
    )


def _chunk(
    core: Core, q, k, v, decay, padding_mask, state: RunningSums | None, want_state: bool
):
    """One document: ``y`` (and the state after it) from ``state`` (None: the empty one)."""
    out_dtype, cdt = q.dtype, compute_dtype(q.dtype)
    T = q.shape[1]
    if state is None:
        y = core(q, k, v, padding_mask)
    else:
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        y = core(*_with_past(q, k, v, padding_mask, state))[:, 1:].to(out_dtype)
    if not want_state:
        return y
    lam = None if decay is None else decay.to(cdt)
    after = running_sums_after(k.to(cdt), v.to(cdt), lam, padding_mask, T)
    if state is not None:
        first = RunningSums(a=state.a.to(cdt), b=state.b.to(cdt), p=state.p.to(cdt),
                            position=state.position)
        after = continue_running_sums(first, after, lam, T)
    return y, after


def run_scan(
    where: str,
    core: Core,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    *,
    padding_mask: torch.Tensor | None,
    initial_state: object,
    return_state: bool,
    cu_seqlens: object,
    check_state: bool = True,
):
    """``core`` continued from ``initial_state``, returning ``y`` or ``(y, state)``, over one
    sequence or the documents of ``cu_seqlens`` (:mod:`aftlab.ops._packed`).

    ``q, k, v: (B, T, d)`` and ``padding_mask`` are validated by the caller; ``initial_state``
    (unless ``check_state=False``: a mixer's caller has checked it) and ``cu_seqlens`` here.
    The state is kept in the compute dtype (float32 for float16/bfloat16, else the input
    dtype); its ``position`` advances by ``T``.
    """
    if initial_state is not None and check_state:
        check_running_sums(where, initial_state, q)
    if cu_seqlens is None or q.shape[1] == 0:
        if cu_seqlens is not None:
            check_cu_seqlens(where, cu_seqlens, q.shape[1], q.shape[0])
        return _chunk(core, q, k, v, decay, padding_mask, initial_state, return_state)
    offsets = check_cu_seqlens(where, cu_seqlens, q.shape[1], q.shape[0])

    def call(a: int, b: int, state, want: bool):
        mask = None if padding_mask is None else padding_mask[:, a:b]
        return _chunk(core, q[:, a:b], k[:, a:b], v[:, a:b], decay, mask, state, want)

    return run_documents(offsets, call, initial_state=initial_state, return_state=return_state)
