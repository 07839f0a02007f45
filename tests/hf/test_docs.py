"""docs/huggingface.md's Python example runs as written."""

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is missing")

DOC = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_doc_has_an_example():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(index):
    exec(compile(BLOCKS[index], f"docs/huggingface.md example {index}", "exec"), {})
