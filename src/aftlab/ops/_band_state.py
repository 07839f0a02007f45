"""A causal band op's call continuing a :class:`~aftlab.ops.state.BandState`, with no new kernel.

``aft_local`` (causal) and ``aft_conv`` (causal) with window ``s`` (aft-local's ``window``,
aft-conv's kernel size) keep ``r = max(s - 1, 0)`` ring slots. A chunk ``(B, T)`` continuing a
state is the op's own stateless computation on ``n = r + 1`` prepended tokens and the chunk:

* index 0, a *virtual* key ``L = log sum_{t' gone} e^{K_t'}`` (``gone.log_sum()``) with value
  ``A = gone.average()``, valid where ``gone`` holds a key;
* indices ``1 .. r``, the ring's keys and values (validity from ``valid``), at their true
  offsets;
* then the chunk; the outputs of the ``n`` prepended positions are dropped.

A query of the chunk is ``>= n >= s`` positions after the virtual token, outside the band, so
it weighs it with bias 0: ``e^L A = sum_{t' gone} e^{K_t'} V_t'``, the term of the keys that
left the window, exactly. The ring keys sit inside the band at their own offsets and get their
biases. The next state (:func:`state_after`): the ring is the last ``r`` of ring + chunk, and
``gone`` the old one merged with the shifted sums of the tokens that left the window, its
``(p, a, b)`` directly (as the scan ops merge theirs: ``p`` stays the running maximum).
Everything is autograd: the gradient flows into and out of the states.

Also here: the checks of the state keywords and of a state, the loop over packed documents
(:mod:`aftlab.ops._packed`), and the float64 references' prepended inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ._numerics import compute_dtype, finite_shift
from ._packed import check_cu_seqlens, run_documents
from ._scan_state import continue_running_sums
from ._state_checks import check_state_fields
from .state import BandState, RunningSums

__all__ = [
    "check_band_state",
    "continue_band",
    "ring_size",
    "run_band",
    "reference_inputs",
    "state_after",
]

_NEG_INF = float("-inf")


def ring_size(window: int) -> int:
    """``max(window - 1, 0)``: a band state's ring slots (the band's keys before ``t``)."""
    return max(window - 1, 0)


def check_band_state(
    where: str,
    state: object,
    q: torch.Tensor,
    *,
    window: int,
    window_name: str,
    value_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
) -> BandState:
    """Validate ``initial_state`` of a causal band op on queries ``q`` with window ``s``.

    Expected: a :class:`BandState` with ``k (B, r, *Fk)``, ``v (B, r, *F)``, ``valid (B, r)``
    bool, ``gone.a (B, *F)``, ``gone.b, gone.p (B, *Fk)`` (``r = max(s - 1, 0)``) in the compute
    dtype of ``q`` on its device, and an int ``position >= 0``
    (:func:`~aftlab.ops._state_checks.check_state_fields`).
    """
    what = "the state of a causal band op"
    gone = getattr(state, "gone", None)
    if isinstance(state, BandState) and not isinstance(gone, RunningSums):
        raise TypeError(
            f"{where}: 'initial_state.gone' must be a RunningSums, got {type(gone).__name__}"
        )
    B, r = q.shape[0], ring_size(window)
    F, Fk = tuple(value_shape), tuple(key_shape)
    ring = f"(B, {window_name} - 1"
    fields = {
        "k": (getattr(state, "k", None), (B, r, *Fk), ring + ", *key)"),
        "v": (getattr(state, "v", None), (B, r, *F), ring + ", *value)"),
        "valid": (getattr(state, "valid", None), (B, r), ring + ")"),
        "gone.a": (getattr(gone, "a", None), (B, *F), "(B, *value)"),
        "gone.b": (getattr(gone, "b", None), (B, *Fk), "(B, *key)"),
        "gone.p": (getattr(gone, "p", None), (B, *Fk), "(B, *key)"),
    }
    check_state_fields(where, state, BandState, fields, q, what=what)
    assert isinstance(state, BandState)
    return state


def _gone_token(gone: RunningSums) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The virtual token of ``gone``: key ``L (B, 1, *Fk)``, value ``A (B, 1, *F)``, valid
    ``(B, 1)`` where every channel holds a key (``b > 0``; a state of these ops has keys in all
    channels or none). ``L = 0`` where invalid; no ``log 0`` in the graph (its gradient is NaN)."""
    present = gone.b > 0
    valid = present.flatten(1).all(1)
    L = torch.where(present, gone.log_sum(), 0.0)  # log_sum: finite gradients where b = 0
    return L[:, None], gone.average()[:, None], valid[:, None]


def _mask_of(padding_mask: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
    if padding_mask is not None:
        return padding_mask
    return torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)


def _masked_sums(z: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, position: int):
    """:class:`RunningSums` of the tokens ``z (B, n, *Fk)``, ``v (B, n, *F)`` where ``valid``
    ``(B, n)``: ``p = max z``, ``a = sum e^{z - p} V``, ``b = sum e^{z - p}`` (``p = -inf``,
    ``a = b = 0`` where none is valid; a masked token adds exactly 0)."""
    m = valid.view(*valid.shape, *(1,) * (z.dim() - 2))
    z = torch.where(m, z, _NEG_INF)
    p = z.amax(1)
    e = torch.exp(z - finite_shift(p)[:, None])  # <= 1, exactly 0 where masked
    a = (e * torch.where(m, v, 0.0)).sum(1)
    return RunningSums(a=a, b=e.sum(1), p=p, position=position)


def state_after(
    state: BandState, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None
) -> BandState:
    """The state after a chunk ``k (B, T, *Fk)``, ``v (B, T, *F)`` (in the state's dtype).

    Of ring + chunk (``r + T`` tokens, oldest first) the last ``r`` form the new ring and the
    first ``T`` leave the window: ``gone`` becomes the old ``gone`` merged with the shifted sums
    of those ``T`` (:func:`~aftlab.ops._scan_state.continue_running_sums` without decay:
    ``(p, a, b)`` merged directly, so ``p`` stays the running maximum of the keys gone, as a
    decoding step's fold leaves it, whatever the chunking). ``position`` advances by ``T``
    (padded positions count).
    """
    T = k.shape[1]
    if T == 0:
        return dataclasses.replace(state)
    r = state.k.shape[1]
    ck, cv = torch.cat([state.k, k], 1), torch.cat([state.v, v], 1)
    cm = torch.cat([state.valid, _mask_of(padding_mask, k)], 1)
    position = state.position + T
    left = _masked_sums(ck[:, :T], cv[:, :T], cm[:, :T], position)
    gone = continue_running_sums(state.gone, left, None, T)
    gone.position = max(position - r, 0)
    # the ring copied out: a view would keep the whole ring + chunk buffer alive with the state
    ring = (x[:, T:].clone() for x in (ck, cv, cm))
    return BandState(gone, *ring, position=position)


#: ``call(q, k, v, padding_mask, n)``: the stateless causal op on a sequence whose first ``n``
#: positions are prepended tokens (``n = 0``: the chunk alone, in the caller's dtype)
BandCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, int], torch.Tensor]


def continue_band(
    call: BandCall,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding_mask: torch.Tensor | None,
    state: BandState | None,
    want: bool,
    empty: Callable[[], BandState],
) -> Any:
    """One causal chunk ``q, k, v (B, T, ...)`` continuing ``state`` (None: the empty one).

    With a state, the chunk (in the compute dtype) is preceded by its virtual token and ring
    (module docstring) and ``call`` runs on the ``n + T`` positions; without one, ``call`` runs
    on the chunk alone. Returns ``y`` in ``q``'s dtype, and with ``want`` also the state after
    the chunk (:func:`state_after`; ``empty()`` builds the empty state).
    """
    cd = compute_dtype(q.dtype)
    if state is None:
        y = call(q, k, v, padding_mask, 0)
        if not want:
            return y
        state = empty()
    else:
        gk, gv, gok = _gone_token(state.gone)
        kx = torch.cat([gk, state.k, k.to(cd)], 1)
        vx = torch.cat([gv, state.v, v.to(cd)], 1)
        mx = torch.cat([gok, state.valid, _mask_of(padding_mask, k)], 1)
        n = kx.shape[1] - k.shape[1]
        qx = torch.cat([q.new_zeros(q.shape[0], n, *q.shape[2:], dtype=cd), q.to(cd)], 1)
        y = call(qx, kx, vx, mx, n)[:, n:].to(q.dtype)
    return (y, state_after(state, k.to(cd), v.to(cd), padding_mask)) if want else y


#: ``chunk(start, end, state, want)``: the op on positions ``start .. end - 1`` of the row
Chunk = Callable[[int, int, Any, bool], Any]


def run_band(
    where: str,
    q: torch.Tensor,
    chunk: Chunk,
    *,
    initial_state: BandState | None,
    return_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> Any:
    """``chunk`` on the whole sequence, or once per packed document (``cu_seqlens``)."""
    if cu_seqlens is None:
        return chunk(0, q.shape[1], initial_state, return_state)
    offsets = check_cu_seqlens(where, cu_seqlens, q.shape[1], q.shape[0])
    return run_documents(
        offsets, chunk, initial_state=initial_state, return_state=return_state
    )


def reference_inputs(
    state: BandState | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Any, int]:
    """The float64 references' view of a chunk continuing ``state``: the ring's ``r`` keys and
    values as real keys before the chunk (with zero queries, whose rows the caller drops), the
    padding mask extended by ``valid``, and ``gone`` as the ``past`` of
    :func:`~aftlab.ops.reference.biased_average_reference`. Returns
    ``(q, k, v, padding_mask, past, r)``; ``past = None`` and ``r = 0`` without a state."""
    if state is None:
        return q, k, v, padding_mask, None, 0
    r = state.k.shape[1]
    q = torch.cat([q.new_zeros(q.shape[0], r, *q.shape[2:]).double(), q.double()], 1)
    k = torch.cat([state.k.double(), k.double()], 1)
    v = torch.cat([state.v.double(), v.double()], 1)
    mask = torch.cat([state.valid, _mask_of(padding_mask, q[:, r:])], 1)
    g = state.gone
    b, seen = g.b.double(), g.b > 0
    L = torch.where(seen, g.p.double() + torch.log(torch.where(seen, b, 1.0)), _NEG_INF)
    A = torch.where(seen, g.a.double() / torch.where(seen, b, 1.0), 0.0)
    return q, k, v, mask, (lambda t: (L, A)), r
