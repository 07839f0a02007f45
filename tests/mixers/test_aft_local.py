"""The aft-local mixer: band of U V^T, padding, O(s d) decoding == forward, relation to aft-full."""

import pytest
import torch

from aftlab.functional import aft_local
from aftlab.mixers import build_mixer
from aftlab.testing import assert_close


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _mixer(causal=True, **opts):
    opts.setdefault("max_seq_len", 20)
    return build_mixer("aft-local", d_model=6, causal=causal, **opts).double()


def _randomise_bias(m, scale=1.0):
    with torch.no_grad():
        for p in m.pos_bias.parameters():
            p.normal_().mul_(scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_rank", [3, None])
def test_forward_is_projections_around_aft_local(causal, bias_rank):
    m = _mixer(causal=causal, window=4, bias_rank=bias_rank)
    _randomise_bias(m)
    x = torch.randn(2, 13, 6, dtype=torch.float64)
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    w = m.pos_bias.matrix(20)
    assert_close("y", m(x), m.proj(aft_local(q, k, v, w, 4, causal=causal)))


def test_default_window_and_bias_trains():
    m = build_mixer("aft-local", d_model=4, max_seq_len=64)
    assert m.window == 32
    m(torch.randn(1, 40, 4)).pow(2).sum().backward()
    assert m.pos_bias.v.grad.abs().max() > 0


def test_window_beyond_length_is_aft_full():
    loc = _mixer(window=50, bias_rank=3)
    _randomise_bias(loc)
    full = build_mixer("aft-full", d_model=6, causal=True, max_seq_len=20, bias_rank=3).double()
    full.load_state_dict(loc.state_dict())
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    assert_close("aft-local(window >= T) vs aft-full", loc(x), full(x))


@pytest.mark.parametrize("causal", [False, True])
def test_padding(causal):
    m = _mixer(causal=causal, window=2)
    _randomise_bias(m)
    x = torch.randn(2, 9, 6, dtype=torch.float64, requires_grad=True)
    pm = torch.ones(2, 9, dtype=torch.bool)
    pm[0, :3] = False
    pm[1, 6:] = False
    y = m(x, padding_mask=pm)
    x2 = x.detach().clone()
    x2[~pm] = -50.0
    assert_close("y[pm] with other padding", m(x2, padding_mask=pm)[pm], y[pm])
    if causal:
        assert_close("no valid key", y[0, :3], torch.zeros_like(y[0, :3]))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("window", [0, 1, 3, 20, 64])
@pytest.mark.parametrize("key_scale", [1.0, 1e3])
def test_step_matches_forward(window, key_scale):
    m = _mixer(window=window, bias_rank=None if window == 3 else 4)
    _randomise_bias(m, 5.0)
    with torch.no_grad():
        m.to_k.weight.mul_(key_scale)
        x = torch.randn(2, 20, 6, dtype=torch.float64)
        y = m(x)
        state = m.init_state(2, dtype=torch.float64)
        steps = []
        for t in range(20):
            y_t, state = m.step(x[:, t], state)
            steps.append(y_t)
    assert torch.isfinite(y).all()
    assert state.k.shape[1] == min(window, 20)  # ring buffer of the last s tokens only
    assert_close("step-by-step", torch.stack(steps, 1), y)


def test_autocast_bf16_trains():
    m = build_mixer("aft-local", d_model=8, causal=True, max_seq_len=16, window=3)
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
        build_mixer("aft-local", d_model=4)
    with pytest.raises(ValueError, match="'window' must be >= 0, got -1"):
        build_mixer("aft-local", d_model=4, max_seq_len=8, window=-1)
    with pytest.raises(ValueError, match=r"length 9 .* max_seq_len \(T_max\) = 8"):
        build_mixer("aft-local", d_model=4, max_seq_len=8)(torch.randn(1, 9, 4))
    with pytest.raises(ValueError, match="unexpected keyword argument 'windw'"):
        build_mixer("aft-local", d_model=4, max_seq_len=8, windw=3)
