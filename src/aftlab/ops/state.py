"""The states of the causal AFT ops: what one call leaves for the next.

Every causal op continues from a state and returns the one after its last position::

    y, s = op(..., return_state=True)                   # from the empty state
    y, s = op(..., initial_state=s, return_state=True)  # continue from s

Running a sequence in chunks with the state passed along gives the one-pass outputs and final
state; the state is differentiable (a loss over every chunk's output backpropagates through the
chain of states into every chunk's inputs), and ``s.detach()`` truncates that chain. The same
types are the mixers' decoding states: one type per op, for decoding and chunking alike.

* :class:`RunningSums` -- ``aft_simple`` (causal) and ``aft_decay``: the scan's running maximum,
  numerator and denominator.
* :class:`BandState` -- ``aft_local`` (causal) and ``aft_conv`` (causal): the ring of the last
  ``window - 1`` keys and values and the running sums of the keys that left the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._state import detach_state
from ._numerics import compute_dtype

__all__ = ["RunningSums", "BandState", "shifted_sums"]

#: exponent floor of :func:`shifted_sums`: ``e^-60 < 1e-26``, negligible next to 1 in float64
_NEGLIGIBLE = -60.0


def shifted_sums(
    z: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over the tokens (dim 1) of exponents ``z`` and values ``v``, shifted::

        p = max_t' z_t',   a = sum_t' exp(z_t' - p) V_t',   b = sum_t' exp(z_t' - p)

    ``z: (B, T, *Fk)``, ``v: (B, T, *F)`` with ``Fk`` broadcasting against ``F``; ``p, b``
    ``(B, *Fk)``, ``a`` ``(B, *F)``; every ``exp`` is ``<= 1`` and the largest is 1. A token
    with ``z = -inf`` (a padded one) weighs exactly 0, and a row without a finite exponent
    (``T = 0``, or every token padded) gives ``p = -inf``, ``a = b = 0`` (no token), with finite
    gradients. This is the running ``(p, a, b)`` of an online
    log-sum-exp after the ``T`` tokens (its maximum is exact, its sums equal within rounding),
    computed as one reduction over ``T`` instead of ``T`` sequential updates.

    Exponents ``z - p`` below ``-60`` are raised to ``-60``: such terms (``< 1e-26`` against
    the largest, 1) are below the rounding of ``b >= 1`` in float32 and float64 alike, and an
    ``exp`` that underflows takes a slow path on CPU: for the old tokens of ``aft-decay``
    (``z = K - (T-1-t') lambda``) the reduction took 11 ms instead of 2 ms (T=4096, d=256).
    """
    if z.shape[1] == 0:
        b = z.new_zeros(z.shape[:1] + z.shape[2:])
        a = v.new_zeros(v.shape[:1] + v.shape[2:])
        return torch.full_like(b, float("-inf")), a, b
    p = z.amax(1)
    shift = p.masked_fill(p == float("-inf"), 0.0)  # no token: no -inf - -inf
    e = torch.exp((z - shift[:, None]).clamp_min(_NEGLIGIBLE))
    e = e.masked_fill(z == float("-inf"), 0.0)  # not raised to e^-60: a padded token weighs 0
    return p, (e * v).sum(1), e.sum(1)


@dataclass
class RunningSums:
    """State of a causal scan after the tokens ``t' < t``: sums scaled by a running exponent.

    Elementwise over the channels (``lambda = 0`` without decay)::

        a = sum_t' exp(-(t-1-t') lambda + K_t' - p) V_t',   b = the same without V_t'

    with the running exponent ``p`` (``-inf`` before the first token; ``b >= 1`` after it):
    RWKV's stable WKV state. As a log-sum and an average: ``L = p + log b`` and ``A = a / b``.

    Attributes:
        a: ``(B, *F)`` scaled numerator (``F = (d,)``, or ``(h, c)`` for aft-conv).
        b: ``(B, *Fk)`` scaled denominator (``Fk`` broadcasts against ``F``: aft-conv's one key
            channel per head is ``(h, 1)``).
        p: ``(B, *Fk)`` running exponent.
        position: number of tokens consumed (``t``).
    """

    a: torch.Tensor
    b: torch.Tensor
    p: torch.Tensor
    position: int = 0

    @classmethod
    def empty(
        cls,
        batch_size: int,
        d: int | tuple[int, ...],
        *,
        key_shape: tuple[int, ...] | None = None,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> RunningSums:
        """The state before any token; float16/bfloat16 states are kept in float32.

        ``d`` is the value feature shape ``F`` (an int for ``(d,)``); ``key_shape`` that of the
        keys, ``Fk`` (default ``F``).
        """
        F = (d,) if isinstance(d, int) else tuple(d)
        Fk = F if key_shape is None else tuple(key_shape)
        cdt = compute_dtype(dtype)
        b = torch.zeros(batch_size, *Fk, device=device, dtype=cdt)
        a = torch.zeros(batch_size, *F, device=device, dtype=cdt)
        return cls(a=a, b=b, p=torch.full_like(b, float("-inf")))

    @classmethod
    def from_tokens(
        cls, z: torch.Tensor, v: torch.Tensor, position: int | None = None
    ) -> RunningSums:
        """The state after ``T`` tokens, from their exponents and values in one reduction.

        ``z_t' = K_t' - (T-1-t') lambda`` and ``V_t'``, ``(B, T, ...)`` each, in the state
        dtype: the state :meth:`fold` reaches after the ``T`` tokens (:func:`shifted_sums`).
        ``position`` defaults to ``T``.
        """
        p, a, b = shifted_sums(z, v)
        return cls(a=a, b=b, p=p, position=z.shape[1] if position is None else position)

    def fold(self, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None = None) -> None:
        """Add token ``(K_t, V_t)`` (``(B, *Fk)``, ``(B, *F)``), first decaying the past by
        ``lambda``, in place.

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

    def log_sum(self) -> torch.Tensor:
        """``L = p + log b``, ``(B, *Fk)``: ``-inf`` for the empty state (``b = 0``), with finite
        gradients there (0)."""
        tiny = torch.finfo(self.b.dtype).tiny
        empty = self.b <= 0
        L = self.p.masked_fill(empty, 0.0) + torch.log(self.b.clamp_min(tiny))
        return torch.where(empty, float("-inf"), L)

    def average(self) -> torch.Tensor:
        """``A = a / b``, ``(B, *F)``: a convex combination of the values seen, 0 when empty."""
        tiny = torch.finfo(self.b.dtype).tiny
        return torch.where(self.b > 0, self.a / self.b.clamp_min(tiny), 0.0)

    def detach(self) -> RunningSums:
        """The same state cut from its graph (truncated backpropagation: the caller's choice)."""
        return detach_state(self)


@dataclass
class BandState:
    """State of a causal band op (``aft_local``, ``aft_conv``) after the tokens ``t' < t``.

    With window ``s`` (aft-local's ``window``, aft-conv's kernel size), the next query ``t``
    sees the keys ``t - s + 1 .. t - 1`` through the band (with their biases) and the keys
    ``t' <= t - s`` with bias 0, summed in ``gone``.

    Attributes:
        gone: :class:`RunningSums` of the keys ``t' <= t - s`` (no decay).
        k: ``(B, s - 1, *Fk)`` ring of the last ``s - 1`` keys, oldest first (key ``t - s + 1 + i``
            in row ``i``).
        v: ``(B, s - 1, *F)`` their values.
        valid: ``(B, s - 1)`` bool, False where a slot holds no key (before the first token, or
            a padded one).
        position: number of tokens consumed (``t``); aft-local's absolute bias rows start here.
    """

    gone: RunningSums
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    position: int = 0

    @classmethod
    def empty(
        cls,
        batch_size: int,
        window: int,
        d: int | tuple[int, ...],
        *,
        key_shape: tuple[int, ...] | None = None,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> BandState:
        """The state before any token: nothing gone, ``window - 1`` empty slots."""
        gone = RunningSums.empty(batch_size, d, key_shape=key_shape, device=device, dtype=dtype)
        n = max(window - 1, 0)
        k = gone.b.new_zeros(batch_size, n, *gone.b.shape[1:])
        v = gone.a.new_zeros(batch_size, n, *gone.a.shape[1:])
        valid = torch.zeros(batch_size, n, dtype=torch.bool, device=device)
        return cls(gone=gone, k=k, v=v, valid=valid)

    def detach(self) -> BandState:
        """The same state cut from its graph (truncated backpropagation: the caller's choice)."""
        return detach_state(self)
