"""aft_conv (1-D): forward and backward against the float64 per-position reference, the paper's
conv form, AFT-local with a Toeplitz bias, stability at 1e4, padding, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aftlab.functional import aft_conv
from aftlab.ops.aft_conv import aft_conv_reference
from aftlab.testing import assert_close

OP = "aft_conv"
pytestmark = pytest.mark.usefixtures("impl")  # kernel and PyTorch (conftest.py)

F64 = torch.float64


def _inputs(B, T, h, c, ck, s, *, scale=1.0, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, h, c, generator=g, dtype=F64)
    k = torch.randn(B, T, h, ck, generator=g, dtype=F64) * scale
    v = torch.randn(B, T, h, c, generator=g, dtype=F64)
    w = torch.randn(h, s, generator=g, dtype=F64) * scale
    return [x.to(dtype).requires_grad_() for x in (q, k, v, w)]


def _check_fwd_bwd(args, *, causal, padding_mask=None, atol=None, rtol=None):
    """Compare aft_conv with the float64 reference on the same (rounded) inputs, fwd and bwd."""
    y = aft_conv(*args, causal=causal, padding_mask=padding_mask)
    ref_args = [a.detach().double().requires_grad_() for a in args]
    y_ref = aft_conv_reference(*ref_args, causal=causal, padding_mask=padding_mask)
    assert y.dtype == args[0].dtype
    assert_close("y", y, y_ref, atol=atol, rtol=rtol)
    g = torch.randn(y_ref.shape, dtype=F64)
    grads = torch.autograd.grad(y, args, g.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, ref_args, g)
    for name, a, e in zip("qkvw", grads, grads_ref, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert_close(f"d{name}", a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("per_channel_key", [False, True])
def test_matches_reference_forward_backward(causal, T, per_channel_key):
    c = 3
    s = 4 if causal and T == 7 else 5  # an even causal kernel too
    args = _inputs(2, T, 2, c, c if per_channel_key else 1, s, scale=2.0, seed=T)
    _check_fwd_bwd(args, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_longer_than_sequence_and_size_one(causal):
    _check_fwd_bwd(_inputs(2, 3, 2, 2, 1, 9), causal=causal)
    _check_fwd_bwd(_inputs(1, 6, 3, 2, 1, 1), causal=causal)


def test_empty_sequence():
    q, k, v, w = (a.detach() for a in _inputs(2, 0, 2, 3, 1, 3))
    assert aft_conv(q, k, v, w).shape == (2, 0, 2, 3)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    args = _inputs(1, 6, 2, 2, 1, 3)
    mask = torch.tensor([[True, True, False, True, True, True]])
    assert torch.autograd.gradcheck(lambda *a: aft_conv(*a, causal=causal, padding_mask=mask), args)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_matches_reference(causal):
    args = _inputs(2, 33, 4, 8, 1, 7, dtype=torch.float32)
    _check_fwd_bwd(args, causal=causal)


# ----------------------------------------------------------------------- relations
@pytest.mark.parametrize("causal", [False, True])
def test_paper_conv_form_with_conv1d_alignment(causal):
    """Y = sigma(Q) [conv(e^K V, e^w - 1) + sum e^K V] / [conv(e^K, e^w - 1) + sum e^K], with
    F.conv1d (cross-correlation) padding s//2 each side, or s - 1 on the left when causal."""
    B, T, h, c, s = 2, 12, 3, 2, 5
    q, k, v, w = (a.detach() for a in _inputs(B, T, h, c, 1, s))
    ek = torch.exp(k).expand(B, T, h, c)
    kern = (torch.exp(w) - 1).repeat_interleave(c, 0)[:, None]  # (h c, 1, s), depthwise

    def conv(x):  # (B, T, h, c) -> (B, T, h, c)
        x = x.reshape(B, T, h * c).transpose(1, 2)
        x = F.pad(x, (s - 1, 0)) if causal else F.pad(x, (s // 2, s // 2))
        return F.conv1d(x, kern, groups=h * c).transpose(1, 2).reshape(B, T, h, c)

    glob = (lambda x: x.cumsum(1)) if causal else (lambda x: x.sum(1, keepdim=True))
    num = conv(ek * v) + glob(ek * v)
    den = conv(ek) + glob(ek)
    assert_close("y", aft_conv(q, k, v, w, causal=causal), torch.sigmoid(q) * num / den)


def _toeplitz_bias(w_head, T, causal):
    """(T, T) bias of one head's kernel, built entry by entry: w[j] at t' = t + j - l, else 0."""
    s = w_head.shape[0]
    lo = s - 1 if causal else s // 2
    bias = torch.zeros(T, T, dtype=w_head.dtype)
    for t in range(T):
        for j in range(s):
            tp = t + j - lo
            if 0 <= tp < T:
                bias[t, tp] = w_head[j]
    return bias


def _general_bias_loop(q, k, v, bias, causal):
    """Float64 AFT with a general (T, T) bias: q, k, v (B, T, c)."""
    T = q.shape[1]
    out = torch.zeros_like(q)
    for t in range(T):
        n = t + 1 if causal else T
        logits = k[:, :n] + bias[t, :n, None]
        out[:, t] = torch.sigmoid(q[:, t]) * (torch.softmax(logits, 1) * v[:, :n]).sum(1)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_equals_general_bias_with_toeplitz_kernel(causal):
    B, T, h, c, s = 2, 9, 3, 2, 5
    q, k, v, w = (a.detach() for a in _inputs(B, T, h, c, 1, s, scale=3.0))
    y = aft_conv(q, k, v, w, causal=causal)
    for i in range(h):
        bias = _toeplitz_bias(w[i], T, causal)
        ki = k[:, :, i].expand(B, T, c)
        assert_close(
            f"head {i}", y[:, :, i], _general_bias_loop(q[:, :, i], ki, v[:, :, i], bias, causal)
        )


@pytest.mark.parametrize("causal", [False, True])
def test_equals_per_head_aft_local_with_toeplitz_bias(causal):
    """aft_conv == per-head aft_local(w = Toeplitz bias of the kernel)."""
    from aftlab.ops.aft_local import aft_local

    B, T, h, c, s = 2, 9, 3, 2, 5
    q, k, v, w = (a.detach() for a in _inputs(B, T, h, c, 1, s, scale=3.0))
    y = aft_conv(q, k, v, w, causal=causal)
    window = s if causal else s // 2 + 1  # |t - t'| < window covers the kernel footprint
    for i in range(h):
        bias = _toeplitz_bias(w[i], T, causal)
        yi = aft_local(
            q[:, :, i], k[:, :, i].expand(B, T, c), v[:, :, i], bias, window, causal=causal
        )
        assert_close(f"head {i}", y[:, :, i], yi)


# ----------------------------------------------------------------------- stability
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spread", [False, True])
def test_huge_keys_and_kernel_float32(causal, spread):
    """|K|, |w| ~ 1e4 (e^K overflows even float64); causal with the largest key last. "spread":
    wildly different exponents; otherwise all near 1e4 (many comparable terms, where a
    float32 log-sum would lose ~1e-3)."""
    B, T, h, c, s = 2, 40, 2, 3, 5
    q, k, v, w = (a.detach() for a in _inputs(B, T, h, c, 1, s))
    if spread:
        k, w = k * 1e4, w * 1e4
    else:
        k = k + 1e4
    k[:, -1] = k.max() + 10
    args = [a.float().requires_grad_() for a in (q, k, v, w)]
    _check_fwd_bwd(args, causal=causal, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_is_finite_and_close(dtype, causal):
    q, k, v, w = (a.detach() for a in _inputs(2, 30, 2, 4, 1, 5))
    k = k * 1e4
    k[:, -1] = 2e4
    args = [a.to(dtype).requires_grad_() for a in (q, k, v, w)]
    _check_fwd_bwd(args, causal=causal)


def test_autocast_bfloat16():
    q, k, v, w = (a.detach().float() for a in _inputs(2, 16, 2, 4, 1, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = aft_conv(q, k * 1e3, v, w * 1e3, causal=True)
    assert y.dtype == torch.float32
    assert_close("y", y, aft_conv_reference(q, k * 1e3, v, w * 1e3, causal=True))


# ----------------------------------------------------------------------- padding
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_contribute_nothing(causal):
    B, T, h, c, s = 2, 10, 2, 3, 3
    args = _inputs(B, T, h, c, 1, s)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:6] = False
    mask[1, :2] = False
    _check_fwd_bwd(args, causal=causal, padding_mask=mask)
    q, k, v, w = (a.detach() for a in args)
    k2, v2 = k.clone(), v.clone()
    k2[~mask] = 1e4  # garbage at padded positions changes nothing
    v2[~mask] = 1e4
    assert_close(
        "y",
        aft_conv(q, k2, v2, w, causal=causal, padding_mask=mask),
        aft_conv(q, k, v, w, causal=causal, padding_mask=mask),
    )
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    aft_conv(q, kk, vv, w, causal=causal, padding_mask=mask).sum().backward()
    assert (kk.grad[~mask] == 0).all() and (vv.grad[~mask] == 0).all()


def test_query_without_valid_key_gets_zero_not_nan():
    args = _inputs(2, 6, 2, 2, 1, 3)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0] = False  # sequence 0 entirely padded
    mask[1, :3] = False  # causal queries 0..2 of sequence 1 see no key
    for causal in (False, True):
        y = aft_conv(*args, causal=causal, padding_mask=mask)
        assert (y[0] == 0).all()
        if causal:
            assert (y[1, :3] == 0).all()
        y.sum().backward()
        assert all(torch.isfinite(a.grad).all() for a in args)
        _check_fwd_bwd(args, causal=causal, padding_mask=mask)


# ----------------------------------------------------------------------- bad input
def test_bad_input_errors_name_argument_and_shapes():
    q, k, v, w = (a.detach() for a in _inputs(2, 5, 2, 3, 1, 3))
    with pytest.raises(ValueError, match=r"odd size.*'w' of shape \(2, 4\)"):
        aft_conv(q, k, v, torch.zeros(2, 4, dtype=F64))
    aft_conv(q, k, v, torch.zeros(2, 4, dtype=F64), causal=True)  # even is fine when causal
    with pytest.raises(
        ValueError,
        match=r"'k' must have shape \(2, 5, 2, 1\) or \(2, 5, 2, 3\).*got \(2, 5, 2, 2\)",
    ):
        aft_conv(q, torch.zeros(2, 5, 2, 2, dtype=F64), v, w)
    with pytest.raises(ValueError, match=r"'v' must have the shape .*got \(2, 5, 2, 4\)"):
        aft_conv(q, k, torch.zeros(2, 5, 2, 4, dtype=F64), w)
    with pytest.raises(ValueError, match=r"'q' must have 4 dimensions.*got 3"):
        aft_conv(q[0], k, v, w)
    with pytest.raises(ValueError, match=r"'w' must have one kernel per head.*got \(3, 3\)"):
        aft_conv(q, k, v, torch.zeros(3, 3, dtype=F64))
    with pytest.raises(TypeError, match=r"'k' has dtype torch.float32 but 'q' has torch.float64"):
        aft_conv(q, k.float(), v, w)
    with pytest.raises(ValueError, match=r"'w' is on meta but 'q' is on cpu"):
        aft_conv(q, k, v, w.to("meta"))
    with pytest.raises(ValueError, match=r"'padding_mask' must have shape \(2, 5\), got \(2, 4\)"):
        aft_conv(q, k, v, w, padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="'padding_mask' must be a bool tensor"):
        aft_conv(q, k, v, w, padding_mask=torch.ones(2, 5))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "qshape, kc", [((2, 6, 3, 0), 1), ((2, 6, 3, 0), 0), ((2, 6, 0, 4), 1), ((0, 6, 3, 4), 1)]
)
def test_empty_channels_heads_or_batch(qshape, kc, causal):
    """c = 0, h = 0 or B = 0: an empty output of the right shape, and a backward that works."""
    q, v = (torch.randn(qshape, requires_grad=True) for _ in range(2))
    k = torch.randn(*qshape[:3], kc, requires_grad=True)
    w = torch.randn(qshape[2], 3, requires_grad=True)
    y = aft_conv(q, k, v, w, causal=causal)
    assert y.shape == qshape
    y.sum().backward()
    assert [x.grad.shape for x in (q, k, v, w)] == [q.shape, k.shape, v.shape, w.shape]
