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
from .common import RunningSums, ScanMixer

__all__ = ["AFTSimple", "AFTSimpleState"]

#: The decoding state of a causal AFT-simple (running sums, no decay).
AFTSimpleState = RunningSums


@register_mixer("aft-simple")
class AFTSimple(ScanMixer):
    """AFT-simple token mixer (Zhai et al. 2021, Sec. 3.2).

    Takes only the common arguments of :class:`~aftlab.mixers.SequenceMixer`; ``n_heads`` and
    ``max_seq_len`` are ignored (no heads, any length). ``causal`` restricts every sum to
    ``t' <= t`` (and allows :meth:`step`).

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` bool -> ``(B, T, d)``;
        ``step``: ``x (B, d)`` -> ``(B, d)``.
    """

    def _op(self, q, k, v, padding_mask, state, return_state: bool):
        """``aft_simple(Q, K, V)``, ``(B, T, d)`` each -> ``(B, T, d)`` (the mixer is
        ``dropout(W^O aft_simple(X W^Q, X W^K, X W^V))``).

        With ``return_state``, one op call continuing ``state`` (its ``initial_state``) also
        gives the state after ``x``: ``p = max_t' K_t'``, ``a = sum_t' e^{K_t' - p} V_t'``,
        ``b = sum_t' e^{K_t' - p}`` over every key so far.
        """
        return _aft_simple(q, k, v, causal=self.causal, padding_mask=padding_mask,
                           initial_state=state, return_state=return_state, check_state=False)

    def _op_step(self, q, k, v, state: RunningSums) -> tuple[torch.Tensor, RunningSums]:
        """One token's projections ``(B, d)`` each; ``O(d)`` work (RWKV's stability trick, no
        decay).

        ``p' = max(p, K_t)``, ``a' = e^{p - p'} a + e^{K_t - p'} V_t``,
        ``b' = e^{p - p'} b + e^{K_t - p'}``, ``Y_t = sigma(Q_t) * a' / b'``.
        """
        sdt = state.a.dtype
        q, k, v = q.to(sdt), k.to(sdt), v.to(sdt)
        state.fold(k, v)
        y = torch.sigmoid(q) * (state.a / state.b)
        return y, state
