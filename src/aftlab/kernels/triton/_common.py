"""What the Triton kernels share, as ``csrc/common.h`` for the C++ ones: the sigmoid, the clamp
of an average to the largest value seen, and the launch geometry.

Every kernel computes in the dtype of its tensors (float32 or float64; the callers cast
float16/bfloat16 to float32, as for the C++ kernels) and takes exponentials of non-positive
numbers only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: ``tl`` dtypes of the compute dtypes.
TL = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def sigmoid(x):
    """``1 / (1 + exp(-x))`` with only ``exp(-|x|)``."""
    e = tl.exp(-tl.abs(x))
    inv = 1.0 / (1.0 + e)
    return tl.where(x >= 0, inv, e * inv)


@triton.jit
def clamp_abs(x, vm):
    """``x`` clamped to ``[-vm, vm]``; a NaN ``x`` stays NaN."""
    return tl.where(x > vm, vm, tl.where(x < -vm, -vm, x))


def value_scale(n: int) -> float:
    """``2^-e`` with ``2^e >= n + 1`` (``csrc/common.h``): values enter the sums times this, so
    that a sum of ``n`` weights ``<= 1`` times values never overflows."""
    e = 0
    while e < 62 and (1 << e) < n + 1:
        e += 1
    return 2.0 ** -e


def block(B: int, d: int, device: torch.device) -> tuple[int, int]:
    """``(BB, BD)``, the sequences and channels of one program. On a GPU one sequence and 32
    channels (a warp's lanes; many programs for the SMs, as fla's recurrent kernels). Under the
    interpreter, whose cost is per program and per step rather than per element, all of them
    (powers of two, up to 2^16 elements)."""
    if device.type == "cuda":
        return 1, 32
    bd = min(1024, triton.next_power_of_2(max(d, 1)))
    bb = min(max(1, 65536 // bd), triton.next_power_of_2(max(B, 1)))
    return bb, bd
