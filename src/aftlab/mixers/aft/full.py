"""The ``aft-full`` mixer: AFT-full with the paper's factorised position bias ``w = U V^T``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..._checks import check_positive_int
from ...ops._numerics import compute_dtype, headroom
from ...ops.aft_full import _aft_full
from ..registry import register_mixer
from .common import AFTMixer

__all__ = ["AFTFull", "AFTFullState", "PositionBias"]


class PositionBias(nn.Module):
    """Learned pairwise position biases ``w in R^{T_max x T_max}``, shared by the channels.

    ``rank=r`` (the paper's parameterisation): ``w = U V^T`` with ``U, V in R^{T_max x r}``;
    ``U ~ N(0, 1/r)`` and ``V = 0``, so ``w`` starts at 0 (the model starts as AFT-simple) and
    both factors train (``dL/dV = dL/dw^T U != 0``). ``rank=None``: a full ``T_max x T_max``
    matrix, initialised to 0.
    """

    def __init__(self, max_seq_len: int, *, rank: int | None) -> None:
        super().__init__()
        self.max_seq_len, self.rank = max_seq_len, rank
        if rank is None:
            self.w = nn.Parameter(torch.empty(max_seq_len, max_seq_len))
        else:
            self.u = nn.Parameter(torch.empty(max_seq_len, rank))
            self.v = nn.Parameter(torch.empty(max_seq_len, rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``U ~ N(0, 1/r)``, ``V = 0`` (or ``w = 0``): the bias starts at 0."""
        if self.rank is None:
            nn.init.zeros_(self.w)
        else:
            nn.init.normal_(self.u, std=1 / math.sqrt(self.rank))
            nn.init.zeros_(self.v)

    def matrix(self, T: int) -> torch.Tensor:
        """``w[:T, :T]``: ``(T, T)``."""
        return self.w[:T, :T] if self.rank is None else self.u[:T] @ self.v[:T].t()

    def row(self, t: int, upto: int) -> torch.Tensor:
        """``w[t, :upto]``: ``(upto,)``."""
        return self.w[t, :upto] if self.rank is None else self.v[:upto] @ self.u[t]

    def entries(self, t: int, cols: torch.Tensor) -> torch.Tensor:
        """``w[t, cols]``: ``(len(cols),)``, in ``O(len(cols) r)`` (decoding a window)."""
        return self.w[t, cols] if self.rank is None else self.v[cols] @ self.u[t]

    def extra_repr(self) -> str:
        return f"max_seq_len={self.max_seq_len}, rank={self.rank}"


def require_max_seq_len(where: str, max_seq_len: int | None) -> int:
    if max_seq_len is None:
        raise ValueError(
            f"{where}: 'max_seq_len' (T_max, the size of the position bias) is required"
        )
    return max_seq_len


@dataclass
class AFTFullState:
    """Decoding state: every past key and value, ``(B, T_max, d)`` each, and the position."""

    k: torch.Tensor
    v: torch.Tensor
    t: int = 0


@register_mixer("aft-full")
class AFTFull(AFTMixer):
    """AFT-full token mixer, then the output projection (see :func:`aftlab.ops.aft_full`)::

        Y_t = sigma(Q_t) * sum_t' exp(K_t' + w_{t,t'}) V_t' / sum_t' exp(K_t' + w_{t,t'})

    Args:
        bias_rank: ``d'`` of ``w = U V^T`` (the paper: 64 on CIFAR-10, 128 ImageNet, 256 enwik8);
            ``None`` for a full ``T_max x T_max`` bias.
        **common: see :class:`~aftlab.mixers.SequenceMixer`; ``max_seq_len`` is required.

    Decoding keeps all past keys and values: ``O(t d)`` per token. Continuing a state at
    position ``t0`` (``prefill(x, state)``) is one pass of the op over all ``t0 + T`` keys;
    positions past ``max_seq_len`` are refused.
    """

    length_limited = True

    def __init__(self, *, bias_rank: int | None = 64, **common) -> None:
        super().__init__(**common)
        where = type(self).__name__
        T_max = require_max_seq_len(where, self.max_seq_len)
        if bias_rank is not None:
            check_positive_int(where, "bias_rank", bias_rank)
        self.pos_bias = PositionBias(T_max, rank=bias_rank)

    def reset_parameters(self) -> None:
        """The init hook: the position bias starts at 0 (:class:`PositionBias`)."""
        super().reset_parameters()
        self.pos_bias.reset_parameters()

    def _op(self, q, k, v, padding_mask, state, return_state: bool):
        """``aft_full(Q, K, V, w[:T, :T])``: ``(B, T, d_model)`` each with ``T <= T_max`` ->
        ``(B, T, d_model)``.

        With a state keyword, ``x`` after the ``t0`` tokens of ``state`` (None: none) in one
        pass: rows ``t0 .. t0 + T - 1`` of the causal op on all ``S = t0 + T`` keys (the
        state's, then the chunk's) with ``w[:S, :S]``; the queries of the ``t0`` earlier rows
        are zeros and their outputs dropped (``Y_t`` reads only ``Q_t``). ``O(S^2 d)`` for ``T``
        rows; the state is not modified. With ``return_state`` also the state after the ``S``
        tokens (slots ``[0, S)``).
        """
        if state is None and not return_state:
            q, k, v, w = self.match_dtypes(q, k, v, self.pos_bias.matrix(q.shape[1]))
            return _aft_full(q, k, v, w, causal=self.causal, padding_mask=padding_mask)
        if state is None:  # compute_dtype(q.dtype) is x's, autocast or not
            state = self._init_op_state(q.shape[0], q.device, q.dtype)
        t0 = state.t
        S = t0 + q.shape[1]
        self._check_position(S - 1)
        cd = state.k.dtype
        k_all = torch.cat((state.k[:, :t0], k.to(cd)), 1)
        v_all = torch.cat((state.v[:, :t0], v.to(cd)), 1)
        q_all = torch.cat((q.new_zeros(q.shape[0], t0, q.shape[2]), q), 1)
        qa, ka, va, w = self.match_dtypes(q_all, k_all, v_all, self.pos_bias.matrix(S))
        y = _aft_full(qa, ka, va, w, causal=True, padding_mask=None)[:, t0:].to(q.dtype)
        return (y, self._state_of(k_all, v_all, q.dtype)) if return_state else y

    def _state_of(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> AFTFullState:
        """The state after the tokens of ``k, v: (B, S, d)``: slots ``[0, S)``, position ``S``
        (for inputs of ``dtype``; a fresh buffer, differentiable in ``k`` and ``v``)."""
        state = self._init_op_state(k.shape[0], k.device, dtype)
        S = k.shape[1]
        state.k[:, :S], state.v[:, :S] = k, v  # cast to the state's dtype, as step() does
        state.t = S
        return state

    def _op_state_position(self, state: AFTFullState) -> int:
        """``state.t``: the tokens seen."""
        return state.t

    def _init_op_state(
        self, batch_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> AFTFullState:
        """No keys or values yet: ``(B, T_max, d)`` zeros, float16/bfloat16 kept in float32."""
        shape = (batch_size, self.max_seq_len, self.d_model)
        k = torch.zeros(shape, device=device, dtype=compute_dtype(dtype))
        return AFTFullState(k, torch.zeros_like(k))

    def _op_step(self, q, k, v, state: AFTFullState) -> tuple[torch.Tensor, AFTFullState]:
        """One token's projections ``(B, d_model)`` each at position ``t``; ``O(t d)``::

            y_t = sigma(q_t) * sum_{t'<=t} softmax_t'(K_t' + w_{t,t'}) V_t'
        """
        t = state.t
        self._check_position(t)
        cd = state.k.dtype
        state.k[:, t], state.v[:, t] = k.to(cd), v.to(cd)
        s = state.k[:, : t + 1] + self.pos_bias.row(t, t + 1).to(cd)[None, :, None]
        # per-(t, c) max over t' <= t and the headroom of t + 1 terms: each weight <= 1 / (t + 2)
        e = torch.exp(s - (s.amax(1, keepdim=True) + headroom(t + 1)))
        avg = (e * state.v[:, : t + 1]).sum(1) / e.sum(1)
        state.t = t + 1
        return torch.sigmoid(q.to(cd)) * avg, state
