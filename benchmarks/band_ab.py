"""The band kernel (``aftlab::band``) of this checkout against another commit's, in one process.

A quick A/B measurement for kernel work, not a test:

    python benchmarks/band_ab.py --base HEAD~1 [--lengths 256,4096] [--windows 1,32]
        [--non-causal] [--conv] [--base-cflags "..."] [--threads 2] [--rounds 12]
        [--batch 4] [--dim 256]
    python benchmarks/band_ab.py --base HEAD --identical

The base commit's ``csrc/band.cpp`` and ``common.h`` are read with ``git show``, built under the op
namespace ``aftbase`` (with aftlab's compiler flags, or ``--base-cflags``: the same source under
other flags) and loaded beside this checkout's kernels. ``--conv`` times aft-conv's form (one key
per head, 4 heads, a shared kernel ``w (1, 4, W)``) instead of aft-local's (a key per channel, a
bias row per query). Each round times one call of each build, alternating, so a slow spell of a
shared machine hits both; the report is the fastest round of each (ms), forward with the statistics
saved (as training runs it) and the backward alone, B = 4, d = 256 (``--batch``, ``--dim``),
float32, and the largest
difference between the two builds' outputs and gradients.

``--identical`` times nothing: it checks a change that should not alter a bit (a refactor) on
1,156 problems that reach every path (T 1 to 300, d 24 and 275, a key per channel or per group,
causal or not, float32 and float64, keys and biases up to 1e4 for the exact rows, padding, NaN
and inf, windows 1 to 33, no upstream gradient at every fifth query): y, M, 1/den and every
gradient equal bit for bit, or the differing cases are listed and it exits 1. The vectoriser's
choices count: the same arithmetic inlined differently can sum in another order.
"""

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aftlab import kernels
from aftlab.kernels import _build

ROOT = Path(__file__).resolve().parents[1]
CSRC = "src/aftlab/kernels/csrc"


def build_base(rev: str, folder: Path, cflags: list[str]) -> None:
    """Build ``rev``'s band kernel into ``folder`` as the ops ``aftbase::band[_backward]``."""
    for name in ("band.cpp", "common.h"):
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"],
            check=True, capture_output=True, text=True,
        ).stdout
        text = text.replace("TORCH_LIBRARY_FRAGMENT(aftlab,", "TORCH_LIBRARY_FRAGMENT(aftbase,")
        text = text.replace("TORCH_LIBRARY_IMPL(aftlab,", "TORCH_LIBRARY_IMPL(aftbase,")
        (folder / name).write_text(text)
    from torch.utils.cpp_extension import load

    load("aftlab_band_base", [str(folder / "band.cpp")], extra_cflags=cflags,
         extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def compare(ops: dict, T: int, s: int, causal: bool, rounds: int, conv: bool = False,
            B: int = 4, d: int = 256) -> str:
    """One table row: the fastest forward (statistics saved) and backward of each build."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, d, generator=g) for _ in range(3))
    lo, hi = s - 1, 0 if causal else s - 1
    rows, groups = (1, 4) if conv else (T, 1)
    if conv:
        k = torch.randn(B, T, groups, generator=g)
    w = 0.1 * torch.randn(rows, groups, lo + hi + 1, generator=g, dtype=torch.float64)
    gy = torch.randn(B, T, d, generator=g)
    geo = (lo, hi, causal, None)
    out = {n: op.band(q, k, v, w, *geo, True) for n, op in ops.items()}
    best = {(n, m): float("inf") for n in ops for m in ("f", "b")}
    for _ in range(rounds):
        for n, op in ops.items():
            f = timed(op.band, q, k, v, w, *geo, True)
            b = timed(op.band_backward, gy, q, k, v, w, *out[n], *geo)
            best[n, "f"], best[n, "b"] = min(best[n, "f"], f), min(best[n, "b"], b)
    grads = [op.band_backward(gy, q, k, v, w, *out[n], *geo) for n, op in ops.items()]
    dy = (out["base"][0] - out["this"][0]).abs().max().item()
    dg = max((x - y).abs().max().item() for x, y in zip(*grads, strict=True))
    ms = {key: f"{t * 1e3:.2f}" for key, t in best.items()}
    return (f"| {T} | {s} | {ms['base', 'f']} / {ms['this', 'f']} | {ms['base', 'b']} / "
            f"{ms['this', 'b']} | {dy:.1e}, {dg:.1e} |")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int64 if x.dtype == torch.float64 else torch.int32)


def identical_case(ops: dict, T: int, per_channel: bool, causal: bool, dtype: torch.dtype,
                   scale: float, masked: bool, nan: bool, s: int, seed: int,
                   D: int = 24) -> str | None:
    """One problem through both builds; the first output that differs in a bit, or None."""
    g = torch.Generator().manual_seed(seed)
    B, G = (2 if T < 200 else 1), (1 if per_channel else 4)
    lo, hi = s - 1, (0 if causal else s // 2)
    q, v, gy = (torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    k = scale * torch.randn(B, T, D if per_channel else G, generator=g, dtype=torch.float64)
    w = scale * torch.randn(T if per_channel else 1, G, lo + hi + 1, generator=g,
                            dtype=torch.float64)
    if nan:
        k[0, T // 2, 0], v[-1, T // 3, -1] = float("nan"), float("inf")
    gy[:, ::5] = 0
    q, k, v, gy = (x.to(dtype) for x in (q, k, v, gy))
    geo = (lo, hi, causal, torch.rand(B, T, generator=g) > 0.3 if masked else None)
    out = {n: op.band(q, k, v, w, *geo, True) for n, op in ops.items()}
    grads = {n: op.band_backward(gy, q, k, v, w, *out[n], *geo) for n, op in ops.items()}
    lean = {n: op.band(q, k, v, w, *geo, False)[:1] for n, op in ops.items()}
    for part, res in (("forward", out), ("forward without statistics", lean),
                      ("backward", grads)):
        if any(not torch.equal(bits(a), bits(b)) for a, b in zip(*res.values(), strict=True)):
            return part
    return None


def identical(ops: dict) -> int:
    """Every case of the grid through both builds; prints the differing ones."""
    grid = itertools.product([1, 7, 37, 200], [True, False], [True, False],
                             [torch.float32, torch.float64], [1.0, 30.0, 1e4], [False, True],
                             [False, True], [1, 5, 33])
    # and wide ones, through the 32- and 16-channel register blocks and several query blocks
    wide = [(300, True, c, dt, 3.0, True, False, 32, 275)
            for c in (True, False) for dt in (torch.float32, torch.float64)]
    bad = 0
    for seed, case in enumerate(itertools.chain(grid, wide)):
        part = identical_case(ops, *case[:8], seed, *case[8:])
        if part:
            bad += 1
            print(f"differs ({part}): T, per_channel, causal, dtype, scale, masked, nan, s, "
                  f"(d) = {case}")
    print(f"{seed + 1} cases, {bad} differ")
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="HEAD")
    p.add_argument("--lengths", default="256,4096")
    p.add_argument("--windows", default="1,32")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--conv", action="store_true", help="aft-conv's form: one key per head")
    p.add_argument("--base-cflags", help="compiler flags of the base build (default: aftlab's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--identical", action="store_true",
                   help="check that every output is bit for bit the base's instead of timing")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    assert kernels.load(), kernels.status()
    with tempfile.TemporaryDirectory() as tmp:
        flags = a.base_cflags.split() if a.base_cflags else _build.cflags()
        build_base(a.base, Path(tmp), flags)
        ops = {"base": torch.ops.aftbase, "this": torch.ops.aftlab}
        if a.identical:
            sys.exit(identical(ops))
        causal = not a.non_causal
        form = "aft-conv (4 heads, a key each)" if a.conv else "aft-local (a key per channel)"
        print(f"band kernel, {a.base} (base, flags {' '.join(flags)}) against this checkout "
              f"(flags {' '.join(_build.cflags())}); {form}, B {a.batch}, d {a.dim}, float32, "
              f"{a.threads} threads, {'causal' if causal else 'non-causal'}, fastest of "
              f"{a.rounds} alternating rounds")
        print("| T | s | forward base / this | backward base / this | max diff y, grads |")
        print("|---|---|---|---|---|")
        for T in map(int, a.lengths.split(",")):
            for s in map(int, a.windows.split(",")):
                print(compare(ops, T, s, causal, a.rounds, a.conv, a.batch, a.dim))

if __name__ == "__main__":
    main()
