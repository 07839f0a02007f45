"""aft_simple against its float64 per-position reference; stability; padding; bad input.

Every test runs twice: on the C++ kernel and on the pure-PyTorch implementation.
"""

import functools
import subprocess
import sys
import textwrap

import pytest
import torch

from aftlab.functional import aft_simple
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.testing import assert_close

F64 = torch.float64


OP = "aft_simple"
pytestmark = pytest.mark.usefixtures("impl")  # every implementation (conftest.py)
# gradcheck runs its fast mode (a random projection of the Jacobian) under Triton's interpreter,
# whose every call costs milliseconds: the full Jacobian takes a minute there.


def _qkv(B, T, d, *, kscale=3.0, vscale=1.0, dtype=F64):
    q = torch.randn(B, T, d, dtype=F64)
    k = torch.randn(B, T, d, dtype=F64) * kscale
    v = torch.randn(B, T, d, dtype=F64) * vscale
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _compare(q, k, v, *, causal, padding_mask=None, atol=None, rtol=None):
    y = aft_simple(q, k, v, causal=causal, padding_mask=padding_mask)
    assert y.dtype == q.dtype
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    y0 = aft_simple_reference(*ref_in, causal=causal, padding_mask=padding_mask)
    assert_close("Y", y, y0, atol=atol, rtol=rtol)
    g = torch.randn_like(y0)
    grads = torch.autograd.grad((y.double() * g).sum(), (q, k, v))
    grads0 = torch.autograd.grad((y0 * g).sum(), ref_in)
    for name, a, e in zip(("dq", "dk", "dv"), grads, grads0, strict=True):
        assert torch.isfinite(a).all(), f"{name} not finite"
        assert_close(name, a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("T", [1, 2, 7, 64, 257, 1000])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(T, causal):
    _compare(*_qkv(2 if T < 100 else 1, T, 5), causal=causal)


def test_gradcheck(impl):
    q, k, v = _qkv(1, 9, 2)
    for causal in (False, True):
        fn = functools.partial(aft_simple, causal=causal)
        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=impl == "triton")


def test_gradcheck_padding_mask(impl):
    q, k, v = _qkv(2, 11, 3)
    mask = torch.rand(2, 11) > 0.4
    mask[1, :4] = False
    for causal in (False, True):
        fn = functools.partial(aft_simple, causal=causal, padding_mask=mask)
        assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=impl == "triton")


@pytest.mark.parametrize("causal", [False, True])
def test_float32_odd_channels(causal):
    # d = 259: a full block of 256 channels and a ragged one of 3 (the kernel's channel blocks).
    q, k, v = _qkv(2, 70, 259, dtype=torch.float32)
    mask = torch.rand(2, 70) > 0.2
    _compare(q, k, v, causal=causal, padding_mask=mask, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_causal_later_position_cannot_change_earlier_outputs(bad):
    q, k, v = (t.detach() for t in _qkv(2, 40, 5))
    y = aft_simple(q, k, v, causal=True)
    for x in (q, k, v):
        x2 = x.clone()
        x2[:, 23] = bad
        ins = [x2 if t is x else t for t in (q, k, v)]
        y2 = aft_simple(*ins, causal=True)
        assert torch.equal(y2[:, :23], y[:, :23])


def test_definition_small_case():
    # Y_t = sigma(Q_t) * sum_t' softmax_t'(K) V_t', written out for T = 2, d = 1.
    q = torch.tensor([[[0.3], [-1.0]]], dtype=F64)
    k = torch.tensor([[[1.0], [2.0]]], dtype=F64)
    v = torch.tensor([[[5.0], [-3.0]]], dtype=F64)
    w = torch.softmax(k[0, :, 0], 0)
    full = (w * v[0, :, 0]).sum()
    assert_close("non-causal", aft_simple(q, k, v)[0, :, 0], torch.sigmoid(q[0, :, 0]) * full)
    causal = torch.stack([v[0, 0, 0], full])
    y = aft_simple(q, k, v, causal=True)[0, :, 0]
    assert_close("causal", y, torch.sigmoid(q[0, :, 0]) * causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_huge_keys_and_values(causal, dtype):
    q, k, v = _qkv(2, 70, 3, kscale=1e4, vscale=1e4, dtype=dtype)
    # values ~1e4: absolute errors scale with them (float32: exponents carry ~1e-3 error)
    tol = {"atol": 1e-6, "rtol": 1e-8} if dtype == F64 else {"atol": 20.0, "rtol": 1e-2}
    _compare(q, k, v, causal=causal, **tol)


def test_causal_increasing_keys_largest_last():
    # keys [0, 120] already give 0/0 at t = 0 in float32 when normalised by the global max.
    T = 64
    k = torch.linspace(0, 120, T)[None, :, None].expand(1, T, 4).contiguous()
    q, v = torch.randn(1, T, 4), torch.randn(1, T, 4)
    y = aft_simple(q, k, v, causal=True)
    assert torch.isfinite(y).all()
    assert_close("Y", y, aft_simple_reference(q, k, v, causal=True))
    assert_close("Y_0", y[:, 0], torch.sigmoid(q[:, 0]) * v[:, 0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kscale", [3.0, 1e4])
def test_low_precision(causal, dtype, kscale):
    q, k, v = (t.detach() for t in _qkv(2, 40, 5, kscale=kscale, dtype=dtype))
    y = aft_simple(q, k, v, causal=causal)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert_close("Y", y, aft_simple_reference(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_autocast_bfloat16(causal):
    q, k, v = (torch.randn(2, 30, 4) * s for s in (1.0, 1e3, 1.0))
    w = torch.randn(4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qp, kp, vp = q @ w, k @ w, v @ w  # bfloat16 under autocast
        y = aft_simple(qp, kp, vp, causal=causal)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert_close("Y", y, aft_simple_reference(qp, kp, vp, causal=causal))
    y.float().sum().backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask(causal):
    B, T, d = 3, 33, 5
    q, k, v = _qkv(B, T, d)
    mask = torch.rand(B, T) > 0.4
    mask[1] = False
    mask[2, :10] = False
    _compare(q, k, v, causal=causal, padding_mask=mask)
    y = aft_simple(q, k, v, causal=causal, padding_mask=mask)
    assert (y[1] == 0).all()
    if causal:
        assert (y[2, :10] == 0).all()
    # Padded keys and values change nothing, however large.
    k2 = k.detach().masked_fill(~mask[:, :, None], 1e4)
    v2 = v.detach().masked_fill(~mask[:, :, None], 1e4)
    assert torch.equal(aft_simple(q.detach(), k2, v2, causal=causal, padding_mask=mask), y.detach())


def test_bad_inputs():
    q = torch.zeros(2, 5, 3)
    with pytest.raises(ValueError, match="'q'"):
        aft_simple(torch.zeros(5, 3), q, q)
    with pytest.raises(ValueError, match="'k'"):
        aft_simple(q, torch.zeros(2, 5, 4), q)
    with pytest.raises(ValueError, match="'v'"):
        aft_simple(q, q, torch.zeros(2, 6, 3))
    with pytest.raises(TypeError, match="'v'"):
        aft_simple(q, q, q.double())
    with pytest.raises(ValueError, match="'k'"):
        aft_simple(q, torch.zeros(2, 5, 3, device="meta"), q)
    with pytest.raises(ValueError, match="'padding_mask'"):
        aft_simple(q, q, q, padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="'padding_mask'"):
        aft_simple(q, q, q, padding_mask=torch.ones(2, 5))


_MEMORY_SCRIPT = """
import resource, torch
from aftlab.functional import aft_decay, aft_simple
torch.set_num_threads(1)
B, T, d = 2, 8192, 16
q, k, v = (torch.randn(B, T, d, requires_grad=True) for _ in range(3))
decay, bonus = torch.rand(d, requires_grad=True), torch.zeros(d, requires_grad=True)
aft_simple(q[:, :64], k[:, :64], v[:, :64], causal=True).sum().backward()  # warm-up
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
aft_simple(q, k, v, causal=True).sum().backward()
aft_decay(q, k, v, decay, bonus).sum().backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


@pytest.mark.slow
def test_causal_memory_is_linear_in_T():
    # B*T*T floats would be 512 MiB; B*T*d floats are 1 MiB. Peak RSS growth (KiB) in a
    # fresh process must stay far below the quadratic size.
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MEMORY_SCRIPT)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    grown_kib = int(out.stdout.strip().splitlines()[-1])
    quadratic_kib = 2 * 8192 * 8192 * 4 // 1024
    assert grown_kib < quadratic_kib // 8, f"peak RSS grew by {grown_kib} KiB"


# ----------------------------------------------------------------------------- numerical range
MAX32 = torch.finfo(torch.float32).max


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("key", [-MAX32, -1e38, -MAX32 / 4, 1e38, MAX32])
def test_single_key_has_weight_one_whatever_its_value(causal, key):
    # A finite "no key yet" maximum (-max/4) gave keys below about -max/8 weight 0 (Y = 0).
    q, v = torch.tensor([[[0.5], [-1.0]]]), torch.tensor([[[3.0], [-2.0]]])
    k = torch.tensor([[[key], [0.0]]])
    y = aft_simple(q[:, :1], k[:, :1], v[:, :1], causal=causal)
    assert_close("Y (T = 1)", y, torch.sigmoid(q[:, :1]) * v[:, :1])
    assert_close("Y", aft_simple(q, k, v, causal=causal),
                 aft_simple_reference(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_values_near_float32_max_stay_finite(causal):
    # sum_t' w_t' V_t' (weights <= 1) overflowed for 16 values ~1e38, and so does a mean of
    # values at the largest float through rounding alone; the average is bounded by max |V|.
    T = 16
    gen = torch.Generator().manual_seed(5)
    k = torch.linspace(-1.0, 1.0, T).view(1, T, 1).expand(1, T, 3).contiguous()
    v = (torch.randn(1, T, 3, generator=gen, dtype=F64) * 1e38).clamp(-MAX32, MAX32).float()
    v[0, :, 0] = MAX32
    v[0, ::2, 1], v[0, 1::2, 1] = -MAX32, MAX32
    q = torch.full((1, T, 3), 20.0)  # sigma(q) rounds to 1 in float32
    y = aft_simple(q, k, v, causal=causal)
    assert torch.isfinite(y).all()
    assert_close("Y", y, aft_simple_reference(q, k, v, causal=causal), atol=3e33, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(0, 5, 3), (2, 0, 3), (2, 5, 0)])
def test_zero_sizes(causal, shape):
    # T = 0 non-causal crashed (a maximum over an empty dim).
    q, k, v = (torch.randn(shape, dtype=F64, requires_grad=True) for _ in range(3))
    y = aft_simple(q, k, v, causal=causal)
    assert y.shape == shape
    y.sum().backward()
    for x in (q, k, v):
        assert x.grad is None or (x.grad.shape == shape and not x.grad.any())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_input_gives_nan_output(causal, which):
    # NaN at position 4: NaN from there on (causal) or everywhere (not), as in the reference.
    q, k, v = (t.detach() for t in _qkv(2, 9, 3))
    {"k": k, "v": v}[which][:, 4] = float("nan")
    y = aft_simple(q, k, v, causal=causal)
    assert torch.isnan(y[:, 4:] if causal else y).all()
    if causal:
        assert torch.isfinite(y[:, :4]).all()
