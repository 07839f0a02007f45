"""torch.export traces through every kernel op, C++ and Triton: the exported program calls the
``aftlab::`` op (no graph break, no fallback to the PyTorch composition) and gives the eager
result. The Triton ops run through Triton's interpreter on CPU (tests/conftest.py)."""

import pytest
import torch

from aftlab import kernels
from aftlab.ops import aft_conv, aft_decay, aft_full, aft_simple
from aftlab.ops.aft_local import aft_local_band

B, T, d, h, s = 2, 19, 6, 2, 5
CASES = {
    "aft_simple causal": (lambda q, k, v: aft_simple(q, k, v, causal=True), "simple_causal"),
    "aft_simple": (lambda q, k, v: aft_simple(q, k, v), "simple_global"),
    "aft_decay": (
        lambda q, k, v: aft_decay(q, k, v, torch.full((d,), 0.3), torch.full((d,), -0.2)),
        "decay",
    ),
    "aft_local causal": (
        lambda q, k, v: aft_local_band(q, k, v, torch.ones(T, s) * 0.1, s, causal=True),
        "band",
    ),
    "aft_full causal": (
        lambda q, k, v: aft_full(q, k, v, torch.linspace(-1, 1, T * T).view(T, T), causal=True),
        "full",
    ),
    "aft_conv": (
        lambda q, k, v: aft_conv(
            q.view(B, T, h, d // h), k[..., :h, None].expand(B, T, h, 1), v.view(B, T, h, d // h),
            torch.linspace(-1, 1, h * s).view(h, s),
        ).reshape(B, T, d),
        "band",
    ),
}


class _Op(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v)


#: the Triton op each case stands for where it is not ``triton_<the C++ op>``: aft-local's band
#: (one bias row for all channels) on the products, aft-conv's (a kernel per head) on the terms
TRITON = {"aft_local causal": "triton_band_dot", "aft_conv": "triton_band_core",
          "aft_full causal": "triton_full_core"}


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_calls_the_kernel_and_equals_eager(name, backend):
    if backend == "cpp" and not kernels.load():
        pytest.skip(f"kernels unavailable: {kernels.status()['aft_simple'][1]}")
    if backend == "triton" and not kernels.triton.load():
        pytest.skip(f"Triton kernels unavailable: {kernels.triton.error()}")
    fn, op = CASES[name]
    if backend == "triton":
        op = TRITON.get(name, f"triton_{op}")
    q, k, v = (torch.randn(B, T, d) for _ in range(3))
    with kernels.use_kernels(True if backend == "cpp" else "triton"):
        program = torch.export.export(_Op(fn), (q, k, v))
        eager = fn(q, k, v)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert f"aftlab.{op}.default" in targets, f"{name}: aftlab::{op} not in the graph: {targets}"
    assert torch.equal(program.module()(q, k, v), eager), f"{name}: exported != eager"
