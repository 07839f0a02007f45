"""The fast chunked scan against the sequential float64 reference, forward and backward."""

import pytest
import torch

import aftlab.ops.scan as scan
from aftlab.ops.scan import stable_prefix_average, stable_prefix_average_reference
from aftlab.testing import assert_close

F64 = torch.float64


def _inputs(B, T, d, *, scale=5.0, dtype=F64, grad=True):
    k = (torch.randn(B, T, d, dtype=F64) * scale).to(dtype).requires_grad_(grad)
    v = torch.randn(B, T, d, dtype=F64).to(dtype).requires_grad_(grad)
    return k, v


def _finite(L):
    """L with -inf (no key yet) replaced by 0, for comparisons and losses."""
    return torch.where(torch.isfinite(L), L, torch.zeros_like(L))


def _compare(
    k, v, *, decay=None, reverse=False, padding_mask=None, atol=None, rtol=None, loose=()
):
    """Forward and backward of the fast op against the float64 reference on the same inputs."""
    L, A = stable_prefix_average(k, v, decay=decay, reverse=reverse, padding_mask=padding_mask)
    kd, vd = k.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    dd = None if decay is None else decay.detach().double().requires_grad_()
    L0, A0 = stable_prefix_average_reference(
        kd, vd, decay=dd, reverse=reverse, padding_mask=padding_mask
    )
    assert torch.equal(torch.isfinite(L), torch.isfinite(L0)), "-inf pattern of L differs"
    assert_close("L", _finite(L), _finite(L0), atol=atol, rtol=rtol)
    assert_close("A", A, A0, atol=atol, rtol=rtol)
    gL, gA = torch.randn_like(L0), torch.randn_like(A0)
    ins = [k, v] + ([decay] if decay is not None and decay.requires_grad else [])
    ins0 = [kd, vd] + ([dd] if decay is not None and decay.requires_grad else [])
    g = torch.autograd.grad((_finite(L).double() * gL).sum() + (A.double() * gA).sum(), ins)
    g0 = torch.autograd.grad((_finite(L0) * gL).sum() + (A0 * gA).sum(), ins0)
    for name, a, e in zip(["dk", "dv", "ddecay"][: len(g)], g, g0, strict=True):
        assert torch.isfinite(a).all(), f"{name} not finite"
        if name not in loose:
            assert_close(name, a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("T", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_decay", [False, True])
def test_matches_reference_forward_backward(T, reverse, with_decay):
    k, v = _inputs(2, T, 5)
    decay = torch.rand(5, dtype=F64, requires_grad=True) if with_decay else None
    _compare(k, v, decay=decay, reverse=reverse)


@pytest.mark.parametrize("chunk", [2, 3])
def test_deep_recursion_and_ragged_chunks(monkeypatch, chunk):
    # Tiny chunks force several levels of chunk summaries and a padded last chunk.
    monkeypatch.setattr(scan, "_chunk_size", lambda T: min(T, chunk))
    k, v = _inputs(2, 23, 3)
    mask = torch.rand(2, 23) > 0.4
    _compare(k, v, decay=torch.rand(3, dtype=F64, requires_grad=True), padding_mask=mask)
    _compare(k, v, reverse=True)


def test_gradcheck_float64():
    k, v = _inputs(1, 10, 2, scale=2.0)  # T = 10: two chunks of 8, the second ragged
    decay = torch.rand(2, dtype=F64, requires_grad=True)
    mask = torch.tensor([[False, False, True, True, False, True, True, True, False, True]])

    def fn(k, v, decay):
        L, A = stable_prefix_average(k, v, decay=decay, padding_mask=mask)
        return _finite(L), A

    assert torch.autograd.gradcheck(fn, (k, v, decay))
    assert torch.autograd.gradcheck(
        lambda k, v: stable_prefix_average(k, v, reverse=True), (k, v)
    )


@pytest.mark.parametrize("reverse", [False, True])
def test_padding_mask(reverse):
    B, T, d = 3, 40, 4
    k, v = _inputs(B, T, d)
    mask = torch.rand(B, T) > 0.5
    mask[1] = False  # a row without any valid key
    mask[2, :20] = False  # a long prefix without keys
    _compare(k, v, decay=torch.rand(d, dtype=F64), reverse=reverse, padding_mask=mask)
    L, A = stable_prefix_average(k, v, reverse=reverse, padding_mask=mask)
    assert torch.isneginf(L[1]).all() and (A[1] == 0).all()
    # Padded keys and values do not matter, even huge ones.
    k2 = k.detach().masked_fill(~mask[:, :, None], 1e4)
    v2 = v.detach().masked_fill(~mask[:, :, None], -1e4)
    L2, A2 = stable_prefix_average(k2, v2, reverse=reverse, padding_mask=mask)
    assert torch.equal(A2, A.detach())
    assert torch.equal(L2, L.detach())


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_huge_keys_and_values(dtype):
    # exp(1e4) overflows even float64; the scan only exponentiates non-positive numbers.
    k, v = _inputs(2, 70, 3, scale=1e4, dtype=dtype)
    v = (v.detach() * 1e4).requires_grad_()
    decay = torch.rand(3, dtype=dtype) * 10
    # float32 keys of size 1e4 carry an absolute error ~1e-3 into every exponent.
    # float32: keys of 1e4 carry ~1e-3 absolute error into every exponent; dlambda sums terms
    # of size ~|v| that cancel, so in float32 it is only checked finite (float64 checks it).
    tol = {"atol": 1e-6, "rtol": 1e-8} if dtype == F64 else {"atol": 20.0, "rtol": 1e-2}
    _compare(k, v, decay=decay, loose=() if dtype == F64 else ("ddecay",), **tol)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_increasing_keys_largest_last(dtype):
    # A causal output must not be normalised by future keys: with keys rising to 1e4, a global
    # maximum would underflow every early term to 0/0.
    T = 100
    k = torch.linspace(0, 1e4, T, dtype=dtype)[None, :, None].expand(2, T, 3).contiguous()
    v = torch.randn(2, T, 3, dtype=dtype)
    L, A = stable_prefix_average(k, v)
    assert torch.isfinite(L).all() and torch.isfinite(A).all()
    assert_close("A_0", A[:, 0], v[:, 0])
    assert_close("L_0", L[:, 0], k[:, 0])
    # Steps of ~101 between keys: each position is its own value up to exp(-101).
    assert_close("A", A, v, atol=1e-6, rtol=1e-6)


def test_huge_decay():
    k, v = _inputs(2, 33, 3)
    decay = torch.tensor([1e4, 1e30, 0.5], dtype=F64)
    _compare(k, v, decay=decay.requires_grad_())
    L, A = stable_prefix_average(k, v, decay=decay)
    assert_close("A (no memory)", A[..., :2], v[..., :2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [3.0, 1e4])
def test_low_precision_inputs(dtype, scale):
    k, v = _inputs(2, 50, 5, scale=scale, dtype=dtype, grad=False)
    decay = torch.rand(5).to(dtype)
    L, A = stable_prefix_average(k, v, decay=decay)
    assert L.dtype == dtype and A.dtype == dtype
    L0, A0 = stable_prefix_average_reference(k.double(), v.double(), decay=decay.double())
    assert_close("A", A, A0)
    # L is rounded to the output dtype: relative error of its ulp.
    assert_close("L", L, L0, atol=1e-2, rtol=1e-2)


def test_low_precision_backward_is_finite():
    k = (torch.randn(2, 40, 3) * 1e4).to(torch.bfloat16).requires_grad_()
    v = torch.randn(2, 40, 3).to(torch.bfloat16).requires_grad_()
    L, A = stable_prefix_average(k, v)
    (L.float().sum() + A.float().sum()).backward()
    assert k.grad.dtype == torch.bfloat16 and torch.isfinite(k.grad).all()
    assert torch.isfinite(v.grad).all()


def test_empty_sequence():
    L, A = stable_prefix_average(torch.zeros(2, 0, 3), torch.zeros(2, 0, 3))
    assert L.shape == (2, 0, 3) and A.shape == (2, 0, 3)


def test_bad_inputs():
    k, v = torch.zeros(2, 5, 3), torch.zeros(2, 5, 3)
    with pytest.raises(ValueError, match="'k'"):
        stable_prefix_average(torch.zeros(5, 3), v)
    with pytest.raises(ValueError, match="'v'"):
        stable_prefix_average(k, torch.zeros(2, 5, 4))
    with pytest.raises(TypeError, match="'v'"):
        stable_prefix_average(k, v.double())
    with pytest.raises(TypeError, match="'k'"):
        stable_prefix_average(k.long(), v)
    with pytest.raises(ValueError, match="'decay'"):
        stable_prefix_average(k, v, decay=torch.zeros(4))
    with pytest.raises(ValueError, match="'decay'"):
        stable_prefix_average(k, v, decay=torch.tensor([0.0, -1.0, 0.0]))
    with pytest.raises(ValueError, match="'decay'"):
        stable_prefix_average(k, v, decay=torch.tensor([0.0, float("inf"), 0.0]))
    with pytest.raises(ValueError, match="'padding_mask'"):
        stable_prefix_average(k, v, padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="'padding_mask'"):
        stable_prefix_average(k, v, padding_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="'v'"):
        stable_prefix_average(k, torch.zeros(2, 5, 3, device="meta"))


# ----------------------------------------------------------------------------- numerical range
MAX32 = torch.finfo(torch.float32).max


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("frac", [-1.0, -0.3, -0.25, 1.0])
def test_single_key_whatever_its_value(dtype, frac):
    # A finite "no key yet" log-sum (-max/4) gave keys below about -max/8 weight 0.
    key = frac * torch.finfo(dtype).max
    k, v = torch.full((1, 1, 2), key, dtype=dtype), torch.tensor([[[3.0, -2.0]]], dtype=dtype)
    L, A = stable_prefix_average(k, v)
    assert torch.equal(L, k) and torch.equal(A, v)


def test_minus_inf_key_weighs_nothing():
    k = torch.tensor([[[float("-inf")], [1.0]]])
    L, A = stable_prefix_average(k, torch.tensor([[[5.0], [2.0]]]))
    assert torch.equal(L[0, :, 0], torch.tensor([float("-inf"), 1.0]))
    assert torch.equal(A[0, :, 0], torch.tensor([0.0, 2.0]))


def test_all_padded_row_with_huge_decay():
    # exp(-inf - -inf) gave A = NaN on a row without a real token for a decay ~1e38.
    k, v = _inputs(1, 3, 2, dtype=torch.float32)
    decay = torch.tensor([3e38, 1e38], requires_grad=True)
    L, A = stable_prefix_average(k, v, decay=decay, padding_mask=torch.zeros(1, 3, dtype=bool))
    assert torch.equal(A, torch.zeros_like(A)) and (L == float("-inf")).all()
    grads = torch.autograd.grad(A.sum(), (k, v, decay))
    assert all(torch.isfinite(g).all() for g in grads)


def test_decayed_log_sum_is_not_clamped():
    # L_t = k - (t - t') lambda below -max/4 was clamped to -max/4. T = 40: also the chunk
    # level, whose decay 16 lambda overflows float32 although L - 16 lambda does not.
    T = 40
    k = torch.zeros(1, T, 2)
    k[0, 15] = torch.tensor([3e38, 0.0])
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, [0, 15]] = True
    decay = torch.tensor([3e37, 1.3e38])
    v = torch.randn(1, T, 2)
    L, A = stable_prefix_average(k, v, decay=decay, padding_mask=mask)
    L0, A0 = stable_prefix_average_reference(k.double(), v.double(), decay=decay.double(),
                                             padding_mask=mask)
    inside = L0.abs() <= MAX32  # beyond it float32 has only -inf
    assert torch.equal(torch.isfinite(L), inside)
    assert_close("L", L[inside], L0[inside], atol=1e-6 * 3e38)  # float32: eps * |scores|
    assert_close("A", A[inside], A0[inside])  # beyond: see docs/aft-scan.md, "Range"
    assert L[0, 31, 0] == pytest.approx(3e38 - 16 * 3e37, rel=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
def test_values_near_float32_max_of_opposite_signs(reverse):
    # lerp(A, v, r) forms v - A, which overflows (NaN) for values of opposite signs near max.
    T = 7
    v = torch.full((3, T, 1), MAX32)
    v[:, 1::2] = -MAX32
    v[1] *= 0.9
    k = torch.randn(3, T, 1, generator=torch.Generator().manual_seed(0))
    L, A = stable_prefix_average(k, v, reverse=reverse)
    assert torch.isfinite(A).all()
    _, A0 = stable_prefix_average_reference(k.double(), v.double(), reverse=reverse)
    assert_close("A", A, A0, atol=3e33, rtol=1e-5)


def test_compile_fullgraph_equals_eager():
    """No host sync and no graph break: the decay's value check is skipped while tracing, and
    the scan writes no ``out=`` into strided slices (which torch.compile cannot trace)."""
    k, v = _inputs(2, 21, 3)
    decay = torch.rand(3, dtype=F64, requires_grad=True)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, 15:] = False

    def fn(k, v, decay):
        L, A = stable_prefix_average(k, v, decay=decay, padding_mask=mask)
        return _finite(L), A

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(k, v, decay), fn(k, v, decay)
    gs = [torch.randn_like(x) for x in want]
    losses = [sum((x * g).sum() for x, g in zip(out, gs, strict=True)) for out in (got, want)]
    grads = [torch.autograd.grad(loss, (k, v, decay)) for loss in losses]
    for name, a, b in zip(("L", "A", "dk", "dv", "ddecay"), got + grads[0], want + grads[1],
                          strict=True):
        assert_close(name, a, b)


#: opcheck of the PyTorch custom ops without its dynamic-shape trace: their fakes run the ops'
#: loops on symbolic shapes (5-10 s each)
OPCHECK = (
    "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static"
)


def test_op_registration():
    """``torch.library.opcheck`` of ``aftlab::stable_prefix_average`` and its backward op
    (schema, fake tensors with their strides, autograd, AOT dispatch); ``T = 19`` is not a
    multiple of the chunk size, so the outputs are views of padded buffers, in the fakes too."""
    k, v = _inputs(2, 19, 3)
    lam = torch.rand(3, dtype=F64, requires_grad=True)
    op = torch.ops.aftlab.stable_prefix_average
    torch.library.opcheck(op.default, (k, v, lam), test_utils=OPCHECK)
    with torch.no_grad():
        L, A = op(k, v, lam)
    bwd = (torch.randn_like(L), torch.randn_like(A), k.detach(), v.detach(), lam.detach(), L, A)
    torch.library.opcheck(
        torch.ops.aftlab.stable_prefix_average_backward.default, (*bwd, True, True, True),
        test_utils=OPCHECK,
    )
