"""``aftlab bench``: time, memory and machine-limit floors of every sequence mixer.

Modules: ``cases`` (what runs), ``measure`` (the gate, times, memory), ``runner`` (the run),
``report``, ``cli``. See docs/benchmarks.md.
"""

from .cases import OPS, Op, Shape, cases
from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench", "cases", "Op", "OPS", "Shape"]
