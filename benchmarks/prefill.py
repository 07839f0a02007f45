"""Prefill of a prompt vs one forward pass of it, per causal mixer (target: <= 1.5x at T=4096).

A ``TransformerLM`` (d_model 256, 4 layers, 4 heads, batch of 1, float32, byte vocabulary) runs
``model(idx)`` and ``model.prefill(idx)`` (the same logits plus every layer's decoding state)
on one ``(1, T)`` prompt under ``torch.inference_mode``. The two are timed alternately, after
one warm-up call each, by the wall clock and by this process's CPU time (robust to other
processes sharing the cores); each ratio is of the fastest calls.

    python benchmarks/prefill.py [--length 4096] [--repeats 3] [--threads 2] [--mixers a,b]
        [--steps]

``--steps`` also times the token-by-token prefill that ``generate`` used before (``T`` calls of
``step``), for comparison.
"""

import argparse
import time

import torch

from aftlab.mixers import available_mixers
from aftlab.models import TransformerConfig, TransformerLM


def timed(fn) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one call of ``fn``."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def fastest(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return min(a[0], b[0]), min(a[1], b[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mixers", default=",".join(available_mixers()))
    p.add_argument("--steps", action="store_true", help="also time T calls of step()")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    T = a.length
    print(
        f"prefill vs forward: B=1, T={T}, d_model={a.d_model}, {a.layers} layers, "
        f"{a.heads} heads, float32, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    for name in a.mixers.split(","):
        print(measure(name, a), flush=True)


@torch.inference_mode()
def measure(name: str, a: argparse.Namespace) -> str:
    """One mixer's line: forward and prefill times (and token by token with ``--steps``)."""
    T = a.length
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
        max_seq_len=T, mixer=name,
    )
    model = TransformerLM(cfg).eval()
    idx = torch.randint(0, 256, (1, T))
    model(idx)
    model.prefill(idx)  # warm-up (and kernel build, if any)
    fwd = pre = (float("inf"), float("inf"))
    for _ in range(a.repeats):  # alternate, so slow phases of the machine hit both
        fwd = fastest(fwd, timed(lambda: model(idx)))
        pre = fastest(pre, timed(lambda: model.prefill(idx)))
    line = (
        f"{name:16s} wall: forward {fwd[0] * 1e3:8.1f} ms, prefill {pre[0] * 1e3:8.1f} ms, "
        f"ratio {pre[0] / fwd[0]:4.2f} | cpu: forward {fwd[1] * 1e3:8.1f} ms, "
        f"prefill {pre[1] * 1e3:8.1f} ms, ratio {pre[1] / fwd[1]:4.2f}"
    )
    if a.steps:

        def by_steps():
            cache = model.init_cache(1)
            for t in range(T):
                model.step(idx[:, t], cache)

        steps = timed(by_steps)
        line += f" | token by token: wall {steps[0] * 1e3:.0f} ms ({steps[0] / pre[0]:.0f}x)"
    return line


if __name__ == "__main__":
    main()
