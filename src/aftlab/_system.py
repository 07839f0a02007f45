"""Facts of this machine and process, for the records of ``aftlab train`` and ``aftlab bench``:
``/proc`` fields on Linux, the standard library's elsewhere."""

from __future__ import annotations

import datetime
import math
import os
import platform
import resource
import sys

import torch

__all__ = [
    "available_memory",
    "format_bytes",
    "env_off",
    "machine_info",
    "memory_baseline",
    "peak_memory_since",
    "peak_rss_bytes",
    "proc_bytes",
    "proc_field",
]


def format_bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, 3 significant digits: ``"96 KiB"``, ``"1.5 MiB"``."""
    exp = min(int(math.log(n, 1024)), 3) if n >= 1 else 0
    x = n / 1024**exp
    text = f"{x:.3g}"
    return f"{text if 'e' not in text else f'{x:,.0f}'} {('B', 'KiB', 'MiB', 'GiB')[exp]}"


def proc_field(path: str, key: str) -> str:
    """The value of ``key`` in ``/proc/<path>`` (``"key: value"`` lines); ``""`` if absent."""
    try:
        with open(f"/proc/{path}") as f:
            fields = [line.partition(":") for line in f]
    except OSError:
        return ""
    return next((v.strip() for k, _, v in fields if k.strip() == key), "")


def proc_bytes(path: str, key: str) -> int:
    """A ``/proc`` field in KiB (``"1234 kB"``), in bytes; 0 if absent."""
    return int((proc_field(path, key) or "0").split()[0]) * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory of this process image, in bytes.

    On Linux ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` there carries over the peak of
    the process that spawned this one (vfork + exec keeps it), so a run started by a large
    parent such as ``aftlab compare`` would measure the parent. Elsewhere ``ru_maxrss``.
    """
    if peak := proc_bytes("self/status", "VmHWM"):
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def available_memory(device: torch.device | str | None = None) -> tuple[int, str]:
    """Bytes this process can still allocate on ``device``, and where the figure comes from.

    A CUDA device: its free memory (``torch.cuda.mem_get_info``). Otherwise RAM:
    ``MemAvailable`` of ``/proc/meminfo`` (``MemTotal`` on an old kernel), lowered to what
    ``RLIMIT_AS`` (``ulimit -v``) leaves this process beyond its ``VmSize``. ``(0, "unknown")``
    when nothing tells.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    found = []
    for key in ("MemAvailable", "MemTotal"):
        if ram := proc_bytes("meminfo", key):
            found.append((ram, f"{key} in /proc/meminfo"))
            break
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        left = max(limit - proc_bytes("self/status", "VmSize"), 0)
        found.append((left, "what ulimit -v leaves"))
    return min(found) if found else (0, "unknown")


def env_off(name: str) -> bool:
    """True when the environment variable ``name`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def memory_baseline(device: torch.device, *, reset: bool = False) -> int | None:
    """What :func:`peak_memory_since` measures the peak above, on ``device``.

    Without ``reset`` (a training run's peak): on CUDA 0, the peak counting all that is
    allocated; on the CPU the peak RSS so far (:func:`peak_rss_bytes`), so that what the
    process held before is not counted. With ``reset`` (one call's peak): the peak is cleared
    first (CUDA ``reset_peak_memory_stats``; Linux ``/proc/self/clear_refs``), and the baseline
    is the memory in use now; None where the CPU's peak cannot be cleared.
    """
    if device.type == "cuda":
        if not reset:
            return 0
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    if not reset:
        return peak_rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        return None
    return proc_bytes("self/status", "VmRSS")


def peak_memory_since(device: torch.device, baseline: int) -> int:
    """Peak memory above ``baseline`` (:func:`memory_baseline`): CUDA ``max_memory_allocated``,
    on the CPU the peak RSS; in bytes, at least 0."""
    if device.type == "cuda":
        return max(0, int(torch.cuda.max_memory_allocated(device)) - baseline)
    return max(0, peak_rss_bytes() - baseline)


def machine_info(device: torch.device, argv: list[str] | None = None) -> dict:
    """What ran a measurement: CPU, cores, memory, torch, threads, GPU, command and date."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "cpu_model": proc_field("cpuinfo", "model name")
        or platform.processor()
        or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_bytes": proc_bytes("meminfo", "MemTotal") or None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "command": " ".join(argv if argv is not None else sys.argv),
        "date": now.strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
