"""The fused band kernel (``aftlab::band``) against the float64 references of aft-local/aft-conv.

``aftlab.kernels.band.local`` has the semantics of ``aft_local_band`` and ``conv1d`` those of
``aft_conv`` (1-D); both are checked forward and backward (dq, dk, dv and the bias gradient)
against ``aft_local_reference`` / ``aft_conv_reference``, causal and not, with padding.
"""

import pytest
import torch

from aftlab import kernels
from aftlab.kernels import band
from aftlab.ops.aft_conv import aft_conv_reference
from aftlab.ops.aft_local import aft_local_reference, band_of
from aftlab.testing import assert_close

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"kernels unavailable: {kernels.status()['aft_simple'][1]}"
)

F64 = torch.float64


def _local_inputs(B, T, d, *, scale=1.0, wscale=1.0, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, d, generator=g, dtype=F64) for _ in range(3))
    w = wscale * torch.randn(T, T, generator=g, dtype=F64)
    return [x.to(dtype).requires_grad_() for x in (q, scale * k, v, w)]


def _local(q, k, v, w, window, causal, mask=None):
    """The kernel with the full bias ``w (T, T)`` (its band gathered differentiably)."""
    T = q.shape[1]
    w_band = band_of(w, T, max(window, 1), causal=causal)
    return band.local(q, k, v, w_band, window, causal=causal, padding_mask=mask)


def _check_local(args, window, causal, mask=None, grads=True, **tol):
    q, k, v, w = args
    y = _local(q, k, v, w, window, causal, mask)
    ref = aft_local_reference(q, k, v, w, window, causal=causal, padding_mask=mask)
    assert y.dtype == q.dtype
    assert_close("y", y, ref, **tol)
    if grads:
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        opt = {"allow_unused": True, "materialize_grads": True}  # window 0 ignores w
        got = torch.autograd.grad((y * g.to(y.dtype)).sum(), args, **opt)
        want = torch.autograd.grad((ref * g).sum(), args, **opt)
        for name, a, b in zip(("dq", "dk", "dv", "dw"), got, want, strict=True):
            assert_close(name, a, b, **tol)


def _conv_inputs(B, T, h, c, ck, s, *, scale=1.0, wscale=1.0, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, v = (torch.randn(B, T, h, c, generator=g, dtype=F64) for _ in range(2))
    k = scale * torch.randn(B, T, h, ck, generator=g, dtype=F64)
    w = wscale * torch.randn(h, s, generator=g, dtype=F64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, w)]


def _check_conv(args, causal, mask=None, **tol):
    y = band.conv1d(*args, causal=causal, padding_mask=mask)
    ref = aft_conv_reference(*args, causal=causal, padding_mask=mask)
    assert y.dtype == args[0].dtype
    assert_close("y", y, ref, **tol)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad((y * g.to(y.dtype)).sum(), args)
    want = torch.autograd.grad((ref * g).sum(), args)
    for name, a, b in zip(("dq", "dk", "dv", "dw"), got, want, strict=True):
        assert_close(name, a, b, **tol)


def _mask(B, T, seed=2):
    m = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.3
    m[0, : min(3, T)] = False  # causal: the first queries of row 0 see no key
    return m


# ----------------------------------------------------------------------- against the references
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("window", [0, 1, 2, 5, 32, 300])
def test_local_matches_reference(causal, T, window):
    args = _local_inputs(2, T, 3)
    _check_local(args, window, causal, _mask(2, T) if T > 2 else None)


@pytest.mark.parametrize("causal", [True, False])
def test_local_long_sequence(causal):
    _check_local(_local_inputs(1, 1000, 3), 5, causal, _mask(1, 1000))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("s", [1, 3, 5, 31])
@pytest.mark.parametrize("ck", [1, 3])
def test_conv_matches_reference(causal, T, s, ck):
    B = 1 if T > 100 else 2  # the reference is O(B T^2)
    args = _conv_inputs(B, T, 2, 3, ck, s)
    _check_conv(args, causal, _mask(B, T) if T > 2 else None)


def test_conv_even_causal_kernel_and_long_sequence():
    _check_conv(_conv_inputs(1, 1000, 2, 3, 1, 4), True, _mask(1, 1000))
    _check_conv(_conv_inputs(1, 1000, 3, 1, 1, 7), False)  # c = 1: one key per channel


def test_conv_non_causal_even_kernel_is_refused():
    q, k, v, w = _conv_inputs(1, 5, 2, 3, 1, 4)
    with pytest.raises(ValueError, match="odd"):
        band.conv1d(q, k, v, w)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck(causal):
    mask = torch.tensor([[True, False, True, True, False, True, True], [False] * 3 + [True] * 4])
    q, k, v, w = _local_inputs(2, 7, 3)
    for window in (0, 2, 9):
        assert torch.autograd.gradcheck(
            lambda q, k, v, w, window=window: _local(q, k, v, w, window, causal, mask),
            (q, k, v, w),
        )
    for ck in (1, 2):
        args = _conv_inputs(2, 7, 2, 2, ck, 3)
        assert torch.autograd.gradcheck(
            lambda q, k, v, w: band.conv1d(q, k, v, w, causal=causal, padding_mask=mask),
            tuple(args),
        )


# ----------------------------------------------------------------------- padding
@pytest.mark.parametrize("causal", [True, False])
def test_queries_without_keys_get_zero_and_padding_is_ignored(causal):
    B, T = 3, 9
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False  # causal: queries 0..3 see no key
    mask[1] = False  # no key at all
    mask[2, 5:] = False
    q, k, v, w = _local_inputs(B, T, 5)
    _check_local([q, k, v, w], 3, causal, mask)
    y = _local(q, k, v, w, 3, causal, mask)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    if causal:
        assert torch.equal(y[0, :4], torch.zeros_like(y[0, :4]))
    # garbage (huge, NaN) at padded positions changes nothing, forward or backward
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[~mask], v2[~mask] = 1e30, float("nan")
    k2.requires_grad_(), v2.requires_grad_()
    y2 = _local(q, k2, v2, w, 3, causal, mask)
    assert torch.equal(y2, y)
    dk, dv = torch.autograd.grad(y2.sum(), (k2, v2))
    assert torch.equal(dk[~mask], torch.zeros_like(dk[~mask]))
    assert torch.isfinite(dv).all() and torch.isfinite(dk).all()
    args = _conv_inputs(B, T, 2, 3, 1, 3)
    _check_conv(args, causal, mask)


# ----------------------------------------------------------------------- numerics
@pytest.mark.parametrize("causal", [True, False])
def test_magnitudes_1e4_float32(causal):
    """|k|, |w| ~ 1e4: the log domain is float64, so float32 keeps its usual tolerance."""
    args = _local_inputs(2, 40, 5, scale=1e4, wscale=1e4, dtype=torch.float32)
    with torch.no_grad():
        args[1][:, -1] = 3e4
    _check_local(args, 3, causal)
    args = _local_inputs(2, 40, 5, dtype=torch.float32)
    with torch.no_grad():
        args[1] += 1e4  # many comparable terms near 1e4
    _check_local(args, 4, causal)
    for spread in (True, False):
        a = _conv_inputs(2, 40, 2, 3, 1, 5, scale=1e4 if spread else 1.0, dtype=torch.float32)
        with torch.no_grad():
            if spread:
                a[3].mul_(1e4)
            else:
                a[1].add_(1e4)
        _check_conv(a, causal)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("causal", [True, False])
def test_local_factorised_and_exact_rows_in_one_sequence(dtype, causal):
    """The forward factorises exp(k + w) over (band key, channel) with a per-channel shift b.

    Rising keys raise the causal b at almost every step (the ring's exp(k - b) are recomputed);
    a key of 100 before a band whose biases reach 100 on small keys leaves the factorised den
    below its floor (exp(-100) flushes in float32), so those rows take the exact path. Two
    such segments: the exact rows' prefix state is folded lazily, brought up to each exact row
    from where the last one left it, while the factorised rows keep the prefix in the shift b.
    """
    T, d = 200, 5
    q, k, v, w = (x.detach() for x in _local_inputs(2, T, d, dtype=dtype, seed=3))
    t = torch.arange(T, dtype=dtype)
    k = k + (0.05 * t)[None, :, None]  # rising keys
    k[:, 60] = 100.0
    w[120:140] += 100.0 * (torch.rand(20, T, generator=torch.Generator().manual_seed(4)) > 0.5)
    w[170:180] += 100.0 * (torch.rand(10, T, generator=torch.Generator().manual_seed(5)) > 0.5)
    args = [x.requires_grad_() for x in (q, k, v, w)]
    _check_local(args, 8, causal, _mask(2, T))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("causal", [True, False])
def test_local_backward_blocks_with_key_jumps_inside_and_across_blocks(dtype, causal):
    """The backward's band runs by blocks of 64 queries with one shift per block (the largest
    key before the block, causal). A key 30 above it inside a block sends the queries from it
    on to the exact path; a lasting rise of 20 from position 150 raises the next blocks' shift;
    keys 40 below everything before them (position 230 on) underflow their e_u, which only the
    exact sums may then carry. The window (40) spans block boundaries; padding as elsewhere."""
    T, d = 300, 5
    q, k, v, w = (x.detach() for x in _local_inputs(2, T, d, dtype=dtype, seed=7))
    k[:, 100] += 30.0
    k[:, 150:] += 20.0
    k[:, 230:] -= 60.0
    args = [x.requires_grad_() for x in (q, k, v, w)]
    _check_local(args, 40, causal, _mask(2, T))


@pytest.mark.parametrize("causal", [True, False])
def test_near_float32_max_stays_finite(causal):
    big = torch.finfo(torch.float32).max
    q, k, v, w = (x.detach() for x in _local_inputs(2, 20, 3, dtype=torch.float32))
    k = (k.sign() * big * 0.9).requires_grad_()
    w = (w.sign() * big * 0.9).requires_grad_()
    v.requires_grad_()
    y = _local(q, k, v, w, 3, causal)
    ref = aft_local_reference(q, k, v, w, 3, causal=causal)
    assert torch.isfinite(y).all()
    assert_close("y", y, ref)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(y.sum(), (k, v, w)))


@pytest.mark.parametrize("causal", [True, False])
def test_values_near_float32_max_give_finite_outputs(causal):
    """|v| up to finfo.max: values are summed times 2^-e (2^e >= T + 1), the mean is clamped.

    Regression: the band's weighted sums of values ~1e38 overflowed to inf (found by the
    property tests: aft_conv, (B, T, h, c) = (1, 17, 2, 1), non-causal, v ~ 1e38).
    """
    big = torch.finfo(torch.float32).max
    q, k, v, w = (x.detach() for x in _local_inputs(2, 17, 3, dtype=torch.float32))
    v = (v / v.abs().max()) * big  # one value at +-finfo.max per tensor, the rest near it
    y = _local(q, k, v, w, 4, causal)
    assert torch.isfinite(y).all()
    assert_close("y", y, aft_local_reference(q, k, v, w, 4, causal=causal))
    for ck in (1, 3):
        q, k, v, w = (x.detach() for x in _conv_inputs(1, 17, 2, 3, ck, 5, dtype=torch.float32))
        v = v.sign() * big * 0.99
        y = band.conv1d(q, k, v, w, causal=causal)
        assert torch.isfinite(y).all()
        assert_close("y", y, aft_conv_reference(q, k, v, w, causal=causal))
    # a mean of values all at finfo.max stays finite (the clamp removes the last rounding)
    q, k, v, w = (x.detach() for x in _local_inputs(1, 33, 4, dtype=torch.float32))
    y = _local(torch.full_like(q, 100.0), k, torch.full_like(v, big), w, 5, causal)
    assert torch.isfinite(y).all()
    assert_close("y", y, torch.full_like(y, big))


@pytest.mark.parametrize("which", ["k", "v"])
def test_causal_gradients_before_p_ignore_an_input_at_p(which):
    """Loss = the outputs before p: the gradients before p (and dw) are bit-identical.

    Queries t >= p have no upstream gradient; they must not enter the backward's scans over
    queries (their shift -M_t changed the rounding) nor the band ring (0 * NaN). Regression.
    """
    T, p = 80, 37

    def grads(f, xs, bad):
        xs = [x.detach().clone() for x in xs]
        if bad is not None:
            xs["qkv".index(which)][:, p] = bad
        xs = [x.requires_grad_() for x in xs]
        return torch.autograd.grad(f(*xs)[:, :p].sum(), xs)

    local = _local_inputs(2, T, 5, dtype=torch.float32)
    cases = [(lambda q, k, v, w, s=s: _local(q, k, v, w, s, True), local) for s in (6, T)]
    for ck in (1, 3):  # one key per head, one per channel
        args = _conv_inputs(2, T, 2, 3, ck, 7, dtype=torch.float32)
        cases.append((lambda q, k, v, w: band.conv1d(q, k, v, w, causal=True), args))
    for f, xs in cases:
        g0 = grads(f, xs, None)
        for bad in (float("nan"), float("inf"), float("-inf"), 1e3, -7.5):
            got = grads(f, xs, bad)
            for name, a, b in zip(("dq", "dk", "dv"), got[:3], g0[:3], strict=True):
                assert torch.equal(a[:, :p], b[:, :p]), f"{name} moved with {which}[{p}]={bad}"
            assert torch.equal(got[3], g0[3]), f"dw moved with {which}[{p}]={bad}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_half_precision(dtype, causal):
    q, k, v, w = _local_inputs(2, 30, 5, scale=100.0, wscale=100.0, dtype=dtype)
    y = _local(q, k, v, w, 4, causal)
    assert y.dtype == dtype
    assert_close("y", y, aft_local_reference(q, k, v, w, 4, causal=causal))
    dq, dk, dv, dw = torch.autograd.grad(y.float().sum(), (q, k, v, w))
    assert dk.dtype == dtype and dw.dtype == dtype
    args = _conv_inputs(2, 30, 2, 4, 1, 5, scale=100.0, dtype=dtype)
    y = band.conv1d(*args, causal=causal)
    assert y.dtype == dtype
    assert_close("y", y, aft_conv_reference(*args, causal=causal))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_causal_outputs_before_a_bad_key_or_value_are_bit_identical(bad):
    T, p = 50, 23
    q, k, v, w = (x.detach() for x in _local_inputs(2, T, 5, dtype=torch.float32))
    y = _local(q, k, v, w, 4, True)
    for which in ("k", "v"):
        k2, v2 = k.clone(), v.clone()
        (k2 if which == "k" else v2)[:, p] = bad
        y2 = _local(q, k2, v2, w, 4, True)
        assert torch.equal(y2[:, :p], y[:, :p]), which
        ref = aft_local_reference(q, k2, v2, w, 4, causal=True)
        assert torch.equal(y2.isnan(), ref.isnan()), which  # NaN exactly where the reference
    q, k, v, w = (x.detach() for x in _conv_inputs(2, T, 2, 3, 1, 5, dtype=torch.float32))
    y = band.conv1d(q, k, v, w, causal=True)
    k2 = k.clone()
    k2[:, p] = bad
    y2 = band.conv1d(q, k2, v, w, causal=True)
    assert torch.equal(y2[:, :p], y[:, :p])
    assert torch.equal(y2.isnan(), aft_conv_reference(q, k2, v, w, causal=True).isnan())


def test_forward_only_saves_nothing_and_equals_the_training_forward():
    q, k, v, w = _local_inputs(2, 33, 5, dtype=torch.float32)
    wb = band_of(w, 33, 4, causal=True)[:, None]
    y, mx, iv = torch.ops.aftlab.band(
        q.detach(), k.detach(), v.detach(), wb.detach(), 3, 0, True, None, False
    )
    assert mx.numel() == 0 and iv.numel() == 0
    assert torch.equal(y, _local(q, k, v, w, 4, True))


def test_deterministic_with_two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            args = _local_inputs(3, 300, 37, dtype=torch.float32)
            cargs = _conv_inputs(3, 300, 4, 9, 1, 31, dtype=torch.float32)
            runs = []
            for _ in range(2):
                y = _local(*args, 32, True)
                yc = band.conv1d(*cargs, causal=True)
                runs.append([y, yc, *torch.autograd.grad((y.sum() + yc.sum()), args + cargs)])
            for a, b in zip(*runs, strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_compile_fullgraph_equals_eager():
    args = _local_inputs(2, 17, 5)
    cargs = _conv_inputs(2, 17, 2, 3, 1, 5)

    def fn(q, k, v, w, cq, ck, cv, cw):
        w_band = band_of(w, 17, 4, causal=True)
        y = band.local(q, k, v, w_band, 4, causal=True)
        return y, band.conv1d(cq, ck, cv, cw)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    ins = args + cargs
    out, out_c = fn(*ins), compiled(*ins)
    for a, b in zip(out, out_c, strict=True):
        assert torch.equal(a, b)
    loss = sum(o.sum() for o in out)
    loss_c = sum(o.sum() for o in out_c)
    for a, b in zip(torch.autograd.grad(loss, ins), torch.autograd.grad(loss_c, ins), strict=True):
        assert torch.equal(a, b)
