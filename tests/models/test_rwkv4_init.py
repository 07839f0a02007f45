"""RWKV4LM's initialisation against BlinkDL's RWKV-LM RWKV-4 formulas (docs/rwkv.md,
"Initialisation (BlinkDL's RWKV-LM)"), each recomputed here in float64 from the docs' symbols,
and against transformers' ``_init_weights`` (the same ramps; ``time_first`` ones)."""

from __future__ import annotations

import math

import pytest
import torch

from aftlab.models import RWKV4LM, RWKV4Config
from aftlab.models.rwkv4 import init_rwkv4
from aftlab.models.rwkv4_io import hf_state_dict
from aftlab.testing import assert_close

from .rwkv4_helpers import randomise_

pytestmark = pytest.mark.usefixtures("one_thread")

V, D, L = 99, 24, 5
ZERO = ("attention.key", "attention.receptance", "attention.output",
        "feed_forward.value", "feed_forward.receptance")  # fmt: skip


def _lm(n_layers: int = L, d: int = D, reinit: bool = False):
    """``(model, its tensors in float64 under RWKV's (Hugging Face's) names)``; ``reinit``: every
    parameter randomised, then ``init_rwkv4`` again (it must reset all, LayerNorms included)."""
    torch.manual_seed(0)
    lm = RWKV4LM(RWKV4Config(vocab_size=V, d_model=d, n_layers=n_layers))
    if reinit:
        init_rwkv4(randomise_(lm))
    return lm, {k: v.double() for k, v in hf_state_dict(lm).items()}


def _ramps(layer: int, n_layers: int, d: int) -> dict[str, torch.Tensor]:
    """docs/rwkv.md's time-mix and channel-mix formulas, float64 (``r0 = 0`` when ``L = 1``:
    aftlab's choice, where RWKV-LM and transformers divide by zero)."""
    r0 = layer / (n_layers - 1) if n_layers > 1 else 0.0
    r1 = 1 - layer / n_layers
    h = torch.arange(d, dtype=torch.float64)
    x = h / d
    zigzag = torch.tensor([0.5 * ((i + 1) % 3 - 1) for i in range(d)], dtype=torch.float64)
    return {
        "attention.time_decay": -5 + 8 * (h / (d - 1)) ** (0.7 + 1.3 * r0),
        "attention.time_first": math.log(0.3) + zigzag,
        "attention.time_mix_key": x**r1,
        "attention.time_mix_value": x**r1 + 0.3 * r0,
        "attention.time_mix_receptance": x ** (0.5 * r1),
        "feed_forward.time_mix_key": x**r1,
        "feed_forward.time_mix_receptance": x**r1,
    }


@pytest.mark.parametrize("reinit", [False, True], ids=["constructed", "init_rwkv4-again"])
@pytest.mark.parametrize(("n_layers", "d"), [(L, D), (5, 20), (1, 20)])
def test_vectors_follow_rwkv_lm(n_layers, d, reinit):
    lm, sd = _lm(n_layers, d, reinit)
    for layer in range(n_layers):
        pre = f"rwkv.blocks.{layer}."
        ramps = _ramps(layer, n_layers, d)
        for name, want in ramps.items():
            got = sd[pre + name].reshape(-1)
            assert torch.isfinite(got).all(), pre + name
            assert_close(pre + name, got, want, atol=1e-6, rtol=0)
        # the decay used: lambda = exp(time_decay) here, w = -exp(time_decay) in RWKV's WKV
        want = ramps["attention.time_decay"].exp()
        assert_close(f"{pre}decay", lm.blocks[layer].att.decay(), want, rtol=1e-6, atol=0)
    norms = [
        k[: -len(".weight")]
        for k in sd
        if k.endswith(("ln1.weight", "ln2.weight", "pre_ln.weight", "ln_out.weight"))
    ]
    assert len(norms) == 2 * n_layers + 2
    for n in norms:
        assert torch.equal(sd[n + ".weight"], torch.ones(d, dtype=torch.float64)), n
        assert torch.equal(sd[n + ".bias"], torch.zeros(d, dtype=torch.float64)), n


def _gram_is(name: str, w: torch.Tensor, gain: float) -> None:
    """``W^T W`` (tall or square) or ``W W^T`` (wide) is ``gain^2 I`` on the short side."""
    g = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
    assert_close(name, g, gain**2 * torch.eye(g.shape[0], dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("reinit", [False, True], ids=["constructed", "init_rwkv4-again"])
def test_matrices_and_embedding_follow_rwkv_v4neo(reinit):
    _, sd = _lm(reinit=reinit)
    for layer in range(L):
        pre = f"rwkv.blocks.{layer}."
        for name in ZERO:
            assert torch.count_nonzero(sd[pre + name + ".weight"]) == 0, pre + name
        _gram_is(pre + "attention.value", sd[pre + "attention.value.weight"], 1.0)
        key = sd[pre + "feed_forward.key.weight"]
        assert key.shape == (4 * D, D)
        _gram_is(pre + "feed_forward.key", key, 2.0)  # sqrt(4d / d)
    assert sd["head.weight"].shape == (V, D)
    _gram_is("head", sd["head.weight"], 0.5 * math.sqrt(V / D))
    e = sd["rwkv.embeddings.weight"]
    assert e.abs().max() <= 6e-4 and e.abs().max() > 5.5e-4  # P(max < 5.5e-4) ~ (11/12)^2376
    assert e.unique().numel() > e.numel() // 2
    # U(-a, a) has std a / sqrt(3); the sample std's relative error is ~1% at n = 2376
    assert abs(e.std().item() / (6e-4 / math.sqrt(3)) - 1) < 0.1
    assert abs(e.mean().item()) < 6e-4 / math.sqrt(3) * 5 / math.sqrt(e.numel())


def _hf(n_layers: int):
    transformers = pytest.importorskip("transformers", reason="the test extra (transformers)")
    cfg = transformers.RwkvConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=n_layers, intermediate_size=4 * D,
        attention_hidden_size=D, context_length=64,
    )  # fmt: skip
    return transformers.RwkvForCausalLM(cfg)


def test_ramps_equal_transformers_init_weights_and_time_first_differs():
    _, ours = _lm()
    theirs = {k: v.double() for k, v in _hf(L).state_dict().items()}
    for layer in range(L):
        pre = f"rwkv.blocks.{layer}."
        for name in _ramps(layer, L, D):
            if name != "attention.time_first":
                assert_close(pre + name, ours[pre + name], theirs[pre + name], atol=1e-6, rtol=0)
        # the documented difference: HF's ones_like drops log(0.3) + zigzag
        assert torch.equal(theirs[pre + "attention.time_first"], torch.ones(D, dtype=torch.float64))
        assert (ours[pre + "attention.time_first"] < 0).any()
        # and HF zeroes no matrix (RWKV-LM and aftlab zero five per block)
        assert torch.count_nonzero(theirs[pre + "attention.key.weight"]) > 0


def test_one_layer_divides_by_zero_in_transformers_not_here():
    with pytest.raises(ZeroDivisionError):
        _hf(1)
    _, sd = _lm(1)  # aftlab: r0 = 0 (the formulas: test_vectors_follow_rwkv_lm's 1-layer case)
    assert all(torch.isfinite(v).all() for v in sd.values())
