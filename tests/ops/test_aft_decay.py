"""aft_decay against its float64 per-position reference; relations; stability; bad input.

Every test runs twice: on the C++ kernel and on the pure-PyTorch implementation.
"""

import pytest
import torch

from aftlab.functional import aft_decay, aft_simple
from aftlab.ops.aft_decay import aft_decay_reference
from aftlab.testing import assert_close

F64 = torch.float64


OP = "aft_decay"
pytestmark = pytest.mark.usefixtures("impl")  # every implementation (conftest.py)
# gradcheck runs its fast mode (a random projection of the Jacobian) under Triton's interpreter,
# whose every call costs milliseconds: the full Jacobian takes a minute there.


def _inputs(B, T, d, *, kscale=3.0, vscale=1.0, dtype=F64):
    q = torch.randn(B, T, d, dtype=F64)
    k = torch.randn(B, T, d, dtype=F64) * kscale
    v = torch.randn(B, T, d, dtype=F64) * vscale
    decay = torch.rand(d, dtype=F64) * 2
    bonus = torch.randn(d, dtype=F64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, decay, bonus)]


def _compare(q, k, v, decay, bonus, *, padding_mask=None, atol=None, rtol=None, loose=()):
    y = aft_decay(q, k, v, decay, bonus, padding_mask=padding_mask)
    assert y.dtype == q.dtype
    ins = (q, k, v, decay, bonus)
    ref_in = [t.detach().double().requires_grad_() for t in ins]
    y0 = aft_decay_reference(*ref_in, padding_mask=padding_mask)
    assert_close("Y", y, y0, atol=atol, rtol=rtol)
    g = torch.randn_like(y0)
    grads = torch.autograd.grad((y.double() * g).sum(), ins)
    grads0 = torch.autograd.grad((y0 * g).sum(), ref_in)
    for name, a, e in zip(("dq", "dk", "dv", "ddecay", "dbonus"), grads, grads0, strict=True):
        assert torch.isfinite(a).all(), f"{name} not finite"
        if name not in loose:  # only checked finite
            assert_close(name, a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("T", [1, 2, 7, 64, 257, 1000])
def test_matches_reference(T):
    _compare(*_inputs(2 if T < 100 else 1, T, 5))


def test_gradcheck(impl):
    q, k, v, decay, bonus = _inputs(1, 9, 2)
    assert torch.autograd.gradcheck(aft_decay, (q, k, v, decay, bonus), fast_mode=impl == "triton")


def test_gradcheck_padding_mask(impl):
    q, k, v, decay, bonus = _inputs(2, 11, 3)
    mask = torch.rand(2, 11) > 0.4
    mask[1, :4] = False

    def fn(q, k, v, decay, bonus):
        return aft_decay(q, k, v, decay, bonus, padding_mask=mask)

    assert torch.autograd.gradcheck(fn, (q, k, v, decay, bonus), fast_mode=impl == "triton")


def test_float32_odd_channels():
    # d = 259: a full block of 256 channels and a ragged one of 3 (the kernel's channel blocks).
    q, k, v, decay, bonus = _inputs(2, 70, 259, dtype=torch.float32)
    mask = torch.rand(2, 70) > 0.2
    # dlambda sums ~T terms that cancel: float32 gets a looser absolute tolerance for it.
    _compare(q, k, v, decay, bonus, padding_mask=mask, atol=2e-5, rtol=1e-4, loose=("ddecay",))
    y = aft_decay(q, k, v, decay, bonus, padding_mask=mask)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, decay, bonus)]
    g = torch.randn_like(y)
    dl = torch.autograd.grad((y * g).sum(), decay)[0]
    dl0 = torch.autograd.grad((aft_decay_reference(*ins, padding_mask=mask) * g).sum(), ins[3])
    assert_close("ddecay", dl, dl0[0], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_later_position_cannot_change_earlier_outputs(bad):
    q, k, v, decay, bonus = (t.detach() for t in _inputs(2, 40, 5))
    y = aft_decay(q, k, v, decay, bonus)
    for x in (q, k, v):
        x2 = x.clone()
        x2[:, 23] = bad
        ins = [x2 if t is x else t for t in (q, k, v)]
        y2 = aft_decay(*ins, decay, bonus)
        assert torch.equal(y2[:, :23], y[:, :23])


def test_definition_small_case():
    # T = 2, d = 1: Y_0 = sigma(q_0) v_0;
    # Y_1 = sigma(q_1) (e^{k_0} v_0 + e^{u + k_1} v_1) / (e^{k_0} + e^{u + k_1}) (no decay yet).
    q, k, v = (torch.randn(1, 2, 1, dtype=F64) for _ in range(3))
    decay, bonus = torch.tensor([0.7], dtype=F64), torch.tensor([0.4], dtype=F64)
    y = aft_decay(q, k, v, decay, bonus)[0, :, 0]
    a, b = torch.exp(k[0, 0, 0]), torch.exp(bonus[0] + k[0, 1, 0])
    y1 = torch.sigmoid(q[0, 1, 0]) * (a * v[0, 0, 0] + b * v[0, 1, 0]) / (a + b)
    assert_close("Y", y, torch.stack([torch.sigmoid(q[0, 0, 0]) * v[0, 0, 0], y1]))


def test_zero_decay_zero_bonus_is_causal_aft_simple():
    q, k, v, _, _ = _inputs(2, 65, 5)
    zero = torch.zeros(5, dtype=F64)
    mask = torch.rand(2, 65) > 0.3
    assert_close(
        "aft_decay(0, 0)",
        aft_decay(q, k, v, zero, zero, padding_mask=mask),
        aft_simple(q, k, v, causal=True, padding_mask=mask),
    )


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_huge_keys_values_bonus(dtype):
    q, k, v, decay, bonus = _inputs(2, 70, 3, kscale=1e4, vscale=1e4, dtype=dtype)
    bonus = (bonus.detach() * 1e4).requires_grad_()
    # values ~1e4: absolute errors scale with them (float32: exponents carry ~1e-3 error, and
    # dlambda sums terms of size ~|v| that cancel: in float32 it is only checked finite).
    tol = {"atol": 1e-6, "rtol": 1e-8} if dtype == F64 else {"atol": 20.0, "rtol": 1e-2}
    _compare(q, k, v, decay, bonus, loose=() if dtype == F64 else ("ddecay",), **tol)


def test_increasing_keys_largest_last():
    T = 64
    k = torch.linspace(0, 1e4, T)[None, :, None].expand(1, T, 3).contiguous()
    q, v = torch.randn(1, T, 3), torch.randn(1, T, 3)
    decay, bonus = torch.rand(3), torch.zeros(3)
    y = aft_decay(q, k, v, decay, bonus)
    assert torch.isfinite(y).all()
    assert_close("Y", y, aft_decay_reference(q, k, v, decay, bonus))


def test_huge_decay():
    q, k, v, _, bonus = _inputs(2, 30, 3)
    decay = torch.tensor([1e4, 1e30, 0.1], dtype=F64, requires_grad=True)
    _compare(q, k, v, decay, bonus)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kscale", [3.0, 1e4])
def test_low_precision(dtype, kscale):
    q, k, v, decay, bonus = (t.detach() for t in _inputs(2, 40, 5, kscale=kscale, dtype=dtype))
    y = aft_decay(q, k, v, decay, bonus)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert_close("Y", y, aft_decay_reference(q, k, v, decay, bonus))


def test_autocast_bfloat16():
    q, k, v = (torch.randn(2, 30, 4) * s for s in (1.0, 1e3, 1.0))
    w = torch.randn(4, 4, requires_grad=True)
    decay, bonus = torch.rand(4, requires_grad=True), torch.randn(4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qp, kp, vp = q @ w, k @ w, v @ w
        y = aft_decay(qp, kp, vp, decay, bonus)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert_close("Y", y, aft_decay_reference(qp, kp, vp, decay, bonus))
    y.float().sum().backward()
    for name, t in (("W", w), ("decay", decay), ("bonus", bonus)):
        assert torch.isfinite(t.grad).all(), name


def test_padding_mask():
    B, T, d = 3, 33, 5
    q, k, v, decay, bonus = _inputs(B, T, d)
    mask = torch.rand(B, T) > 0.4
    mask[1] = False
    mask[2, :10] = False
    _compare(q, k, v, decay, bonus, padding_mask=mask)
    y = aft_decay(q, k, v, decay, bonus, padding_mask=mask)
    assert (y[1] == 0).all() and (y[2, :10] == 0).all()
    k2 = k.detach().masked_fill(~mask[:, :, None], 1e4)
    v2 = v.detach().masked_fill(~mask[:, :, None], 1e4)
    y2 = aft_decay(q.detach(), k2, v2, decay.detach(), bonus.detach(), padding_mask=mask)
    assert torch.equal(y2, y.detach())


def test_bad_inputs():
    q = torch.zeros(2, 5, 3)
    dec, bon = torch.ones(3), torch.zeros(3)
    with pytest.raises(ValueError, match="'decay'"):
        aft_decay(q, q, q, torch.tensor([0.1, -0.2, 0.0]), bon)
    with pytest.raises(ValueError, match="'decay'"):
        aft_decay(q, q, q, torch.ones(4), bon)
    with pytest.raises(ValueError, match="'bonus'"):
        aft_decay(q, q, q, dec, torch.zeros(3, 1))
    with pytest.raises(TypeError, match="'decay'"):
        aft_decay(q, q, q, [1.0, 1.0, 1.0], bon)
    with pytest.raises(ValueError, match="'k'"):
        aft_decay(q, torch.zeros(2, 5, 2), q, dec, bon)
    with pytest.raises(TypeError, match="'k'"):
        aft_decay(q, q.double(), q, dec, bon)
    with pytest.raises(ValueError, match="'padding_mask'"):
        aft_decay(q, q, q, dec, bon, padding_mask=torch.ones(5, dtype=torch.bool))


# ----------------------------------------------------------------------------- numerical range
MAX32 = torch.finfo(torch.float32).max


@pytest.mark.parametrize("key", [-MAX32, -1e38, 0.0, 1e38, MAX32])
@pytest.mark.parametrize("bonus", [-MAX32, -1e38, 0.0, MAX32])
def test_first_token_is_its_own_value_whatever_key_and_bonus(key, bonus):
    # The first token sees only itself: Y_0 = sigma(Q_0) V_0. A finite "no key yet" maximum
    # (-max/4) gave NaN (kernel, keys near -max) or 0 (PyTorch, bonus near -1e38).
    q, v = torch.tensor([[[0.5, -1.0]]]), torch.tensor([[[3.0, -2.0]]])
    k = torch.full((1, 1, 2), key)
    y = aft_decay(q, k, v, torch.tensor([0.0, MAX32]), torch.full((2,), bonus))
    assert_close("Y_0", y, torch.sigmoid(q) * v)


def test_extreme_keys_decay_bonus_match_reference():
    # Scores beyond the float range (u + K, t lambda) must neither overflow into NaN nor be
    # clamped: exact ties, a past that dominates a huge negative bonus, a decay ~1e38.
    k = torch.tensor([[[-3e38, 3e38, 3e38], [-3e38, 3e38, 3e38], [0.0, 0.0, 2e38]]])
    q, v = torch.zeros(1, 3, 3), torch.tensor([[[1.0, 2.0, 3.0], [-4.0, 5.0, 6.0], [7, 8, 9]]])
    decay = torch.tensor([0.0, 3e38, 1.3e38])
    bonus = torch.tensor([0.0, -3e38, 0.0])
    y = aft_decay(q, k, v, decay, bonus)
    y0 = aft_decay_reference(q, k, v, decay, bonus)
    assert torch.isfinite(y).all()
    assert_close("Y", y, y0)
    assert_close("Y (ties)", y[0, 1, 0], torch.tensor(-1.5) * 0.5)


def test_all_padded_row_with_huge_decay():
    # A row without a real token gets 0 (it was NaN for a decay ~1e38 on the PyTorch path).
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, generator=gen) for _ in range(3))
    decay, bonus = torch.tensor([3e38, 1e38]), torch.zeros(2)
    y = aft_decay(q, k, v, decay, bonus, padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    assert torch.equal(y, torch.zeros_like(y))


def test_values_near_float32_max_stay_finite():
    # n exp(m) + e^{u + k} v overflowed for three values ~1e38 (weights ~1); the average of
    # values is bounded by max |V|.
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, 3, 3, generator=gen) * 0.1
    v = (torch.randn(2, 3, 3, generator=gen, dtype=F64) * 1e38).clamp(-MAX32, MAX32).float()
    v[0, :, 0], v[1, :, 0] = MAX32, -MAX32
    q, decay, bonus = torch.full((2, 3, 3), 20.0), torch.rand(3, generator=gen), torch.zeros(3)
    y = aft_decay(q, k, v, decay, bonus)
    assert torch.isfinite(y).all()
    assert_close("Y", y, aft_decay_reference(q, k, v, decay, bonus), atol=3e33, rtol=1e-5)


@pytest.mark.parametrize("shape", [(0, 5, 3), (2, 0, 3), (2, 5, 0)])
def test_zero_sizes(shape):
    q, k, v = (torch.randn(shape, dtype=F64, requires_grad=True) for _ in range(3))
    decay, bonus = (torch.rand(shape[2], dtype=F64, requires_grad=True) for _ in range(2))
    y = aft_decay(q, k, v, decay, bonus)
    assert y.shape == shape
    y.sum().backward()
    for x in (q, k, v, decay, bonus):
        assert x.grad is None or (x.grad.shape == x.shape and not x.grad.any())


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_input_gives_nan_output(which):
    q, k, v, decay, bonus = (t.detach() for t in _inputs(2, 9, 3))
    {"k": k, "v": v}[which][:, 4] = float("nan")
    y = aft_decay(q, k, v, decay, bonus)
    assert torch.isnan(y[:, 4:]).all() and torch.isfinite(y[:, :4]).all()
