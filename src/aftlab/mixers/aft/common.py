"""Shared pieces of the AFT mixers: the projections around an AFT op.

An AFT mixer computes ``Q = X W^Q, K = X W^K, V = X W^V`` (the paper's notation), applies a
sigma-gated AFT op ``Y = sigma(Q) * (...)`` and projects back with ``W^O`` (then dropout).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..base import SequenceMixer

__all__ = ["AFTMixer", "RunningSums"]


@dataclass
class RunningSums:
    """Decoding state of the O(d)-per-token AFT mixers: sums scaled by a running exponent.

    Elementwise over the channels, after the tokens ``t' < t`` (``lambda = 0`` without decay)::

        a = sum_t' exp(-(t-1-t') lambda + K_t' - p) V_t',   b = the same without V_t'

    with the running exponent ``p`` (``-inf`` before the first token): RWKV's stable WKV state.

    Attributes:
        a: ``(B, d)`` scaled numerator.
        b: ``(B, d)`` scaled denominator.
        p: ``(B, d)`` running exponent.
        position: number of tokens consumed.
    """

    a: torch.Tensor
    b: torch.Tensor
    p: torch.Tensor
    position: int = 0

    @classmethod
    def empty(
        cls, batch_size: int, d: int, *, device: torch.device | str, dtype: torch.dtype
    ) -> RunningSums:
        """The state before any token; float16/bfloat16 states are kept in float32."""
        dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        z = torch.zeros(batch_size, d, device=device, dtype=dtype)
        return cls(a=z, b=z.clone(), p=torch.full_like(z, float("-inf")))

    def fold(self, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None = None) -> None:
        """Add token ``(K_t, V_t)`` (``(B, d)`` each), first decaying the past by ``lambda``.

        ``p' = max(p - lambda, K_t)``, ``a' = e^{p-lambda-p'} a + e^{K_t-p'} V_t``,
        ``b' = e^{p-lambda-p'} b + e^{K_t-p'}``.
        """
        carried = self.p if decay is None else self.p - decay
        p_new = torch.maximum(carried, k)
        e_old, e_new = torch.exp(carried - p_new), torch.exp(k - p_new)
        self.a = e_old * self.a + e_new * v
        self.b = e_old * self.b + e_new
        self.p = p_new
        self.position += 1


class AFTMixer(SequenceMixer):
    """Base class of the AFT mixers: owns ``W^Q``, ``W^K``, ``W^V`` and the output projection.

    Args:
        key_dim: width of ``K``; ``d_model`` for AFT-full/local/simple/decay, ``n_heads`` for
            AFT-conv (one key channel per head).
        **common: the common mixer arguments of :class:`~aftlab.mixers.SequenceMixer`.

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
        self.proj = nn.Linear(d, d, bias=self.bias)
        self.drop = nn.Dropout(self.dropout_p)

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
