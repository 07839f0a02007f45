"""The ``aft-simple`` mixer: AFT-simple between the AFT projections.

``Y = dropout(W^O (sigma(Q) * sum_t' softmax_t'(K) V))`` with ``Q, K, V = X W^Q, X W^K, X W^V``
(:func:`aftlab.functional.aft_simple`). Any sequence length; ``O(T d)`` time and memory.
Causal instances decode in ``O(d)`` per token with RWKV's running-max state (see
:class:`AFTSimpleState`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.aft_simple import aft_simple
from ..registry import register_mixer
from .common import AFTMixer

__all__ = ["AFTSimple", "AFTSimpleState"]

_LOW = (torch.float16, torch.bfloat16)


@dataclass
class AFTSimpleState:
    """Decoding state of a causal AFT-simple: running sums scaled by a running maximum.

    Elementwise over the channels, after the tokens ``t' < t``::

        p = max_t' K_t',   a = sum_t' exp(K_t' - p) V_t',   b = sum_t' exp(K_t' - p)

    Attributes:
        a: ``(B, d)`` scaled numerator.
        b: ``(B, d)`` scaled denominator (>= 1 once a token was seen).
        p: ``(B, d)`` running maximum of the keys (``-inf`` before the first token).
        position: number of tokens consumed.
    """

    a: torch.Tensor
    b: torch.Tensor
    p: torch.Tensor
    position: int = 0


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW else dtype


@register_mixer("aft-simple")
class AFTSimple(AFTMixer):
    """AFT-simple token mixer (Zhai et al. 2021, Sec. 3.2).

    Args:
        d_model: model width ``d``.
        causal: restrict every sum to ``t' <= t`` (and allow :meth:`step`).
        dropout: dropout on the output projection.
        bias: biases in the projections.
        n_heads: ignored (AFT-simple has no heads).
        max_seq_len: ignored (any length works).

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` bool -> ``(B, T, d)``;
        ``step``: ``x (B, d)`` -> ``(B, d)``.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int = 1,
        causal: bool = False,
        max_seq_len: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        # max_seq_len is not passed on: AFT-simple takes any length.
        super().__init__(
            d_model=d_model, n_heads=n_heads, causal=causal, dropout=dropout, bias=bias
        )

    def forward(self, x: torch.Tensor, *, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``dropout(W^O aft_simple(X W^Q, X W^K, X W^V))``; ``x: (B, T, d)`` -> ``(B, T, d)``."""
        x, padding_mask = self._check_input(x, padding_mask)
        q, k, v = self.project(x)
        y = aft_simple(q, k, v, causal=self.causal, padding_mask=padding_mask)
        return self.output(y, padding_mask)

    def init_state(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> AFTSimpleState:
        """Empty state for ``batch_size`` sequences (float16/bfloat16 states stay in float32)."""
        if not self.causal:
            raise RuntimeError(
                "AFTSimple: init_state() needs a causal mixer; this one has causal=False"
            )
        ref = self.to_q.weight
        device = ref.device if device is None else device
        sdt = _state_dtype(ref.dtype if dtype is None else dtype)
        shape = (batch_size, self.d_model)
        return AFTSimpleState(
            a=torch.zeros(shape, device=device, dtype=sdt),
            b=torch.zeros(shape, device=device, dtype=sdt),
            p=torch.full(shape, float("-inf"), device=device, dtype=sdt),
        )

    def step(self, x: torch.Tensor, state: AFTSimpleState) -> tuple[torch.Tensor, AFTSimpleState]:
        """One token ``x: (B, d)``; ``O(d)`` work (RWKV's stability trick, no decay).

        ``p' = max(p, K_t)``, ``a' = e^{p - p'} a + e^{K_t - p'} V_t``,
        ``b' = e^{p - p'} b + e^{K_t - p'}``, ``Y_t = sigma(Q_t) * a' / b'``.
        """
        x = self._check_step_input(x)
        q, k, v = self.project(x)
        sdt = state.a.dtype
        q, k, v = q.to(sdt), k.to(sdt), v.to(sdt)
        p_new = torch.maximum(state.p, k)
        e_old, e_new = torch.exp(state.p - p_new), torch.exp(k - p_new)
        state.a = e_old * state.a + e_new * v
        state.b = e_old * state.b + e_new
        state.p = p_new
        state.position += 1
        y = torch.sigmoid(q) * (state.a / state.b)
        return self.output(y.to(x.dtype)), state
