"""aft_full against its float64 per-position reference: values, gradients, stability, memory,
errors."""

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

from aftlab.functional import aft_full
from aftlab.ops.aft_full import aft_full_reference
from aftlab.testing import assert_close

aft_full_module = importlib.import_module("aftlab.ops.aft_full")
lse_module = importlib.import_module("aftlab.ops.lse_average")

# the C++ kernel and the PyTorch op, one thread each (conftest)
OP = "aft_full"
pytestmark = pytest.mark.usefixtures("impl", "one_thread")


def _inputs(B, T, d, *, scale=1.0, wscale=1.0, dtype=torch.float64, extra=0):
    q, k, v = torch.randn(3, B, T, d, dtype=torch.float64)
    w = torch.randn(T + extra, T + extra, dtype=torch.float64) * wscale
    return [x.to(dtype) for x in (q, k * scale, v, w)]


def _check_against_reference(
    inputs, *, causal, padding_mask=None, atol=None, rtol=None, op=aft_full
):
    """Forward and the gradients of q, k, v, w (``op``: aft_full or a compiled form of it)
    against the float64 reference."""
    xs = [x.clone().requires_grad_() for x in inputs]
    rs = [x.detach().double().requires_grad_() for x in inputs]
    y = op(*xs, causal=causal, padding_mask=padding_mask)
    yr = aft_full_reference(*rs, causal=causal, padding_mask=padding_mask)
    assert y.dtype == inputs[0].dtype
    assert_close("y", y, yr, atol=atol, rtol=rtol)
    g = torch.randn_like(yr)
    grads = torch.autograd.grad(y, xs, g.to(y.dtype))
    ref = torch.autograd.grad(yr, rs, g)
    for name, a, e in zip("qkvw", grads, ref, strict=False):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert_close(f"d{name}", a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_reference(T, causal, dtype):
    _check_against_reference(_inputs(2, T, 5, dtype=dtype, extra=3), causal=causal)


def test_causal_block_pairs(monkeypatch):
    """Many small causal blocks: block-triangular products, key shifts, padding, rescue."""
    monkeypatch.setattr(lse_module, "_CAUSAL_BLOCK", (4, 4))
    monkeypatch.setattr(aft_full_module, "_KERNEL_CAUSAL_BLOCK", (4, 4))
    B, T, d = 2, 19, 3
    pm = torch.ones(B, T, dtype=torch.bool)
    pm[0, :6] = False  # whole first block padded in row 0
    pm[1, 9:14] = False
    q, k, v, w = _inputs(B, T, d)
    _check_against_reference([q, k, v, w], causal=True, padding_mask=pm)
    k = k * 1e4  # plus keys and biases far beyond exp's range
    k[:, -1] = 3e4
    _check_against_reference([q, k, v, w * 1e4], causal=True, padding_mask=pm)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask(causal):
    B, T, d = 3, 9, 5
    pm = torch.ones(B, T, dtype=torch.bool)
    pm[0, :3] = False  # left padding: causal queries 0..2 of row 0 see no valid key
    pm[1, 6:] = False  # right padding
    pm[2] = False  # nothing valid at all
    inputs = _inputs(B, T, d)
    _check_against_reference(inputs, causal=causal, padding_mask=pm)
    y = aft_full(*inputs, causal=causal, padding_mask=pm)
    assert (y[2] == 0).all()
    if causal:
        assert (y[0, :3] == 0).all()
    # padded keys contribute nothing: changing them leaves every output unchanged
    q, k, v, w = inputs
    k2, v2 = k.clone(), v.clone()
    k2[~pm], v2[~pm] = 1e3, -7.0
    y2 = aft_full(q, k2, v2, w, causal=causal, padding_mask=pm)
    assert_close("y with other padded keys", y2, y)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal, impl):
    xs = [x.requires_grad_() for x in _inputs(2, 5, 3)]
    fast = impl == "triton"  # Jacobian's random projection under the interpreter (slow calls)
    assert torch.autograd.gradcheck(lambda *a: aft_full(*a, causal=causal), xs, fast_mode=fast)


def _exact_rows(impl, monkeypatch, q, k, v, w, causal):
    """Rows (b, t) the op computes on its exact path (the factorised denominator underflowed):
    the kernels report them (the C++ op's output ``fb``, the Triton op's ``exact`` per channel),
    the PyTorch op's rescue is counted."""
    if impl == "triton":
        T = q.shape[1]
        exact = torch.ops.aftlab.triton_full_core(k, v, w[:T, :T], causal)[2]
        return int(exact.any(-1).sum())
    if impl == "cpp":
        T = q.shape[1]
        fb = torch.ops.aftlab.full(q, k, v, w[:T, :T], None, causal, 256, False)[3]
        return int(fb.sum())
    calls = []
    real = lse_module._rescue_forward
    monkeypatch.setattr(lse_module, "_rescue_forward", lambda *a: calls.append(1) or real(*a))
    aft_full(q, k, v, w, causal=causal)
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_exact_rescue_path(causal, monkeypatch, impl):
    """Key and bias maximisers that disagree make the factorised denominator underflow."""
    q, k, v, w = _inputs(1, 5, 3)
    k[0, 0] += 800.0  # key 0 is the largest ...
    w[:, 0] -= 800.0  # ... but every query's bias kills it
    rows = _exact_rows(impl, monkeypatch, q, k, v, w, causal)
    assert rows, "the exact path was not taken"
    xs = [x.requires_grad_() for x in (q, k, v, w)]
    assert torch.autograd.gradcheck(
        lambda *a: aft_full(*a, causal=causal), xs, fast_mode=impl == "triton"
    )


def test_typical_inputs_take_the_fast_path(monkeypatch, impl):
    q, k, v, w = _inputs(2, 64, 8, scale=3.0, dtype=torch.float32)
    assert _exact_rows(impl, monkeypatch, q, k, v, w, True) == 0
    assert torch.isfinite(aft_full(q, k, v, w, causal=True)).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_huge_keys_and_biases(causal, dtype):
    """Magnitudes of 1e4, where exp overflows even float64 (bug 1 of the notes)."""
    q, k, v, w = _inputs(2, 33, 5, scale=1e4, wscale=1e4)
    k[:, -1] = 2e4  # largest key last: a causal max over the future would give 0/0 (bug 2)
    # round to a grid that float32 holds exactly, so both sides see the same inputs
    k, w = k.round(), w.round()
    _check_against_reference([x.to(dtype) for x in (q, k, v, w)], causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_exact_rescue_matches_reference(causal, monkeypatch, impl):
    """Under ``torch.compile(fullgraph=True)`` the op is one opaque operator (the PyTorch op's
    rescue picks rows by value, which a graph cannot): the exact path runs inside it."""
    q, k, v, w = _inputs(2, 33, 5, scale=1e4, wscale=1e4)
    k, w = k.round(), w.round()
    rows = _exact_rows(impl, monkeypatch, q, k, v, w, causal)
    assert rows, "the exact path was not taken"
    torch._dynamo.reset()
    compiled = torch.compile(aft_full, fullgraph=True, backend="aot_eager")
    _check_against_reference([q, k, v, w], causal=causal, op=compiled)


def test_causal_output_ignores_future():
    q, k, v, w = _inputs(1, 12, 4)
    y = aft_full(q, k, v, w, causal=True)
    k2, v2, w2 = k.clone(), v.clone(), w.clone()
    k2[:, 6:] = 1e4
    v2[:, 6:] = 3.0
    w2[:, 6:] = 50.0
    assert_close("y[:6]", aft_full(q, k2, v2, w2, causal=True)[:, :6], y[:, :6])


def test_bias_is_added_to_keys_not_multiplied():
    """exp(K + w) = exp(K) exp(w): a bias that is constant per row cancels (bug 7 guard)."""
    q, k, v, _ = _inputs(2, 6, 3)
    w_rows = torch.arange(6, dtype=torch.float64)[:, None].expand(6, 6) * 3.0
    y0 = aft_full(q, k, v, torch.zeros(6, 6, dtype=torch.float64))
    assert_close("row-constant w", aft_full(q, k, v, w_rows), y0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision(dtype, causal):
    q, k, v, w = _inputs(2, 40, 5, scale=100.0, wscale=100.0)
    k[:, -1] = 500.0
    inputs = [x.to(dtype) for x in (q, k, v, w)]
    _check_against_reference(inputs, causal=causal)


def test_autocast_bf16():
    q, k, v, w = (x.float() for x in _inputs(2, 20, 5, scale=300.0, wscale=300.0))
    xs = [x.clone().requires_grad_() for x in (q, k, v, w)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = aft_full(*xs, causal=True)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in xs)
    assert_close("y under autocast", y, aft_full_reference(q, k, v, w, causal=True))


def test_memory_is_linear_in_batch_times_length_times_width():
    """fwd+bwd at B=2, T=1024, d=272: a B x T x T x d float32 tensor would be 2.1 GiB (bug 8)."""
    code = textwrap.dedent("""
        import resource, torch
        from aftlab.functional import aft_full
        torch.manual_seed(0)
        torch.set_num_threads(1)
        B, T, d = 2, 1024, 272
        q, k, v = (torch.randn(B, T, d, requires_grad=True) for _ in range(3))
        w = torch.randn(T, T, requires_grad=True)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for causal in (False, True):
            aft_full(q, k, v, w, causal=causal).sum().backward()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - base) / 2**20)  # ru_maxrss is in KiB on Linux: GiB
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    growth_gib = float(out.stdout.strip())
    assert growth_gib < 0.25, f"peak memory grew by {growth_gib:.2f} GiB"


@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequence(causal):
    q = torch.randn(2, 0, 3, requires_grad=True)
    y = aft_full(q, q, q, torch.zeros(0, 0), causal=causal)
    assert y.shape == (2, 0, 3)
    y.sum().backward()
    assert q.grad.shape == (2, 0, 3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(0, 5, 3), (2, 5, 0), (0, 600, 2)])
def test_empty_batch_or_channels(shape, causal):
    """B = 0 or d = 0: an empty output of the right shape, and a backward that works."""
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    w = torch.randn(shape[1], shape[1], requires_grad=True)
    y = aft_full(q, k, v, w, causal=causal)
    assert y.shape == shape
    y.sum().backward()
    assert [x.grad.shape for x in (q, k, v, w)] == [q.shape, k.shape, v.shape, w.shape]


def test_language_model_on_an_empty_batch():
    from aftlab.models.config import TransformerConfig
    from aftlab.models.transformer import TransformerLM

    cfg = TransformerConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=8, mixer="aft-full")
    out = TransformerLM(cfg)(torch.zeros(0, 8, dtype=torch.long))
    logits = out if torch.is_tensor(out) else out[0]
    assert logits.shape == (0, 8, 256)
    logits.sum().backward()


def test_bad_inputs():
    q, k, v, w = _inputs(2, 7, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"'k' must have shape \(2, 7, 4\).*\(2, 7, 3\)"):
        aft_full(q, k[..., :3], v, w)
    with pytest.raises(ValueError, match=r"'v' must have shape"):
        aft_full(q, k, v[:, :5], w)
    with pytest.raises(ValueError, match=r"'q' must have 3 dimensions"):
        aft_full(q[0], k, v, w)
    with pytest.raises(ValueError, match=r"'w' must have shape \(T', T'\) .* T = 7.*\(5, 5"):
        aft_full(q, k, v, w[:5, :5])
    with pytest.raises(ValueError, match=r"'w' must have 2 dimensions"):
        aft_full(q, k, v, w[None])
    with pytest.raises(TypeError, match=r"'w' has dtype torch.float64 but 'q' has torch.float32"):
        aft_full(q, k, v, w.double())
    with pytest.raises(TypeError, match=r"'k' must be a floating-point"):
        aft_full(q, k.long(), v, w)
    with pytest.raises(ValueError, match=r"'v' is on meta but 'q' is on cpu"):
        aft_full(q, k, v.to("meta"), w)
    with pytest.raises(ValueError, match=r"'padding_mask' must have shape \(2, 7\)"):
        aft_full(q, k, v, w, padding_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"'padding_mask' must be a bool tensor"):
        aft_full(q, k, v, w, padding_mask=torch.ones(2, 7))
