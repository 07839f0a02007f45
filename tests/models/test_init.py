"""Initialisation of the practical Transformer (GPT-2's scheme) and the mixers' init hook.

Tolerance of the standard deviations: the sample std ``s`` of ``n`` independent draws from
``N(0, sigma^2)`` has relative standard error ``1 / sqrt(2 n)``; the tests accept
``|s / sigma - 1| <= 5 / sqrt(2 n)`` (a false alarm below 1e-6 per tensor; the seed is fixed
anyway). PyTorch's default, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, has std
``1/sqrt(3 fan_in)`` (0.051 at ``fan_in = 128``), far outside it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aftlab.mixers import SequenceMixer, available_mixers, register_mixer
from aftlab.mixers import registry as _registry
from aftlab.mixers.aft.decay import rwkv_bonus_init, rwkv_decay_init
from aftlab.mixers.base import is_residual_projection
from aftlab.models import TransformerClassifier, TransformerConfig, TransformerLM

MIXERS = available_mixers()
N_LAYERS = 4


def _lm(mixer: str, **kw) -> TransformerLM:
    cfg = dict(vocab_size=256, d_model=128, n_layers=N_LAYERS, n_heads=4, max_seq_len=64)
    return TransformerLM(TransformerConfig(mixer=mixer, **{**cfg, **kw}))


def _assert_std(name: str, t: torch.Tensor, sigma: float) -> None:
    s = t.detach().double().std().item()
    tol = 5 / math.sqrt(2 * t.numel())
    assert abs(s / sigma - 1) <= tol, (
        f"{name}: std {s:.5f}, expected {sigma:.5f} (rel. tol {tol:.4f})"
    )


@pytest.mark.parametrize("mixer", MIXERS)
def test_fresh_model_statistics(mixer):
    lm = _lm(mixer)
    residual_std = 0.02 / math.sqrt(2 * N_LAYERS)
    marked = []
    for name, m in lm.named_modules():
        if isinstance(m, nn.Linear):
            if is_residual_projection(m):
                marked.append(name)
            _assert_std(name, m.weight, residual_std if is_residual_projection(m) else 0.02)
            if m.bias is not None:
                assert torch.count_nonzero(m.bias) == 0, f"{name}.bias is not zero"
        elif isinstance(m, nn.Embedding):
            _assert_std(name, m.weight, 0.02)
        elif isinstance(m, nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight)), name
            assert torch.count_nonzero(m.bias) == 0, name
    # one mixer output projection and one W_2 per block, nothing else
    for i in range(N_LAYERS):
        block = f"backbone.blocks.{i}."
        assert f"{block}ff.fc2" in marked
        outputs = [n for n in marked if n.startswith(f"{block}mixer.")]
        assert len(outputs) == 1, f"{mixer}: block {i} marks {outputs}"
    assert len(marked) == 2 * N_LAYERS, marked


def test_untied_and_classifier_heads_are_gpt2_initialised():
    lm = _lm("attention", tie_embeddings=False)
    _assert_std("head", lm.head.weight, 0.02)
    cfg = TransformerConfig(
        vocab_size=50, d_model=128, n_layers=2, n_heads=4, max_seq_len=16, causal=False
    )
    clf = TransformerClassifier(cfg, num_classes=300)
    _assert_std("classifier head", clf.head.weight, 0.02)
    assert torch.count_nonzero(clf.head.bias) == 0


def test_torch_init_keeps_pytorch_defaults():
    """``init="torch"``: the scheme before GPT-2's, kept to measure against."""
    lm = _lm("attention", init="torch")
    w = lm.backbone.blocks[0].mixer.qkv.weight
    _assert_std("qkv (torch)", w, 1 / math.sqrt(3 * 128))
    assert torch.count_nonzero(lm.backbone.blocks[0].ff.fc1.bias) > 0
    _assert_std("token embedding (torch)", lm.backbone.token_embedding.weight, 0.02)


def test_mixer_parameters_keep_their_meaning():
    decay = _lm("aft-decay")
    for i, block in enumerate(decay.backbone.blocks):
        assert torch.equal(block.mixer.time_decay, rwkv_decay_init(128, i, N_LAYERS))
        assert torch.equal(block.mixer.time_bonus, rwkv_bonus_init(128))
    for mixer in ("aft-full", "aft-local"):
        for block in _lm(mixer).backbone.blocks:
            pb = block.mixer.pos_bias
            assert torch.count_nonzero(pb.v) == 0  # w = U V^T starts at 0
            _assert_std(f"{mixer} U", pb.u, 1 / math.sqrt(pb.rank))
    for block in _lm("aft-conv").backbone.blocks:
        m = block.mixer
        assert torch.count_nonzero(m.gamma) == 0 and torch.count_nonzero(m.beta) == 0
        _assert_std("aft-conv raw kernel", m.weight, 1.0)


@pytest.mark.parametrize("mixer", MIXERS)
def test_first_step_loss_is_near_log_vocab(mixer):
    """At initialisation the predictions are near uniform: loss within 0.1 of ``ln V``."""
    torch.manual_seed(0)
    lm = TransformerLM(
        TransformerConfig(
            vocab_size=256, d_model=128, n_layers=3, n_heads=4, max_seq_len=128, mixer=mixer
        )
    )
    idx = torch.randint(0, 256, (8, 129))
    with torch.no_grad():
        loss = F.cross_entropy(lm(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    assert abs(loss.item() - math.log(256)) < 0.1, (mixer, loss.item())


class _Gated(SequenceMixer):
    """A toy mixer whose ``nn.Linear`` gate has a meaning: it starts as the identity."""

    calls = 0

    def __init__(self, **common):
        super().__init__(**common)
        self.gate = nn.Linear(self.d_model, self.d_model)
        self.scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        type(self).calls += 1
        self.gate.weight.copy_(torch.eye(self.d_model))
        self.gate.bias.zero_()
        self.scale.fill_(3.0)

    def forward(self, x, *, padding_mask=None):
        x, padding_mask = self._check_input(x, padding_mask)
        return self.scale * self.gate(x)


@pytest.fixture
def gated():
    register_mixer("test-init-gated")(_Gated)
    _Gated.calls = 0
    yield "test-init-gated"
    _registry._MIXERS.pop("test-init-gated", None)


def test_model_calls_the_mixer_hook_after_the_generic_scheme(gated):
    cfg = TransformerConfig(
        vocab_size=20, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, mixer=gated, causal=False
    )
    model = TransformerClassifier(cfg, num_classes=3)
    # each mixer's constructor called it once, the model once more after drawing the Linears;
    # and the memory check built one more mixer on the meta device to count its parameters
    assert _Gated.calls == 2 * 2 + 1
    for block in model.backbone.blocks:
        assert torch.equal(block.mixer.gate.weight, torch.eye(16))  # not N(0, 0.02^2)
        assert block.mixer.scale.item() == 3.0
    # the generic scheme still reached the other layers
    _assert_std("ff.fc1", model.backbone.blocks[0].ff.fc1.weight, 0.02)
