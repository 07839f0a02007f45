"""``aftlab bench``: time, memory and machine-limit floors of every sequence mixer.

The case table lives in :mod:`aftlab.bench.cases`, the correctness gate in
:mod:`aftlab.bench.gate`, the measurements in :mod:`aftlab.bench.measure` and
:mod:`aftlab.bench.machine`, the report in :mod:`aftlab.bench.report`. See docs/benchmarks.md.
"""

from .cases import CASES, MATMUL_CASE, OpCase, Shape, default_cases
from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench", "CASES", "MATMUL_CASE", "OpCase", "Shape", "default_cases"]
