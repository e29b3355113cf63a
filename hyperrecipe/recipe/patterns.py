"""FQN patterns: the `match` language of recipe rules.

Glob form, segment-aware: ``*`` matches within one dot-separated segment, ``**`` matches any
number of whole segments (zero included), ``?`` one character, ``{a,b}`` alternatives (which may
contain dots and wildcards; nested at most 32 deep). ``re:<regex>`` matches the whole FQN with
the regular part of Python's syntax: literals, ``.``, classes, ``\\d \\w \\s``, groups, ``|``
and the quantifiers ``* + ? {m,n}``; lookarounds, backreferences, possessive quantifiers and
inline flags are refused. Matching never backtracks: it costs one step per FQN character
whatever the pattern (docs/security.md)."""

from __future__ import annotations

import functools
import re

from hyperrecipe.errors import PatternError
from hyperrecipe.recipe.automaton import (
    MAX_GROUP_DEPTH,
    MAX_PATTERN_LENGTH,
    Automaton,
    Node,
    PatternSyntaxError,
    alternation,
    char_class,
    concat,
    literal,
    parse_regex,
    repeat,
)

__all__ = ["FqnPattern", "PatternError", "compile_pattern", "generalize_fqn"]


class FqnPattern:
    """A compiled ``match`` pattern; ``fullmatch(fqn)`` is true when it matches the whole FQN.

    Matched by the automaton, or by Python's ``re`` for the plain globs of
    :func:`_plain_glob_regex`, whose backtracking is bounded (and which are most of a recipe's
    patterns: ``re`` runs them about eight times faster).
    """

    def __init__(self, pattern: str, automaton: Automaton, plain: re.Pattern[str] | None) -> None:
        self.pattern = pattern
        self._automaton = automaton
        self._plain = plain

    def fullmatch(self, fqn: str) -> bool:
        if self._plain is not None:
            return self._plain.fullmatch(fqn) is not None
        return self._automaton.fullmatch(fqn)

    def __repr__(self) -> str:
        return f"FqnPattern({self.pattern!r})"


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> FqnPattern:
    """Compile a recipe ``match`` pattern.

    Raises:
        PatternError: empty pattern, unbalanced braces, empty segment, braces nested deeper than
            32, a bad or unsupported regular expression, or a pattern too large to match in
            bounded memory.
    """
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternError(f"the pattern is longer than {MAX_PATTERN_LENGTH} characters")
    try:
        if pattern.startswith("re:"):
            try:
                node = parse_regex(pattern[3:])
            except PatternSyntaxError as exc:
                raise PatternError(f"bad regular expression: {exc}") from None
        else:
            if not pattern:
                raise PatternError("empty pattern")
            node = _glob(pattern, 0)
    except PatternSyntaxError as exc:
        raise PatternError(str(exc)) from None
    plain = None if pattern.startswith("re:") else _plain_glob_regex(pattern)
    return FqnPattern(pattern, Automaton(node), None if plain is None else re.compile(plain))


_LITERAL_ALTERNATIVES = re.compile(r"\{[A-Za-z0-9_\-]+(?:,[A-Za-z0-9_\-]+)*\}", re.ASCII)


def _plain_glob_regex(pattern: str) -> str | None:
    """A Python regex for a glob whose backtracking is bounded, else ``None``.

    Plain means: at most one ``*`` per segment (``[^.]*`` cannot cross a dot, so one star
    retries at most a segment's length), at most two ``**`` segments, and braces holding only
    dot-free literal words. Backtracking is then polynomial of low degree in the FQN's length;
    anything else (``*a*a*b``, ``{a*,b.c}``, ``**.x.**.y.**``) goes to the automaton.
    """
    split = pattern.split(".")
    segs = [s for i, s in enumerate(split) if not (s == "**" and i and split[i - 1] == "**")]
    if sum(s == "**" for s in segs) > 2:
        return None
    out: list[str] = []
    for i, seg in enumerate(segs):
        if seg == "**":
            out.append(r"(?:[^.]+\.)*" if i == 0 else r"(?:\.[^.]+)*")
            continue
        if "**" in seg or seg.count("*") > 1:
            return None
        text = ""
        pos = 0
        for m in _LITERAL_ALTERNATIVES.finditer(seg):
            text += _plain_segment(seg[pos:m.start()])
            text += "(?:" + "|".join(re.escape(a) for a in m.group()[1:-1].split(",")) + ")"
            pos = m.end()
        rest = seg[pos:]
        if "{" in rest or "}" in rest:
            return None
        text += _plain_segment(rest)
        out.append(("" if i == 0 or (i == 1 and segs[0] == "**") else r"\.") + text)
    if segs == ["**"]:
        return r"[^.]+(?:\.[^.]+)*"
    return "".join(out)


def _plain_segment(text: str) -> str:
    return "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in text)


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise PatternError("unbalanced '}'")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise PatternError("unbalanced '{'")
    parts.append(text[start:])
    return parts


_NOT_DOT = char_class(lambda c: c != ".")
_DOT = literal(".")
_SEGMENT = repeat(_NOT_DOT, 1, None)  # one whole segment: [^.]+


def _segment(seg: str, depth: int) -> Node:
    """Glob text that lies within segments (alternatives may span dots)."""
    out: list[Node] = []
    i = 0
    while i < len(seg):
        ch = seg[i]
        if ch == "{":
            level, j = 1, i + 1
            while level:
                if seg[j] == "{":
                    level += 1
                elif seg[j] == "}":
                    level -= 1
                j += 1
            alts = _split_top(seg[i + 1 : j - 1], ",")
            if any(a == "" for a in alts):
                raise PatternError("empty alternative in {...}")
            out.append(alternation([_glob(a, depth + 1) for a in alts]))
            i = j
            continue
        if ch == "*":
            if seg[i : i + 2] == "**":
                raise PatternError("'**' must be a whole segment, e.g. 'model.**.q_proj'")
            out.append(repeat(_NOT_DOT, 0, None))
        elif ch == "?":
            out.append(_NOT_DOT)
        else:
            out.append(literal(ch))
        i += 1
    return concat(out)


def _glob(pattern: str, depth: int) -> Node:
    if depth > MAX_GROUP_DEPTH:
        raise PatternError(f"braces nest deeper than {MAX_GROUP_DEPTH}")
    segs = _split_top(pattern, ".")
    # `**.**` means what `**` means; collapsing keeps the automaton small
    collapsed = [s for i, s in enumerate(segs) if not (s == "**" and i and segs[i - 1] == "**")]
    if collapsed == ["**"]:
        return concat([_SEGMENT, repeat(concat([_DOT, _SEGMENT]), 0, None)])
    parts: list[Node] = []
    for i, seg in enumerate(collapsed):
        if seg == "":
            raise PatternError("empty segment (two dots in a row, or a leading/trailing dot)")
        if seg == "**":
            parts.append(repeat(concat([_SEGMENT, _DOT]), 0, None) if i == 0
                         else repeat(concat([_DOT, _SEGMENT]), 0, None))
            continue
        if not (i == 0 or (i == 1 and collapsed[0] == "**")):
            parts.append(_DOT)
        parts.append(_segment(seg, depth))
    return concat(parts)


_NUM = re.compile(r"(?<=\.)[0-9]+(?=\.|$)")


def generalize_fqn(fqn: str) -> str:
    """``model.layers.3.mlp`` → ``model.layers.*.mlp``: a suggestion for patterns."""
    return _NUM.sub("*", fqn)
