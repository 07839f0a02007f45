"""The ``aft-simple`` mixer: AFT-simple between the AFT projections.

``Y = dropout(W^O (sigma(Q) * sum_t' softmax_t'(K) V))`` with ``Q, K, V = X W^Q, X W^K, X W^V``
(:func:`aftlab.functional.aft_simple`). Any sequence length; ``O(T d)`` time and memory.
Causal instances decode in ``O(d)`` per token with RWKV's running-max state (see
:class:`AFTSimpleState`).
"""

from __future__ import annotations

import torch

from ...ops.aft_simple import _aft_simple
from ..registry import register_mixer
from .common import AFTMixer, RunningSums

__all__ = ["AFTSimple", "AFTSimpleState"]

#: The decoding state of a causal AFT-simple (running sums, no decay).
AFTSimpleState = RunningSums


@register_mixer("aft-simple")
class AFTSimple(AFTMixer):
    """AFT-simple token mixer (Zhai et al. 2021, Sec. 3.2).

    Takes only the common arguments of :class:`~aftlab.mixers.SequenceMixer`; ``n_heads`` and
    ``max_seq_len`` are ignored (no heads, any length). ``causal`` restricts every sum to
    ``t' <= t`` (and allows :meth:`step`).

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` bool -> ``(B, T, d)``;
        ``step``: ``x (B, d)`` -> ``(B, d)``.
    """

    def _mix(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None,
        state: AFTSimpleState | None = None,
        *,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, AFTSimpleState]:
        """``dropout(W^O aft_simple(X W^Q, X W^K, X W^V))``; ``x: (B, T, d)`` -> ``(B, T, d)``.

        With ``return_state``, one op call continuing ``state`` (its ``initial_state``) also
        gives the state after ``x``: ``p = max_t' K_t'``, ``a = sum_t' e^{K_t' - p} V_t'``,
        ``b = sum_t' e^{K_t' - p}`` over every key so far.
        """
        q, k, v = self.project(x)
        out = _aft_simple(q, k, v, causal=self.causal, padding_mask=padding_mask,
                          initial_state=state, return_state=return_state, check_state=False)
        return self.outputs(out, padding_mask, return_state)

    def _init_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> AFTSimpleState:
        """Empty state for ``batch_size`` sequences (float16/bfloat16 states stay in float32)."""
        return RunningSums.empty(batch_size, self.d_model, device=device, dtype=dtype)

    def _step(self, x: torch.Tensor, state: AFTSimpleState) -> tuple[torch.Tensor, AFTSimpleState]:
        """One token ``x: (B, d)``; ``O(d)`` work (RWKV's stability trick, no decay).

        ``p' = max(p, K_t)``, ``a' = e^{p - p'} a + e^{K_t - p'} V_t``,
        ``b' = e^{p - p'} b + e^{K_t - p'}``, ``Y_t = sigma(Q_t) * a' / b'``.
        """
        q, k, v = self.project(x)
        sdt = state.a.dtype
        q, k, v = q.to(sdt), k.to(sdt), v.to(sdt)
        state.fold(k, v)
        y = torch.sigmoid(q) * (state.a / state.b)
        return self.output(y.to(x.dtype)), state
