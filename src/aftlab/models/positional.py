"""Positional encodings added to token embeddings (rotary lives in the attention mixer)."""

from __future__ import annotations

import torch

__all__ = ["sinusoidal_positions"]


def sinusoidal_positions(
    length: int,
    d_model: int,
    *,
    offset: int = 0,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The fixed encodings of Vaswani et al. (2017) for positions ``offset .. offset+length-1``.

    ``PE[p, 2i] = sin(p / base^(2i/d))`` and ``PE[p, 2i+1] = cos(p / base^(2i/d))``; for odd
    ``d`` the last column is a sine.

    Args:
        length: number of positions ``T``.
        d_model: model width ``d``.
        offset: first position ``p`` (the decoding position when stepping).
        base: 10000 in the paper.
        device: device of the result.
        dtype: dtype of the result (default float32; computed in float64).

    Returns:
        ``(T, d)`` tensor.

    Example:
        >>> import math, torch
        >>> pe = sinusoidal_positions(3, 4, dtype=torch.float64)
        >>> pe[1, 0].item() == math.sin(1.0), pe[1, 3].item() == math.cos(1.0 / 100.0)
        (True, True)
    """
    p = torch.arange(offset, offset + length, device=device, dtype=torch.float64)
    two_i = torch.arange(0, d_model, 2, device=device, dtype=torch.float64)
    angles = p[:, None] / base ** (two_i / d_model)  # (T, ceil(d/2))
    pe = torch.empty(length, d_model, device=device, dtype=torch.float64)
    pe[:, 0::2] = angles.sin()
    pe[:, 1::2] = angles.cos()[:, : d_model // 2]
    return pe.to(dtype or torch.float32)
