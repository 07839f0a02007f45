"""Shared pieces of the AFT mixers: the projections around an AFT op.

An AFT mixer computes ``Q = X W^Q, K = X W^K, V = X W^V`` (the paper's notation), applies a
sigma-gated AFT op ``Y = sigma(Q) * (...)`` and projects back with ``W^O`` (then dropout).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ...ops._scan_state import continue_running_sums
from ...ops.state import BandState, RunningSums, shifted_sums
from ..base import SequenceMixer, mark_residual_projection

__all__ = ["AFTMixer", "BandState", "RunningSums", "band_step", "shifted_sums"]


class AFTMixer(SequenceMixer):
    """Base class of the AFT mixers: owns ``W^Q``, ``W^K``, ``W^V`` and the output projection.

    The output projection ``proj`` (``W^O``) is marked a residual projection
    (:func:`~aftlab.mixers.base.mark_residual_projection`).

    Args:
        key_dim: width of ``K``; ``d_model`` for AFT-full/local/simple/decay, ``n_heads`` for
            AFT-conv (one key channel per head).
        **common: the common mixer arguments of :class:`~aftlab.mixers.SequenceMixer`.

    A subclass implements :meth:`_mix`, one call of its op: ``forward`` is ``_mix(x,
    padding_mask)``, ``prefill`` (from the empty state or a given one) ``_mix(x, None, state,
    return_state=True)``, the op continuing the state (its ``initial_state``) and returning the
    one after (its ``return_state``). The decoding states are the ops' own types
    (:mod:`aftlab.ops.state`): a :class:`RunningSums` (aft-simple, aft-decay), a
    :class:`BandState` (aft-local, aft-conv; one step: :func:`band_step`).

    Shapes:
        :meth:`project` maps ``x: (B, T, d)`` (or ``(B, d)`` for one decoding step) to
        ``q: (..., d)``, ``k: (..., key_dim)``, ``v: (..., d)``; :meth:`output` maps the AFT
        result ``(..., d)`` back to ``(..., d)``.
    """

    def __init__(self, *, key_dim: int | None = None, **common) -> None:
        super().__init__(**common)
        d = self.d_model
        self.key_dim = d if key_dim is None else int(key_dim)
        self.to_q = nn.Linear(d, d, bias=self.bias)
        self.to_k = nn.Linear(d, self.key_dim, bias=self.bias)
        self.to_v = nn.Linear(d, d, bias=self.bias)
        self.proj = mark_residual_projection(nn.Linear(d, d, bias=self.bias))
        self.drop = nn.Dropout(self.dropout_p)

    def _forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The output of :meth:`_mix`."""
        return self._mix(x, padding_mask)

    def _prefill(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """One pass of the op from ``state`` (None: the empty state): :meth:`_mix` with
        ``return_state=True``."""
        return self._mix(x, None, state, return_state=True)

    def _mix(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        state: Any = None,
        *,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The mixer's pass over ``x: (B, T, d)``: ``y (B, T, d)``, or with ``return_state``
        ``(y, state after)``, continuing ``state`` (None: the empty one; never with
        ``padding_mask``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _mix")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Q = X W^Q, K = X W^K, V = X W^V``."""
        return self.to_q(x), self.to_k(x), self.to_v(x)

    @staticmethod
    def match_dtypes(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Cast ``tensors`` to their widest dtype.

        Under autocast ``Q, K, V`` come out of the projections in bf16/fp16 while the learned
        position biases stay float32; the op then runs with the biases' precision, as
        :meth:`step` does, so decoding and the forward agree.
        """
        dt = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        return tuple(t.to(dt) for t in tensors)

    def outputs(
        self, out: Any, padding_mask: torch.Tensor | None, return_state: bool
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """:meth:`output` of an op's result ``out``: ``y``, or ``(y, state)`` with
        ``return_state`` (the state passed through)."""
        if not return_state:
            return self.output(out, padding_mask)
        y, state = out
        return self.output(y), state

    def output(self, y: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``dropout(Y W^O)``; rows of queries with no valid key are 0 (as in ``attention``).

        Args:
            y: the AFT op's result ``(B, T, d)`` (or ``(B, d)`` for a decoding step).
            padding_mask: bool ``(B, T)``, True for real tokens; a query sees no valid key when
                every key it may see (all of them, or ``t' <= t`` if causal) is padding.
        """
        out = self.drop(self.proj(y))
        if padding_mask is None:
            return out
        if self.causal:
            has_key = padding_mask.cumsum(1) > 0
        else:
            has_key = padding_mask.any(1, keepdim=True).expand_as(padding_mask)
        return out.masked_fill(~has_key[..., None], 0.0)


def band_step(
    state: BandState, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, BandState]:
    """One token ``K_t (B, *Fk)``, ``V_t (B, *F)`` after a :class:`BandState` of ``r`` ring
    slots: the average it sees, ``(B, *F)``, and the state after it; ``O(r d)`` work.

    ``bias (r + 1, *Fk')`` holds ``w_{t,t'}`` of the band keys ``t' = t - r .. t`` (the ring,
    oldest first, then ``t``; ``Fk'`` broadcasts against ``Fk``). With the scores
    ``z_t' = K_t' + w_{t,t'}`` (``-inf`` on an empty slot) and ``gone``'s ``(p, a, b)``::

        m = max(max_t' z_t', p),   A_t = (sum_t' e^{z_t' - m} V_t' + e^{p - m} a)
                                         / (sum_t' e^{z_t' - m}     + e^{p - m} b)

    (``m`` is finite: key ``t`` is present; every exponent is ``<= 0``). The scores are formed
    in the dtype of ``state.k`` promoted with ``bias``'s (aft-conv's float64 log domain); the
    sums in the values' dtype. The state after is the op's
    (:func:`~aftlab.ops._band_state.state_after` on the one token, field for field): the oldest
    band key leaves the ring and ``gone`` takes it (:func:`continue_running_sums`: ``p`` stays
    the running maximum).
    """
    B, r = state.k.shape[:2]
    gone = state.gone
    z = (state.k + bias[:r]).masked_fill(~_slots(state.valid, state.k), float("-inf"))
    z_t = k + bias[r]  # (B, *Fk): key t, always present
    m = torch.maximum(z_t, gone.p)
    if r:
        m = torch.maximum(m, z.amax(1))
    m = m.detach()  # any shift is exact: keep it out of the graph
    e = torch.exp(z - m[:, None]).to(v.dtype)
    e_t, old = (torch.exp(u - m).to(v.dtype) for u in (z_t, gone.p))
    avg = ((e * state.v).sum(1) + e_t * v + old * gone.a) / (e.sum(1) + e_t + old * gone.b)
    # the key leaving the window (the ring's oldest; t itself without a ring), as one token's
    # shifted sums: p = K, a = V, b = 1 (nothing where its slot is empty)
    if r:
        k0, v0, ok = state.k[:, 0], state.v[:, 0], _slots(state.valid[:, :1], state.k)[:, 0]
        ring = [torch.cat([x[:, 1:], y[:, None]], 1) for x, y in
                ((state.k, k), (state.v, v), (state.valid, state.valid.new_ones(B)))]
    else:
        k0, v0, ok = k, v, torch.ones((), dtype=torch.bool, device=k.device)
        ring = [state.k, state.v, state.valid]
    left = RunningSums(
        a=torch.where(ok, v0, 0.0), b=torch.where(ok, torch.ones_like(k0), 0.0),
        p=torch.where(ok, k0, float("-inf")),
    )
    position = state.position + 1
    gone = continue_running_sums(gone, left, None, 1)
    gone.position = max(position - r, 0)
    return avg, BandState(gone, *ring, position=position)


def _slots(valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``valid (B, n)`` viewed to broadcast against ``like (B, n, ...)``."""
    return valid.view(*valid.shape, *(1,) * (like.dim() - 2))
