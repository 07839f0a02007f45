"""The aft-decay mixer: registry, parameterisation, padding, decoding state, low precision."""

import pytest
import torch

from aftlab.mixers import build_mixer
from aftlab.mixers.aft.decay import AFTDecay
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.testing import assert_close


def _mixer(d=6, **kw):
    return build_mixer(
        "aft-decay", d_model=d, n_heads=2, causal=True, max_seq_len=4, dropout=0.0, **kw
    )


def test_forward_is_projected_aft_decay():
    m = _mixer().double()
    assert isinstance(m, AFTDecay)
    x = torch.randn(2, 11, 6, dtype=torch.float64)  # longer than max_seq_len: any length works
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    expected = m.proj(aft_decay_reference(q, k, v, torch.exp(m.time_decay), m.time_bonus))
    assert_close("mixer", m(x), expected)


def test_causal_only():
    with pytest.raises(ValueError, match="'causal'"):
        build_mixer("aft-decay", d_model=4, causal=False)


def test_rwkv_initialisation():
    d = 9
    first, last = _mixer(d, layer_idx=0, n_layers=4), _mixer(d, layer_idx=3, n_layers=4)
    for m in (first, last):
        raw = m.time_decay.detach()
        assert raw[0].item() == pytest.approx(-5.0) and raw[-1].item() == pytest.approx(3.0)
        assert (raw.diff() > 0).all()
        assert (m.decay() > 0).all()
    # deeper layers keep more channels slow (larger exponent 0.7 + 1.3 l / (L - 1))
    assert (last.time_decay[1:-1] < first.time_decay[1:-1]).all()
    i = torch.arange(d)
    expected_bonus = torch.log(torch.tensor(0.3)) + 0.5 * ((i + 1) % 3 - 1)
    assert_close("bonus", first.time_bonus.detach(), expected_bonus)
    with pytest.raises(ValueError, match="'layer_idx'"):
        _mixer(d, layer_idx=4, n_layers=4)


def test_decay_and_bonus_train():
    m = _mixer()
    m(torch.randn(2, 10, 6)).pow(2).sum().backward()
    assert m.time_decay.grad.abs().sum() > 0 and m.time_bonus.grad.abs().sum() > 0


def test_padding_mask():
    m = _mixer()
    x = torch.randn(3, 9, 6, requires_grad=True)
    mask = torch.rand(3, 9) > 0.3
    mask[2] = False
    y = m(x, padding_mask=mask)
    x2 = torch.where(mask[:, :, None], x.detach(), torch.full_like(x.detach(), 1e3))
    y2 = m(x2, padding_mask=mask)
    assert_close("valid rows", y2[mask], y[mask].detach())
    assert_close("row without keys", y[2], torch.zeros(9, 6))
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.time_decay.grad).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kscale", [1.0, 1e3])
def test_step_matches_forward(dtype, kscale):
    m = _mixer(5).to(dtype).eval()
    with torch.no_grad():
        m.to_k.weight.mul_(kscale)  # keys of magnitude ~1e3: exp overflows without the shift
        m.time_bonus.mul_(kscale)
    x = torch.randn(2, 13, 5, dtype=dtype)
    y = m(x)
    state = m.init_state(2)
    steps = []
    for t in range(13):
        y_t, state = m.step(x[:, t], state)
        steps.append(y_t)
    assert state.position == 13
    got = torch.stack(steps, 1)
    assert torch.isfinite(got).all()
    tol = {} if dtype == torch.float64 else {"atol": 1e-4 * kscale, "rtol": 1e-3}
    assert_close("step vs forward", got, y, **tol)


def test_autocast_bfloat16():
    m = _mixer(8)
    x = torch.randn(2, 20, 8) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert torch.isfinite(y).all()
    assert_close("bf16 vs fp32", y.float(), m(x).detach(), atol=0.1, rtol=0.05)
    y.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_bad_input():
    m = _mixer()
    with pytest.raises(ValueError, match="'x'"):
        m(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="'x'"):
        m.step(torch.randn(2, 5, 6), m.init_state(2))
