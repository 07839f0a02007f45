"""The scripts of benchmarks/ imported as modules (their ``main`` not run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as the module ``benchmarks.<name>`` (registered in
    ``sys.modules``, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
