"""Multi-head attention: SDPA fast path == einsum reference == per-position loop; decoding
through the growing key-value cache; rotary positions; low precision against the reference; a
NaN or inf reaches only the outputs that see it.

What every mixer promises (decoding, padding, causality, autocast, dtypes, dropout, errors) is
in test_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from aftlab.mixers import available_mixers, build_mixer
from aftlab.mixers.attention import (
    KVCache,
    MultiHeadAttention,
    NaiveMultiHeadAttention,
    apply_rotary,
    rotary_angles,
)
from aftlab.testing import assert_close, decode

D = 12
VARIANTS = {
    "plain": dict(n_heads=3),
    "padding": dict(n_heads=3),
    "unscaled": dict(n_heads=3, scaled=False),
    "rotary": dict(n_heads=2, rotary=True),
    "wide_heads": dict(n_heads=3, head_dim=5),  # H * m = 15 != d = 12
}


def _pair(causal: bool, **opts) -> tuple[MultiHeadAttention, NaiveMultiHeadAttention]:
    fast = build_mixer("attention", d_model=D, causal=causal, **opts).double()
    ref = build_mixer("attention-naive", d_model=D, causal=causal, **opts).double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _mask(B: int, T: int) -> torch.Tensor:
    """Random padding with a fully padded sequence and a left-padded one (no-key causal queries)."""
    m = torch.rand(B, T) > 0.3
    m[0] = False
    m[1, : T // 2] = False
    m[1, T // 2 :] = True
    return m


def test_registered():
    assert {"attention", "attention-naive"} <= set(available_mixers())
    assert type(build_mixer("attention", d_model=8, n_heads=2)) is MultiHeadAttention
    assert type(build_mixer("attention-naive", d_model=8, n_heads=2)) is NaiveMultiHeadAttention


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_sdpa_matches_naive_forward_backward(T, causal, variant):
    fast, ref = _pair(causal, **VARIANTS[variant])
    B = 3
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    mask = _mask(B, T) if variant == "padding" else None
    y_fast, y_ref = fast(x, padding_mask=mask), ref(x, padding_mask=mask)
    assert_close("y", y_fast, y_ref)
    assert torch.isfinite(y_fast).all()

    g = torch.randn_like(y_fast)
    names = ["x", *(n for n, _ in fast.named_parameters())]
    grads_fast = torch.autograd.grad(y_fast, [x, *fast.parameters()], g)
    grads_ref = torch.autograd.grad(y_ref, [x, *ref.parameters()], g)
    for name, a, e in zip(names, grads_fast, grads_ref, strict=True):
        assert_close(f"dL/d{name}", a, e)


def _loop_attention(
    m: MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(s q_t . k_t') over allowed t', straight from the formula, one query at a time."""
    B, T, _ = x.shape
    H, hd = m.n_heads, m.head_dim
    W, b = m.qkv.weight, m.qkv.bias
    out = torch.zeros(B, T, H * hd, dtype=x.dtype)
    for bi in range(B):
        qkv = x[bi] @ W.T + b
        q, k, v = qkv[:, : H * hd], qkv[:, H * hd : 2 * H * hd], qkv[:, 2 * H * hd :]
        for h in range(H):
            sl = slice(h * hd, (h + 1) * hd)
            for t in range(T):
                keys = [
                    s
                    for s in range(T)
                    if (not m.causal or s <= t) and (mask is None or bool(mask[bi, s]))
                ]
                if not keys:
                    continue  # the output of a query with no key is 0 (after W^O too)
                logits = torch.stack([q[t, sl] @ k[s, sl] * m.scale for s in keys])
                w = torch.exp(logits - logits.max())
                w = w / w.sum()
                out[bi, t, sl] = sum(w[j] * v[s, sl] for j, s in enumerate(keys))
    y = out @ m.out_proj.weight.T + m.out_proj.bias
    if mask is not None:
        has = torch.tensor(
            [
                [any((not m.causal or s <= t) and mask[bi, s] for s in range(T)) for t in range(T)]
                for bi in range(B)
            ]
        )
        y = y * has[..., None]
    return y


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_naive_matches_per_position_loop(causal, scaled):
    m = build_mixer(
        "attention-naive", d_model=D, n_heads=3, head_dim=5, causal=causal, scaled=scaled
    ).double()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    mask = _mask(2, 6)
    assert_close("y (masked)", m(x, padding_mask=mask), _loop_attention(m, x, mask))
    assert_close("y", m(x), _loop_attention(m, x, None))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["attention", "attention-naive"])
def test_nonfinite_input_reaches_only_the_outputs_that_see_it(name, causal, bad, padded):
    """NaN exactly where the per-position formula gives a non-finite output; every other output
    and the gradient through it as without the bad token (zeroing it changes nothing there)."""
    m = build_mixer(name, d_model=D, n_heads=3, head_dim=5, causal=causal).double()
    B, T, p = 3, 9, 4
    x = torch.randn(B, T, D, dtype=torch.float64)
    mask = _mask(B, T) if padded else None
    if padded:
        mask[2, p] = False  # row 1: x[1, p] is a real token; row 2: a padded one
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    clean = x.clone()
    clean[:, p] = 0.0
    x[:, p] = bad
    expected_nan = ~torch.isfinite(_loop_attention(m, x, mask)) & real[..., None]
    seeing = slice(p, T) if causal else slice(0, T)  # row 1: the real queries that see x[1, p]
    assert expected_nan[1, seeing][real[1, seeing]].all()
    assert not expected_nan[:, :p].any() or not causal
    assert not expected_nan[2].any() or not padded

    def run(inp):
        inp = inp.clone().requires_grad_()
        y = m(inp, padding_mask=mask)
        seen = y.masked_fill(expected_nan | ~real[..., None], 0.0)  # the outputs that stay finite
        return y, torch.autograd.grad(seen.square().sum(), inp)[0]

    (y, grad), (y_clean, grad_clean) = run(x), run(clean)
    assert torch.equal(y.isnan() & real[..., None], expected_nan)
    assert torch.equal(y[~expected_nan & real[..., None]], y_clean[~expected_nan & real[..., None]])
    assert_close("dL/dx through the finite outputs", grad, grad_clean)
    if causal and not padded:  # the prefill is the forward; its cache keeps the bad token
        with torch.no_grad():
            y_pre, state = m.prefill(x)
            y_next, _ = m.step(torch.randn(B, D, dtype=torch.float64), state)
        torch.testing.assert_close(y_pre, y.detach(), equal_nan=True, atol=0, rtol=0)
        assert y_next.isnan().all()


@pytest.mark.parametrize("p", [2, 6])  # in the cache, or in the new chunk
@pytest.mark.parametrize("name", ["attention", "attention-naive"])
def test_nonfinite_token_continuing_a_cache(name, p):
    """A prefill from a cache gives the forward's outputs, NaN included: a NaN key in the
    cache reaches every new query (all see it), one in the chunk only the queries after it."""
    m = build_mixer(name, d_model=D, n_heads=2, rotary=True, head_dim=4, causal=True).double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    x[:, p] = float("nan")
    with torch.no_grad():
        y = m(x)
        _, state = m.prefill(x[:, :4])
        y_rest, _ = m.prefill(x[:, 4:], state)
    assert y[:, p:].isnan().all() and not y[:, :p].isnan().any()
    torch.testing.assert_close(y_rest, y[:, 4:], equal_nan=True, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["attention", "attention-naive"])
@pytest.mark.parametrize("opts", [dict(n_heads=3), dict(n_heads=2, rotary=True, head_dim=4)])
def test_step_matches_forward(name, opts):
    m = build_mixer(name, d_model=D, causal=True, **opts).double()
    T = 33  # grows the cache 16 -> 32 -> 64
    x = torch.randn(2, T, D, dtype=torch.float64)
    state = m.init_state(2)
    assert isinstance(state, KVCache) and state.length == 0
    assert state.k.dtype == torch.float64 and state.k.shape == (2, m.n_heads, 16, m.head_dim)
    ys, state = decode(m, x, state)
    assert state.length == T and state.k.shape[2] == 64
    assert_close("step outputs", ys, m(x))


def test_rotary_is_relative():
    """<R(p) q, R(s) k> depends only on p - s, and rotation preserves norms."""
    m = 8
    q, k = torch.randn(m, dtype=torch.float64), torch.randn(m, dtype=torch.float64)
    pos = torch.arange(0, 40)
    cos, sin = rotary_angles(pos, m, dtype=torch.float64)
    rq = apply_rotary(q.expand(40, m), cos, sin)
    rk = apply_rotary(k.expand(40, m), cos, sin)
    assert_close("norm", rq.norm(dim=-1), q.norm().expand(40))
    dots = rq @ rk.T  # (p, s)
    assert_close("shifted dot", dots[10:30, 5:25], dots[20:40, 15:35])
    assert (dots[3, 0] - dots[0, 3]).abs() > 1e-6  # genuinely position dependent


def test_rotary_angles_formula():
    cos, sin = rotary_angles(torch.tensor([3]), 4, base=100.0, dtype=torch.float64)
    theta = [3 * 100 ** (-0 / 4), 3 * 100 ** (-2 / 4)] * 2
    assert_close("cos", cos[0], torch.tensor([math.cos(t) for t in theta], dtype=torch.float64))
    assert_close("sin", sin[0], torch.tensor([math.sin(t) for t in theta], dtype=torch.float64))


def test_float32_sdpa_close_to_float64_reference():
    fast, ref = _pair(True, n_heads=3)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    assert_close("y float32", fast.float()(x.float()), ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_float64_reference(dtype):
    fast, ref = _pair(True, n_heads=3)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    mask = _mask(2, 9)
    expected = ref(x, padding_mask=mask)
    for m in (fast, ref):
        y = m.to(dtype)(x.to(dtype), padding_mask=mask)
        assert y.dtype == dtype
        assert_close(f"{m.name} {dtype}", y, expected, atol=3e-2, rtol=3e-2)
