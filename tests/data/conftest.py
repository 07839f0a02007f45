"""Every data test writes its corpus caches into its own temporary folder."""

import pytest


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test writes its corpus caches into its own temporary folder."""
    monkeypatch.setenv("AFTLAB_CACHE_DIR", str(tmp_path / "cache"))
