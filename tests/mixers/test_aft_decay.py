"""The aft-decay mixer: forward == the reference, its RWKV initialisation, huge bonuses.

What every mixer promises (decoding, padding, causality, autocast, dtypes, constant-size state,
errors; causal only) is in test_contract.py.
"""

import pytest
import torch

from aftlab.mixers import build_mixer
from aftlab.mixers.aft.decay import AFTDecay
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.testing import assert_close, decode


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_step_matches_forward_with_huge_keys_and_bonus(dtype):
    m = _mixer(5).to(dtype).eval()
    with torch.no_grad():
        m.to_k.weight.mul_(1e3)  # keys of magnitude ~1e3: exp overflows without the shift
        m.time_bonus.mul_(1e3)
    x = torch.randn(2, 13, 5, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        steps, state = decode(m, x)
    assert state.position == 13
    assert torch.isfinite(steps).all()
    tol = {} if dtype == torch.float64 else {"atol": 1e-1, "rtol": 1e-3}
    assert_close("step vs forward", steps, y, **tol)
