"""Multi-head attention: SDPA fast path == einsum reference == per-position loop; decoding."""

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
from aftlab.testing import assert_close

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


def test_query_without_keys_is_zero_with_finite_grads():
    m = build_mixer("attention", d_model=D, n_heads=3, causal=True).double()
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, False, True, True, True], [False] * 5])
    y = m(x, padding_mask=mask)
    assert torch.equal(y[0, :2], torch.zeros(2, D, dtype=torch.float64))
    assert torch.equal(y[1], torch.zeros(5, D, dtype=torch.float64))
    assert y[0, 2:].abs().sum() > 0
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[1], torch.zeros(5, D, dtype=torch.float64))


@pytest.mark.parametrize("name", ["attention", "attention-naive"])
def test_padded_keys_are_ignored(name):
    m = build_mixer(name, d_model=D, n_heads=3).double()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[:, 5:] = False
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, 2, D, dtype=torch.float64) * 100
    y, y2 = m(x, padding_mask=mask), m(x2, padding_mask=mask)
    assert_close("y at real tokens", y2[:, :5], y[:, :5])
    assert_close("y == unpadded", y[:, :5], m(x[:, :5]))


@pytest.mark.parametrize("name", ["attention", "attention-naive"])
@pytest.mark.parametrize("opts", [dict(n_heads=3), dict(n_heads=2, rotary=True, head_dim=4)])
def test_step_matches_forward(name, opts):
    m = build_mixer(name, d_model=D, causal=True, **opts).double()
    T = 33  # grows the cache 16 -> 32 -> 64
    x = torch.randn(2, T, D, dtype=torch.float64)
    state = m.init_state(2)
    assert isinstance(state, KVCache) and state.length == 0
    ys = []
    for t in range(T):
        y, state = m.step(x[:, t], state)
        ys.append(y)
    assert state.length == T
    assert_close("step outputs", torch.stack(ys, dim=1), m(x))


def test_init_state_defaults_to_parameter_dtype():
    m = build_mixer("attention", d_model=D, n_heads=3, causal=True).double()
    s = m.init_state(4)
    assert s.k.dtype == torch.float64 and s.k.shape[:2] == (4, 3) and s.k.shape[3] == 4


def test_noncausal_cannot_step():
    m = build_mixer("attention", d_model=D, n_heads=3, causal=False)
    with pytest.raises(RuntimeError, match="causal"):
        m.init_state(1)


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


def test_output_dropout_in_training_only():
    m = build_mixer("attention", d_model=D, n_heads=3, dropout=0.5)
    x = torch.randn(2, 5, D)
    m.train()
    y = m(x)
    assert (y == 0).float().mean() > 0.2
    m.eval()
    assert torch.equal(m(x), m(x)) and (m(x) != 0).all()


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
