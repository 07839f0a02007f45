"""SeedTransformer: the definition's two properties, its formula, its init and its errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from aftlab.functional import seed_attention, seed_feedforward
from aftlab.models import SeedTransformer
from aftlab.models.seed import SeedBlock
from aftlab.testing import assert_close
from tests.functional.test_seed import attention_reference, feedforward_reference

PARAM_SHAPES = {  # the definition's matrices, per block, as functions of (d, H, m, r)
    "w_q": lambda d, H, m, r: (H, m, d),
    "w_k": lambda d, H, m, r: (H, m, d),
    "w_v": lambda d, H, m, r: (H, m, d),
    "w_o": lambda d, H, m, r: (H, d, m),
    "w1": lambda d, H, m, r: (r, d),
    "b1": lambda d, H, m, r: (r,),
    "w2": lambda d, H, m, r: (d, r),
    "b2": lambda d, H, m, r: (d,),
}


def _model(d=6, heads=2, head_dim=3, hidden=10, depth=3, dtype=torch.float64):
    return SeedTransformer(d, heads, head_dim, hidden, depth, dtype=dtype)


def transformer_reference(model: SeedTransformer, X: torch.Tensor) -> torch.Tensor:
    """``Block_N ∘ ... ∘ Block_1`` with ``Block = FF ∘ Attention``, column convention, X: (d, n)."""
    for blk in model.blocks:
        X = attention_reference(X, blk.w_q, blk.w_k, blk.w_v, blk.w_o)
        X = feedforward_reference(X, blk.w1, blk.b1, blk.w2, blk.b2)
    return X


# --------------------------------------------------------------------------- property (a)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_permutation_equivariance(n):
    """Transformer(XP) = Transformer(X)P, with P a permutation matrix acting on the columns."""
    model = _model()
    x = torch.randn(3, n, model.d, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
        for _ in range(3):
            P = torch.eye(n, dtype=torch.float64)[:, torch.randperm(n)]  # (XP)[:, j] = X[:, π(j)]
            XP = torch.stack([x[b].T @ P for b in range(3)])  # column convention
            got = model(XP.mT)  # back to batch-first: x_P[b] = (X P)^T
            expected = torch.stack([y[b].T @ P for b in range(3)]).mT  # (Transformer(X) P)^T
            assert_close(f"Transformer(XP), n={n}", got, expected)
            if n > 1 and not torch.equal(P, torch.eye(n, dtype=torch.float64)):
                # not trivially satisfied: the output moves with the permutation
                assert (got - y).abs().max() > 1e-6


def test_permutation_equivariance_per_batch_element_float32():
    model = _model(d=8, heads=2, head_dim=4, hidden=16, depth=2, dtype=torch.float32)
    B, n = 4, 7
    x = torch.randn(B, n, 8)
    perms = torch.stack([torch.randperm(n) for _ in range(B)])
    idx = perms[:, :, None].expand(B, n, 8)
    with torch.no_grad():
        assert_close("per-element perms", model(x.gather(1, idx)), model(x).gather(1, idx))


# --------------------------------------------------------------------------- property (b)

CONFIGS = [(1, 1, 1, 1, 1), (8, 2, 4, 16, 3), (12, 3, 5, 7, 2), (16, 4, 4, 64, 4), (5, 7, 2, 3, 1)]


@pytest.mark.parametrize("d,H,m,r,N", CONFIGS)
def test_parameter_count_matches_definition(d, H, m, r, N):
    model = SeedTransformer(d, H, m, r, N)
    formula = N * (4 * H * m * d + 2 * r * d + r + d)
    assert sum(p.numel() for p in model.parameters()) == formula
    assert model.num_parameters() == formula
    assert SeedTransformer.expected_num_parameters(d, H, m, r, N) == formula
    # exactly the definition's matrices, and nothing else (no buffers either)
    expected = {f"blocks.{i}.{k}": f(d, H, m, r) for i in range(N) for k, f in PARAM_SHAPES.items()}
    assert {k: tuple(p.shape) for k, p in model.named_parameters()} == expected
    assert list(model.buffers()) == []


def test_expected_num_parameters_worked_example():
    # d=8, H=2, m=4, r=16, N=3: 3 * (4*2*4*8 + 2*16*8 + 16 + 8) = 3 * 536
    count = SeedTransformer.expected_num_parameters(d=8, heads=2, head_dim=4, hidden=16, depth=3)
    assert count == 1608


def test_parameter_count_independent_of_n():
    model = SeedTransformer(d=8, heads=2, head_dim=4, hidden=16, depth=2)
    before = model.num_parameters()
    for n in (1, 3, 8, 17, 64):
        out = model(torch.randn(2, n, 8))
        assert out.shape == (2, n, 8)
        assert model.num_parameters() == before == 2 * (4 * 2 * 4 * 8 + 2 * 16 * 8 + 16 + 8)


# --------------------------------------------------------------------------- the formula


@pytest.mark.parametrize("n", [1, 4, 7])
def test_matches_column_convention_reference_float64(n):
    model = _model(depth=3)
    x = torch.randn(2, n, model.d, dtype=torch.float64)
    with torch.no_grad():
        expected = torch.stack([transformer_reference(model, x[b].T).T for b in range(2)])
        assert_close("SeedTransformer", model(x), expected)


def test_block_is_ff_after_attention():
    model = _model(depth=2)
    x = torch.randn(2, 5, model.d, dtype=torch.float64)
    y = x
    for blk in model.blocks:
        y = seed_attention(y, blk.w_q, blk.w_k, blk.w_v, blk.w_o)
        y = seed_feedforward(y, blk.w1, blk.b1, blk.w2, blk.b2)
    assert_close("Block_2 ∘ Block_1", model(x), y, atol=0, rtol=0)
    # the other order is a different function, so the check above can fail
    z = x
    for blk in model.blocks:
        z = seed_attention(blk.feedforward(z), blk.w_q, blk.w_k, blk.w_v, blk.w_o)
    assert (z - y).abs().max() > 1e-6


def test_gradcheck_tiny():
    model = _model(d=3, heads=2, head_dim=2, hidden=4, depth=2)
    x = torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(model, (x,))
    model(x).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# --------------------------------------------------------------------------- init


@pytest.mark.parametrize("depth", [1, 8, 32])
def test_init_keeps_deep_stacks_bounded(depth):
    torch.manual_seed(1)
    model = SeedTransformer(d=16, heads=2, head_dim=8, hidden=32, depth=depth)
    x = torch.randn(4, 12, 16)
    with torch.no_grad():
        ratio = (model(x).std() / x.std()).item()
        blk = model.blocks[0]
        q = torch.einsum("bnd,hmd->bhnm", x, blk.w_q)
        k = torch.einsum("bnd,hmd->bhnm", x, blk.w_k)
        logit_std = (q @ k.mT).std().item()
    assert 0.8 < ratio < 2.0, ratio  # residual stream neither vanishes nor explodes
    assert 0.5 < logit_std < 2.0, logit_std  # logits O(1): softmax neither uniform nor one-hot
    assert (model.blocks[0].b1 == 0).all() and (model.blocks[0].b2 == 0).all()


def test_reset_parameters_redraws():
    model = _model()
    before = model.blocks[1].w_q.detach().clone()
    model.reset_parameters()
    assert not torch.equal(before, model.blocks[1].w_q)


def test_factory_kwargs_and_repr():
    model = SeedTransformer(d=4, heads=1, head_dim=2, hidden=3, depth=2, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    text = repr(model)
    assert "d=4, heads=1, head_dim=2, hidden=3, depth=2" in text
    assert isinstance(model.blocks[0], SeedBlock)


# --------------------------------------------------------------------------- bad input

CTOR_BAD = [
    (dict(d=0), ValueError, "'d' must be > 0, got 0"),
    (dict(heads=-1), ValueError, "'heads' must be > 0, got -1"),
    (dict(head_dim=2.5), TypeError, "'head_dim' must be an int, got float"),
    (dict(hidden=True), TypeError, "'hidden' must be an int, got bool"),
    (dict(depth=0), ValueError, "'depth' must be > 0, got 0"),
    (dict(d="8"), TypeError, "'d' must be an int, got str"),
]


@pytest.mark.parametrize("over,exc,msg", CTOR_BAD)
def test_constructor_bad_args(over, exc, msg):
    kwargs = dict(d=8, heads=2, head_dim=4, hidden=16, depth=2) | over
    with pytest.raises(exc, match=re.escape(msg)):
        SeedTransformer(**kwargs)
    with pytest.raises(exc, match=re.escape(msg)):
        SeedTransformer.expected_num_parameters(**kwargs)


FORWARD_BAD = [
    (torch.randn(2, 5, 7), ValueError, "'x' must have shape (..., n, d) with d = 8, got (2, 5, 7)"),
    (torch.randn(8), ValueError, "'x' must have shape (..., n, d) with d = 8, got (8,)"),
    (torch.ones(2, 5, 8, dtype=torch.long), TypeError, "'x' must be a floating-point tensor"),
    (torch.randn(2, 5, 8, dtype=torch.float64), TypeError,
     "'x' has dtype torch.float64 but the parameters have torch.float32"),
    ([[0.0] * 8], TypeError, "'x' must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("x,exc,msg", FORWARD_BAD)
def test_forward_bad_input(x, exc, msg):
    model = SeedTransformer(d=8, heads=2, head_dim=4, hidden=16, depth=2)
    with pytest.raises(exc, match=re.escape(msg)) as info:
        model(x)
    assert str(info.value).startswith("SeedTransformer: ")


# --------------------------------------------------------------------------- docs


def test_docs_definition_example_runs(capsys):
    path = Path(__file__).resolve().parents[2] / "docs" / "definition.md"
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(path), "exec"), {})  # the example asserts its own claims
    assert "SeedTransformer(" in capsys.readouterr().out
