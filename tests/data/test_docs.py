"""The example in docs/data.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def test_docs_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "docs/data.md has no python example"
    exec(compile(blocks[0], str(DOC), "exec"), {})
    out = capsys.readouterr().out
    assert "['text', 'enwik8', 'text8', 'digits'" in out
    assert "queries in the first 16 validation examples" in out


def test_docs_name_every_task():
    from aftlab.data import available_tasks

    text = DOC.read_text(encoding="utf-8")
    for name in available_tasks():
        assert f"| `{name}`" in text, name
