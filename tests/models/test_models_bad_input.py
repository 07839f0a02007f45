"""Bad input to the practical models and attention: clear errors naming argument and shapes."""

from __future__ import annotations

import pytest
import torch

from aftlab.mixers import build_mixer
from aftlab.models import (
    PixelTransformer,
    TransformerBlock,
    TransformerClassifier,
    TransformerConfig,
    TransformerLM,
)


def _cfg(**kw) -> TransformerConfig:
    base = dict(vocab_size=20, d_model=12, n_layers=1, n_heads=3, max_seq_len=8)
    return TransformerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def lm():
    return TransformerLM(_cfg()).eval()


# ----------------------------------------------------------------------------- attention
def test_attention_x_wrong_width():
    m = build_mixer("attention", d_model=12, n_heads=3)
    with pytest.raises(ValueError, match=r"'x' must have shape \(\*, \*, 12\), got \(2, 5, 10\)"):
        m(torch.randn(2, 5, 10))


def test_attention_x_wrong_rank():
    m = build_mixer("attention", d_model=12, n_heads=3)
    with pytest.raises(
        ValueError, match=r"'x' must have 3 dimensions .*got 2 with shape \(5, 12\)"
    ):
        m(torch.randn(5, 12))
    with pytest.raises(TypeError, match="'x' must be a floating-point tensor"):
        m(torch.ones(2, 5, 12, dtype=torch.long))


def test_attention_heads_inconsistent():
    with pytest.raises(ValueError, match=r"'n_heads' = 5 must divide d_model = 12"):
        build_mixer("attention", d_model=12, n_heads=5)
    with pytest.raises(ValueError, match=r"'head_dim' must be even for rotary=True, got 3"):
        build_mixer("attention", d_model=12, n_heads=4, rotary=True)
    with pytest.raises(ValueError, match=r"'head_dim' must be > 0, got 0"):
        build_mixer("attention", d_model=12, n_heads=4, head_dim=0)


def test_attention_mask_shape_and_dtype():
    m = build_mixer("attention", d_model=12, n_heads=3)
    x = torch.randn(2, 5, 12)
    with pytest.raises(ValueError, match=r"'padding_mask' must have shape \(2, 5\), got \(2, 4\)"):
        m(x, padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(
        TypeError, match="'padding_mask' must be a bool tensor.*got dtype torch.int64"
    ):
        m(x, padding_mask=torch.ones(2, 5, dtype=torch.long))


def test_attention_step_input():
    m = build_mixer("attention", d_model=12, n_heads=3, causal=True)
    state = m.init_state(2)
    with pytest.raises(ValueError, match=r"'x' must have shape \(\*, 12\), got \(2, 11\)"):
        m.step(torch.randn(2, 11), state)
    with pytest.raises(ValueError, match="'x' has batch size 3 but 'state' was made for 2"):
        m.step(torch.randn(3, 12), state)
    with pytest.raises(TypeError, match="'state' must be a KVCache"):
        m.step(torch.randn(2, 12), None)


def test_unknown_mixer():
    with pytest.raises(ValueError, match=r"unknown mixer 'nope'; expected one of \[.*'attention'"):
        TransformerLM(_cfg(mixer="nope"))
    with pytest.raises(ValueError, match="mixer 'attention'.*unexpected keyword argument 'windw'"):
        TransformerLM(_cfg(mixer_options={"windw": 3}))


# ----------------------------------------------------------------------------- models
def test_block_x_wrong_width():
    block = TransformerBlock(_cfg())
    with pytest.raises(
        ValueError, match=r"TransformerBlock: 'x' must have shape \(\*, \*, 12\), got \(2, 3, 10\)"
    ):
        block(torch.randn(2, 3, 10))
    with pytest.raises(ValueError, match=r"'x' must have shape \(\*, 12\), got \(2, 10\)"):
        block.step(torch.randn(2, 10), None)


def test_tokens_wrong_rank(lm):
    with pytest.raises(
        ValueError, match=r"'idx' must have shape \(B, T\) of token ids, got \(2, 3, 4\)"
    ):
        lm(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"'idx' must have shape \(B, T\) of token ids, got \(5,\)"
    ):
        lm(torch.zeros(5, dtype=torch.long))


def test_tokens_wrong_dtype_and_range(lm):
    with pytest.raises(
        TypeError, match="'idx' must be an integer \\(long\\) tensor.*torch.float32"
    ):
        lm(torch.zeros(2, 3))
    with pytest.raises(
        ValueError, match=r"ids must be in \[0, vocab_size=20\), got values in \[0, 20\]"
    ):
        lm(torch.tensor([[0, 20]]))
    with pytest.raises(ValueError, match=r"got values in \[-1, 3\]"):
        lm(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="'idx' must be a torch.Tensor"):
        lm([[1, 2]])
    with pytest.raises(ValueError, match=r"at least one token, got shape \(2, 0\)"):
        lm(torch.zeros(2, 0, dtype=torch.long))


def test_sequence_longer_than_learned_table(lm):
    with pytest.raises(ValueError, match=r"sequence length 9.*max_seq_len = 8"):
        lm(torch.zeros(1, 9, dtype=torch.long))


def test_model_mask_shape_and_dtype(lm):
    idx = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=r"TransformerLM: 'padding_mask' must have 2 dimensions \(2, 5\), "
        r"got 1 with shape \(5,\)",
    ):
        lm(idx, padding_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="'padding_mask' must be a bool tensor.*torch.float32"):
        lm(idx, padding_mask=torch.ones(2, 5))


def test_step_input(lm):
    cache = lm.init_cache(2)
    with pytest.raises(
        ValueError, match=r"'tokens' must have shape \(B,\) of token ids, got \(2, 1\)"
    ):
        lm.step(torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(
        ValueError, match="'tokens' has batch size 3 but 'cache' was made for batch_size=2"
    ):
        lm.step(torch.zeros(3, dtype=torch.long), cache)
    with pytest.raises(TypeError, match="'cache' must be a DecodingCache"):
        lm.step(torch.zeros(2, dtype=torch.long), [])


def test_generate_arguments(lm):
    p = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'temperature' must be >= 0.*got -0.5"):
        lm.generate(p, 2, temperature=-0.5)
    with pytest.raises(ValueError, match=r"'top_k' must be in \[1, vocab_size=20\], got 21"):
        lm.generate(p, 2, top_k=21)
    for bad in (0, 0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=rf"'top_p' must be in \(0, 1\], got {bad}"):
            lm.generate(p, 2, top_p=bad)
    with pytest.raises(TypeError, match=r"'top_p' must be a float in \(0, 1\] or None, got str"):
        lm.stream_generate(p, 2, top_p="0.9")
    with pytest.raises(TypeError, match="'top_p' must be a float .* got bool"):
        lm.generate(p, 2, top_p=True)
    with pytest.raises(ValueError, match="'max_new_tokens' must be >= 0, got -1"):
        lm.generate(p, -1)
    with pytest.raises(ValueError, match=r"'prompt' must have shape \(B, T\)"):
        lm.generate(torch.zeros(2, dtype=torch.long), 2)


def test_config_type_and_causality():
    with pytest.raises(TypeError, match="'config' must be a TransformerConfig, got dict"):
        TransformerLM({"d_model": 12})
    with pytest.raises(ValueError, match="config.causal=True"):
        TransformerLM(_cfg(causal=False))
    with pytest.raises(ValueError, match="config.causal=False"):
        TransformerClassifier(_cfg(), num_classes=2)
    with pytest.raises(
        ValueError, match=r"'pooling' must be one of \['first', 'mean'\], got 'max'"
    ):
        TransformerClassifier(_cfg(causal=False), num_classes=2, pooling="max")
    with pytest.raises(ValueError, match="'num_classes' must be > 0, got 0"):
        TransformerClassifier(_cfg(causal=False), num_classes=0)


def test_noncausal_cannot_decode():
    clf = TransformerClassifier(_cfg(causal=False), num_classes=2)
    with pytest.raises(RuntimeError, match="causal"):
        clf.backbone.init_cache(1)


def test_pixel_model_shapes():
    with pytest.raises(ValueError, match=r"image_shape \(3, 3\) has 9 .*max_seq_len = 8"):
        PixelTransformer(_cfg(), image_shape=(3, 3))
    model = PixelTransformer(_cfg(), image_shape=(2, 4))
    with pytest.raises(
        ValueError, match=r"'pixels' must have shape \(B, N\) or \(B, \*\(2, 4\)\), got \(1, 4, 2\)"
    ):
        model(torch.zeros(1, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"at most N = 8 positions, got shape \(1, 9\)"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"'prefix' must have shape \(2, T0\), got \(1, 3\)"):
        model.sample(2, prefix=torch.zeros(1, 3, dtype=torch.long))
