"""The aft-full mixer: registry, position-bias parameters, padding, decoding == forward."""

import pytest
import torch

from aftlab.functional import aft_full
from aftlab.mixers import build_mixer
from aftlab.testing import assert_close


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _mixer(causal=True, **opts):
    opts.setdefault("max_seq_len", 16)
    return build_mixer("aft-full", d_model=6, causal=causal, **opts).double()


def _randomise_bias(m, scale=1.0):
    with torch.no_grad():
        for p in m.pos_bias.parameters():
            p.normal_().mul_(scale)


def test_forward_is_projections_around_aft_full():
    m = _mixer(causal=False, bias_rank=3)
    _randomise_bias(m)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    w = m.pos_bias.u @ m.pos_bias.v.t()  # w = U V^T
    assert_close("y", m(x), m.proj(aft_full(q, k, v, w)))


def test_bias_parameters_train():
    """U, V are registered parameters created once; an optimizer step moves w (bug 4)."""
    m = _mixer(bias_rank=4)
    names = {n for n, _ in m.named_parameters()}
    assert {"pos_bias.u", "pos_bias.v"} <= names
    assert m.pos_bias.v.abs().max() == 0  # w starts at 0: the mixer starts as AFT-simple
    w0 = m.pos_bias.matrix(16).detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 10, 6, dtype=torch.float64)).pow(2).sum().backward()
    assert m.pos_bias.v.grad.abs().max() > 0
    opt.step()
    assert (m.pos_bias.matrix(16) - w0).abs().max() > 0
    assert m.pos_bias.u is dict(m.named_parameters())["pos_bias.u"]  # same object after a step


def test_full_matrix_option():
    m = _mixer(bias_rank=None)
    assert m.pos_bias.w.shape == (16, 16)
    assert isinstance(m.pos_bias.w, torch.nn.Parameter)
    m(torch.randn(1, 5, 6, dtype=torch.float64)).sum().backward()
    assert m.pos_bias.w.grad[:5, :5].abs().max() > 0


def test_follows_dtype_and_device():
    m = build_mixer("aft-full", d_model=4, max_seq_len=8).to(torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    assert m(torch.randn(1, 8, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("causal", [False, True])
def test_padding(causal):
    m = _mixer(causal=causal)
    _randomise_bias(m)
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    pm = torch.ones(2, 7, dtype=torch.bool)
    pm[0, :2] = False
    pm[1, 5:] = False
    y = m(x, padding_mask=pm)
    x2 = x.detach().clone()
    x2[~pm] = 100.0
    assert_close("y[pm] with other padding", m(x2, padding_mask=pm)[pm], y[pm])
    if causal:  # queries 0 and 1 of row 0 see no valid key: Y = 0, output = proj(0)
        assert_close("no valid key", y[0, :2], torch.zeros_like(y[0, :2]))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("bias_rank", [3, None])
@pytest.mark.parametrize("key_scale", [1.0, 1e3])
def test_step_matches_forward(bias_rank, key_scale):
    m = _mixer(bias_rank=bias_rank)
    _randomise_bias(m, 5.0)
    with torch.no_grad():
        m.to_k.weight.mul_(key_scale)
        x = torch.randn(2, 16, 6, dtype=torch.float64)
        y = m(x)
        state = m.init_state(2, dtype=torch.float64)
        steps = []
        for t in range(16):
            y_t, state = m.step(x[:, t], state)
            steps.append(y_t)
    assert torch.isfinite(y).all()
    assert_close("step-by-step", torch.stack(steps, 1), y)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.step(x[:, 0], state)


def test_autocast_bf16_trains():
    m = build_mixer("aft-full", d_model=8, causal=True, max_seq_len=16)
    x = torch.randn(2, 12, 8) * 30.0
    with torch.no_grad():
        m.pos_bias.v.normal_()  # a non-zero bias, which autocast must not round to bf16
        y32 = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    scale = y32.abs().max().item()
    assert_close("bf16 autocast vs float32", y.float(), y32, atol=0.05 * scale, rtol=0.05)
    y.float().pow(2).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert m.pos_bias.v.grad.abs().max() > 0


def test_errors():
    with pytest.raises(ValueError, match="'max_seq_len'.*required"):
        build_mixer("aft-full", d_model=4)
    with pytest.raises(ValueError, match="'bias_rank' must be > 0"):
        build_mixer("aft-full", d_model=4, max_seq_len=8, bias_rank=0)
    with pytest.raises(ValueError, match=r"length 9 .* max_seq_len \(T_max\) = 8"):
        build_mixer("aft-full", d_model=4, max_seq_len=8)(torch.randn(1, 9, 4))
    with pytest.raises(RuntimeError, match="causal"):
        m = build_mixer("aft-full", d_model=4, max_seq_len=8)
        m.step(torch.randn(1, 4), None)
