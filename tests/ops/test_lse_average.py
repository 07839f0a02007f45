"""The PyTorch engine of AFT-full and AFT-local's band (:mod:`aftlab.ops.lse_average`) as a
registered operator. Its values, gradients and causality are tested through the ops that use
it (test_aft_full.py, test_aft_local.py, test_causality.py) on their PyTorch implementation."""

import pytest
import torch

import aftlab.ops.lse_average  # noqa: F401  (registers aftlab::lse_average)

pytestmark = pytest.mark.usefixtures("one_thread")  # small sizes (conftest)


@pytest.mark.parametrize("geometry", ["full", "full-causal", "band-causal"])
def test_pytorch_op_registration(geometry):
    """``torch.library.opcheck`` of ``aftlab::lse_average`` and its backward op (schema, fake
    tensors with their strides, autograd, AOT dispatch), with a transposed bias: the gradient is
    contiguous in the real op and must be so in the fake one."""
    B, T, d = 2, 9, 3
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, B, T, d, generator=g, dtype=torch.float64).unbind(0)
    W, alpha, beta = (3, 1, 2) if geometry == "band-causal" else (T, 0, 0)
    causal = geometry != "full"
    wb = torch.randn(W, T, generator=g, dtype=torch.float64).t()  # (T, W), not contiguous
    geo = (W, alpha, beta, causal)
    fwd = [k.requires_grad_(), v.requires_grad_(), wb.requires_grad_(), None, *geo, True]
    torch.library.opcheck(torch.ops.aftlab.lse_average.default, fwd)
    with torch.no_grad():
        L, A, den, redo = torch.ops.aftlab.lse_average(*fwd)
    gL, gA = torch.randn(2, B, T, d, generator=g, dtype=torch.float64).unbind(0)
    bwd = (gL, gA, k.detach(), v.detach(), wb.detach(), None, A, den, redo, *geo)
    torch.library.opcheck(torch.ops.aftlab.lse_average_backward.default, bwd)
