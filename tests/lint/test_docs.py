"""docs/lint.md carries the rule reference generated from the rule classes, up to date."""

from __future__ import annotations

from pathlib import Path

from hyperrecipe.lint.codes import CODES
from hyperrecipe.lint.docs import BEGIN, END, render_reference, update_document

DOC = Path(__file__).resolve().parents[2] / "docs" / "lint.md"


def test_the_generated_rule_reference_in_docs_is_up_to_date() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    hint = "run: python -m hyperrecipe.lint.docs --write docs/lint.md"
    assert update_document(text) == text, hint


def test_the_reference_lists_every_code_with_its_name() -> None:
    reference = render_reference()
    for info in CODES:
        assert f"| {info.code} | {info.name} |" in reference
