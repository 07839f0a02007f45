"""Shared pieces of the RWKV-4 tests: transformers' ``RwkvForCausalLM`` with every parameter
random (not its initialisation, under which paths vanish), aftlab's copy of it, BlinkDL names."""

from __future__ import annotations

import pytest
import torch

from aftlab.models import RWKV4LM, RWKV4Config
from aftlab.testing import assert_close

# odd sizes: the channel mix's width differs from the model's
V, D, D_FF = 99, 32, 37


def randomise_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter of ``module`` drawn afresh in place: ``N(0, 0.3^2)`` for matrices,
    ``N(0, 0.5^2)`` for the per-channel vectors (decays, bonuses, mixes, LayerNorms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = 0.3 if p.squeeze().dim() == 2 else 0.5
            p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def random_hf(n_layers: int = 2, *, seed: int = 0, **config):
    """A transformers ``RwkvForCausalLM`` (``V`` ids, width ``D``, channel mix ``D_FF``), every
    parameter random, in eval mode (not yet rescaled: that happens at its first eval forward)."""
    transformers = pytest.importorskip("transformers", reason="the test extra (transformers)")
    cfg = transformers.RwkvConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=n_layers, intermediate_size=D_FF,
        attention_hidden_size=D, context_length=64, **config,
    )  # fmt: skip
    return randomise_(transformers.RwkvForCausalLM(cfg), seed).eval()


def hf_pair(n_layers: int = 2, *, train: bool = False, seed: int = 0, **config):
    """``(hf, lm)``: :func:`random_hf` and ``RWKV4LM.from_hf`` of it, both in the same mode."""
    hf = random_hf(n_layers, seed=seed, **config).train(train)
    return hf, RWKV4LM.from_hf(hf)


def random_lm(n_layers: int = 2, *, seed: int = 0, **config) -> RWKV4LM:
    """aftlab's model of the same sizes, every parameter random (no transformers needed)."""
    cfg = RWKV4Config(vocab_size=V, d_model=D, n_layers=n_layers, d_ff=D_FF, **config)
    return randomise_(RWKV4LM(cfg), seed).eval()


def scale(t: torch.Tensor) -> float:
    """``max |t|``: the magnitude float32 rounding errors of ``t`` follow."""
    return t.detach().abs().max().item()


def assert_float32_close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two float32 computations of the same logits (or gradients) in another order agree to
    ``1e-5`` relative to ``expected``'s magnitude.

    Float32's unit roundoff is ``6e-8``; a logit passes ``2 N + 2`` LayerNorms, the WKV and
    products of width <= 37 whose sums the two libraries (and Intel and AMD CPUs) order
    differently, so ~10-50 roundoffs of the magnitude are expected (measured: 6e-7 at 7 layers
    for the logits, 3e-6 for the gradients); ``1e-5`` leaves room. The bound is relative to the
    magnitude ``max |expected|`` and not elementwise alone: an entry near 0 carries the error
    of the large terms it was summed from.
    """
    assert_close(name, actual, expected, rtol=1e-5, atol=1e-5 * scale(expected))


def blinkdl_name(hf_name: str) -> str:
    """BlinkDL's name of a Hugging Face tensor name (``blinkdl_to_hf`` inverted, written out from
    transformers' ``convert_rwkv_checkpoint_to_hf.py``): no ``rwkv.`` prefix, ``emb``, ``ln0``,
    ``att``, ``ffn``, ``time_mix_{k,v,r}``."""
    n = hf_name.removeprefix("rwkv.")
    n = n.replace("embeddings.", "emb.", 1).replace("blocks.0.pre_ln.", "blocks.0.ln0.")
    n = n.replace(".attention.", ".att.").replace(".feed_forward.", ".ffn.")
    for long, short in (("key", "k"), ("value", "v"), ("receptance", "r")):
        n = n.replace(f".time_mix_{long}", f".time_mix_{short}")
    return n


def to_blinkdl(hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BlinkDL ``.pth`` state dict of Hugging Face-named tensors: the values as they are (the
    mixes ``(1, 1, d)``, the raw ``time_decay``), renamed by :func:`blinkdl_name`."""
    return {blinkdl_name(n): t.detach().clone() for n, t in hf_tensors.items()}
