"""Fixtures of the bench tests: the scripts of benchmarks/ as modules."""

from __future__ import annotations

import pytest

from .scripts import load_script


@pytest.fixture
def benchmark_script():
    """``load(name) -> module``: ``benchmarks/<name>.py`` imported (its ``main`` not run)."""
    return load_script
