"""benchmarks/band_ab.py --identical: a change to the band kernel that should alter no bit."""

from __future__ import annotations

import types

import pytest
import torch

from aftlab import kernels

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"kernels unavailable: {kernels.status()['aft_simple'][1]}"
)

CASES = [  # T, per_channel, causal, dtype, scale, masked, nan, s
    (37, True, True, torch.float32, 1e4, True, True, 33),  # exact rows, NaN, padding
    (37, True, False, torch.float32, 1.0, False, False, 5),
    (7, False, True, torch.float64, 30.0, True, False, 5),  # one key per group
]


def _nudged(part: str):
    """The aftlab op with one output moved by one unit in the last place."""
    op = torch.ops.aftlab

    def nudge(outs):
        first = outs[0].clone()
        first.view(-1)[0] = torch.nextafter(first.view(-1)[0], torch.tensor(float("inf")))
        return (first, *outs[1:])

    def band(*a):
        out = op.band(*a)
        return nudge(out) if part == "forward" else out

    def band_backward(*a):
        out = op.band_backward(*a)
        return nudge(out) if part == "backward" else out

    return types.SimpleNamespace(band=band, band_backward=band_backward)


def test_the_same_build_is_identical_and_one_ulp_is_found(benchmark_script):
    case = benchmark_script("band_ab").identical_case
    same = {"base": torch.ops.aftlab, "this": torch.ops.aftlab}
    for i, c in enumerate(CASES):
        assert case(same, *c, i) is None
    for part in ("forward", "backward"):
        ops = {"base": torch.ops.aftlab, "this": _nudged(part)}
        assert case(ops, *CASES[1], 1) == part
