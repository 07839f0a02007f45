"""Values up to ``finfo(float32).max / 2`` give finite outputs, on the kernels and the PyTorch path.

Each average is at most the largest ``|V|``, but its sums are not: the PyTorch path (CUDA,
``AFTLAB_KERNELS=0``) gave ``inf`` for values of 1e38 before its shifts kept a headroom of
``log(n + 1)`` for ``n`` terms (``aftlab.ops._numerics.headroom``), as the kernels scale theirs.
T = 300: causal AFT-full in two query blocks (256 rows, then a diagonal with keys above the
block's shift), AFT-local's band in blocks of 64.
"""

from __future__ import annotations

import pytest
import torch

from aftlab.ops import aft_conv, aft_conv2d, aft_full, aft_local
from aftlab.ops.aft_conv import aft_conv2d_reference, aft_conv_reference
from aftlab.ops.aft_full import aft_full_reference
from aftlab.ops.aft_local import aft_local_reference
from aftlab.testing import assert_close

OP = ("aft_local", "aft_conv", "aft_full")  # what the impl fixture runs
pytestmark = pytest.mark.usefixtures("one_thread", "impl")

B, T, D, HEADS = 2, 300, 4, 2
HALF_MAX = torch.finfo(torch.float32).max / 2
_G = torch.Generator().manual_seed(0)
Q, K = torch.randn(2, B, T, D, generator=_G).unbind(0)
# many comparable terms, whose sums times the values overflow without the headroom; the keys
# of the second causal block's diagonal (257 on) above that block's shift
K = K * 0.5
K[:, :257] -= 4.0
W = torch.randn(T, T, generator=_G) * 0.1
KERNEL = torch.randn(HEADS, 15, generator=_G) * 0.1
#: absolute tolerance per largest |V| (mixed signs cancel: a small average is only known to that)
_ATOL = 1e-5
VALUES = {
    "1e38": torch.full((B, T, D), 1e38),
    "-max/2": torch.full((B, T, D), -HALF_MAX),
    "uniform in +-max/2": (torch.rand(B, T, D, generator=_G) * 2 - 1) * HALF_MAX,
}


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(B, T, HEADS, D // HEADS)


OPS = {
    "aft_full": (aft_full, aft_full_reference, lambda q, k, v: (q, k, v, W)),
    "aft_local": (
        lambda *a, causal: aft_local(*a, 32, causal=causal),
        lambda *a, causal: aft_local_reference(*a, 32, causal=causal),
        lambda q, k, v: (q, k, v, W),
    ),
    "aft_conv": (
        aft_conv,
        aft_conv_reference,
        lambda q, k, v: (_heads(q), _heads(k)[..., :1], _heads(v), KERNEL),
    ),
}


@pytest.mark.parametrize("values", list(VALUES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", list(OPS))
def test_large_values_give_finite_outputs(op, causal, values):
    f, reference, args = OPS[op]
    x = args(Q, K, VALUES[values])
    y = f(*x, causal=causal)
    assert torch.isfinite(y).all(), f"{op}: {int((~torch.isfinite(y)).sum())} non-finite outputs"
    ref = reference(*x, causal=causal).reshape(B, T, D)
    assert_close(op, y.reshape(B, T, D), ref, atol=_ATOL * VALUES[values].abs().max().item())


@pytest.mark.parametrize("values", list(VALUES))
def test_large_values_give_finite_outputs_2d(values):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, B, 6, 6, HEADS, 2, generator=g).unbind(0)
    v = VALUES[values].reshape(-1)[: q.numel()].reshape(q.shape)
    w = torch.randn(HEADS, 3, 3, generator=g)
    y = aft_conv2d(q, k[..., :1], v, w)
    assert torch.isfinite(y).all()
    ref = aft_conv2d_reference(q, k[..., :1], v, w)
    assert_close("aft_conv2d", y, ref, atol=_ATOL * v.abs().max().item())


def test_aft_full_decoding_stays_finite_for_large_values():
    """``AFTFull.step`` shifts its weights by the headroom too: decoding values of 1e38 (equal
    keys, so every weight is the same) gives finite outputs, as the forward does."""
    from aftlab.mixers import build_mixer

    torch.manual_seed(0)
    m = build_mixer("aft-full", d_model=4, causal=True, max_seq_len=8).eval()
    with torch.no_grad():
        m.to_v.weight.zero_()
        m.to_v.bias.fill_(1e38)
        m.to_k.weight.zero_()
        x = torch.randn(2, 6, 4)
        state = m.init_state(2)
        for t in range(6):
            y, state = m.step(x[:, t], state)
            assert torch.isfinite(y).all(), t
        assert torch.isfinite(m(x)).all()
