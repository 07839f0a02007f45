"""docs/data.md: its example prints what the doc says (tests/test_docs_examples.py runs every
doc's examples) and its table names every task."""

from __future__ import annotations

from pathlib import Path

from ..test_docs_examples import run_doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def test_docs_example_prints_what_the_doc_says(capsys):
    run_doc(DOC)
    out = capsys.readouterr().out
    assert "['text', 'enwik8', 'text8', 'digits'" in out
    assert "queries in the first 16 validation examples" in out


def test_docs_name_every_task():
    from aftlab.data import available_tasks

    text = DOC.read_text(encoding="utf-8")
    for name in available_tasks():
        assert f"| `{name}`" in text, name
