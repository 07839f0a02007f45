"""Shared pieces of the model tests: a small float64 LM with every parameter perturbed."""

from __future__ import annotations

import torch

from aftlab.mixers import get_mixer_class
from aftlab.models import TransformerConfig, TransformerLM


def small_lm(name: str, **kw) -> TransformerLM:
    """A float64 LM (odd sizes) on mixer ``name`` with its ``test_options`` (small windows and
    kernels: ring buffers wrap in a short prompt), every parameter perturbed (biases, kernels,
    decays move), in eval mode; ``kw`` overrides the config."""
    base = dict(vocab_size=29, d_model=15, n_layers=2, n_heads=3, max_seq_len=40)
    options = dict(get_mixer_class(name).test_options)
    cfg = TransformerConfig(**{**base, "mixer": name, "mixer_options": options, **kw})
    model = TransformerLM(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model
