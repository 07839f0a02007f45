"""The formulas as plain functions: the definition's Transformer and the AFT family.

Tensors are batch-first: ``x`` is ``(..., n, d)``; the definition's column matrix is
``X = x[b].T``.
"""

from ..ops import aft_conv, aft_conv2d, aft_decay, aft_full, aft_local, aft_simple
from .seed import seed_attention, seed_feedforward

__all__ = [
    "seed_attention",
    "seed_feedforward",
    "aft_full",
    "aft_local",
    "aft_simple",
    "aft_conv",
    "aft_conv2d",
    "aft_decay",
]
