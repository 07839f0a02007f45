"""Every Python block of README.md, CONTRIBUTING.md and docs/*.md, and every docstring example
(``>>>``) in src/aftlab, runs as written.

The blocks of one file run in order in one namespace (a block may use an earlier block's names),
with line numbers as in the file. A block opts out only with a visible marker on the line
before its fence, ``<!-- no-test: reason -->``: for a block that needs a GPU, a downloaded file
or minutes of CPU. A block importing an optional extra (``transformers``) is skipped, with its
file's later blocks, where that extra is not installed.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

from aftlab.mixers import registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
NO_TEST = re.compile(r"<!-- no-test: (\S.*?) -->\n$")
OPTIONAL = ("transformers",)
SRC = ROOT / "src"
MODULES = sorted(
    ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for p in (SRC / "aftlab").rglob("*.py")
    if p.name != "__main__.py" and ">>>" in p.read_text(encoding="utf-8")
)


def python_blocks(path: Path) -> list[tuple[int, str | None, str]]:
    """``(line, opt-out reason or None, code)`` of each Python block of the Markdown ``path``."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()]
        reason = NO_TEST.search(before[before.rfind("\n", 0, len(before) - 1) + 1 :])
        blocks.append((before.count("\n") + 2, reason and reason.group(1), m.group(1)))
    return blocks


def run_doc(path: Path) -> dict:
    """Run the Python blocks of ``path`` in order in one namespace; return the namespace.

    A mixer a block registers is unregistered afterwards, so no other test sees it.
    """
    namespace: dict = {"__name__": f"doc:{path.name}"}
    mixers = dict(registry._MIXERS)
    try:
        for line, reason, code in python_blocks(path):
            if reason:
                continue
            for module in OPTIONAL:
                if re.search(rf"^\s*(from|import) {module}\b", code, re.M):
                    pytest.importorskip(module, reason=f"{path.name}:{line} needs {module}")
            exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
    finally:
        registry._MIXERS.clear()
        registry._MIXERS.update(mixers)
    return namespace


#: the files with a block that runs
DOCS_WITH_CODE = [p for p in DOCS if p.exists() and any(not r for _, r, _ in python_blocks(p))]


@pytest.mark.parametrize("path", DOCS_WITH_CODE, ids=lambda p: p.name)
def test_doc_examples_run(path, tmp_path, monkeypatch):
    monkeypatch.setenv("AFTLAB_CACHE_DIR", str(tmp_path / "cache"))  # corpus caches
    monkeypatch.chdir(tmp_path)
    run_doc(path)


def test_every_python_block_is_found_and_opt_outs_give_a_reason():
    for path in DOCS:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        assert len(python_blocks(path) if text else []) == text.count("```python\n"), path.name
        for marker in re.findall(r"<!-- no-test:(.*?)-->", text):
            assert marker.strip(), f"{path.name}: a no-test marker without a reason"
    assert len(DOCS_WITH_CODE) >= 8, [p.name for p in DOCS_WITH_CODE]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    if name.startswith("aftlab.hf"):
        pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=False)
    assert result.attempted > 0, f"{name}: no example found"
    assert result.failed == 0, f"{name}: {result.failed} docstring example(s) failed (output above)"
