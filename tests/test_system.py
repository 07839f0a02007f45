"""Machine and process facts (``aftlab._system``): ``/proc`` fields, the peak RSS of a run,
the machine record of ``aftlab bench``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from aftlab._system import machine_info, proc_bytes, proc_field

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")


@LINUX
def test_proc_fields_read_and_missing_ones_are_empty():
    assert int(proc_field("self/status", "Pid")) > 0
    assert proc_bytes("meminfo", "MemTotal") > 2**20  # KiB turned into bytes
    assert proc_field("self/status", "NoSuchKey") == "" and proc_bytes("no/such", "x") == 0


@LINUX
def test_peak_rss_sees_a_new_100_mib_buffer():
    # a fresh process: in the suite's own, freed memory of earlier tests may hold the peak already
    code = (
        "import torch; from aftlab._system import peak_rss_bytes\n"
        "before = peak_rss_bytes()\n"
        "x = torch.ones(100 * 2**20, dtype=torch.uint8)\n"  # written: resident
        "print(peak_rss_bytes() - before, int(x.sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grew, total = map(int, out.stdout.split())
    assert grew >= 90 * 2**20 and total == 100 * 2**20, out.stdout


@LINUX
def test_peak_since_a_baseline_with_and_without_clearing_the_peak():
    """A run's baseline is the peak so far: an earlier, freed 200 MiB is not counted, a new
    100 MiB is not seen below it; a call's (``reset``) is the memory in use: 100 MiB is seen."""
    code = (
        "import torch; from aftlab._system import memory_baseline, peak_memory_since\n"
        "cpu = torch.device('cpu')\n"
        "y = torch.ones(200 * 2**20, dtype=torch.uint8); del y\n"
        "run = memory_baseline(cpu)\n"
        "x = torch.ones(100 * 2**20, dtype=torch.uint8); del x\n"
        "call = memory_baseline(cpu, reset=True)\n"
        "x = torch.ones(100 * 2**20, dtype=torch.uint8)\n"
        "print(peak_memory_since(cpu, run), peak_memory_since(cpu, call), int(x.sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    run, call, total = map(int, out.stdout.split())
    assert run < 20 * 2**20 and call >= 90 * 2**20 and total == 100 * 2**20, out.stdout


@LINUX
def test_peak_memory_of_a_run_does_not_include_the_parent_that_spawned_it():
    # ru_maxrss survives vfork + exec: a child of a 400 MiB parent would start at 400 MiB, and an
    # `aftlab compare` run (a child of compare) would report 0 above its baseline
    code = (
        "import subprocess, sys\n"
        "x = bytearray(400 * 2**20)\n"
        "x[::4096] = b'1' * len(x[::4096])\n"
        "child = 'from aftlab._system import peak_rss_bytes; print(peak_rss_bytes())'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True,"
        " check=True).stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 350 * 2**20, out.stdout


def test_machine_info_records_what_ran():
    info = machine_info(torch.device("cpu"), ["aftlab", "bench", "--dim", "8"])
    assert info["command"] == "aftlab bench --dim 8" and info["device"] == "cpu"
    assert info["torch"] == torch.__version__ and info["gpu"] is None
    assert info["cpu_model"] and info["cpu_count"] >= 1 and info["threads"] >= 1
    assert info["date"].endswith(" UTC")
