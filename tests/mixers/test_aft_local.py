"""The aft-local mixer: band of U V^T, its window (decoding included), relation to aft-full.

What every mixer promises (decoding, padding, causality, autocast, dtypes) is in test_contract.py.
"""

import pytest
import torch

from aftlab.functional import aft_local
from aftlab.mixers import build_mixer
from aftlab.testing import assert_close, decode, perturb_parameters

pytestmark = pytest.mark.usefixtures("one_thread")


def _mixer(causal=True, **opts):
    opts.setdefault("max_seq_len", 20)
    return build_mixer("aft-local", d_model=6, causal=causal, **opts).double()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_rank", [3, None])
def test_forward_is_projections_around_aft_local(causal, bias_rank):
    m = perturb_parameters(_mixer(causal=causal, window=4, bias_rank=bias_rank), 1.0)
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
    loc = perturb_parameters(_mixer(window=50, bias_rank=3), 1.0)
    full = build_mixer("aft-full", d_model=6, causal=True, max_seq_len=20, bias_rank=3).double()
    full.load_state_dict(loc.state_dict())
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    assert_close("aft-local(window >= T) vs aft-full", loc(x), full(x))


@pytest.mark.parametrize("window", [0, 1, 3, 20, 64])
@pytest.mark.parametrize("key_scale", [1.0, 1e3])
def test_step_matches_forward_for_every_window(window, key_scale):
    """Also with huge keys; the state (a BandState of window min(s, T_max)) keeps a ring of
    the last min(s, T_max) - 1 keys only."""
    m = perturb_parameters(_mixer(window=window, bias_rank=None if window == 3 else 4), 5.0)
    with torch.no_grad():
        m.to_k.weight.mul_(key_scale)
        x = torch.randn(2, 20, 6, dtype=torch.float64)
        y = m(x)
        steps, state = decode(m, x)
    assert torch.isfinite(y).all()
    r = max(min(window, 20) - 1, 0)
    assert state.k.shape == state.v.shape == (2, r, 6) and state.valid.shape == (2, r)
    assert state.position == 20 and state.gone.position == 20 - r
    assert_close("step-by-step", steps, y)


def test_errors():
    with pytest.raises(ValueError, match="'max_seq_len'.*required"):
        build_mixer("aft-local", d_model=4)
    with pytest.raises(ValueError, match="'window' must be >= 0, got -1"):
        build_mixer("aft-local", d_model=4, max_seq_len=8, window=-1)
    with pytest.raises(ValueError, match=r"length 9 .* max_seq_len \(T_max\) = 8"):
        build_mixer("aft-local", d_model=4, max_seq_len=8)(torch.randn(1, 9, 4))
    with pytest.raises(ValueError, match="unexpected keyword argument 'windw'"):
        build_mixer("aft-local", d_model=4, max_seq_len=8, windw=3)
