"""The practical Transformer: blocks, positional encodings, LM decoding, classifier, pixel model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from aftlab.functional import seed_attention, seed_feedforward
from aftlab.mixers import (
    SequenceMixer,
    available_mixers,
    build_mixer,
    get_mixer_class,
    register_mixer,
)
from aftlab.mixers import registry as _registry
from aftlab.models import (
    PixelTransformer,
    TransformerBlock,
    TransformerClassifier,
    TransformerConfig,
    TransformerLM,
    sinusoidal_positions,
)
from aftlab.testing import assert_close

ALL_MIXERS = available_mixers()  # every registered mixer, the AFT family included


def _cfg(**kw) -> TransformerConfig:
    base = dict(vocab_size=23, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    return TransformerConfig(**{**base, **kw})


def _tokens(B: int, T: int, V: int = 23) -> torch.Tensor:
    return torch.randint(0, V, (B, T))


def _decode_all(model: TransformerLM, idx: torch.Tensor) -> torch.Tensor:
    cache = model.init_cache(idx.shape[0])
    return torch.stack([model.step(idx[:, t], cache) for t in range(idx.shape[1])], dim=1)


def _supports(name: str, *, causal: bool) -> bool:
    """Whether mixer ``name`` builds with ``causal`` (it must, unless its class says
    ``causal_only``)."""
    if get_mixer_class(name).causal_only and not causal:
        with pytest.raises(ValueError, match="causal"):
            build_mixer(name, d_model=16, n_heads=2, causal=False, max_seq_len=16)
        return False
    build_mixer(name, d_model=16, n_heads=2, causal=causal, max_seq_len=16)
    return True


class _PrefixMean(SequenceMixer):
    """A minimal non-attention mixer: ``y_t = W (mean of the allowed x_s, s <= t if causal)``."""

    def __init__(self, **common) -> None:
        super().__init__(**common)
        self.proj = nn.Linear(self.d_model, self.d_model)

    def _forward(self, x, padding_mask):
        m = torch.ones_like(x[..., :1]) if padding_mask is None else padding_mask[..., None].to(x)
        if self.causal:
            num, den = (x * m).cumsum(1), m.cumsum(1)
        else:
            num, den = (x * m).sum(1, keepdim=True), m.sum(1, keepdim=True)
        return self.proj(num / den.clamp(min=1)).expand_as(x)

    def _init_state(self, batch_size, device, dtype):
        return [torch.zeros(batch_size, self.d_model, device=device, dtype=dtype), 0]

    def _step(self, x, state):
        total, n = state[0] + x, state[1] + 1
        return self.proj(total / n), [total, n]


@pytest.fixture
def prefix_mean():
    """Register the toy mixer as "test-prefix-mean" for one test only."""
    register_mixer("test-prefix-mean")(_PrefixMean)
    yield "test-prefix-mean"
    _registry._MIXERS.pop("test-prefix-mean", None)


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("name", ALL_MIXERS)
def test_decoding_matches_forward_for_every_causal_mixer(name):
    if not _supports(name, causal=True):
        pytest.skip(f"{name} rejects causal=True (checked: it builds with causal=False)")
    # Small windows/kernels so ring buffers wrap within 11 tokens, and every parameter perturbed
    # so the AFT position biases and kernels (zero at initialisation) are really exercised.
    small = {"aft-local": {"window": 3}, "aft-conv": {"kernel_size": 3}}.get(name, {})
    model = TransformerLM(_cfg(mixer=name, mixer_options=small)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    idx = _tokens(2, 11)
    assert_close(f"{name}: step logits", _decode_all(model, idx), model(idx))


@pytest.mark.parametrize(
    "kw",
    [
        dict(positional="sinusoidal"),
        dict(positional="rotary"),
        dict(positional="none", norm="none", final_norm=False),
        dict(norm="post", final_norm=False, activation="relu"),
        dict(head_dim=5, activation="gelu_tanh", scaled=False, tie_embeddings=False, bias=False),
    ],
    ids=["sinusoidal", "rotary", "no-norm", "post-ln", "head-dim"],
)
def test_decoding_matches_forward_variants(kw):
    model = TransformerLM(_cfg(**kw)).double().eval()
    idx = _tokens(3, 13)
    assert_close("step logits", _decode_all(model, idx), model(idx))


def test_decoding_with_a_non_attention_mixer(prefix_mean):
    model = TransformerLM(_cfg(mixer=prefix_mean, positional="sinusoidal")).double().eval()
    idx = _tokens(2, 9)
    assert_close("step logits", _decode_all(model, idx), model(idx))


def test_lm_is_causal():
    model = TransformerLM(_cfg()).double().eval()
    idx = _tokens(2, 10)
    idx2 = idx.clone()
    idx2[:, 6:] = (idx2[:, 6:] + 1) % 23
    a, b = model(idx), model(idx2)
    assert_close("logits before the change", b[:, :6], a[:, :6])
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6


# ----------------------------------------------------------------------------- mixer options
def test_attention_options_reach_attention(prefix_mean):
    block = TransformerBlock(_cfg(head_dim=6, scaled=False, positional="rotary"))
    assert (block.mixer.head_dim, block.mixer.scaled, block.mixer.rotary) == (6, False, True)
    assert isinstance(TransformerBlock(_cfg(mixer=prefix_mean)).mixer, _PrefixMean)


@pytest.mark.parametrize(
    "kw, shown",
    [
        (dict(positional="rotary"), "positional='rotary'"),
        (dict(head_dim=4), "head_dim=4"),
        (dict(scaled=False), "scaled=False"),
    ],
)
def test_attention_options_rejected_by_other_mixers(prefix_mean, kw, shown):
    with pytest.raises(ValueError) as e:
        TransformerLM(_cfg(mixer=prefix_mean, **kw))
    assert shown in str(e.value) and "'test-prefix-mean'" in str(e.value)


def test_default_head_dim_is_fine_for_other_mixers(prefix_mean):
    model = TransformerLM(_cfg(mixer=prefix_mean, head_dim=8))  # 8 == d_model // n_heads
    assert isinstance(model.backbone.blocks[0].mixer, _PrefixMean)


def test_mixer_options_must_not_repeat_config_fields():
    with pytest.raises(ValueError, match=r"\['head_dim'\].*set them there"):
        TransformerLM(_cfg(mixer_options={"head_dim": 4}))


def test_mixer_options_are_forwarded():
    model = TransformerLM(_cfg(mixer_options={"rotary_base": 500.0}, positional="rotary"))
    assert model.backbone.blocks[1].mixer.rotary_base == 500.0


# ----------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_block_formula(norm):
    block = TransformerBlock(_cfg(norm=norm)).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mix, ff = block.mixer, block.ff
    if norm == "post":
        h = block.norm1(x + mix(x))
        expected = block.norm2(h + ff(h))
    elif norm == "pre":
        h = x + mix(block.norm1(x))
        expected = h + ff(block.norm2(h))
    else:
        assert isinstance(block.norm1, nn.Identity)
        h = x + mix(x)
        expected = h + ff(h)
    assert_close("block output", block(x), expected)


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_a_block_without_feed_forward_is_its_mixer_branch(norm):
    """``d_ff = 0`` (Zoology's MQAR models): no feed-forward and no second norm."""
    block = TransformerBlock(_cfg(norm=norm, d_ff=0)).double().eval()
    assert block.ff is None and block.norm2 is None
    assert not [n for n, _ in block.named_parameters() if not n.startswith(("mixer.", "norm1."))]
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    h = block.norm1(x + block.mixer(x)) if norm == "post" else x + block.mixer(block.norm1(x))
    assert_close("block output", block(x), h)


def test_feedforward_activations():
    x = torch.randn(4, 16, dtype=torch.float64)
    for act, fn in [
        ("relu", torch.relu),
        ("gelu", lambda u: 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))),
        (
            "gelu_tanh",
            lambda u: 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3))),
        ),
    ]:
        ff = TransformerBlock(_cfg(activation=act)).double().ff
        expected = ff.fc2(fn(ff.fc1(x)))
        assert_close(f"FF[{act}]", ff(x), expected)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_pre_and_post_ln_both_learn(norm):
    """A next-token rule (x_{t+1} = x_t + 1 mod V) is learnt by either placement."""
    torch.manual_seed(0)
    model = TransformerLM(_cfg(norm=norm, final_norm=norm == "pre", d_model=32, n_heads=4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = torch.randint(0, 23, (16, 1))
    data = (start + torch.arange(12)) % 23
    losses = []
    for _ in range(20):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 23), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # tokens are uniform, so without using the context the loss stays at log(23) = 3.14
    assert losses[-1] < 0.5 * math.log(23), (norm, losses[0], losses[-1])


def test_post_ln_output_is_normalised():
    model = TransformerLM(_cfg(norm="post", final_norm=False)).double()
    h = model.backbone(_tokens(2, 7))
    assert_close("mean", h.mean(-1), torch.zeros(2, 7, dtype=torch.float64), atol=1e-8)
    assert_close("var", h.var(-1, unbiased=False), torch.ones(2, 7, dtype=torch.float64), atol=1e-4)


# ----------------------------------------------------------------------------- positions
def test_sinusoidal_formula():
    T, d, off = 6, 7, 3
    pe = sinusoidal_positions(T, d, offset=off, dtype=torch.float64)
    expected = torch.empty(T, d, dtype=torch.float64)
    for p in range(T):
        for j in range(d):
            i = j // 2
            angle = (p + off) / 10000 ** (2 * i / d)
            expected[p, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    assert_close("PE", pe, expected)


@pytest.mark.parametrize("kind", ["none", "learned", "sinusoidal", "rotary"])
def test_positions_break_permutation_equivariance(kind):
    """Without positions a bidirectional stack is permutation-equivariant; with any, it is not."""
    backbone = TransformerClassifier(_cfg(positional=kind, causal=False), num_classes=2).backbone
    backbone = backbone.double().eval()
    idx = torch.randperm(23)[:8][None]
    perm = torch.randperm(8)
    err = (backbone(idx[:, perm]) - backbone(idx)[:, perm]).abs().max()
    if kind == "none":
        assert err < 1e-10
    else:
        assert err > 1e-6
    assert (backbone.position_embedding is None) == (kind != "learned")


def test_learned_table_size():
    model = TransformerLM(_cfg(max_seq_len=9))
    assert model.backbone.position_embedding.weight.shape == (9, 16)


# ----------------------------------------------------------------------------- parameters
def test_num_parameters_exact():
    V, d, N, T, r = 23, 16, 2, 16, 64
    per_block = (3 * d * d + 3 * d) + (d * d + d) + 2 * (2 * d) + (d * r + r) + (r * d + d)
    expected = V * d + T * d + N * per_block + 2 * d  # tied head counted once; final LN
    model = TransformerLM(_cfg())
    assert model.num_parameters() == expected
    assert model.num_parameters(exclude_embeddings=True) == expected - V * d - T * d
    untied = TransformerLM(_cfg(tie_embeddings=False))
    assert untied.num_parameters() == expected + V * d
    assert model.head.weight is model.backbone.token_embedding.weight


# ----------------------------------------------------------------------------- classifier
@pytest.mark.parametrize("pooling", ["mean", "first"])
@pytest.mark.parametrize("name", ALL_MIXERS)
def test_classifier_padding_invariance(name, pooling):
    if not _supports(name, causal=False):
        pytest.skip(f"{name} rejects causal=False (checked: it builds with causal=True)")
    model = TransformerClassifier(_cfg(mixer=name, causal=False), num_classes=3, pooling=pooling)
    model = model.double().eval()
    idx = _tokens(2, 6)
    padded = torch.cat([idx, _tokens(2, 4)], dim=1)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 6:] = False
    mask[1, 6:8] = True  # the second sequence keeps 2 more real tokens
    out = model(padded, padding_mask=mask)
    assert out.shape == (2, 3)
    assert_close("row 0 (4 pads)", out[0], model(idx[:1])[0])
    assert_close("row 1 (2 pads)", out[1], model(padded[1:, :8])[0])
    garbage = padded.clone()
    garbage[:, 8:] = _tokens(2, 2)
    assert_close("pad contents", model(garbage, padding_mask=mask), out)


def test_classifier_mean_pooling_formula():
    model = TransformerClassifier(_cfg(causal=False), num_classes=4).double().eval()
    idx = _tokens(2, 5)
    h = model.backbone(idx)
    assert_close("logits", model(idx), model.head(h.mean(1)))


# ----------------------------------------------------------------------------- pixels
def _pixel(**kw) -> PixelTransformer:
    cfg = _cfg(vocab_size=17, max_seq_len=16, **kw)
    return PixelTransformer(cfg, image_shape=(4, 4)).double().eval()


def test_pixel_logits_shift_and_causality():
    model = _pixel()
    px = torch.randint(0, 17, (2, 16))
    logits = model(px)
    assert logits.shape == (2, 16, 17)
    px2 = px.clone()
    px2[:, 5] = (px2[:, 5] + 1) % 17
    logits2 = model(px2)
    # logits[:, t] predicts pixel t from pixels < t: pixel 5 changes logits 6.. only
    assert_close("logits[:, :6]", logits2[:, :6], logits[:, :6])
    assert (logits2[:, 6] - logits[:, 6]).abs().max() > 1e-8
    assert_close("image input", model(px.view(2, 4, 4)), logits)


def test_pixel_first_logits_come_from_start_token():
    model = _pixel()
    a = model(torch.randint(0, 17, (1, 16)))[:, 0]
    b = model(torch.randint(0, 17, (1, 16)))[:, 0]
    assert_close("p(x_0)", a, b)
    with torch.no_grad():
        model.start.add_(torch.randn_like(model.start))
    assert (model(torch.zeros(1, 16, dtype=torch.long))[:, 0] - a).abs().max() > 1e-6


@pytest.mark.parametrize("positional", ["learned", "rotary"])
def test_pixel_decoding_matches_forward(positional):
    model = _pixel(positional=positional)
    px = torch.randint(0, 17, (2, 16))
    cache = model.init_cache(2)
    steps, prev = [], None
    for t in range(16):
        steps.append(model.step(prev, cache))
        prev = px[:, t]
    assert_close("step logits", torch.stack(steps, 1), model(px))


def test_bits_per_dim_formula():
    model = _pixel()
    px = torch.randint(0, 17, (3, 16))
    logp = model(px).log_softmax(-1).gather(-1, px[..., None])[..., 0]
    assert_close("bits/dim", model.bits_per_dim(px), -logp.mean(1) / math.log(2))


# ----------------------------------------------------------------------------- the definition
def test_switches_off_give_the_definitions_block():
    """Unscaled, no norm, no positions, ReLU, no attention biases: Block = FF o Attention."""
    H, m, d, r = 2, 3, 8, 10
    cfg = _cfg(
        d_model=d,
        n_heads=H,
        head_dim=m,
        d_ff=r,
        scaled=False,
        norm="none",
        activation="relu",
        causal=False,
        positional="none",
        final_norm=False,
    )
    block = TransformerBlock(cfg).double().eval()
    attn = block.mixer
    with torch.no_grad():
        attn.qkv.bias.zero_()
        attn.out_proj.bias.zero_()
    w_q, w_k, w_v = (w.view(H, m, d) for w in attn.qkv.weight.chunk(3, dim=0))
    w_o = attn.out_proj.weight.view(d, H, m).permute(1, 0, 2)  # (H, d, m)
    ff = block.ff
    x = torch.randn(2, 5, d, dtype=torch.float64)
    expected = seed_feedforward(
        seed_attention(x, w_q, w_k, w_v, w_o),
        ff.fc1.weight,
        ff.fc1.bias,
        ff.fc2.weight,
        ff.fc2.bias,
    )
    assert_close("block vs definition", block(x), expected)
