"""Shared pieces of the AFT mixers: the projections around an AFT op.

An AFT mixer computes ``Q = X W^Q, K = X W^K, V = X W^V`` (the paper's notation), applies a
sigma-gated AFT op ``Y = sigma(Q) * (...)`` and projects back with ``W^O`` (then dropout).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...ops._numerics import compute_dtype
from ..base import SequenceMixer, mark_residual_projection

__all__ = ["AFTMixer", "RunningSums", "shifted_sums"]


#: exponent floor of :func:`shifted_sums`: ``e^-60 < 1e-26``, negligible next to 1 in float64
_NEGLIGIBLE = -60.0


def shifted_sums(
    z: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over the tokens of exponents ``z`` and values ``v`` (both ``(B, T, d)``), shifted::

        p = max_t' z_t',   a = sum_t' exp(z_t' - p) V_t',   b = sum_t' exp(z_t' - p)

    each ``(B, d)``; every ``exp`` is ``<= 1`` and the largest is 1. ``T = 0`` gives
    ``p = -inf``, ``a = b = 0`` (no token). This is the running ``(p, a, b)`` of an online
    log-sum-exp after the ``T`` tokens (its maximum is exact, its sums equal within rounding),
    computed as one reduction over ``T`` instead of ``T`` sequential updates.

    Exponents ``z - p`` below ``-60`` are raised to ``-60``: such terms (``< 1e-26`` against
    the largest, 1) are below the rounding of ``b >= 1`` in float32 and float64 alike, and an
    ``exp`` that underflows takes a slow path on CPU: for the old tokens of ``aft-decay``
    (``z = K - (T-1-t') lambda``) the reduction took 11 ms instead of 2 ms (T=4096, d=256).
    """
    if z.shape[1] == 0:
        b = z.new_zeros(z.shape[0], z.shape[2])
        return torch.full_like(b, float("-inf")), torch.zeros_like(b), b
    p = z.amax(1)
    e = torch.exp((z - p[:, None]).clamp_min(_NEGLIGIBLE))
    return p, (e * v).sum(1), e.sum(1)


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
        z = torch.zeros(batch_size, d, device=device, dtype=compute_dtype(dtype))
        return cls(a=z, b=z.clone(), p=torch.full_like(z, float("-inf")))

    @classmethod
    def from_tokens(cls, z: torch.Tensor, v: torch.Tensor) -> RunningSums:
        """The state after ``T`` tokens, from their exponents and values in one reduction.

        ``z_t' = K_t' - (T-1-t') lambda`` and ``V_t'``, ``(B, T, d)`` each, in the state dtype:
        the state :meth:`fold` reaches after the ``T`` tokens (:func:`shifted_sums`).
        """
        p, a, b = shifted_sums(z, v)
        return cls(a=a, b=b, p=p, position=z.shape[1])

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

    The output projection ``proj`` (``W^O``) is marked a residual projection
    (:func:`~aftlab.mixers.base.mark_residual_projection`).

    Args:
        key_dim: width of ``K``; ``d_model`` for AFT-full/local/simple/decay, ``n_heads`` for
            AFT-conv (one key channel per head).
        **common: the common mixer arguments of :class:`~aftlab.mixers.SequenceMixer`.

    A subclass implements :meth:`_mix` (its forward pass, also returning the keys and values)
    and, when causal, :meth:`_state_after` (the state a prompt leaves): ``forward`` returns the
    first's output, ``prefill`` that and the second's state, from one pass.

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

    def _prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The output of :meth:`_mix` and the state reduced from its keys and values."""
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
