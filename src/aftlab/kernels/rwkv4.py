"""Callers of the RWKV-4 decoding-step kernels (``csrc/rwkv4.cpp``), with their fakes:
``aftlab::rwkv4_step``, one block's step in one call, and ``aftlab::rwkv4_linear``, the
product of a few rows that it uses (for the head).

Inference only (no autograd: the caller runs it when no gradient is taken). The library must be
loaded (:func:`aftlab.kernels.load`); the caller passes tensors of the shapes and dtypes below.
"""

from __future__ import annotations

import torch

__all__ = ["rwkv4_step", "rwkv4_linear", "STATE", "WEIGHTS"]

#: The state tensors, ``(B, d)`` each (``a, b, p`` float32, or float64 for float64 inputs).
STATE = ("last_att", "a", "b", "p", "last_ffn")
#: The weights, in the kernel's order (``W_*`` ``(n_out, n_in)``, the rest ``(d,)``).
WEIGHTS = (
    "ln1_weight", "ln1_bias", "mix_r", "mix_k", "mix_v", "W_r", "W_k", "W_v", "W_o",
    "time_decay", "time_bonus", "ln2_weight", "ln2_bias", "ffn_mix_k", "ffn_mix_r",
    "ffn_W_k", "ffn_W_r", "ffn_W_v",
)


def register() -> None:
    """Register the fakes of ``aftlab::rwkv4_step`` and ``aftlab::rwkv4_linear`` (once, after
    the library is loaded)."""

    @torch.library.register_fake("aftlab::rwkv4_step")
    def _(x, state, weights, eps, scale):
        sums = [s.new_empty(s.shape) for s in state[1:4]]
        return [x.new_empty(x.shape), x.new_empty(x.shape), *sums, x.new_empty(x.shape)]

    @torch.library.register_fake("aftlab::rwkv4_linear")
    def _(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])


def rwkv4_step(
    x: torch.Tensor,
    state: list[torch.Tensor],
    weights: list[torch.Tensor],
    *,
    eps: float,
    scale: float = 1.0,
) -> list[torch.Tensor]:
    """One RWKV-4 block's step on ``x: (B, d)`` (``csrc/rwkv4.cpp`` has the formulas).

    Args:
        state: the :data:`STATE` tensors before the token.
        weights: the :data:`WEIGHTS`.
        eps: the layer norms' epsilon.
        scale: the branches' ``rescale_every`` factor (a power of two).

    Returns:
        ``[out (B, d), last_att, a, b, p, last_ffn]``: the block's output and the state after.
    """
    return torch.ops.aftlab.rwkv4_step(x, state, weights, eps, scale)


def rwkv4_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` for ``x: (B, d)``, ``weight: (n, d)``: ``(B, n)``, without gradient.

    For float32, bfloat16 and float16 with ``B <= 16`` the kernel reads ``W`` once, 8 rows at a
    time, with float32 accumulation and one rounding per output (ATen's product of a few rows
    runs below the memory bandwidth on some CPUs: in bfloat16 at half of it); otherwise
    ``torch.nn.functional.linear``.
    """
    return torch.ops.aftlab.rwkv4_linear(x, weight)
