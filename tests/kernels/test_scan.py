"""The scan kernels (``aftlab::simple_causal``, ``simple_global``, ``decay``; ``csrc/scan.cpp``):
a forward without gradient saves nothing, and ``torch.compile(fullgraph=True)`` equals eager.

Their values against the float64 references are tested in tests/ops (test_aft_simple.py,
test_aft_decay.py), on both implementations.
"""

import pytest
import torch

from aftlab import kernels
from aftlab.ops import aft_decay, aft_simple

from .test_kernels import _inputs, needs_kernels


@needs_kernels
def test_forward_only_saves_nothing_and_matches():
    q, k, v, lam, u = (t.detach().float() for t in _inputs())
    with kernels.use_kernels(True), torch.no_grad():
        y, r = torch.ops.aftlab.simple_causal(q, k, v, None, False)
        assert r.numel() == 0
        assert torch.equal(y, aft_simple(q, k, v, causal=True))
        y, r, w = torch.ops.aftlab.decay(q, k, v, lam, u, None, False)
        assert r.numel() == 0 and w.numel() == 0


@needs_kernels
@pytest.mark.slow
def test_compile_fullgraph_equals_eager():
    q, k, v, lam, u = _inputs()
    g = torch.randn(2, 33, 5, dtype=torch.float64)
    cases = {
        "simple causal": (lambda q, k, v, lam, u: aft_simple(q, k, v, causal=True), 3),
        "simple": (lambda q, k, v, lam, u: aft_simple(q, k, v), 3),
        "decay": (lambda q, k, v, lam, u: aft_decay(q, k, v, lam, u), 5),
    }
    with kernels.use_kernels(True):
        for name, (fn, n) in cases.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True)
            ins = (q, k, v, lam, u)
            y, yc = fn(*ins), compiled(*ins)
            assert torch.equal(y, yc), name
            grads = torch.autograd.grad((y * g).sum(), ins[:n])
            grads_c = torch.autograd.grad((yc * g).sum(), ins[:n])
            for a, b in zip(grads, grads_c, strict=True):
                assert torch.equal(a, b), name
