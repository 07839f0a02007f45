"""Sampling the next token from logits: temperature, top-k, greedy."""

from __future__ import annotations

import torch

__all__ = ["sample_next_token", "check_sampling_args"]


def check_sampling_args(
    where: str, *, temperature: float, top_k: int | None, vocab_size: int
) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``temperature >= 0``, ``top_k`` in ``[1, V]``."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"{where}: 'temperature' must be a float >= 0, got {type(temperature).__name__}"
        )
    if not temperature >= 0:
        raise ValueError(f"{where}: 'temperature' must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"{where}: 'top_k' must be an int or None, got {type(top_k).__name__}")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(
                f"{where}: 'top_k' must be in [1, vocab_size={vocab_size}], got {top_k}"
            )


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits / temperature)``, restricted to the top ``k``.

    Args:
        logits: ``(B, V)`` unnormalised log-probabilities.
        temperature: ``tau``; ``p_i ∝ exp(z_i / tau)``. ``0`` takes the argmax (greedy).
        top_k: keep only the ``k`` largest logits of each row (None keeps all).
        generator: random generator for reproducible sampling (on the logits' device).

    Returns:
        ``(B,)`` long tensor of token ids.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits.float() / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
