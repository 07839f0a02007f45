"""seed_attention / seed_feedforward against plain loops written straight from the definition.

The references work in the definition's column convention: ``X ∈ R^{d×n}`` is built as
``x[b].T``, the heads and the columns are looped over, and each column's softmax is computed by
hand. They are imported by tests/models/test_seed.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from aftlab.functional import seed_attention, seed_feedforward
from aftlab.testing import assert_close

# --------------------------------------------------------------------------- references


def column_softmax(S: torch.Tensor) -> torch.Tensor:
    """Softmax of each column of ``S`` (each column sums to 1), by hand, shifted by its max."""
    A = torch.empty_like(S)
    for j in range(S.shape[1]):
        col = S[:, j]
        e = torch.exp(col - col.max())
        A[:, j] = e / e.sum()
    return A


def attention_reference(X, w_q, w_k, w_v, w_o):
    """``Attention(X) = X + Σ_h W_h^O (W_h^V X) Softmax[(W_h^K X)^T (W_h^Q X)]``, X: (d, n)."""
    d, n = X.shape
    Y = X.clone()
    for h in range(w_q.shape[0]):
        Q, K, V = w_q[h] @ X, w_k[h] @ X, w_v[h] @ X  # (m, n) each
        A = column_softmax(K.T @ Q)  # (n, n); A[i, j]: weight of key i for query j
        for j in range(n):
            Y[:, j] += w_o[h] @ (V @ A[:, j])
    return Y


def feedforward_reference(X, w1, b1, w2, b2):
    """``FF(X) = X + W_2 ReLU(W_1 X + b_1 1^T) + b_2 1^T``, column by column, X: (d, n)."""
    Y = X.clone()
    for j in range(X.shape[1]):
        Y[:, j] = X[:, j] + w2 @ torch.clamp(w1 @ X[:, j] + b1, min=0) + b2
    return Y


def batched(ref, x, *weights):
    """Apply a column-convention reference to a batch-first ``x: (B, n, d)`` via ``X = x[b].T``."""
    return torch.stack([ref(x[b].T, *weights).T for b in range(x.shape[0])])


def attention_weights(H, m, d, dtype=torch.float64):
    return (
        torch.randn(H, m, d, dtype=dtype),
        torch.randn(H, m, d, dtype=dtype),
        torch.randn(H, m, d, dtype=dtype),
        torch.randn(H, d, m, dtype=dtype),
    )


def ff_weights(r, d, dtype=torch.float64):
    return (
        torch.randn(r, d, dtype=dtype),
        torch.randn(r, dtype=dtype),
        torch.randn(d, r, dtype=dtype),
        torch.randn(d, dtype=dtype),
    )


# --------------------------------------------------------------------------- attention

SIZES = [(1, 1, 1, 1), (1, 3, 5, 7), (2, 4, 8, 5), (3, 5, 6, 11), (4, 2, 7, 1)]  # H, m, d, n


@pytest.mark.parametrize("H,m,d,n", SIZES)
def test_attention_matches_reference_float64(H, m, d, n):
    x = torch.randn(2, n, d, dtype=torch.float64)
    w = attention_weights(H, m, d)
    assert_close("seed_attention", seed_attention(x, *w), batched(attention_reference, x, *w))


def test_attention_float32_matches_float64_reference():
    H, m, d, n = 3, 4, 6, 9
    x = torch.randn(2, n, d, dtype=torch.float64) * 0.5
    w = attention_weights(H, m, d)
    out = seed_attention(x.float(), *(t.float() for t in w))
    assert out.dtype == torch.float32
    assert_close("seed_attention fp32", out, batched(attention_reference, x, *w), atol=1e-4)


def test_attention_columns_of_softmax_sum_to_one():
    # The last coordinate of every token is 1 and W^V reads it (m = 1), so v_i = 1 for all keys;
    # W^O writes to coordinate 0. Then Attention(X)[0, j] - X[0, j] = Σ_i A[i, j], the sum of
    # column j of the definition's Softmax, which must be 1 for every query j (a row softmax
    # would give row sums instead).
    n, d = 7, 5
    x = torch.randn(3, n, d, dtype=torch.float64)
    x[..., -1] = 1.0
    w_q, w_k = torch.randn(1, 1, d, dtype=torch.float64), torch.randn(1, 1, d, dtype=torch.float64)
    w_v = torch.zeros(1, 1, d, dtype=torch.float64)
    w_v[0, 0, -1] = 1.0
    w_o = torch.zeros(1, d, 1, dtype=torch.float64)
    w_o[0, 0, 0] = 1.0
    delta = seed_attention(x, w_q, w_k, w_v, w_o) - x
    assert_close("column sums", delta[..., 0], torch.ones(3, n, dtype=torch.float64))
    assert_close("other coordinates", delta[..., 1:], torch.zeros(3, n, d - 1, dtype=torch.float64))


def test_attention_equals_unscaled_sdpa():
    # Independent cross-check: per head, torch's SDPA with scale=1 (no 1/sqrt(m)) on the rows.
    H, m, d, n = 3, 4, 6, 9
    x = torch.randn(2, n, d, dtype=torch.float64)
    w_q, w_k, w_v, w_o = attention_weights(H, m, d)
    expected = x.clone()
    for h in range(H):
        o = F.scaled_dot_product_attention(x @ w_q[h].T, x @ w_k[h].T, x @ w_v[h].T, scale=1.0)
        expected = expected + o @ w_o[h].T
    assert_close("seed_attention vs sdpa", seed_attention(x, w_q, w_k, w_v, w_o), expected)


def test_attention_is_not_scaled():
    # With m = 4 the definition and the 1/sqrt(m)-scaled version differ: ours is the former.
    H, m, d, n = 1, 4, 6, 5
    x = torch.randn(1, n, d, dtype=torch.float64)
    w_q, w_k, w_v, w_o = attention_weights(H, m, d)
    scaled = x + F.scaled_dot_product_attention(x @ w_q[0].T, x @ w_k[0].T, x @ w_v[0].T) @ w_o[0].T
    out = seed_attention(x, w_q, w_k, w_v, w_o)
    assert (out - scaled).abs().max() > 1e-3


def test_attention_batch_dims():
    H, m, d, n = 2, 3, 5, 4
    w = attention_weights(H, m, d)
    x = torch.randn(2, 3, n, d, dtype=torch.float64)
    out = seed_attention(x, *w)
    assert out.shape == x.shape
    assert_close("unbatched", seed_attention(x[1, 2], *w), attention_reference(x[1, 2].T, *w).T)
    assert_close("4-d batch", out.flatten(0, 1), seed_attention(x.flatten(0, 1), *w))


def test_attention_stable_for_huge_logits():
    # Logits of order 1e4 overflow an unshifted exp even in float64 (exp(710) = inf).
    H, m, d, n = 2, 3, 4, 6
    x = torch.randn(2, n, d, dtype=torch.float64) * 30
    w_q, w_k, w_v, w_o = attention_weights(H, m, d)
    w_q, w_k = w_q * 3, w_k * 3
    logits = torch.einsum("bnd,hmd->bhnm", x, w_q) @ torch.einsum("bnd,hmd->bhnm", x, w_k).mT
    assert logits.abs().max() > 1e4
    out = seed_attention(x, w_q, w_k, w_v, w_o)
    assert torch.isfinite(out).all()
    assert_close("huge logits", out, batched(attention_reference, x, w_q, w_k, w_v, w_o))
    out32 = seed_attention(x.float() * 1e8, *(t.float() for t in (w_q, w_k, w_v, w_o)))
    assert torch.isfinite(out32).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision(dtype):
    H, m, d, n = 2, 4, 8, 6
    x = torch.randn(2, n, d, dtype=torch.float64) * 0.5
    w = tuple(t * 0.5 for t in attention_weights(H, m, d))
    out = seed_attention(x.to(dtype), *(t.to(dtype) for t in w))
    assert out.dtype == dtype
    assert_close("low precision", out, batched(attention_reference, x, *w), atol=0.1, rtol=0.05)


def test_attention_gradcheck():
    H, m, d, n = 2, 2, 3, 4
    x = torch.randn(2, n, d, dtype=torch.float64, requires_grad=True)
    w = tuple(t.requires_grad_() for t in attention_weights(H, m, d))
    assert torch.autograd.gradcheck(seed_attention, (x, *w))


# --------------------------------------------------------------------------- feed-forward


@pytest.mark.parametrize("r,d,n", [(1, 1, 1), (5, 3, 7), (16, 8, 4), (9, 6, 11)])
def test_feedforward_matches_reference_float64(r, d, n):
    x = torch.randn(2, n, d, dtype=torch.float64)
    w = ff_weights(r, d)
    assert_close("seed_feedforward", seed_feedforward(x, *w), batched(feedforward_reference, x, *w))


def test_feedforward_float32_and_batch_dims():
    r, d, n = 7, 5, 3
    x = torch.randn(2, 3, n, d, dtype=torch.float64)
    w = ff_weights(r, d)
    out = seed_feedforward(x.float(), *(t.float() for t in w))
    assert out.dtype == torch.float32 and out.shape == x.shape
    expected = batched(feedforward_reference, x.flatten(0, 1), *w).view_as(x)
    assert_close("seed_feedforward fp32", out, expected, atol=1e-4)
    assert_close("unbatched", seed_feedforward(x[0, 0], *w), feedforward_reference(x[0, 0].T, *w).T)


def test_feedforward_relu_is_active():
    # b1 very negative: every hidden unit is off, so FF(X) = X + b_2 1^T exactly.
    r, d, n = 4, 3, 5
    x = torch.randn(1, n, d, dtype=torch.float64)
    w1, _, w2, b2 = ff_weights(r, d)
    b1 = torch.full((r,), -1e6, dtype=torch.float64)
    assert_close("relu off", seed_feedforward(x, w1, b1, w2, b2), x + b2)


def test_feedforward_gradcheck():
    r, d, n = 3, 2, 4
    x = torch.randn(2, n, d, dtype=torch.float64, requires_grad=True)
    w = tuple(t.requires_grad_() for t in ff_weights(r, d))
    assert torch.autograd.gradcheck(seed_feedforward, (x, *w))


# --------------------------------------------------------------------------- bad input

H_, M_, D_, N_, R_ = 2, 4, 8, 5, 16


def _att(**over):
    args = dict(
        x=torch.randn(2, N_, D_),
        w_q=torch.randn(H_, M_, D_),
        w_k=torch.randn(H_, M_, D_),
        w_v=torch.randn(H_, M_, D_),
        w_o=torch.randn(H_, D_, M_),
    )
    args.update(over)
    return args


def _ff(**over):
    args = dict(
        x=torch.randn(2, N_, D_),
        w1=torch.randn(R_, D_),
        b1=torch.randn(R_),
        w2=torch.randn(D_, R_),
        b2=torch.randn(D_),
    )
    args.update(over)
    return args


ATTENTION_BAD = [
    ("x rank 1", _att(x=torch.randn(D_)), ValueError, "'x' must have at least 2 dimensions",
     "(8,)"),
    ("x not tensor", _att(x=[[1.0] * D_]), TypeError, "'x' must be a torch.Tensor", "list"),
    ("x integer", _att(x=torch.ones(2, N_, D_, dtype=torch.long)), TypeError, "'x'", "int64"),
    ("w_q rank 2", _att(w_q=torch.randn(M_, D_)), ValueError, "'w_q' must have 3 dimension",
     "(4, 8)"),
    ("d mismatch", _att(w_q=torch.randn(H_, M_, 7)), ValueError, "'w_q' must have shape (H, m, d)",
     "got (2, 4, 7)"),
    ("w_k H mismatch", _att(w_k=torch.randn(3, M_, D_)), ValueError,
     "'w_k' must have shape (H, m, d) = (2, 4, 8)", "got (3, 4, 8)"),
    ("w_v m mismatch", _att(w_v=torch.randn(H_, 3, D_)), ValueError,
     "'w_v' must have shape (H, m, d) = (2, 4, 8)", "got (2, 3, 8)"),
    ("w_k d mismatch", _att(w_k=torch.randn(H_, M_, 9)), ValueError, "'w_k'", "got (2, 4, 9)"),
    ("w_o transposed", _att(w_o=torch.randn(H_, M_, D_)), ValueError,
     "'w_o' must have shape (H, d, m) = (2, 8, 4)", "got (2, 4, 8)"),
    ("w_o H mismatch", _att(w_o=torch.randn(1, D_, M_)), ValueError, "'w_o'", "got (1, 8, 4)"),
    ("w_o rank 4", _att(w_o=torch.randn(1, H_, D_, M_)), ValueError, "'w_o' must have 3 dimension",
     "(1, 2, 8, 4)"),
    ("w_v dtype", _att(w_v=torch.randn(H_, M_, D_, dtype=torch.float64)), TypeError,
     "'w_v' has dtype torch.float64", "torch.float32"),
    ("w_o not tensor", _att(w_o=None), TypeError, "'w_o' must be a torch.Tensor", "NoneType"),
]


@pytest.mark.parametrize(
    "args,exc,msg,got", [c[1:] for c in ATTENTION_BAD], ids=[c[0] for c in ATTENTION_BAD]
)
def test_attention_bad_input(args, exc, msg, got):
    with pytest.raises(exc, match=re.escape(msg)) as info:
        seed_attention(**args)
    assert str(info.value).startswith("seed_attention: ")
    assert got in str(info.value)


FF_BAD = [
    ("x rank 1", _ff(x=torch.randn(D_)), ValueError, "'x' must have at least 2 dimensions", "(8,)"),
    ("w1 rank 3", _ff(w1=torch.randn(1, R_, D_)), ValueError, "'w1' must have 2 dimension",
     "(1, 16, 8)"),
    ("w1 d mismatch", _ff(w1=torch.randn(R_, 7)), ValueError, "'w1' must have shape (r, d)",
     "got (16, 7)"),
    ("b1 length", _ff(b1=torch.randn(R_ - 1)), ValueError, "'b1' must have shape (r,) = (16,)",
     "got (15,)"),
    ("b1 rank 2", _ff(b1=torch.randn(1, R_)), ValueError, "'b1' must have 1 dimension",
     "(1, 16)"),
    ("w2 r mismatch", _ff(w2=torch.randn(D_, R_ + 1)), ValueError,
     "'w2' must have shape (d, r) = (8, 16)", "got (8, 17)"),
    ("w2 transposed", _ff(w2=torch.randn(R_, D_)), ValueError, "'w2'", "got (16, 8)"),
    ("b2 length", _ff(b2=torch.randn(R_)), ValueError, "'b2' must have shape (d,) = (8,)",
     "got (16,)"),
    ("b2 column", _ff(b2=torch.randn(D_, 1)), ValueError, "'b2' must have 1 dimension",
     "(8, 1)"),
    ("b2 dtype", _ff(b2=torch.randn(D_, dtype=torch.float64)), TypeError,
     "'b2' has dtype torch.float64", "torch.float32"),
    ("x half vs fp32 weights", _ff(x=torch.randn(2, N_, D_, dtype=torch.float16)), TypeError,
     "'w1' has dtype torch.float32", "torch.float16"),
]


@pytest.mark.parametrize("args,exc,msg,got", [c[1:] for c in FF_BAD], ids=[c[0] for c in FF_BAD])
def test_feedforward_bad_input(args, exc, msg, got):
    with pytest.raises(exc, match=re.escape(msg)) as info:
        seed_feedforward(**args)
    assert str(info.value).startswith("seed_feedforward: ")
    assert got in str(info.value)
