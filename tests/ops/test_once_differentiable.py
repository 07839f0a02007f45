"""A second derivative through an AFT op is right or raises; it is never silently wrong.

Most backward passes are hand-written (C++ kernels and custom autograd) and have no derivative
of their own. With ``create_graph=True`` the first gradient is unchanged; differentiating it
again raises, even when the second derivative has another path to the same input (where
``torch.autograd.function.once_differentiable`` alone would return the other path's term only).
An op made of plain autograd operations (non-causal aft_simple in PyTorch) instead gives the
float64 reference's second derivative.
"""

import pytest
import torch

from aftlab.ops import aft_conv, aft_decay, aft_full, aft_local, aft_simple
from aftlab.ops.aft_simple import aft_simple_reference
from aftlab.testing import assert_close

OP = ("aft_simple", "aft_decay", "aft_local", "aft_conv", "aft_full")  # what the impl fixture runs
pytestmark = pytest.mark.usefixtures("impl")

B, T, d, h = 1, 7, 4, 2


def _case(name):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, d, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(T, T, generator=g, dtype=torch.float64)
    lam, u = torch.rand(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_()
    fns = {
        "aft_simple causal": lambda: aft_simple(q, k, v, causal=True),
        "aft_simple": lambda: aft_simple(q, k, v),
        "aft_decay": lambda: aft_decay(q, k, v, lam, u),
        "aft_full causal": lambda: aft_full(q, k, v, w, causal=True),
        "aft_local": lambda: aft_local(q, k, v, w, 3),
        "aft_conv": lambda: aft_conv(
            q.view(B, T, h, d // h), k.view(B, T, h, d // h), v.view(B, T, h, d // h), w[:h, :3]
        ),
    }
    refs = {
        "aft_simple": lambda: aft_simple_reference(q, k, v),
    }
    return fns[name], refs.get(name), q, k


@pytest.mark.parametrize(
    "name",
    ["aft_simple causal", "aft_simple", "aft_decay", "aft_full causal", "aft_local", "aft_conv"],
)
def test_second_derivative_raises(name):
    fn, ref, q, k = _case(name)
    plain = torch.autograd.grad(fn().sum(), k)[0]
    first = torch.autograd.grad(fn().sum(), k, create_graph=True)[0]
    assert torch.equal(first.detach(), plain), f"{name}: create_graph changed the gradient"
    try:
        (second,) = torch.autograd.grad(first.sum() + (q * q).sum(), q)
    except RuntimeError as e:
        assert "differentiable once" in str(e), f"{name}: {e}"
        return
    assert ref is not None, f"{name}: a second derivative came back from a hand-written backward"
    first_ref = torch.autograd.grad(ref().sum(), k, create_graph=True)[0]
    (second_ref,) = torch.autograd.grad(first_ref.sum() + (q * q).sum(), q)
    assert_close("d2y/dk dq", second, second_ref)
