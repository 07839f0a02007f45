"""aft_local against its float64 reference; its relations to aft_full and AFT-simple; stability."""

import pytest
import torch

from aftlab.functional import aft_full, aft_local, aft_simple
from aftlab.ops.aft_full import aft_full_reference
from aftlab.ops.aft_local import aft_local_band, aft_local_reference, band_of
from aftlab.testing import assert_close

OP = "aft_local"
pytestmark = pytest.mark.usefixtures("impl", "one_thread")  # kernel and PyTorch (conftest.py)


def _inputs(B, T, d, *, scale=1.0, wscale=1.0, dtype=torch.float64, extra=0):
    q, k, v = torch.randn(3, B, T, d, dtype=torch.float64)
    w = torch.randn(T + extra, T + extra, dtype=torch.float64) * wscale
    return [x.to(dtype) for x in (q, k * scale, v, w)]


def _grads(y, xs, g):
    """Gradients of ``(y * g).sum()``; an input that is not used (w at window 0) gets zeros."""
    gs = torch.autograd.grad(y, xs, g.to(y.dtype), allow_unused=True)
    return [torch.zeros_like(x) if a is None else a for a, x in zip(gs, xs, strict=False)]


def _check_against_reference(inputs, window, *, causal, padding_mask=None, atol=None, rtol=None):
    xs = [x.clone().requires_grad_() for x in inputs]
    rs = [x.detach().double().requires_grad_() for x in inputs]
    y = aft_local(*xs, window, causal=causal, padding_mask=padding_mask)
    yr = aft_local_reference(*rs, window, causal=causal, padding_mask=padding_mask)
    assert y.dtype == inputs[0].dtype
    assert_close("y", y, yr, atol=atol, rtol=rtol)
    g = torch.randn_like(yr)
    for name, a, e in zip("qkvw", _grads(y, xs, g), _grads(yr, rs, g), strict=False):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert_close(f"d{name}", a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "T, window", [(1, 1), (2, 1), (7, 0), (7, 1), (7, 3), (7, 7), (64, 5), (64, 33), (257, 4)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_reference(T, window, causal, dtype):
    _check_against_reference(_inputs(2, T, 5, dtype=dtype, extra=2), window, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask(causal):
    B, T, d = 3, 11, 3
    pm = torch.ones(B, T, dtype=torch.bool)
    pm[0, :4] = False
    pm[1, 7:] = False
    pm[2] = False
    inputs = _inputs(B, T, d)
    _check_against_reference(inputs, 3, causal=causal, padding_mask=pm)
    assert (aft_local(*inputs, 3, causal=causal, padding_mask=pm)[2] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 2])
def test_gradcheck(causal, window):
    xs = [x.requires_grad_() for x in _inputs(1, 6, 3)]
    fn = lambda *a: aft_local(*a, window, causal=causal)  # noqa: E731
    assert torch.autograd.gradcheck(fn, xs if window else xs[:3] + [xs[3].detach()])


@pytest.mark.parametrize("causal", [False, True])
def test_window_at_least_T_is_aft_full(causal):
    q, k, v, w = _inputs(2, 9, 5, extra=1)
    for window in (9, 10, 100):
        assert_close(f"window={window}", aft_local(q, k, v, w, window, causal=causal),
                     aft_full(q, k, v, w, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_window_zero_is_aft_simple(causal):
    """AFT-simple is AFT-full with w = 0 (the paper's definition); window 0 ignores w entirely."""
    q, k, v, w = _inputs(2, 9, 5, scale=20.0, wscale=5.0)
    y = aft_local(q, k, v, w, 0, causal=causal)
    assert_close("vs aft_full(w=0)", y, aft_full(q, k, v, torch.zeros_like(w), causal=causal))
    assert_close("vs reference(w=0)", y, aft_full_reference(q, k, v, 0 * w, causal=causal))
    assert_close("vs aft_simple", y, aft_simple(q, k, v, causal=causal))


def test_outside_window_counts_as_zero_not_minus_inf():
    """Global connectivity is kept (bug 3): a far key still moves the output, its bias does not."""
    q, k, v, w = _inputs(1, 10, 2)
    y = aft_local(q, k, v, w, 2)
    v2 = v.clone()
    v2[:, 9] += 1.0  # key 9 is far outside query 0's window
    assert (aft_local(q, k, v2, w, 2)[:, 0] - y[:, 0]).abs().min() > 1e-6
    w2 = w.clone()
    w2[0, 2:] = 1e3  # biases outside |t - t'| < 2 are ignored ...
    assert_close("bias outside window", aft_local(q, k, v, w2, 2)[:, 0], y[:, 0])
    w3 = w.clone()
    w3[5, 4], w3[5, 6] = 3.0, -3.0  # ... those at |t - t'| = s - 1 on both sides are used
    assert (aft_local(q, k, v, w3, 2)[:, 5] - y[:, 5]).abs().min() > 1e-6


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_huge_keys_and_biases(causal, dtype):
    """1e4 magnitudes; a very negative band bias on the dominant key is where the paper's
    'global sum + (exp(w) - 1) correction' cancels catastrophically."""
    q, k, v, w = _inputs(2, 40, 5, scale=1e4, wscale=1e4)
    k[:, -1] = 2e4
    k[:, 20] = 3e4
    w[21:24, 20] = -5e4
    k, w = k.round(), w.round()  # a grid float32 holds exactly
    # The parts are combined through their log-sum-exps L ~ 3e4, which float32 holds to ~2e-3:
    # that is the float32 resolution of such keys, so float32 gets a matching tolerance.
    tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {}
    _check_against_reference([x.to(dtype) for x in (q, k, v, w)], 3, causal=causal, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    q, k, v, w = _inputs(2, 30, 5, scale=100.0, wscale=100.0)
    inputs = [x.to(dtype) for x in (q, k, v, w)]
    for causal in (False, True):
        _check_against_reference(inputs, 4, causal=causal)


def test_autocast_bf16():
    q, k, v, w = (x.float().requires_grad_() for x in _inputs(2, 20, 5, scale=300.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = aft_local(q, k, v, w, 3, causal=True)
    y.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, w))
    assert_close("y under autocast", y, aft_local_reference(q, k, v, w, 3, causal=True))


def test_band_layout():
    w = torch.arange(36.0).reshape(6, 6)
    band = band_of(w, 5, 2)  # offsets -1, 0, +1
    assert band.shape == (5, 3)
    assert band[2].tolist() == [w[2, 1], w[2, 2], w[2, 3]]
    assert band[0, 0] == 0 and band[4, 2] == 0  # keys outside [0, T)
    assert band_of(w, 5, 2, causal=True)[3].tolist() == [w[3, 2], w[3, 3]]


@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequence(causal):
    q = torch.randn(2, 0, 3, requires_grad=True)
    y = aft_local(q, q, q, torch.zeros(0, 0), 3, causal=causal)
    assert y.shape == (2, 0, 3)
    y.sum().backward()
    assert q.grad.shape == (2, 0, 3)


def test_bad_inputs():
    q, k, v, w = _inputs(2, 7, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"'window' must be >= 0, got -1"):
        aft_local(q, k, v, w, -1)
    with pytest.raises(TypeError, match=r"'window' must be an int"):
        aft_local(q, k, v, w, 2.0)
    with pytest.raises(ValueError, match=r"aft_local: 'w' must have shape .* T = 7 .*got \(6, 6\)"):
        aft_local(q, k, v, w[:6, :6], 3)
    with pytest.raises(ValueError, match=r"aft_local: 'k' must have shape \(2, 7, 4\)"):
        aft_local(q, k[:1], v, w, 3)
    with pytest.raises(TypeError, match=r"'v' has dtype torch.float64"):
        aft_local(q, k, v.double(), w, 3)
    with pytest.raises(ValueError, match=r"'w_band' must have shape \(7, 5\), got \(7, 3\)"):
        aft_local_band(q, k, v, band_of(w, 7, 2), 3)
    with pytest.raises(TypeError, match=r"'w_band' has dtype torch.float64"):
        aft_local_band(q, k, v, band_of(w, 7, 3).double(), 3)
    with pytest.raises(ValueError, match=r"'k' must have shape \(2, 7, 4\) like 'q'"):
        aft_local_band(q, k[:, :6], v, band_of(w, 7, 3), 3)
    with pytest.raises(ValueError, match=r"'padding_mask' must have 2 dimensions \(2, 7\), got 1"):
        aft_local(q, k, v, w, 3, padding_mask=torch.ones(7, dtype=torch.bool))
