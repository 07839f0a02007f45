"""The machine: what it is, and its measured limits (GEMM rate and memory bandwidth).

The limits turn each case's cost model into floors: ``bytes / bandwidth`` and
``FLOPs / GEMM rate``; a case cannot run faster than the larger of the two.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

__all__ = ["machine_info", "measure_limits", "synchronize", "timed"]


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call of ``fn``, synchronising the device around it."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info(device: torch.device, argv: list[str] | None = None) -> dict:
    """What ran the benchmark: CPU, cores, memory, torch, threads, GPU, command and date."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "mem_total_bytes": _mem_total(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "command": " ".join(argv if argv is not None else sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    return info


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn, device) for _ in range(repeats))


def measure_limits(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    size: str = "full",
    repeats: int = 5,
) -> dict:
    """Measure the GEMM rate and the memory bandwidth on ``device``.

    * GEMM: ``a @ b`` with ``a, b`` square ``n x n`` (``n = 2048`` on CPU, 8192 on CUDA):
      ``2 n^3`` FLOPs per product.
    * Bandwidth: ``y.copy_(x)`` (reads and writes ``N`` elements: ``2 N`` element moves) and
      ``torch.add(x, y, out=z)`` (``3 N``) on 64 Mi elements (256 MiB in float32), far past
      the caches; the larger of the two rates is the bandwidth (a floor must be a lower bound).

    Args:
        size: ``"full"``, or ``"tiny"`` for tests (small sizes, numbers meaningless).

    Returns:
        ``{"gemm_flops_per_s", "bandwidth_bytes_per_s", "copy_bytes_per_s", "add_bytes_per_s",
        "gemm_n", "stream_elements"}``.
    """
    gen_kw = {"device": device, "dtype": dtype}
    n = 256 if size == "tiny" else (8192 if device.type == "cuda" else 2048)
    mats = [torch.randn(n, n, **gen_kw), torch.randn(n, n, **gen_kw)]
    t_gemm = _median_time(lambda: mats[0] @ mats[1], device, repeats)
    mats.clear()
    m = 2**16 if size == "tiny" else 2**26
    x, y, z = torch.randn(m, **gen_kw), torch.empty(m, **gen_kw), torch.empty(m, **gen_kw)
    es = x.element_size()
    t_copy = _median_time(lambda: y.copy_(x), device, repeats)
    y.copy_(x)
    t_add = _median_time(lambda: torch.add(x, y, out=z), device, repeats)
    copy_bw, add_bw = 2 * m * es / t_copy, 3 * m * es / t_add
    return {
        "gemm_flops_per_s": 2.0 * n**3 / t_gemm,
        "bandwidth_bytes_per_s": max(copy_bw, add_bw),
        "copy_bytes_per_s": copy_bw,
        "add_bytes_per_s": add_bw,
        "gemm_n": n,
        "stream_elements": m,
        "dtype": str(dtype).replace("torch.", ""),
    }
