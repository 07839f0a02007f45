"""The aft-simple mixer: registry, projections, padding, decoding state, low precision."""

import pytest
import torch

from aftlab.mixers import build_mixer
from aftlab.mixers.aft.simple import AFTSimple
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.testing import assert_close


def _mixer(causal, d=6, **kw):
    return build_mixer(
        "aft-simple", d_model=d, n_heads=2, causal=causal, max_seq_len=4, dropout=0.0, **kw
    )


@pytest.mark.parametrize("causal", [False, True])
def test_forward_is_projected_aft_simple(causal):
    m = _mixer(causal).double()
    assert isinstance(m, AFTSimple)
    x = torch.randn(2, 11, 6, dtype=torch.float64)  # longer than max_seq_len: any length works
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    expected = m.proj(aft_simple_reference(q, k, v, causal=causal))
    assert_close("mixer", m(x), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask(causal):
    m = _mixer(causal)
    x = torch.randn(3, 9, 6, requires_grad=True)
    mask = torch.rand(3, 9) > 0.3
    mask[:, 0] = True
    mask[2] = False
    y = m(x, padding_mask=mask)
    x2 = torch.where(mask[:, :, None], x.detach(), torch.full_like(x.detach(), 1e3))
    y2 = m(x2, padding_mask=mask)
    keep = mask[:2]  # outputs at padded query positions are not constrained
    assert_close("valid rows", y2[:2][keep], y[:2][keep].detach())
    assert_close("row without keys", y[2], torch.zeros(9, 6))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kscale", [1.0, 1e3])
def test_step_matches_forward(dtype, kscale):
    m = _mixer(True, d=5).to(dtype).eval()
    with torch.no_grad():
        m.to_k.weight.mul_(kscale)  # keys of magnitude ~1e3: exp overflows without the shift
    x = torch.randn(2, 13, 5, dtype=dtype)
    y = m(x)
    state = m.init_state(2)
    steps = []
    for t in range(13):
        y_t, state = m.step(x[:, t], state)
        steps.append(y_t)
    assert state.position == 13
    tol = {} if dtype == torch.float64 else {"atol": 1e-4 * kscale, "rtol": 1e-3}
    assert torch.isfinite(torch.stack(steps, 1)).all()
    assert_close("step vs forward", torch.stack(steps, 1), y, **tol)


def test_step_state_is_constant_size():
    m = _mixer(True, d=4)
    state = m.init_state(3)
    for _ in range(5):
        _, state = m.step(torch.randn(3, 4), state)
    assert state.a.shape == state.b.shape == state.p.shape == (3, 4)


def test_non_causal_cannot_step():
    m = _mixer(False)
    with pytest.raises(RuntimeError, match="causal"):
        m.init_state(1)
    with pytest.raises(RuntimeError, match="causal"):
        m.step(torch.randn(1, 6), None)


def test_autocast_bfloat16():
    m = _mixer(True, d=8)
    x = torch.randn(2, 20, 8) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert torch.isfinite(y).all()
    assert_close("bf16 vs fp32", y.float(), m(x).detach(), atol=0.1, rtol=0.05)
    y.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_bad_input():
    m = _mixer(True)
    with pytest.raises(ValueError, match="'x'"):
        m(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="'padding_mask'"):
        m(torch.randn(2, 5, 6), padding_mask=torch.ones(2, 4, dtype=torch.bool))
