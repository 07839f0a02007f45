"""Peak memory of aft_full forward+backward above its inputs (budget: <= 3 GiB at B=8, T=2048,
d=512, float32, CPU). Peak RSS (VmHWM) is read in this fresh process before and after.

    python benchmarks/aft_full_memory.py [--causal] [--batch 8] [--length 2048] [--dim 512]

One case per process: the peak RSS only ever grows.
"""

import argparse
import resource

import torch

from aftlab.functional import aft_full


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--causal", action="store_true")
    a = p.parse_args()
    B, T, d, causal = a.batch, a.length, a.dim, a.causal
    q, k, v = (torch.randn(B, T, d, requires_grad=True) for _ in range(3))
    w = torch.randn(T, T, requires_grad=True)
    # warm up the allocator and autograd on a tiny case, then take the baseline
    aft_full(q[:1, :8], k[:1, :8], v[:1, :8], w, causal=causal).sum().backward()
    for t in (q, k, v, w):
        t.grad = None
    base = peak_rss_bytes()
    y = aft_full(q, k, v, w, causal=causal)
    y.square().sum().backward()
    grown = max(0, peak_rss_bytes() - base)
    naive = B * T * T * d * 4
    print(
        f"aft_full causal={causal} B={B} T={T} d={d}: peak RSS above inputs "
        f"{grown / 2**30:.2f} GiB (B x T x T x d in float32: {naive / 2**30:.0f} GiB)"
    )


if __name__ == "__main__":
    main()
