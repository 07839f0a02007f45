"""Measuring one case of ``aftlab bench``: the correctness gate (no case is timed before its
computation, at a small shape, matches its float64 reference), its times and its peak memory
above the inputs (on CPU in a fresh process per case); and the machine's limits (what the
machine is: :mod:`aftlab._system`). See docs/benchmarks.md, "How it is measured" and
"Correctness gate"."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from statistics import median
from typing import Any, NamedTuple

import torch

from .._system import memory_baseline, peak_memory_since
from ..testing import assert_close, decode, max_error
from .cases import Op, Shape, Spec, cases, prepare

SLOW_CALL_S = 1.0  # a first call slower than this is all the warm-up
MIN_CALLS = 3  # the fewest calls of a case: a warm-up, one timed call, the memory call


class Gate(NamedTuple):
    """``status``: ``"passed"`` (with the largest error), ``"failed"``, ``"unavailable"`` (op or
    reference missing: skipped) or ``"unchecked"`` (a peer without a reference: timed)."""

    status: str
    note: str = ""
    max_error: float | None = None


def gate_shape(s: Shape) -> Shape:
    """``B <= 2``, ``T <= 71`` (past aft-local's band of 2 x 32), at most 8 channels per head."""
    return Shape(min(s.B, 2), min(s.T, 71), s.h * min(s.c, 8), s.h, s.esize)


def first_line(e: BaseException) -> str:
    """``"Type: message"``, the message's first line only."""
    return traceback.format_exception_only(e)[-1].strip().splitlines()[0]


def _steps(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m.step`` from ``m.init_state`` over ``x (B, T, d)``, token by token: ``(B, T, d)``."""
    return decode(m, x)[0]


def _check(spec: Spec, op: Op | None, dtype, device) -> float | None:
    """The output (train: and the gradient of every leaf for the same ``dy``; decode: the steps)
    against the float64 reference; the largest error (None: a peer's module without one)."""
    f64, x64, leaves64 = prepare(spec, op, torch.float64, "cpu", seed=1234, reference=True)
    if f64 is None:
        return None
    f, x, leaves = prepare(spec, op, dtype, device, seed=1234)
    with torch.no_grad():  # the reference sees the very inputs and weights, rounded to dtype
        for name, t in leaves64.items():
            t.copy_(leaves[name].double())
    train, f = spec.mode == "train", partial(_steps, f) if spec.mode == "decode" else f
    outs = []  # [y, dy/dleaf...] of each; a leaf the output does not use: a zero gradient
    for fn, inputs, ts in ((f, x, leaves), (f64, x64, leaves64)):
        ts = [t.requires_grad_(train) for t in ts.values()] if train else []
        with torch.set_grad_enabled(train):
            y = fn(inputs)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        g = torch.autograd.grad(y, ts, dy.to(y), allow_unused=True) if train else ()
        outs.append(
            [y, *(torch.zeros_like(t) if a is None else a for t, a in zip(ts, g, strict=True))]
        )
    names = ["y", *(f"d{n}" for n in leaves if train)]
    for what, a, e in zip(names, *outs, strict=True):
        assert_close(f"{spec.name.split(':')[-1]} {what}", a, e)
    return max(max_error(a.detach(), e.detach()) for a, e in zip(*outs, strict=True))


def check(spec: Spec, op: Op | None, dtype, device) -> Gate:
    """Gate ``spec`` at :func:`gate_shape` (decode: the mixer's steps against its forward)."""
    try:
        err = _check(spec._replace(shape=gate_shape(spec.shape)), op, dtype, device)
    except AssertionError as e:
        return Gate("failed", f"correctness gate failed: {first_line(e)}")
    except (NotImplementedError, LookupError) as e:
        return Gate("unavailable", f"not available: {first_line(e)}")
    except Exception as e:  # a crash at the gate is a failure of the case, reported as such
        return Gate("failed", f"correctness gate raised {first_line(e)}")
    if err is None:
        return Gate("unchecked", "no float64 reference: outputs not compared")
    return Gate("passed", max_error=err)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call of ``fn``, synchronising the device around it."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _device: None
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def measure_limits(device: torch.device, dtype: torch.dtype, *, size: str = "full") -> dict:
    """The GEMM rate and the memory bandwidth on ``device`` (median of 5 after a warm-up).

    GEMM: ``a @ b``, ``n x n`` (2048 on CPU, 8192 on CUDA), ``2 n^3`` FLOPs. Bandwidth: the
    larger rate (a floor must be a lower bound) of ``y.copy_(x)`` (``2 N`` elements moved) and
    ``torch.add(x, y, out=z)`` (``3 N``), ``N = 64 Mi``. ``size="tiny"``: small, for tests.
    """
    kw = {"device": device, "dtype": dtype}
    n = 256 if size == "tiny" else (8192 if device.type == "cuda" else 2048)
    m = 2**16 if size == "tiny" else 2**26

    def rate(work: float, fn: Callable[[], object]) -> float:
        fn()
        return work / median(timed(fn, device) for _ in range(5))

    ab = [torch.randn(n, n, **kw), torch.randn(n, n, **kw)]
    gemm = rate(2.0 * n**3, lambda: ab[0] @ ab[1])
    ab.clear()  # freed before the vectors are allocated
    x, y, z = torch.randn(m, **kw), torch.empty(m, **kw), torch.empty(m, **kw)
    nbytes = m * x.element_size()
    copy = rate(2 * nbytes, lambda: y.copy_(x))
    add = rate(3 * nbytes, lambda: torch.add(x, y, out=z))
    return {
        "gemm_flops_per_s": gemm,
        "bandwidth_bytes_per_s": max(copy, add),
        "copy_bytes_per_s": copy,
        "add_bytes_per_s": add,
        "gemm_n": n,
        "stream_elements": m,
        "dtype": str(dtype).replace("torch.", ""),
    }


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes held by the tensors inside ``obj`` (objects, dicts, lists, tuples), each once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage, new = obj.untyped_storage(), obj.untyped_storage().data_ptr() not in seen
        seen.add(storage.data_ptr())
        return storage.nbytes() if new else 0
    obj = vars(obj) if hasattr(obj, "__dict__") else obj
    obj = list(obj.values()) if isinstance(obj, dict) else obj
    return sum(tensor_bytes(v, seen) for v in obj) if isinstance(obj, (list, tuple)) else 0


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[int | None, str, float]:
    """Run ``fn`` once; return (peak bytes above the state before the call, method, seconds)."""
    gc.collect(1)  # the young generations: the previous call's cycles, cheaply
    base = memory_baseline(device, reset=True)
    if base is None:
        return None, "unavailable (no /proc/self/clear_refs)", timed(fn, device)
    seconds = timed(fn, device)
    method = "cuda max_memory_allocated" if device.type == "cuda" else "VmHWM - VmRSS"
    return peak_memory_since(device, base), method, seconds


def _setup(spec: Spec, op: Op | None, device, dtype) -> tuple[Callable, dict]:
    """``(fn, info)``: ``fn`` is one call of the case; ``info`` goes into its row.

    * forward: under ``no_grad``; train: ``autograd.grad`` of every leaf for a fixed ``dy``;
    * decode: the mixer's ``step`` from its ``prefill`` state at ``T`` (timed at ``T, T+1, ...``);
    * a peer's module: also whether its output is finite on ``x`` and on ``1000 x``.
    """
    s, cfg = spec.shape, spec.cfg
    if spec.mode == "decode":
        extra = cfg.warmup + cfg.repeats + 8
        long = spec._replace(shape=Shape(s.B, s.T + extra, s.d, s.h, s.esize))
        m, x, _ = prepare(long, op, dtype, device, seed=cfg.seed)
        with torch.inference_mode():
            box = {"state": m.prefill(x[:, : s.T])[1], "t": s.T}

        @torch.inference_mode()
        def step():
            y, box["state"] = m.step(x[:, box["t"]], box["state"])
            box["t"] += 1
            return y

        return step, {"state_bytes": tensor_bytes(box["state"])}
    f, x, leaves = prepare(spec, op, dtype, device, seed=cfg.seed)
    info = {}
    if ":" in spec.name:
        with torch.no_grad():
            info = {"finite": bool(f(x).isfinite().all())}
            info["finite_large_input"] = bool(f(x * 1000.0).isfinite().all())
    if spec.mode == "forward":
        return torch.no_grad()(lambda: f(x)), info
    dy = torch.randn_like(torch.no_grad()(f)(x))
    leaves = [t.requires_grad_(True) for t in leaves.values()]
    return lambda: torch.autograd.grad(f(x), leaves, dy), info


def run_case(spec: Spec, op: Op | None = None, own_process: bool = False) -> dict:
    """The row's measured fields: prime at a tiny size (one-time costs counted nowhere), set up,
    warm up (a first call over :data:`SLOW_CALL_S` is all the warm-up), time up to ``repeats``
    calls within ``max_seconds_per_case`` (at least one), then measure the peak memory on one
    more call; ``status`` ``"ok"``, ``"skipped"`` (out of memory) or ``"error"``.

    The calls are timed under the allocator as a training process has it; in a case's own
    process (``own_process``) the memory call runs after :func:`fresh_pages`, so that the
    resident set follows the live tensors."""
    cfg, s = spec.cfg, spec.shape
    deadline = time.perf_counter() + cfg.max_seconds_per_case
    torch.set_num_threads(cfg.threads)
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    tiny = spec._replace(shape=Shape(1, min(s.T, 4), s.h * min(s.c, 2), s.h, s.esize))
    try:
        _setup(tiny, op, device, dtype)[0]()
        fn, info = _setup(spec, op, device, dtype)
        if timed(fn, device) < SLOW_CALL_S:
            for _ in range(cfg.warmup - 1):
                timed(fn, device)
        times = [timed(fn, device)]
        while len(times) < cfg.repeats and time.perf_counter() + median(times) < deadline:
            times.append(timed(fn, device))
        if own_process:
            fresh_pages()
        peak, method, _ = peak_memory(fn, device)
    except torch.OutOfMemoryError as e:
        return {"status": "skipped", "note": f"out of memory: {str(e).splitlines()[0]}"}
    except Exception as e:  # reported per case: one broken mixer must not stop the run
        return {"status": "error", "note": first_line(e)}
    short = len(times) < cfg.repeats
    return {
        "status": "ok",
        "note": f"{len(times)} of {cfg.repeats} repeats within the time budget" if short else "",
        "time_median_s": median(times),
        "time_min_s": min(times),
        "repeats": len(times),
        "peak_bytes": peak,
        "mem_method": f"{method}, {'fresh process' if own_process else 'in-process'}",
        **info,
    }


def fresh_pages() -> None:
    """This process's allocator (glibc) maps every block over 128 KiB afresh and returns it on
    free (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``), and the free memory it holds now is given
    back (``malloc_trim``), so that its resident memory follows the live tensors from here on; a
    no-op elsewhere. Each new tensor's pages are then faulted in on first use
    (``benchmarks/alloc_faults.py`` measures what that costs), so the bench times its calls
    before this."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)
        libc.mallopt(-1, 128 * 1024)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _child(spec: Spec, conn) -> None:
    try:
        conn.send(run_case(spec, own_process=True))
    finally:
        conn.close()


def execute(spec: Spec, op: Op | None, isolate: bool) -> dict:
    """:func:`run_case`, in a fresh process if ``isolate`` and possible (a crash or a time-out
    becomes a reported note). A child re-imports the main script, so it needs one that exists;
    a case not built in (``run_bench(cases=...)``) runs here."""
    main = sys.modules.get("__main__")
    path, timeout = getattr(main, "__file__", None), 3 * spec.cfg.max_seconds_per_case + 60
    child_ok = getattr(main, "__spec__", None) is not None or path is None or os.path.exists(path)
    if not (isolate and child_ok and (op is None or op == cases().get(spec.name))):
        return run_case(spec, op)
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else None)
    ctx.set_forkserver_preload(["aftlab.bench.measure"])  # ignored by the other methods
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(spec, child), daemon=True)
    p.start()
    child.close()
    try:
        if not parent.poll(timeout):
            return {"status": "skipped", "note": f"exceeded the hard time limit of {timeout:.0f} s"}
        try:
            return parent.recv()
        except EOFError:
            p.join(5)
            died = f"case process died (exit code {p.exitcode}; out of memory?)"
            return {"status": "error", "note": died}
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)
        parent.close()
