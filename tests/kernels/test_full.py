"""The fused AFT-full kernel (``aftlab::full``, ``csrc/full.cpp``) against the float64 reference.

Forward and the gradients of q, k, v and w, causal and not, on odd sizes, with padding, keys and
biases of 1e4 (the exact path), keys that move the causal key shift (epochs), values at the
float32 maximum, half precision, gradcheck and ``torch.compile(fullgraph=True)``.
"""

import importlib

import pytest
import torch

from aftlab import kernels
from aftlab.ops import aft_full
from aftlab.ops.aft_full import aft_full_reference
from aftlab.testing import assert_close

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"kernels unavailable: {kernels.status()['aft_full'][1]}"
)

F64 = torch.float64
aft_full_module = importlib.import_module("aftlab.ops.aft_full")


@pytest.fixture(autouse=True)
def _kernel_one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with kernels.use_kernels(True):
        yield
    torch.set_num_threads(n)


def _inputs(B, T, d, *, scale=1.0, wscale=1.0, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, d, generator=g, dtype=F64) for _ in range(3))
    w = wscale * torch.randn(T + 2, T + 2, generator=g, dtype=F64)
    return [x.to(dtype) for x in (q, scale * k, v, w)]


def _mask(B, T, seed=2):
    m = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.3
    m[0, : min(3, T)] = False  # causal: the first queries of row 0 see no key
    return m


def _check(inputs, causal, mask=None, **tol):
    """y and dq, dk, dv, dw against the float64 reference (same rounded inputs)."""
    xs = [x.clone().requires_grad_() for x in inputs]
    rs = [x.detach().double().requires_grad_() for x in inputs]
    y = aft_full(*xs, causal=causal, padding_mask=mask)
    assert "aftlab_full" in y.grad_fn.name() or inputs[0].dtype in (torch.float16, torch.bfloat16)
    ref = aft_full_reference(*rs, causal=causal, padding_mask=mask)
    assert y.dtype == inputs[0].dtype
    assert_close("y", y, ref, **tol)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad((y * g.to(y.dtype)).sum(), xs)
    want = torch.autograd.grad((ref * g).sum(), rs)
    for name, a, b in zip(("dq", "dk", "dv", "dw"), got, want, strict=True):
        assert torch.isfinite(a).all(), f"{name} not finite"
        assert_close(name, a, b, **tol)


def _exact_rows(q, k, v, w, causal, block=256, mask=None):
    T = q.shape[1]
    return int(torch.ops.aftlab.full(q, k, v, w[:T, :T], mask, causal, block, False)[3].sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_matches_reference(causal, T, dtype):
    _check(_inputs(2, T, 5, dtype=dtype), causal, _mask(2, T) if T > 2 else None)


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence(causal):
    """T = 1000: causal blocks of 256 rows, the last one partial."""
    _check(_inputs(1, 1000, 3, dtype=torch.float32), causal, _mask(1, 1000))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal, monkeypatch):
    monkeypatch.setattr(aft_full_module, "_KERNEL_CAUSAL_BLOCK", (2, 2))  # blocks of 2 rows
    mask = torch.tensor([[True, False, True, True, False, True, True], [False] * 3 + [True] * 4])
    xs = [x.requires_grad_() for x in _inputs(2, 7, 3)]
    f = lambda *a: aft_full(*a, causal=causal, padding_mask=mask)  # noqa: E731
    assert torch.autograd.gradcheck(f, xs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_huge_keys_and_biases_take_the_exact_path(causal, dtype, monkeypatch):
    """Keys and biases of 1e4: the factorised denominator underflows (its shift m^w_t + m^K is
    far above max_t' (K_t' + w_{t,t'})); those rows are exact in the compute dtype."""
    monkeypatch.setattr(aft_full_module, "_KERNEL_CAUSAL_BLOCK", (8, 8))
    q, k, v, w = _inputs(2, 33, 5, scale=1e4, wscale=1e4)
    k[:, -1] = 2e4
    k, w = k.round(), w.round()  # a grid float32 holds exactly: both sides see the same inputs
    q, k, v, w = (x.to(dtype) for x in (q, k, v, w))
    assert _exact_rows(q, k, v, w, causal, block=8) > 0
    _check([q, k, v, w], causal)


def test_keys_that_move_the_shift(monkeypatch):
    """Rising keys move causal blocks' key shifts (X is recomputed: epochs); a key far above
    its block's shift is unsafe (exact path from it on). Forward, gradients and causality."""
    monkeypatch.setattr(aft_full_module, "_KERNEL_CAUSAL_BLOCK", (4, 4))
    q, k, v, w = _inputs(2, 30, 3)
    k = k + torch.arange(30, dtype=F64)[None, :, None] * 9.0  # +36 per block of 4
    k[1, 13] += 80.0  # unsafe in row 1
    assert _exact_rows(q, k, v, w, True, block=4) > 0
    shifts = torch.ops.aftlab.full(q, k, v, w[:30, :30], None, True, 4, False)[5]
    assert not torch.equal(shifts[2], shifts[3])  # the key shift moved: X was recomputed
    _check([q, k, v, w], True)
    y0 = aft_full(q, k, v, w, causal=True)
    for p in (5, 8, 14):
        k2 = k.clone()
        k2[:, p] += 100.0
        assert torch.equal(aft_full(q, k2, v, w, causal=True)[:, :p], y0[:, :p])


@pytest.mark.parametrize("causal", [False, True])
def test_values_at_the_float32_maximum_stay_finite(causal):
    big = torch.finfo(torch.float32).max
    q, k, v, w = _inputs(2, 40, 3, dtype=torch.float32)
    u = torch.rand(v.shape, generator=torch.Generator().manual_seed(3))
    v = torch.where(v > 0, big, -big) * u
    v[:, ::3] = big
    y = aft_full(q, k, v, w, causal=causal)
    assert torch.isfinite(y).all()
    assert_close("y", y, aft_full_reference(q, k, v, w, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(causal, dtype):
    q, k, v, w = _inputs(2, 40, 5, scale=100.0, wscale=100.0)
    _check([x.to(dtype) for x in (q, k, v, w)], causal, _mask(2, 40))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_op_registration(causal):
    """``torch.library.opcheck`` of ``aftlab::full`` and ``full_backward`` with a transposed
    ``w``: the C++ ops return contiguous tensors, and so must their fake implementations."""
    q, k, v, w = _inputs(2, 9, 3)
    wt = w[:9, :9].t()  # not contiguous
    fwd = [x.requires_grad_() for x in (q, k, v, wt)] + [None, causal, 4, True]
    torch.library.opcheck(torch.ops.aftlab.full.default, fwd)
    with torch.no_grad():
        _, a, inv, fb, _, sh = torch.ops.aftlab.full(*fwd)
    gy = torch.randn_like(q)
    bwd = (gy, q.detach(), k.detach(), v.detach(), wt.detach(), None, a, inv, fb, sh, causal, 4)
    torch.library.opcheck(torch.ops.aftlab.full_backward.default, bwd)


def test_compile_fullgraph_equals_eager():
    q, k, v, w = (x.requires_grad_() for x in _inputs(2, 33, 5))
    mask = _mask(2, 33)
    g = torch.randn(2, 33, 5, dtype=F64)
    for causal in (False, True):
        fn = lambda q, k, v, w, c=causal: aft_full(q, k, v, w, causal=c, padding_mask=mask)  # noqa: E731
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        y, yc = fn(q, k, v, w), compiled(q, k, v, w)
        assert torch.equal(y, yc), causal
        grads = torch.autograd.grad((y * g).sum(), (q, k, v, w))
        grads_c = torch.autograd.grad((yc * g).sum(), (q, k, v, w))
        for a, b in zip(grads, grads_c, strict=True):
            assert torch.equal(a, b), causal
