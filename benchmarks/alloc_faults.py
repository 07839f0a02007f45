"""One call of a bench case under two allocators, each in a fresh process: glibc's default (as
in a training process, and as the bench times its calls) and the setting of the bench's memory
call (``fresh_pages``: every block over 128 KiB mapped afresh and returned on free, so that the
peak-memory reading follows the live tensors; every page of every new tensor is then faulted in
and zeroed on each call; the bench timed under it until 2026-12-07). Prints the median time and
the minor page faults per call of each:

    python benchmarks/alloc_faults.py [--mixer aft-local] [--mode train] [--T 4096]
        [--batch 4] [--dim 256] [--heads 4] [--threads 2] [--repeats 10]

The case is the bench's own (``aftlab.bench.measure._setup``: causal, float32, CPU), three
calls of warm-up first. A measurement for docs/benchmarks.md, not a test.
"""

import argparse
import multiprocessing as mp
import resource
import time
from statistics import median

import torch

from aftlab.bench import BenchConfig, Shape
from aftlab.bench.cases import Spec
from aftlab.bench.measure import _setup, fresh_pages


def measure(a: argparse.Namespace, fresh: bool) -> str:
    """Median ms and faults per call of the case, in this process."""
    if fresh:  # as the bench's memory call
        fresh_pages()
    torch.set_num_threads(a.threads)
    cfg = BenchConfig(threads=a.threads, device="cpu", dtype="float32")
    spec = Spec(a.mixer, a.mode, True, Shape(a.batch, a.T, a.dim, a.heads), cfg)
    fn, _ = _setup(spec, None, torch.device("cpu"), torch.float32)
    for _ in range(3):
        fn()
    f0, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / a.repeats
    name = "fresh pages" if fresh else "glibc default"
    return f"{name:20s} median {median(times) * 1e3:8.2f} ms, {faults:9,.0f} minor faults a call"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mixer", default="aft-local")
    p.add_argument("--mode", default="train", choices=("forward", "train"))
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    print(f"{a.mixer} {a.mode}, causal, B {a.batch}, T {a.T}, d {a.dim}, {a.heads} heads, "
          f"float32, {a.threads} threads")
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for fresh in (False, True):
            print(pool.apply(measure, (a, fresh)))


if __name__ == "__main__":
    main()
