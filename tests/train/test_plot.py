import math

import pytest
import torch

from aftlab.models import TransformerConfig, TransformerLM
from aftlab.train.plot import conv_kernels, plot_loss_curves, position_biases


def _lm(mixer, **options):
    cfg = TransformerConfig(
        vocab_size=11,
        d_model=8,
        n_layers=2,
        n_heads=2,
        max_seq_len=6,
        mixer=mixer,
        mixer_options=options,
    )
    return TransformerLM(cfg)


def test_position_biases_of_aft_local_mask_what_the_layer_never_uses():
    model = _lm("aft-local", window=2)
    for layer in model.backbone.blocks:
        with torch.no_grad():
            layer.mixer.pos_bias.v.normal_()  # v starts at 0: make w non-zero
    biases = position_biases(model)
    assert len(biases) == 2 and "aft-local" in biases[0][0]
    w = biases[0][1]
    expected = model.backbone.blocks[0].mixer.pos_bias.matrix(6).detach()
    for t in range(6):
        for s in range(6):
            used = s <= t and t - s < 2  # causal, and inside the window
            assert math.isnan(w[t, s]) != used
            if used:
                assert w[t, s] == pytest.approx(expected[t, s].item())


def test_models_without_position_bias_or_kernels_give_nothing():
    model = _lm("attention")
    assert position_biases(model) == [] and conv_kernels(model) == []


def test_conv_kernels_skip_scalar_gains():
    model = _lm("aft-conv", kernel_size=3)
    kernels = conv_kernels(model)
    assert kernels and all(k.shape[-1] > 1 for _, k in kernels)


def test_loss_curves_png(tmp_path):
    pytest.importorskip("matplotlib")
    m = tmp_path / "metrics.jsonl"
    m.write_text(
        '{"step": 1, "split": "train", "loss": 3.0}\n{"step": 2, "split": "train", "loss": 2.0}\n'
        '{"step": 2, "split": "val", "loss": 2.5}\n{"step": 3, "spl'
    )  # a line cut by a kill
    png = plot_loss_curves({"run": m}, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
