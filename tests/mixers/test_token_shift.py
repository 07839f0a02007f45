"""``token_shift``: the formula against a per-position float64 reference, its options, the
``rwkv4`` mixer. The shared promises (decoding, chunks, packed documents, padding, causality)
are the contract's, run on every AFT mixer with the shift (tests/mixers/test_contract.py)."""

from __future__ import annotations

import pytest
import torch

from aftlab.mixers import build_mixer
from aftlab.mixers.aft.common import ShiftedState
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.testing import assert_close, perturb_parameters

B, T, D = 2, 9, 7
F64 = torch.float64


def _shifted_projections(m, x):
    """``q, k, v`` from the formula, position by position: ``W (mu x_t + (1 - mu) x_{t-1}) + b``
    with ``x_{-1} = 0``."""
    rows = []
    for t in range(x.shape[1]):
        prev = x[:, t - 1] if t else torch.zeros_like(x[:, 0])
        row = []
        for lin, mu in ((m.to_q, m.mix_q), (m.to_k, m.mix_k), (m.to_v, m.mix_v)):
            mixed = mu * x[:, t] + (1 - mu) * prev
            row.append(mixed @ lin.weight.T + (0 if lin.bias is None else lin.bias))
        rows.append(row)
    return [torch.stack([r[i] for r in rows], 1) for i in range(3)]


@pytest.mark.parametrize("name", ["aft-decay", "rwkv4", "aft-simple"])
def test_forward_is_the_op_on_the_shifted_projections(name):
    opts = {} if name == "rwkv4" else {"token_shift": True}
    m = perturb_parameters(build_mixer(name, d_model=D, causal=True, **opts).to(F64)).eval()
    x = torch.randn(B, T, D, dtype=F64, requires_grad=True)
    q, k, v = _shifted_projections(m, x)
    if name == "aft-simple":
        y = aft_simple_reference(q, k, v, causal=True)
    else:
        y = aft_decay_reference(q, k, v, m.decay(), m.time_bonus)
    expected = y @ m.proj.weight.T + m.proj.bias
    got = m(x)
    assert_close(f"{name} with token_shift", got, expected, atol=1e-12, rtol=1e-10)  # float64
    g = torch.randn_like(got)
    params = [x, m.mix_q, m.mix_k, m.mix_v]
    for a, b, what in zip(torch.autograd.grad((got * g).sum(), params),
                          torch.autograd.grad((expected * g).sum(), params),
                          ("x", "mix_q", "mix_k", "mix_v"), strict=True):
        assert_close(f"{name} d/d{what}", a, b, atol=1e-11, rtol=1e-9)  # float64


def test_the_state_holds_the_last_input_and_the_ops_state():
    m = build_mixer("aft-local", d_model=D, causal=True, window=3, max_seq_len=32,
                    token_shift=True)
    x = torch.randn(B, T, D)
    _, state = m.prefill(x)
    assert isinstance(state, ShiftedState)
    assert torch.equal(state.last, x[:, -1]) and state.last.data_ptr() != x[:, -1].data_ptr()
    assert state.inner.position == T and m._state_position(state) == T
    bad = ShiftedState(torch.zeros(B, D + 1), state.inner)
    with pytest.raises(ValueError, match=r"state\.last"):
        m.step(torch.randn(B, D), bad)


def test_options():
    with pytest.raises(TypeError, match="'token_shift' must be a bool"):
        build_mixer("aft-simple", d_model=D, token_shift=1)
    with pytest.raises(TypeError, match="'token_shift' is not an option"):
        build_mixer("rwkv4", d_model=D, token_shift=True)
    m = build_mixer("aft-decay", d_model=D, layer_idx=1, n_layers=3, token_shift=True)
    x = torch.arange(D, dtype=torch.float64) / D
    # RWKV-4's ramps for layer 1 of 3 (token_shift_init): mu_k = x^(2/3), mu_v = mu_k + 0.15
    assert_close("mix_k", m.mix_k.double(), x ** (2 / 3), atol=1e-6, rtol=1e-6)  # float32 params
    assert_close("mix_v", m.mix_v.double(), x ** (2 / 3) + 0.15, atol=1e-6, rtol=1e-6)
    assert_close("mix_q", m.mix_q.double(), x ** (1 / 3), atol=1e-6, rtol=1e-6)
    assert not hasattr(build_mixer("aft-decay", d_model=D), "mix_k")
