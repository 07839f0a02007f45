"""benchmarks/alloc_faults.py: one bench case under glibc's default allocator and under the
bench's fresh-process setting, each in its own process (a tiny shape: the script runs, not
its figures)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_allocators_are_measured_in_their_own_processes():
    argv = [sys.executable, str(ROOT / "benchmarks" / "alloc_faults.py"), "--T", "16",
            "--batch", "1", "--dim", "8", "--heads", "2", "--threads", "1", "--repeats", "2"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
    lines = out.splitlines()
    assert lines[0].startswith("aft-local train, causal, B 1, T 16, d 8, 2 heads")
    pattern = r"median +[0-9.]+ ms, +[0-9,]+ minor faults a call"
    assert lines[1].startswith("glibc default") and re.search(pattern, lines[1])
    assert lines[2].startswith("fresh pages") and re.search(pattern, lines[2])
