"""Every rule's embedded VALID/INVALID cases, as generated tests (``TestHR001...::test_VALID_0``).

Each case runs through the libcst engine directly and through the full runner with the screen on
and off, so a case also proves the screen does not hide it. An opt-in rule's cases run with it
selected (by its code) on top of the default selection, and screened as for that selection.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.lint import codes as registry
from hyperrecipe.lint.engine import lint_source
from hyperrecipe.lint.findings import Finding
from hyperrecipe.lint.prefilter import needs_libcst
from hyperrecipe.lint.rule import Invalid, LintRule, Valid
from hyperrecipe.lint.rules import ALL_RULES
from hyperrecipe.lint.runner import lint_paths

ALL_CODES = registry.resolve_selection(select=None, ignore=(), where="test")


def _selection(rule: type[LintRule]) -> list[str] | None:
    """The ``select`` a rule's cases run under: the default, plus the rule when it is opt-in."""
    return [*sorted(registry.DEFAULT_SELECTION), rule.code] if rule.opt_in else None


def _lint(code: str, rule: type[LintRule] | None = None) -> list[Finding]:
    codes = ALL_CODES | {rule.code} if rule is not None else ALL_CODES
    return lint_source(code.encode("utf-8"), display="case.py", codes=codes)


def _valid_test(rule: type[LintRule], case: Valid) -> Callable[[Any], None]:
    def test(self: Any) -> None:
        findings = _lint(case.code, rule)
        assert [f for f in findings if f.severity == "error"] == []
        assert [f for f in findings if f.code == rule.code] == []

    return test


def _invalid_test(rule: type[LintRule], case: Invalid) -> Callable[[Any, Path], None]:
    def test(self: Any, tmp_path: Path) -> None:
        found = [f for f in _lint(case.code, rule) if f.code == rule.code]
        assert len(found) == case.count, found
        if case.line is not None:
            assert (found[0].line, found[0].column) == (case.line, case.column)
        assert found[0].name == rule.name
        source = case.code.encode("utf-8")
        assert needs_libcst(source, "case.py", patches=rule.opt_in), (
            "the screen would hide this case")
        (tmp_path / "case.py").write_bytes(source)
        select = _selection(rule)
        screened = lint_paths([str(tmp_path)], jobs=1, select=select).findings
        full = lint_paths([str(tmp_path)], jobs=1, screen=False, select=select).findings
        assert screened == full
        assert sum(f.code == rule.code for f in screened) == case.count

    return test


def _case_class(rule: type[LintRule]) -> type:
    namespace: dict[str, object] = {"__doc__": f"{rule.code} {rule.name}: embedded cases."}
    for index, valid in enumerate(rule.VALID):
        namespace[f"test_VALID_{index}"] = _valid_test(rule, valid)
    for index, invalid in enumerate(rule.INVALID):
        namespace[f"test_INVALID_{index}"] = _invalid_test(rule, invalid)
    return type(f"Test{rule.code}{rule.__name__}", (), namespace)


for _rule in ALL_RULES:
    globals()[f"Test{_rule.code}{_rule.__name__}"] = _case_class(_rule)


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_every_rule_carries_valid_and_invalid_cases(rule: type[LintRule]) -> None:
    assert len(rule.VALID) >= 5
    assert len(rule.INVALID) >= 5


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_every_rule_documents_itself_in_ruff_shape(rule: type[LintRule]) -> None:
    doc = inspect.cleandoc(rule.__doc__ or "")
    headings = [line for line in doc.splitlines() if line.startswith("#### ")]
    assert headings == [
        "#### What it does", "#### Why is this bad?", "#### Example", "#### Use instead",
    ]


def test_registry_and_rule_classes_agree_on_codes_names_gating_and_opt_in() -> None:
    from_classes = {(r.code, r.name, r.gated, r.opt_in) for r in ALL_RULES}
    from_registry = {
        (i.code, i.name, i.gated, i.opt_in) for i in registry.CODES if i.kind == "rule"
    }
    assert from_classes == from_registry


def test_process_patch_is_the_one_opt_in_code_and_outside_the_default_selection() -> None:
    assert [i.code for i in registry.CODES if i.opt_in] == ["HR005"]
    assert "HR005" not in registry.DEFAULT_SELECTION
    assert "HR005" not in ALL_CODES
    assert registry.DEFAULT_SELECTION == set(registry.SELECTABLE) - {"HR005"}


@pytest.mark.parametrize("selector", ["HR005", "hr005", "process-patch"])
def test_an_opt_in_code_is_selected_by_its_exact_code_or_name(selector: str) -> None:
    assert registry.resolve_selectors([selector], where="--select") == {"HR005"}
    assert "HR005" in registry.resolve_selection(select=["HR0", selector], ignore=(), where="x")


@pytest.mark.parametrize("prefix", ["HR", "HR0", "hr00"])
def test_a_prefix_never_selects_an_opt_in_code(prefix: str) -> None:
    chosen = registry.resolve_selectors([prefix], where="--select")
    assert "HR005" not in chosen
    assert {"HR001", "HR004"} <= chosen


def test_an_ignore_prefix_does_cover_an_opt_in_code() -> None:
    assert registry.resolve_selection(select=["HR005", "HR001"], ignore=["HR00"], where="x") == {
        "HR000", "HR997", "HR998", "HR999",
    }


def test_codes_are_unique_and_well_formed() -> None:
    codes = [info.code for info in registry.CODES]
    names = [info.name for info in registry.CODES]
    assert len(set(codes)) == len(codes)
    assert len(set(names)) == len(names)
    assert all(len(code) == 5 and code.startswith("HR") and code[2:].isdigit() for code in codes)


def test_selectors_accept_codes_names_and_prefixes() -> None:
    assert registry.resolve_selectors(["HR001", "forward-dict", "hr9"], where="x") == {
        "HR001", "HR003", "HR900", "HR901",
    }


def test_unknown_selector_suggests_the_nearest_name() -> None:
    with pytest.raises(registry.SelectorError) as info:
        registry.resolve_selectors(["forward-setatr"], where="--select")
    assert str(info.value) == (
        "--select: unknown rule code or name 'forward-setatr'; did you mean 'forward-setattr'?"
    )


def test_syntax_budget_and_internal_errors_cannot_be_deselected() -> None:
    assert registry.resolve_selection(select=["HR001"], ignore=["HR0", "HR9"], where="x") == {
        "HR000", "HR997", "HR998", "HR999",
    }
