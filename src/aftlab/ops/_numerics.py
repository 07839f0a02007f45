"""The numerics every AFT op shares: compute dtype, shifts, safe division, log-sum-exp merge.

One convention throughout: a sum of exponentials ``sum_t' exp(z_t')`` is carried as the pair
``(L, A)`` of its log ``L = log sum exp(z)`` and its weighted average ``A = sum exp(z - L) V``,
and every ``exp`` is taken of ``z - m`` with a shift ``m >= z`` over the terms that may be seen,
so that it is at most 1 and never overflows for a finite input. A sum of ``n`` such terms
times values is shifted by :func:`headroom` more, so that it stays below the largest value
(no overflow for values up to ``finfo.max``).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "LOW_PRECISION",
    "compute_dtype",
    "finite_shift",
    "headroom",
    "lse_merge",
    "safe_divide",
    "shift_along",
]

#: Inputs of these dtypes are computed in float32 and returned in their own dtype.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 are computed in float32; other dtypes in themselves."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def finite_shift(m: torch.Tensor) -> torch.Tensor:
    """A maximum used as a shift, with non-finite entries replaced by 0.

    ``-inf`` (no term seen) then gives ``exp(-inf - 0) = 0`` instead of NaN; ``+inf`` or NaN
    (a non-finite input that is seen) gives NaN through ``exp(z - 0)`` in exactly the outputs
    that see it.
    """
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def headroom(n: int) -> float:
    """``log(n + 1)``: a shift that makes each of ``n`` weights ``exp(z - m - headroom(n))`` at
    most ``1 / (n + 1)``, so that their sum times values never exceeds the largest value."""
    return math.log(n + 1)


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else 0 (an empty sum: no key seen). No NaN from 0/0."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def lse_merge(terms: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge log-sum/average pairs: ``L = log sum_i e^{L_i}``, ``A = sum_i e^{L_i - L} A_i``.

    A pair with ``L_i = -inf`` (an empty sum) contributes nothing; if all are empty the result
    is ``(-inf, 0)``. Shifted by :func:`headroom`: the sum of the ``A_i`` never overflows.
    """
    if len(terms) == 1:
        return terms[0]
    m = terms[0][0]
    for L, _ in terms[1:]:
        m = torch.maximum(m, L)
    ms = finite_shift(m) + headroom(len(terms))
    den = torch.zeros_like(ms)
    num = torch.zeros_like(terms[0][1])
    for L, A in terms:
        e = torch.exp(L - ms)
        den = den + e
        num = num + e * A
    return ms + torch.log(den), safe_divide(num, den)


def shift_along(x: torch.Tensor, by: int, dim: int, fill: float) -> torch.Tensor:
    """``out[..., i, ...] = x[..., i - by, ...]`` along ``dim`` (``by`` may be negative), ``fill``
    where ``i - by`` is out of range."""
    if by == 0:
        return x
    n = x.shape[dim]
    out = torch.full_like(x, fill)
    if abs(by) < n:
        if by > 0:
            out.narrow(dim, by, n - by).copy_(x.narrow(dim, 0, n - by))
        else:
            out.narrow(dim, 0, n + by).copy_(x.narrow(dim, -by, n + by))
    return out
