"""AdamW with weight decay on matrices only, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["param_groups", "build_optimizer", "lr_at"]


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Split parameters into a decayed and a non-decayed group (the nanoGPT/GPT-2 rule).

    Decayed: weight matrices of linear layers and other parameters with ``dim >= 2`` that are
    not embeddings (projections ``W^Q, W^K, W^V, W^O``, feed-forward ``W_1, W_2``, convolution
    kernels). Not decayed: biases, LayerNorm gains, embedding tables (token and learned position;
    the token table is also the tied output head) and the parameters a token mixer owns directly
    (AFT position biases ``w`` or their factors ``u, v``, AFT-conv kernels, decay rates): they are
    a learned prior over positions, not a map of inputs, and decaying them pulls AFT-full/local
    towards AFT-simple.

    Args:
        model: the model; parameters are deduplicated (tied weights appear once).
        weight_decay: decay of the first group.

    Returns:
        Two AdamW parameter groups, ``[{"params": decayed, ...}, {"params": others, ...}]``.
    """
    from ..mixers.base import SequenceMixer

    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.LayerNorm)):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, SequenceMixer):
            # the mixer's own parameters (AFT position biases w or their factors u, v, conv
            # kernels, decay rates), wherever they sit; its nn.Linear projections are decayed
            linear = {
                id(p) for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters()
            }
            no_decay_ids.update(id(p) for p in module.parameters() if id(p) not in linear)
    decay, other = [], []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in no_decay_ids else other).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] | list[float]
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` (fused kernel off: results match bit for bit across runs)."""
    return torch.optim.AdamW(
        param_groups(model, weight_decay=weight_decay), lr=lr, betas=tuple(betas), foreach=False
    )


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay.

    ``lr_t = lr * (t + 1) / warmup`` for ``t < warmup``; afterwards, with
    ``p = (t - warmup) / max(1, steps - warmup)``,
    ``lr_t = min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``, reaching ``min_lr`` at ``t = steps``.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
