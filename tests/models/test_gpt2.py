"""GPT-2 compatibility: a Hugging Face GPT2LMHeadModel state dict gives the same logits."""

from __future__ import annotations

import pytest
import torch

from aftlab.models import TransformerConfig, TransformerLM
from aftlab.models.gpt2 import gpt2_config_from_state_dict
from aftlab.testing import assert_close

transformers = pytest.importorskip("transformers")  # test-only dependency ("test" extra)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=100,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # make the LayerNorms non-trivial so their mapping is tested too
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_inferred_config(hf_model):
    cfg = gpt2_config_from_state_dict(hf_model.state_dict(), n_heads=2)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads) == (100, 32, 2, 2)
    assert (cfg.max_seq_len, cfg.resolved_d_ff) == (64, 128)
    assert (cfg.norm, cfg.activation, cfg.positional) == ("pre", "gelu_tanh", "learned")
    assert cfg.bias and cfg.tie_embeddings and cfg.layer_norm_eps == 1e-5


def test_logits_equal_hugging_face(hf_model):
    lm = TransformerLM.from_gpt2_state_dict(hf_model.state_dict(), n_heads=2).eval()
    idx = torch.randint(0, 100, (3, 37))
    with torch.no_grad():
        expected = hf_model(idx).logits
        assert_close("logits", lm(idx), expected, atol=1e-5, rtol=0)
        # incremental decoding of the loaded model agrees too
        cache = lm.init_cache(3)
        last = [lm.step(idx[:, t], cache) for t in range(idx.shape[1])][-1]
    assert_close("step logits", last, expected[:, -1], atol=1e-5, rtol=0)


def test_explicit_config_and_gpt2model_keys(hf_model):
    sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    sd.pop("lm_head.weight")  # a GPT2Model state dict: no head, no prefix
    cfg = gpt2_config_from_state_dict(sd, n_heads=2)
    lm = TransformerLM.from_gpt2_state_dict(sd, config=cfg).eval()
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        assert_close("logits", lm(idx), hf_model(idx).logits, atol=1e-5, rtol=0)


def test_n_heads_is_required_and_checked(hf_model):
    sd = hf_model.state_dict()
    with pytest.raises(ValueError, match="n_heads"):
        TransformerLM.from_gpt2_state_dict(sd)
    with pytest.raises(
        ValueError, match=r"'n_heads' must be a positive divisor of n_embd = 32.*got 3"
    ):
        TransformerLM.from_gpt2_state_dict(sd, n_heads=3)


def test_wrong_config_names_the_tensor(hf_model):
    cfg = TransformerConfig(
        vocab_size=100, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, activation="gelu_tanh"
    )
    with pytest.raises(
        ValueError,
        match=r"'backbone.position_embedding.weight' must have shape \(32, 32\).*got \(64, 32\)",
    ):
        TransformerLM.from_gpt2_state_dict(hf_model.state_dict(), config=cfg)


def test_unexpected_and_missing_keys(hf_model):
    sd = dict(hf_model.state_dict())
    sd["transformer.h.0.attn.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected key"):
        TransformerLM.from_gpt2_state_dict(sd, n_heads=2)
    sd = dict(hf_model.state_dict())
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="h.1.mlp.c_fc.bias"):
        TransformerLM.from_gpt2_state_dict(sd, n_heads=2)
