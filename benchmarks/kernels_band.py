"""Band kernel vs pure-PyTorch aft-local / aft-conv vs SDPA, causal, forward and forward+backward.

A quick measurement, not a test (see docs/kernels.md for the figures):

    python benchmarks/kernels_band.py [--B 4] [--T 4096] [--d 256] [--threads 2] [--n 5]

aft-local: window 32 (bias band (T, 32)); aft-conv: kernel 31, 4 heads, one key per head;
SDPA: ``scaled_dot_product_attention`` causal with 4 heads of 64 (d / 4). Medians of ``n`` runs
after one warm-up; forward under ``no_grad``, forward+backward with a random upstream gradient.
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from aftlab import kernels
from aftlab.kernels import band
from aftlab.ops.aft_conv import aft_conv
from aftlab.ops.aft_local import aft_local_band


def median_ms(fn, n):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--no-pytorch", action="store_true", help="skip the (slow) PyTorch ops")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    assert kernels.load(), kernels.status()
    B, T, d, h = a.B, a.T, a.d, 4
    q, k, v = (torch.randn(B, T, d, requires_grad=True) for _ in range(3))
    wl = (0.1 * torch.randn(T, 32)).requires_grad_()
    kc = torch.randn(B, T, h, 1, requires_grad=True)
    wc = (0.1 * torch.randn(h, 31)).requires_grad_()
    g = torch.randn(B, T, d)

    def heads(x):
        return x.view(B, T, h, d // h)

    def sdpa():
        qh, kh, vh = (x.view(B, T, h, d // h).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)

    cases = {
        "aft-local kernel": lambda: band.local(q, k, v, wl, 32, causal=True),
        "aft-local pytorch": lambda: aft_local_band(q, k, v, wl, 32, causal=True),
        "aft-conv kernel": lambda: band.conv1d(heads(q), kc, heads(v), wc, causal=True),
        "aft-conv pytorch": lambda: aft_conv(heads(q), kc, heads(v), wc, causal=True),
        "sdpa (4x64)": sdpa,
    }
    load = os.getloadavg()[0]
    print(
        f"B={B} T={T} d={d} float32, {a.threads} threads, median of {a.n}; "
        f"load average {load:.1f} before"
    )
    for name, op in cases.items():
        if a.no_pytorch and "pytorch" in name:
            continue
        with torch.no_grad():
            fwd = median_ms(op, a.n)
        fb = median_ms(lambda op=op: op().reshape(B, T, d).backward(g), a.n)
        print(f"{name:18s} fwd {fwd:8.1f} ms   fwd+bwd {fb:8.1f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
