"""The house's layering, read from the imports: ops -> mixers -> models -> train -> cli.

Each package imports only from the layers below it (and from the shared modules at the top of
``aftlab``: ``_checks``, ``errors``, ``_system``, ...). A mixer takes plain keyword arguments and
never sees a model config; the bench measures ops and mixers without the training code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aftlab

ROOT = Path(aftlab.__file__).parent

#: package -> the aftlab packages it must not import
FORBIDDEN = {
    "ops": ("mixers", "models", "train", "bench", "cli", "hf"),
    "kernels": ("mixers", "models", "train", "bench", "cli", "hf"),
    "mixers": ("models", "train", "bench", "cli", "hf"),
    "models": ("train", "bench", "cli", "hf"),
    "bench": ("train", "cli", "hf"),
    "functional": ("mixers", "models", "train", "bench", "cli", "hf"),
    "data": ("mixers", "models", "train", "bench", "cli", "hf"),
    "train": ("cli", "hf", "bench"),
}


def _imported(path: Path, package: str) -> list[str]:
    """The aftlab packages a module of ``aftlab.<package>`` imports, absolute or relative."""
    depth = len(path.relative_to(ROOT).parts) - 1  # folders below aftlab/
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level > depth:  # relative to aftlab/ itself: from ..X import
                names = [node.module or ""] if node.module else [a.name for a in node.names]
            else:  # within the package
                continue
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            name = name.removeprefix("aftlab.") if name.startswith("aftlab.") else name
            out.append(name.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_from_the_layers_below(package):
    # a package's __main__.py is a program's entry, the top of the stack (python -m aftlab.bench)
    files = sorted(f for f in (ROOT / package).rglob("*.py") if f.name != "__main__.py")
    assert files, package
    found = [
        (str(f.relative_to(ROOT)), name)
        for f in files
        for name in _imported(f, package)
        if name in FORBIDDEN[package]
    ]
    assert found == [], f"{package} imports from a layer above it: {found}"


def test_the_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The parser finds both spellings of an import from above (the check can fail)."""
    pkg = tmp_path / "aftlab" / "mixers" / "aft"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from ...models.config import C\nimport aftlab.train\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path / "aftlab")
    assert _imported(pkg / "x.py", "mixers") == ["models", "train"]
