"""The aft-conv mixer: registry, reparameterised kernel, forward == functional op, decoding ==
forward for every kernel size with huge keys, grid (2-D) mode, bad options.

What every mixer promises (decoding, padding, causality, autocast, dtypes, constant-size state,
errors) is in test_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from aftlab.functional import aft_conv, aft_conv2d
from aftlab.mixers import build_mixer
from aftlab.mixers.aft.conv import AFTConvMixer
from aftlab.testing import assert_close, decode

F64 = torch.float64


def _mixer(**kw):
    opts = dict(d_model=12, n_heads=3, causal=True, kernel_size=5)
    opts.update(kw)
    m = build_mixer("aft-conv", **opts).double()
    with torch.no_grad():  # a non-trivial kernel (gamma = beta = 0 would give w = 0)
        m.gamma.normal_()
        m.beta.normal_()
    return m


def test_registered_with_one_key_channel_per_head_and_paper_init():
    m = build_mixer("aft-conv", d_model=16, n_heads=4, kernel_size=7)
    assert isinstance(m, AFTConvMixer)
    assert m.to_k.out_features == 4 and m.key_dim == 4
    assert m.weight.shape == (4, 7) and m.gamma.shape == (4, 1) and m.beta.shape == (4, 1)
    assert (m.gamma == 0).all() and (m.beta == 0).all() and (m.kernel() == 0).all()
    names = {n for n, _ in m.named_parameters()}
    assert {"weight", "gamma", "beta"} <= names
    assert build_mixer(
        "aft-conv", d_model=16, n_heads=4, grid=(2, 3), kernel_size=3
    ).weight.shape == (4, 3, 3)


def test_kernel_reparameterisation():
    m = _mixer()
    w = m.weight.detach()
    mean, std = w.mean(1, keepdim=True), (w.var(1, keepdim=True, correction=0) + 1e-5).sqrt()
    assert_close("kernel", m.kernel(), m.gamma * (w - mean) / std + m.beta)
    m.kernel().square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (m.weight, m.gamma, m.beta))


@pytest.mark.parametrize("causal", [False, True])
def test_forward_equals_functional_op(causal):
    m = _mixer(causal=causal)
    x = torch.randn(2, 9, 12, dtype=F64)
    q, k, v = m.project(x)
    y = aft_conv(
        q.view(2, 9, 3, 4), k.view(2, 9, 3, 1), v.view(2, 9, 3, 4), m.kernel(), causal=causal
    )
    assert_close("y", m(x), m.output(y.reshape(2, 9, 12)))


@pytest.mark.parametrize("kernel_size", [1, 4, 5])
@pytest.mark.parametrize("key_scale", [1.0, 1e4])
def test_step_by_step_equals_forward(kernel_size, key_scale):
    m = _mixer(kernel_size=kernel_size)
    with torch.no_grad():
        m.to_k.weight.mul_(key_scale)  # keys ~ 1e4: e^K overflows float64 without the shifts
        m.gamma.mul_(key_scale)
    x = torch.randn(2, 11, 12, dtype=F64)
    x[:, -1] *= 3  # a large key last
    y = m(x)
    steps, state = decode(m, x)
    assert state.position == 11  # a BandState: the ring of the last s - 1 tokens, one key a head
    r = kernel_size - 1
    assert state.k.shape == (2, r, 3, 1) and state.v.shape == (2, r, 3, 4)
    assert state.valid.all() and state.gone.b.shape == (2, 3, 1) and state.gone.a.shape == (2, 3, 4)
    assert torch.isfinite(y).all()
    assert_close("steps", steps, y)


def test_grid_mode_uses_2d_op_and_trains():
    m = build_mixer("aft-conv", d_model=16, n_heads=4, grid=(8, 8), kernel_size=3).double()
    with torch.no_grad():
        m.gamma.normal_()
    x = torch.randn(2, 64, 16, dtype=F64)
    q, k, v = m.project(x)
    y = aft_conv2d(q.view(2, 8, 8, 4, 4), k.view(2, 8, 8, 4, 1), v.view(2, 8, 8, 4, 4), m.kernel())
    out = m(x)
    assert_close("y", out, m.output(y.reshape(2, 64, 16)))
    out.square().mean().backward()
    assert m.weight.grad.abs().sum() > 0 and m.gamma.grad.abs().sum() > 0


def test_bad_options():
    with pytest.raises(ValueError, match="n_heads=5 must divide d_model=12"):
        build_mixer("aft-conv", d_model=12, n_heads=5)
    with pytest.raises(ValueError, match="'kernel_size' must be odd, got 4"):
        build_mixer("aft-conv", d_model=12, n_heads=3, kernel_size=4)
    build_mixer("aft-conv", d_model=12, n_heads=3, kernel_size=4, causal=True)  # fine when causal
    with pytest.raises(ValueError, match="non-causal only"):
        build_mixer("aft-conv", d_model=12, n_heads=3, causal=True, grid=(2, 2))
    with pytest.raises(ValueError, match="'grid' must be a pair"):
        build_mixer("aft-conv", d_model=12, n_heads=3, grid=(4,))
    m = build_mixer("aft-conv", d_model=12, n_heads=3, grid=(2, 3), kernel_size=3)
    with pytest.raises(ValueError, match=r"sequence length 7 .* must equal H \* W = 6"):
        m(torch.randn(1, 7, 12))
