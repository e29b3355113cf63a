"""Suppression comments: ``# hyperrecipe: ignore[HR001] -- why this one is fine``.

A suppression names the codes (or rule names) it silences and must give a reason after ``--``;
the reason is what a reviewer reads. It applies to findings on the statement it trails (any line
of a multi-line statement) or, on a line of its own, to the next line of code. A suppression
with no codes, no reason or an unknown code is an ``HR901`` finding (a suppression missing only
its reason still silences, so fixing the comment is the one thing left to do); one that
silences nothing is ``HR900``. Neither of those can itself be suppressed.
"""

from __future__ import annotations

import re
from typing import Final

import attrs

from hyperrecipe.lint.codes import CODES, resolve_selectors

__all__ = ["DIRECTIVE", "Suppression", "parse_suppression"]

#: A comment that speaks to hyperrecipe at all.
DIRECTIVE: Final = re.compile(r"#[ \t]*hyperrecipe[ \t]*:(?P<rest>.*)\Z", re.DOTALL)
_IGNORE: Final = re.compile(r"[ \t]*ignore\b(?P<codes>\[[^\]]*\])?(?P<tail>.*)\Z", re.DOTALL)
_REASON: Final = re.compile(r"[ \t]*--(?P<reason>.*)\Z", re.DOTALL)
_SUPPRESSIBLE: Final = frozenset(info.code for info in CODES if info.kind == "rule")
_EXAMPLE: Final = "`# hyperrecipe: ignore[HR001] -- reason`"


@attrs.frozen(kw_only=True)
class Suppression:
    """One parsed suppression comment.

    Args:
        codes: the rule codes it silences (names already resolved to codes).
        reason: the text after ``--`` (empty when missing).
        problems: what is wrong with the comment (each becomes an HR901 message).
    """

    codes: tuple[str, ...]
    reason: str
    problems: tuple[str, ...]


def parse_suppression(comment: str) -> Suppression | None:
    """Parse a comment; ``None`` when it is not a ``# hyperrecipe:`` comment at all.

    Example::

        >>> parse_suppression("# hyperrecipe: ignore[forward-setattr] -- test double")
        Suppression(codes=('HR002',), reason='test double', problems=())
    """
    directive = DIRECTIVE.match(comment)
    if directive is None:
        return None
    rest = directive.group("rest")
    ignore = _IGNORE.match(rest)
    if ignore is None:
        return Suppression(
            codes=(),
            reason="",
            problems=(f"unknown hyperrecipe directive; write {_EXAMPLE}",),
        )
    problems: list[str] = []
    codes: list[str] = []
    bracket = ignore.group("codes")
    if bracket is None or not bracket[1:-1].strip():
        problems.append(f"a suppression must name the codes it silences, as in {_EXAMPLE}")
    else:
        for token in bracket[1:-1].split(","):
            token = token.strip()
            if not token:
                continue
            try:
                resolved = resolve_selectors([token], where="suppression")
            except ValueError as exc:
                problems.append(str(exc).removeprefix("suppression: "))
                continue
            if len(resolved) != 1 or not resolved <= _SUPPRESSIBLE:
                problems.append(
                    f"{token!r} cannot be suppressed: name one rule code (HR001-HR099) or its name"
                )
                continue
            (code,) = resolved
            if code not in codes:
                codes.append(code)
    tail = ignore.group("tail")
    reason_match = _REASON.match(tail)
    reason = reason_match.group("reason").strip() if reason_match else ""
    if not reason:
        problems.append(
            f"a suppression needs a reason after ' -- ', as in {_EXAMPLE}"
            if reason_match is None
            else "the reason after ' -- ' is empty"
        )
    return Suppression(codes=tuple(codes), reason=reason, problems=tuple(problems))
