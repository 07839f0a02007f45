"""What the attention mixer's NaN isolation costs: the mixer against bare SDPA, side by side.

    python benchmarks/attention_nonfinite_cost.py

The same weights, one thread, B = 4, d = 256, 4 heads, causal, forward + backward, best of 7,
the two interleaved. The outputs are checked equal first (finite input).
"""

import time

import torch
import torch.nn.functional as F

from aftlab.mixers import build_mixer


def bare(m, x):
    """``W^O SDPA(split(W^{QKV} x))``: the mixer without its non-finite handling."""
    B, T, _ = x.shape
    q, k, v = (t.view(B, T, m.n_heads, m.head_dim).transpose(1, 2) for t in m.qkv(x).chunk(3, -1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.scale)
    return m.out_proj(y.transpose(1, 2).reshape(B, T, -1))


def main() -> None:
    torch.set_num_threads(1)
    for T in (128, 1024):
        m = build_mixer("attention", d_model=256, n_heads=4, causal=True)
        x = torch.randn(4, T, 256, requires_grad=True)
        assert torch.equal(m(x), bare(m, x))
        best = {"bare": float("inf"), "mixer": float("inf")}
        for _ in range(7):
            for name, f in (("bare", bare), ("mixer", lambda m, x: m(x))):
                t0 = time.perf_counter()
                f(m, x).sum().backward()
                best[name] = min(best[name], time.perf_counter() - t0)
        extra = (best["mixer"] / best["bare"] - 1) * 100
        print(
            f"T={T}: bare SDPA {best['bare'] * 1e3:.2f} ms, mixer {best['mixer'] * 1e3:.2f} ms "
            f"(+{extra:.0f}%)"
        )


if __name__ == "__main__":
    main()
