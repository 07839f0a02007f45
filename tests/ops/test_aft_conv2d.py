"""aft_conv2d: forward and backward against the float64 reference, the paper's conv2d form, the 1-D
op on one-row/one-column images, stability at 1e4, padding, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aftlab.functional import aft_conv, aft_conv2d
from aftlab.ops.aft_conv import aft_conv2d_reference
from aftlab.testing import assert_close

from .test_scan import OPCHECK

F64 = torch.float64


def _inputs(B, H, W, h, c, ck, s, *, scale=1.0, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, W, h, c, generator=g, dtype=F64)
    k = torch.randn(B, H, W, h, ck, generator=g, dtype=F64) * scale
    v = torch.randn(B, H, W, h, c, generator=g, dtype=F64)
    w = torch.randn(h, s, s, generator=g, dtype=F64) * scale
    return [x.to(dtype).requires_grad_() for x in (q, k, v, w)]


def _check_fwd_bwd(args, *, padding_mask=None, atol=None, rtol=None):
    y = aft_conv2d(*args, padding_mask=padding_mask)
    ref_args = [a.detach().double().requires_grad_() for a in args]
    y_ref = aft_conv2d_reference(*ref_args, padding_mask=padding_mask)
    assert y.dtype == args[0].dtype
    assert_close("y", y, y_ref, atol=atol, rtol=rtol)
    g = torch.randn(y_ref.shape, dtype=F64)
    grads = torch.autograd.grad(y, args, g.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, ref_args, g)
    for name, a, e in zip("qkvw", grads, grads_ref, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert_close(f"d{name}", a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("H", "W", "s"), [(1, 1, 3), (1, 7, 3), (5, 1, 3), (4, 6, 3), (7, 5, 5), (3, 3, 7), (9, 8, 3)]
)
@pytest.mark.parametrize("per_channel_key", [False, True])
def test_matches_reference_forward_backward(H, W, s, per_channel_key):
    c = 3
    args = _inputs(2, H, W, 2, c, c if per_channel_key else 1, s, scale=2.0, seed=H * 10 + W)
    _check_fwd_bwd(args)


def test_gradcheck():
    args = _inputs(1, 4, 3, 1, 2, 1, 3)  # H = 4 > s//2 + 1: rows above/below the box are used
    mask = torch.ones(1, 4, 3, dtype=torch.bool)
    mask[0, 1, 2] = False
    fn = lambda *a: aft_conv2d(*a, padding_mask=mask)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_paper_conv2d_form():
    """Y = sigma(Q) [conv2d(e^K V, e^w - 1) + sum e^K V] / [conv2d(e^K, e^w - 1) + sum e^K],
    F.conv2d (cross-correlation) with padding s//2: the paper's ImageNet form."""
    B, H, W, h, c, s = 2, 6, 5, 3, 2, 3
    q, k, v, w = (a.detach() for a in _inputs(B, H, W, h, c, 1, s))
    ek = torch.exp(k).expand(B, H, W, h, c)
    kern = (torch.exp(w) - 1).repeat_interleave(c, 0)[:, None]  # (h c, 1, s, s), depthwise

    def conv(x):
        x = x.reshape(B, H, W, h * c).permute(0, 3, 1, 2)
        y = F.conv2d(x, kern, padding=s // 2, groups=h * c)
        return y.permute(0, 2, 3, 1).reshape(B, H, W, h, c)

    num = conv(ek * v) + (ek * v).sum((1, 2), keepdim=True)
    den = conv(ek) + ek.sum((1, 2), keepdim=True)
    assert_close("y", aft_conv2d(q, k, v, w), torch.sigmoid(q) * num / den)


@pytest.mark.parametrize("axis", ["row", "column"])
def test_one_row_or_column_image_equals_1d_op(axis):
    B, n, h, c, s = 2, 9, 2, 3, 5
    P = s // 2
    q, k, v, w = (a.detach() for a in _inputs(B, 1, n, h, c, 1, s, scale=3.0))
    if axis == "row":  # (B, 1, n): the kernel's centre row acts
        y1 = aft_conv(q[:, 0], k[:, 0], v[:, 0], w[:, P, :])
        assert_close("y", aft_conv2d(q, k, v, w)[:, 0], y1)
    else:  # (B, n, 1): the centre column acts
        qc, kc, vc = (x.transpose(1, 2) for x in (q, k, v))
        y1 = aft_conv(q[:, 0], k[:, 0], v[:, 0], w[:, :, P])
        assert_close("y", aft_conv2d(qc, kc, vc, w)[:, :, 0], y1)


def test_huge_keys_and_kernel_float32():
    """|K|, |w| ~ 1e4, and keys all near 1e4 (many comparable terms): exact to float32."""
    for mode in ("spread", "offset"):
        q, k, v, w = (a.detach() for a in _inputs(2, 6, 7, 2, 3, 1, 3))
        k, w = (k * 1e4, w * 1e4) if mode == "spread" else (k + 1e4, w)
        args = [a.float().requires_grad_() for a in (q, k, v, w)]
        _check_fwd_bwd(args, atol=1e-5, rtol=1e-4)


def test_in_box_key_dominating_with_negative_bias():
    """The case that breaks "global sum minus in-box correction": the largest key sits in every
    box with bias -1e4, so its global term must cancel; outside terms must survive exactly."""
    q, k, v, w = (a.detach() for a in _inputs(1, 3, 3, 1, 2, 1, 5))
    k[0, 1, 1] = 1e4
    w.fill_(-1e4)
    w[0, 2, 2] = 0.0
    args = [a.float().requires_grad_() for a in (q, k, v, w)]
    _check_fwd_bwd(args)
    q, k, v, w = (a.detach() for a in _inputs(1, 5, 5, 1, 2, 1, 3))
    k[0, 2, 2] = 1e4
    w.fill_(-2e4)
    args = [a.float().requires_grad_() for a in (q, k, v, w)]
    _check_fwd_bwd(args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_finite_and_close(dtype):
    q, k, v, w = (a.detach() for a in _inputs(2, 5, 6, 2, 4, 1, 3))
    args = [a.to(dtype).requires_grad_() for a in (q, k * 1e4, v, w * 1e4)]
    _check_fwd_bwd(args)


def test_padding():
    args = _inputs(2, 4, 5, 2, 3, 1, 3)
    mask = torch.rand(2, 4, 5, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[1] = False  # an image with no valid position: zeros, never NaN
    _check_fwd_bwd(args, padding_mask=mask)
    y = aft_conv2d(*args, padding_mask=mask)
    assert (y[1] == 0).all()
    q, k, v, w = (a.detach() for a in args)
    k2 = k.masked_fill(~mask[..., None, None], 1e4)
    assert_close("y", aft_conv2d(q, k2, v, w, padding_mask=mask), y)


def test_bad_input_errors_name_argument_and_shapes():
    q, k, v, w = (a.detach() for a in _inputs(2, 3, 4, 2, 3, 1, 3))
    with pytest.raises(ValueError, match=r"odd size.*'w' of shape \(2, 4, 4\)"):
        aft_conv2d(q, k, v, torch.zeros(2, 4, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"'w' must be square \(h, s, s\), got \(2, 3, 5\)"):
        aft_conv2d(q, k, v, torch.zeros(2, 3, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"'q' must have 5 dimensions.*got 4"):
        aft_conv2d(q[:, 0], k, v, w)
    with pytest.raises(
        ValueError, match=r"'k' must have shape \(2, 3, 4, 2, 1\) or .*got \(2, 3, 4, 2, 2\)"
    ):
        aft_conv2d(q, torch.zeros(2, 3, 4, 2, 2, dtype=F64), v, w)
    with pytest.raises(
        ValueError,
        match=r"'padding_mask' must have 3 dimensions \(2, 3, 4\), got 2 with shape \(2, 12\)",
    ):
        aft_conv2d(q, k, v, w, padding_mask=torch.ones(2, 12, dtype=torch.bool))


@pytest.mark.parametrize("qshape", [(2, 4, 4, 3, 0), (2, 4, 4, 0, 2), (0, 4, 4, 3, 2)])
def test_empty_channels_heads_or_batch(qshape):
    """c = 0, h = 0 or B = 0: an empty output of the right shape, and a backward that works."""
    q, v = (torch.randn(qshape, requires_grad=True) for _ in range(2))
    k = torch.randn(*qshape[:4], 1, requires_grad=True)
    w = torch.randn(qshape[3], 3, 3, requires_grad=True)
    y = aft_conv2d(q, k, v, w)
    assert y.shape == qshape
    y.sum().backward()
    assert [x.grad.shape for x in (q, k, v, w)] == [q.shape, k.shape, v.shape, w.shape]


@pytest.mark.parametrize("geometry", ["1d-causal", "2d"])
def test_op_registration(geometry):
    """``torch.library.opcheck`` of ``aftlab::aft_conv`` and its backward op (the PyTorch
    implementation of 1-D and 2-D AFT-conv: schema, fake tensors with their strides, autograd,
    AOT dispatch), with a transposed ``q`` and one key channel per head."""
    g = torch.Generator().manual_seed(0)
    H, W, s = (3, 4, 3) if geometry == "2d" else (1, 7, 4)
    q = torch.randn(2, W, H, 2, 3, generator=g, dtype=F64).transpose(1, 2)  # not contiguous
    k = torch.randn(2, H, W, 2, 1, generator=g, dtype=F64)
    v = torch.randn(2, H, W, 2, 3, generator=g, dtype=F64)
    w = torch.randn(2, s * s if geometry == "2d" else s, generator=g, dtype=F64)
    mask = torch.ones(2, H, W, dtype=torch.bool)
    mask[1, :, -2:] = False
    geo = (s, geometry == "1d-causal", geometry == "2d")
    fwd = [x.requires_grad_() for x in (q, k, v, w)] + [mask, *geo]
    torch.library.opcheck(torch.ops.aftlab.aft_conv.default, fwd, test_utils=OPCHECK)
    with torch.no_grad():
        y, Z, O = torch.ops.aftlab.aft_conv(*fwd)
    bwd = (torch.randn_like(y), q.detach(), k.detach(), v.detach(), w.detach(), mask, Z, O, *geo)
    torch.library.opcheck(torch.ops.aftlab.aft_conv_backward.default, bwd, test_utils=OPCHECK)
