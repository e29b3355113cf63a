"""Suppression comments: what they silence, what they must say, and when they are unused."""

from __future__ import annotations

import textwrap

import pytest

from hyperrecipe.lint.codes import resolve_selection
from hyperrecipe.lint.engine import lint_source
from hyperrecipe.lint.suppressions import Suppression, parse_suppression

ALL = resolve_selection(select=None, ignore=(), where="test")


def _lint(code: str, codes: frozenset[str] = ALL) -> list[tuple[int, int, str, str]]:
    findings = lint_source(textwrap.dedent(code).encode(), display="s.py", codes=codes)
    return sorted((f.line, f.column, f.code, f.message) for f in findings)


def _codes(code: str, codes: frozenset[str] = ALL) -> list[tuple[int, str]]:
    return [(line, c) for line, _, c, _ in _lint(code, codes)]


def test_trailing_suppression_with_code_silences_the_finding() -> None:
    assert _codes("m.forward = f  # hyperrecipe: ignore[HR001] -- test double\n") == []


def test_trailing_suppression_with_rule_name_silences_the_finding() -> None:
    assert _codes("m.forward = f  # hyperrecipe: ignore[forward-assignment] -- test double\n") == []


def test_suppression_on_its_own_line_silences_the_next_line_of_code() -> None:
    source = """
    # hyperrecipe: ignore[HR002] -- the adapter is restored in teardown
    # (more explanation)

    setattr(m, "forward", f)
    setattr(n, "forward", f)
    """
    assert _codes(source) == [(6, "HR002")]


def test_trailing_suppression_anywhere_on_a_multi_line_statement_applies() -> None:
    source = """
    setattr(
        m,
        "forward",
        f,
    )  # hyperrecipe: ignore[HR002] -- the adapter is restored in teardown
    """
    assert _codes(source) == []


def test_suppression_on_another_statement_does_not_apply() -> None:
    source = """
    x = 1  # hyperrecipe: ignore[HR001] -- misplaced
    m.forward = f
    """
    assert _codes(source) == [(2, "HR900"), (3, "HR001")]


def test_one_comment_may_silence_several_codes() -> None:
    source = (
        'setattr(m, "forward", f); m.forward = g  # hyperrecipe: ignore[HR001, HR002] -- x\n'
    )
    assert _codes(source) == []


def test_suppressing_another_code_leaves_the_finding_and_is_unused() -> None:
    assert _lint("m.forward = f  # hyperrecipe: ignore[HR002] -- wrong code\n") == [
        (1, 1, "HR001", "assigns `forward` outside the rewriter; hand the replacement to "
                        "hyperrecipe.rewriter (Rewrite.install_forward)"),
        (1, 16, "HR900", "unused suppression: no HR002 (forward-setattr) finding here to "
                         "silence; remove the comment"),
    ]


def test_suppression_without_reason_still_silences_but_is_reported() -> None:
    assert _lint("m.forward = f  # hyperrecipe: ignore[HR001]\n") == [
        (1, 16, "HR901", "a suppression needs a reason after ' -- ', as in "
                         "`# hyperrecipe: ignore[HR001] -- reason`"),
    ]


def test_suppression_with_an_empty_reason_is_reported() -> None:
    assert _lint("m.forward = f  # hyperrecipe: ignore[HR001] --   \n") == [
        (1, 16, "HR901", "the reason after ' -- ' is empty"),
    ]


def test_suppression_without_codes_silences_nothing() -> None:
    assert _codes("m.forward = f  # hyperrecipe: ignore -- blanket\n") == [
        (1, "HR001"), (1, "HR901"),
    ]


def test_unknown_code_in_a_suppression_is_reported_with_a_suggestion() -> None:
    assert _lint("x = 1  # hyperrecipe: ignore[forward-assignmnt] -- typo\n") == [
        (1, 8, "HR901", "unknown rule code or name 'forward-assignmnt'; did you mean "
                        "'forward-assignment'?"),
    ]


def test_only_single_rule_codes_can_be_suppressed() -> None:
    message = "cannot be suppressed: name one rule code (HR001-HR099) or its name"
    assert _lint("x = 1  # hyperrecipe: ignore[HR00, HR900] -- too broad\n") == [
        (1, 8, "HR901", f"'HR00' {message}"),
        (1, 8, "HR901", f"'HR900' {message}"),
    ]


def test_unknown_directive_is_reported() -> None:
    assert _codes("x = 1  # hyperrecipe: noqa\n") == [(1, "HR901")]


def test_unused_suppression_is_reported_at_the_comment() -> None:
    assert _lint("y = m.forward(x)  # hyperrecipe: ignore[HR001] -- nothing here\n") == [
        (1, 19, "HR900", "unused suppression: no HR001 (forward-assignment) finding here to "
                         "silence; remove the comment"),
    ]


def test_unused_suppression_is_not_reported_when_its_rule_did_not_run() -> None:
    only_setattr = resolve_selection(select=["HR002"], ignore=(), where="test")
    assert _codes("y = 1  # hyperrecipe: ignore[HR001] -- rule off\n", only_setattr) == []
    allowed = lint_source(b"y = 1  # hyperrecipe: ignore[HR001] -- rewriter\n", display="r.py",
                          codes=ALL, allow_gated=True)
    assert allowed == []


def test_suppression_findings_can_be_deselected() -> None:
    no_hr9 = resolve_selection(select=None, ignore=["HR9"], where="test")
    assert _codes("y = 1  # hyperrecipe: ignore[HR001]\n", no_hr9) == []


def test_a_suppression_inside_a_string_is_not_a_comment() -> None:
    source = 'm.forward = f; s = "# hyperrecipe: ignore[HR001] -- not a comment"\n'
    assert _codes(source) == [(1, "HR001")]


def test_suppression_in_a_module_header_comment_is_located() -> None:
    source = "# hyperrecipe: ignore[HR001] -- header\nimport os\n"
    assert _lint(source) == [
        (1, 1, "HR900", "unused suppression: no HR001 (forward-assignment) finding here to "
                        "silence; remove the comment"),
    ]


@pytest.mark.parametrize(
    ("comment", "expected"),
    [
        ("# hyperrecipe: ignore[HR001] -- why",
         Suppression(codes=("HR001",), reason="why", problems=())),
        ("#hyperrecipe:ignore[forward-dict, HR004]--x",
         Suppression(codes=("HR003", "HR004"), reason="x", problems=())),
        ("# hyperrecipe: ignore[HR001, HR001] -- twice",
         Suppression(codes=("HR001",), reason="twice", problems=())),
        ("# hyperrecipe: ignore[HR001] because", Suppression(
            codes=("HR001",), reason="",
            problems=("a suppression needs a reason after ' -- ', as in "
                      "`# hyperrecipe: ignore[HR001] -- reason`",))),
        ("# noqa", None),
        ("# see hyperrecipe: docs", None),
    ],
)
def test_parse_suppression(comment: str, expected: Suppression | None) -> None:
    assert parse_suppression(comment) == expected
