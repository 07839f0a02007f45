"""Kernel vs pure-PyTorch aft_simple / aft_decay, causal, forward and forward+backward.

A quick measurement, not a test (see docs/kernels.md for the figures):

    python benchmarks/kernels_scan.py [--B 4] [--T 4096] [--d 256] [--threads 2]

The floor is the time to move the tensors the op must read and write (forward: q, k, v, y;
forward+backward: also dy, dq, dk, dv) at the rate of one ``torch.add(a, b, out=c)`` (3
tensors) measured in the same run.
"""

import argparse
import time

import torch

from aftlab.kernels import use_kernels
from aftlab.ops import aft_decay, aft_simple


def best(fn, n=5):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, T, d = a.B, a.T, a.d
    q, k, v = (torch.randn(B, T, d, requires_grad=True) for _ in range(3))
    lam, u = torch.rand(d, requires_grad=True), torch.randn(d, requires_grad=True)
    g, out = torch.randn(B, T, d), torch.empty(B, T, d)
    copy = best(lambda: torch.add(k.detach(), v.detach(), out=out)) / 3  # ms per tensor
    print(f"B={B} T={T} d={d} float32, {a.threads} threads; floor fwd {4 * copy:.1f} ms, "
          f"fwd+bwd {8 * copy:.1f} ms")
    ops = {
        "aft_simple": lambda: aft_simple(q, k, v, causal=True),
        "aft_decay": lambda: aft_decay(q, k, v, lam, u),
    }
    for name, op in ops.items():
        for impl in (True, False):
            with use_kernels(impl):
                with torch.no_grad():
                    fwd = best(op)
                fb = best(lambda op=op: op().backward(g))
            tag = "kernel " if impl else "pytorch"
            print(f"{name:10s} {tag}  fwd {fwd:7.1f} ms ({fwd / (4 * copy):4.1f}x floor)  "
                  f"fwd+bwd {fb:7.1f} ms ({fb / (8 * copy):4.1f}x floor)")


if __name__ == "__main__":
    main()
