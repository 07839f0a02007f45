"""Shared pieces of the AFT mixers: the projections around an AFT op.

An AFT mixer computes ``Q = X W^Q, K = X W^K, V = X W^V`` (the paper's notation), applies a
sigma-gated AFT op ``Y = sigma(Q) * (...)`` and projects back with ``W^O`` (then dropout).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ...ops.state import RunningSums, shifted_sums
from ..base import SequenceMixer, mark_residual_projection

__all__ = ["AFTMixer", "RunningSums", "shifted_sums"]


class AFTMixer(SequenceMixer):
    """Base class of the AFT mixers: owns ``W^Q``, ``W^K``, ``W^V`` and the output projection.

    The output projection ``proj`` (``W^O``) is marked a residual projection
    (:func:`~aftlab.mixers.base.mark_residual_projection`).

    Args:
        key_dim: width of ``K``; ``d_model`` for AFT-full/local/simple/decay, ``n_heads`` for
            AFT-conv (one key channel per head).
        **common: the common mixer arguments of :class:`~aftlab.mixers.SequenceMixer`.

    A subclass implements :meth:`_mix` (its forward pass, also returning the keys and values)
    and, when causal, :meth:`_state_after` (the state a prompt leaves): ``forward`` returns the
    first's output, ``prefill`` that and the second's state, from one pass (from a given state,
    by steps: ``SequenceMixer._prefill``).

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
        return self._mix(x, padding_mask)[0]

    def _prefill(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """From the empty state (None): the output of :meth:`_mix` and the state reduced from
        its keys and values, one pass. From a given state: the base class's steps."""
        if state is not None:
            return super()._prefill(x, state)
        out, k, v = self._mix(x, None)
        return out, self._state_after(x, k, v)

    def _mix(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mixer's pass over ``x: (B, T, d)``: its output and the keys and values it used."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _mix")

    def _state_after(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        """The decoding state after the prompt ``x``, from the keys and values of :meth:`_mix`."""
        raise NotImplementedError(f"{type(self).__name__} does not support incremental decoding")

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
