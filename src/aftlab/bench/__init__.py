"""``aftlab bench``: time, memory and machine-limit floors of every sequence mixer.

The cases (derived from the mixer registry) are in :mod:`aftlab.bench.cases`, the correctness
gate in :mod:`aftlab.bench.gate`, the measurements in :mod:`aftlab.bench.measure`, the run in
:mod:`aftlab.bench.runner` and the report in :mod:`aftlab.bench.report`. See docs/benchmarks.md.
"""

from .cases import OPS, Op, Shape, cases
from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench", "cases", "Op", "OPS", "Shape"]
