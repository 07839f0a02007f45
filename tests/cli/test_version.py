"""One version, written once (pyproject.toml): the package metadata, ``aftlab --version``,
``aftlab.__version__`` and the newest release of CHANGELOG.md agree."""

import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import aftlab
from aftlab.cli import main

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_version_is_the_installed_metadata_and_pyproject(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"aftlab {aftlab.__version__}"
    # a stale install (pyproject changed, not reinstalled) fails here: pip install -e . again
    assert aftlab.__version__ == version("aftlab") == _project()["version"]


def test_changelog_keeps_a_changelog_with_this_version_released():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n") and "## [Unreleased]" in text
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, re.M)
    assert released and released[0] == _project()["version"]


def test_readme_states_the_declared_python_and_torch_range():
    project = _project()
    python = project["requires-python"].removeprefix(">=")
    torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"Python >= {python} and torch >= {torch.removeprefix('torch>=')}" in readme
