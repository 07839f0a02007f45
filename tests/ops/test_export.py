"""Every hand-written backward of the PyTorch implementations is a ``torch.library`` custom op,
as the C++ kernels' are (tests/kernels/test_export.py): ``torch.export`` of an op with the
kernels off calls its ``aftlab::`` op (forward and backward are one opaque operator each, which
torch.compile calls whole instead of unrolling their loops) and gives the eager result."""

import pytest
import torch

from aftlab import kernels
from aftlab.ops import aft_conv, aft_conv2d, aft_decay, aft_full, aft_simple
from aftlab.ops.aft_local import aft_local_band

pytestmark = pytest.mark.usefixtures("one_thread")  # small sizes (conftest)

B, T, d, h, s = 2, 19, 6, 2, 5


def _heads(x):
    return x.view(B, T, h, d // h)


CASES = {
    "aft_simple causal": (
        lambda q, k, v: aft_simple(q, k, v, causal=True), "stable_prefix_average"
    ),
    "aft_decay": (
        lambda q, k, v: aft_decay(q, k, v, torch.full((d,), 0.3), torch.full((d,), -0.2)),
        "stable_prefix_average",
    ),
    "aft_local causal": (
        lambda q, k, v: aft_local_band(q, k, v, torch.ones(T, s) * 0.1, s, causal=True),
        "lse_average",
    ),
    "aft_full causal": (
        lambda q, k, v: aft_full(q, k, v, torch.linspace(-1, 1, T * T).view(T, T), causal=True),
        "lse_average",
    ),
    "aft_conv": (
        lambda q, k, v: aft_conv(
            _heads(q), _heads(k)[..., :1], _heads(v), torch.linspace(-1, 1, h * s).view(h, s)
        ).reshape(B, T, d),
        "aft_conv",
    ),
    "aft_conv2d": (
        lambda q, k, v: aft_conv2d(
            *(x[:, :18].reshape(B, 3, 6, h, d // h) for x in (q, k, v)),
            torch.linspace(-1, 1, h * 9).view(h, 3, 3),
        ),
        "aft_conv",
    ),
}


class _Op(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v)


@pytest.mark.parametrize("name", list(CASES))
def test_export_calls_the_custom_op_and_equals_eager(name):
    fn, op = CASES[name]
    q, k, v = (torch.randn(B, T, d) for _ in range(3))
    with kernels.use_kernels(False):
        program = torch.export.export(_Op(fn), (q, k, v))
        eager = fn(q, k, v)
    graphs = [m for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    # (the ops' autocast-free blocks are nested graphs)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert f"aftlab.{op}.default" in targets, f"{name}: aftlab::{op} not in the graph: {targets}"
    assert torch.equal(program.module()(q, k, v), eager), f"{name}: exported != eager"
