"""The ``aft-decay`` mixer: RWKV's time mixing as a causal AFT with learned per-channel decay.

``Y = dropout(W^O aft_decay(X W^Q, X W^K, X W^V, lambda, u))`` with ``lambda = exp(w_raw)``
(so ``lambda > 0``) and a learned bonus ``u`` (:func:`aftlab.functional.aft_decay`). Causal
only; any sequence length; ``O(T d)`` time and memory, ``O(d)`` per decoded token.

Initialisation (RWKV-4): channel ``i`` of layer ``l`` of ``n_layers`` gets
``w_raw_i = -5 + 8 (i / (d - 1))^{0.7 + 1.3 l / (n_layers - 1)}`` (decays spread from
``e^-5`` to ``e^3``) and ``u_i = log(0.3) + 0.5 ((i + 1) mod 3 - 1)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..._checks import check_positive_int
from ...ops.aft_decay import _aft_decay
from ..registry import register_mixer
from .common import RunningSums, ScanMixer

__all__ = ["AFTDecay", "AFTDecayState"]


#: The decoding state of AFT-decay (RWKV's WKV state with its stability exponent).
AFTDecayState = RunningSums


def rwkv_decay_init(d: int, layer_idx: int = 0, n_layers: int = 1) -> torch.Tensor:
    """RWKV-4's raw decays ``-5 + 8 (i / (d - 1))^{0.7 + 1.3 l / (n_layers - 1)}``, ``(d,)``."""
    ratio = layer_idx / (n_layers - 1) if n_layers > 1 else 0.0
    i = torch.arange(d, dtype=torch.float64)
    frac = i / (d - 1) if d > 1 else torch.zeros(d, dtype=torch.float64)
    return (-5.0 + 8.0 * frac ** (0.7 + 1.3 * ratio)).float()


def rwkv_bonus_init(d: int) -> torch.Tensor:
    """RWKV-4's bonus ``log(0.3) + 0.5 ((i + 1) mod 3 - 1)``, ``(d,)``."""
    zigzag = torch.tensor([((i + 1) % 3 - 1) * 0.5 for i in range(d)])
    return math.log(0.3) + zigzag


@register_mixer("aft-decay")
class AFTDecay(ScanMixer):
    """AFT-decay token mixer (causal only).

    Args:
        causal: must be True, the default here (a ``ValueError`` otherwise).
        layer_idx: index ``l`` of this layer, for the decay initialisation.
        n_layers: number of layers, for the decay initialisation.
        **common: the other common arguments of :class:`~aftlab.mixers.SequenceMixer`;
            ``n_heads`` and ``max_seq_len`` are ignored (no heads, any length).

    Attributes:
        time_decay: raw decay ``w_raw``, ``(d,)``; ``lambda = exp(w_raw)``.
        time_bonus: bonus ``u``, ``(d,)``.

    Shapes:
        ``forward``: ``x (B, T, d)``, ``padding_mask (B, T)`` bool -> ``(B, T, d)``;
        ``step``: ``x (B, d)`` -> ``(B, d)``.
    """

    causal_only = True
    config_options = ("layer_idx", "n_layers")

    def __init__(
        self, *, causal: bool = True, layer_idx: int = 0, n_layers: int = 1, **common
    ) -> None:
        if not causal:
            raise ValueError(
                "AFTDecay: 'causal' must be True (aft-decay is causal only; use aft-simple, "
                "aft-local, aft-conv or aft-full for a non-causal mixer), got False"
            )
        super().__init__(causal=True, **common)
        check_positive_int("AFTDecay", "n_layers", n_layers)
        check_positive_int("AFTDecay", "layer_idx", layer_idx, allow_zero=True)
        if layer_idx >= n_layers:
            raise ValueError(
                f"AFTDecay: 'layer_idx' must be < n_layers = {n_layers}, got {layer_idx}"
            )
        self.layer_idx, self.n_layers = layer_idx, n_layers
        self.time_decay = nn.Parameter(torch.empty(self.d_model))
        self.time_bonus = nn.Parameter(torch.empty(self.d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init hook: RWKV-4's decays and bonus (module docstring) for this layer."""
        super().reset_parameters()
        self.time_decay.copy_(rwkv_decay_init(self.d_model, self.layer_idx, self.n_layers))
        self.time_bonus.copy_(rwkv_bonus_init(self.d_model))

    def decay(self) -> torch.Tensor:
        """``lambda = exp(min(w_raw, 30))``, ``(d,)``.

        The clamp keeps ``lambda`` finite in any float dtype (``exp(30) ~ 1e13``: a decay that
        large already forgets everything but the current token), whatever the optimiser does.
        """
        return torch.exp(self.time_decay.clamp(max=30.0))

    def _op(self, q, k, v, padding_mask, state, return_state: bool):
        """``aft_decay(Q, K, V, lambda, u)``, ``(B, T, d)`` each -> ``(B, T, d)`` (the mixer is
        ``dropout(W^O aft_decay(X W^Q, X W^K, X W^V, lambda, u))``).

        With ``return_state``, one op call continuing ``state`` (its ``initial_state``) also
        gives the state after ``x``: with ``z_t' = K_t' - (T-1-t') lambda`` over every key so
        far, ``p = max_t' z_t'``, ``a = sum_t' e^{z_t' - p} V_t'``, ``b = sum_t' e^{z_t' - p}``.
        """
        return _aft_decay(q, k, v, self.decay(), self.time_bonus, padding_mask=padding_mask,
                          initial_state=state, return_state=return_state, check_state=False)

    def _op_step(self, q, k, v, state: RunningSums) -> tuple[torch.Tensor, RunningSums]:
        """One token's projections ``(B, d)`` each in ``O(d)`` (RWKV's WKV recurrence with its
        stability trick).

        Output: ``o = max(p, u + K_t)``,
        ``wkv = (e^{p-o} a + e^{u+K_t-o} V_t) / (e^{p-o} b + e^{u+K_t-o})``,
        ``Y_t = sigma(Q_t) wkv``.
        Update: ``p' = max(p - lambda, K_t)``, ``a' = e^{p-lambda-p'} a + e^{K_t-p'} V_t``,
        ``b' = e^{p-lambda-p'} b + e^{K_t-p'}``.
        """
        sdt = state.a.dtype
        q, k, v = q.to(sdt), k.to(sdt), v.to(sdt)
        lam, u = self.decay().to(sdt), self.time_bonus.to(sdt)
        uk = u + k
        o = torch.maximum(state.p, uk)
        e1, e2 = torch.exp(state.p - o), torch.exp(uk - o)
        wkv = (e1 * state.a + e2 * v) / (e1 * state.b + e2)
        state.fold(k, v, lam)
        return torch.sigmoid(q) * wkv, state
