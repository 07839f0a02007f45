"""Bitwise reproducibility at a fixed thread count: forward and backward twice, the same bits.

With 2 threads an accumulation whose order follows the thread schedule (``index_put_`` with
``accumulate=True``, the backward of an advanced index ``x[idx]`` on the CPU) gives results
that differ in the last bits from run to run, which training then amplifies.
"""

from __future__ import annotations

import pytest
import torch

from aftlab.mixers.aft.local import AFTLocal
from aftlab.ops import aft_conv, aft_full, aft_local


@pytest.fixture(autouse=True)
def _two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def _runs(f, xs, n=3):
    """``n`` forward + backward passes of ``f`` on copies of ``xs``: ``[[y, *grads], ...]``."""
    out = []
    for _ in range(n):
        ys = [x.detach().clone().requires_grad_() for x in xs]
        y = f(*ys)
        g = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype).expand_as(y)
        out.append([y.detach(), *torch.autograd.grad(y, ys, g)])
    return out


def _assert_identical(runs):
    for i, run in enumerate(runs[1:], 1):
        for name, a, b in zip(["y", "dq", "dk", "dv", "dw"], run, runs[0], strict=False):
            assert torch.equal(a, b), f"run {i}: {name} differs from run 0"


_G = torch.Generator().manual_seed(0)
_Q, _K, _V = torch.randn(3, 2, 256, 32, generator=_G).unbind(0)
_W = torch.randn(256, 256, generator=_G)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["typical", "huge"])  # huge: every row rescued
def test_aft_full_is_bitwise_reproducible(causal, scale):
    f = lambda q, k, v, w: aft_full(q, k, v, w, causal=causal)  # noqa: E731
    _assert_identical(_runs(f, [_Q, _K * scale, _V, _W * scale]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["typical", "huge"])
def test_aft_local_is_bitwise_reproducible(causal, scale):
    f = lambda q, k, v, w: aft_local(q, k, v, w, 16, causal=causal)  # noqa: E731
    _assert_identical(_runs(f, [_Q, _K * scale, _V, _W * scale]))


@pytest.mark.parametrize("causal", [False, True])
def test_aft_conv_is_bitwise_reproducible(causal):
    h = lambda x: x.reshape(2, 256, 4, 8)  # noqa: E731
    kernel = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    f = lambda q, k, v, w: aft_conv(q, k, v, w, causal=causal)  # noqa: E731
    _assert_identical(_runs(f, [h(_Q), h(_K)[..., :1], h(_V), kernel]))


def test_aft_local_mixer_is_bitwise_reproducible():
    """The band of ``w = U V^T`` (the mixer's own gather): gradients of ``U`` and ``V`` too."""
    torch.manual_seed(0)
    m = AFTLocal(d_model=16, max_seq_len=512, causal=True, window=32)
    with torch.no_grad():
        m.pos_bias.v.normal_()  # V starts at 0; any V exercises the same gather
    x = torch.randn(2, 512, 16, generator=torch.Generator().manual_seed(2))
    runs = []
    for _ in range(8):  # the races are rare enough that 3 runs sometimes all agree
        m.zero_grad()
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * torch.linspace(-1, 1, 16)).sum().backward()
        runs.append([y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()])
    names = ["y", "dx"] + [n for n, _ in m.named_parameters()]
    for i, run in enumerate(runs[1:], 1):
        for name, a, b in zip(names, run, runs[0], strict=True):
            assert torch.equal(a, b), f"run {i}: {name} differs from run 0"
