"""The aft-full mixer: forward == the op, its position-bias parameters and options.

What every mixer promises (decoding, padding, causality, autocast, dtypes) is in test_contract.py.
"""

import pytest
import torch

from aftlab.functional import aft_full
from aftlab.mixers import build_mixer
from aftlab.testing import assert_close, decode, perturb_parameters

pytestmark = pytest.mark.usefixtures("one_thread")


def _mixer(causal=True, **opts):
    opts.setdefault("max_seq_len", 16)
    return build_mixer("aft-full", d_model=6, causal=causal, **opts).double()


def test_forward_is_projections_around_aft_full():
    m = perturb_parameters(_mixer(causal=False, bias_rank=3), 1.0)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    w = m.pos_bias.u @ m.pos_bias.v.t()  # w = U V^T
    assert_close("y", m(x), m.proj(aft_full(q, k, v, w)))


def test_bias_parameters_train():
    """U, V are registered parameters created once; an optimizer step moves w."""
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


@pytest.mark.parametrize("bias_rank", [3, None])
@pytest.mark.parametrize("key_scale", [1.0, 1e3])
def test_step_matches_forward_with_large_biases(bias_rank, key_scale):
    m = perturb_parameters(_mixer(bias_rank=bias_rank), 5.0)
    with torch.no_grad():
        m.to_k.weight.mul_(key_scale)
        x = torch.randn(2, 16, 6, dtype=torch.float64)
        y = m(x)
        steps, state = decode(m, x)
    assert torch.isfinite(y).all()
    assert_close("step-by-step", steps, y)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.step(x[:, 0], state)


def test_errors():
    with pytest.raises(ValueError, match="'max_seq_len'.*required"):
        build_mixer("aft-full", d_model=4)
    with pytest.raises(ValueError, match="'bias_rank' must be > 0"):
        build_mixer("aft-full", d_model=4, max_seq_len=8, bias_rank=0)
    with pytest.raises(ValueError, match=r"length 9 .* max_seq_len \(T_max\) = 8"):
        build_mixer("aft-full", d_model=4, max_seq_len=8)(torch.randn(1, 9, 4))
