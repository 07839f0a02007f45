"""aftlab.models.decoding: a whole model's decoding cache and step at position P."""

from __future__ import annotations

import pytest
import torch

from aftlab.mixers.attention import KVCache
from aftlab.models import TransformerConfig, TransformerLM
from aftlab.models.decoding import cache_at, decoding_cost

D, L, H, V = 16, 2, 2, 32


def _model(mixer: str, max_seq_len: int = 512, **options) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=V, d_model=D, n_layers=L, n_heads=H, max_seq_len=max_seq_len, mixer=mixer,
        mixer_options=options,
    )
    return TransformerLM(cfg).eval()


def test_attention_cache_holds_p_random_keys_and_values_and_steps_on():
    m = _model("attention")
    cache = cache_at(m, 300)
    assert cache.position == 300
    for s in cache.states:
        assert isinstance(s, KVCache) and s.length == 300
        assert s.k[:, :, :300].std() > 0.5 and s.k[:, :, 300:].abs().max() == 0
    with torch.inference_mode():
        logits = m.step(torch.tensor([3]), cache)
    assert logits.shape == (1, V) and logits.isfinite().all()
    assert cache.position == 301 and all(s.length == 301 for s in cache.states)


@pytest.mark.parametrize("mixer", ["aft-decay", "aft-local", "aft-simple"])
def test_a_fixed_size_state_is_prefilled(mixer):
    """The cache of an AFT model is the one its prefill of P tokens leaves: the next step's
    logits are those of a forward over the P + 1 tokens, at the last position."""
    m = _model(mixer)
    P = 200
    cache = cache_at(m, P, seed=5)
    assert cache.position == P
    ids = torch.randint(V, (1, P), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        stepped = m.step(torch.tensor([7]), cache)
        full = m(torch.cat((ids, torch.tensor([[7]])), 1))[:, -1]
    torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)


def test_state_bytes_grow_with_p_for_attention_only():
    att, decay = _model("attention", 5000), _model("aft-decay", 5000)
    a = [decoding_cost(att, p, steps=2, warmup=1)["state_bytes"] for p in (64, 4096)]
    d = [decoding_cost(decay, p, steps=2, warmup=1)["state_bytes"] for p in (64, 4096)]
    # keys and values: 2 x layers x heads x P x head_dim float32
    assert a == [2 * L * H * p * (D // H) * 4 for p in (64, 4096)]
    assert d[0] == d[1] > 0 and d[0] < a[0]


def test_decoding_cost_times_each_step():
    row = decoding_cost(_model("aft-decay"), 100, steps=3, warmup=1)
    assert set(row) == {"position", "state_bytes", "ms_per_token", "ms_min"}
    assert row["position"] == 100 and 0 < row["ms_min"] <= row["ms_per_token"]


@pytest.mark.parametrize(
    "kw, says",
    [({"position": 0}, "position"), ({"steps": 0}, "steps"), ({"warmup": -1}, "warmup")],
)
def test_decoding_cost_refuses_bad_arguments(kw, says):
    args = {"position": 8, "steps": 2, "warmup": 1, **kw}
    with pytest.raises(ValueError, match=f"decoding_cost: {says} must be an integer"):
        decoding_cost(_model("aft-decay"), args.pop("position"), **args)


def test_a_position_past_the_length_limit_is_refused():
    with pytest.raises(ValueError, match="exceeds max_seq_len = 64"):
        decoding_cost(_model("aft-decay", max_seq_len=64), 100, steps=1, warmup=0)
