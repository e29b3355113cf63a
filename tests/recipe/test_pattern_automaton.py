"""The non-backtracking matcher agrees with Python's ``re`` wherever ``re`` finishes."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrecipe.recipe.patterns import compile_pattern

_atoms = st.sampled_from(["a", "b", ".", "\\.", "[ab]", "[^a]", "[a-c_]", "\\d", "\\w", "\\W",
                          "(a|b)", "(?:ab|b)", "x"])
_quantifiers = st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}", "*?"])


@st.composite
def _regexes(draw: st.DrawFn) -> str:
    parts = [draw(_atoms) + draw(_quantifiers) for _ in range(draw(st.integers(1, 5)))]
    text = "".join(parts)
    if draw(st.booleans()):
        text = f"({text})" + draw(_quantifiers)
    if draw(st.booleans()):
        text += "|" + draw(_atoms)
    return text


_subjects = st.text(alphabet="ab.x1_c", max_size=12)


@settings(max_examples=500, deadline=None)
@given(_regexes(), st.lists(_subjects, min_size=1, max_size=8))
def test_regex_patterns_match_what_python_re_matches(pattern: str,
                                                     subjects: list[str]) -> None:
    ours = compile_pattern(f"re:{pattern}")
    theirs = re.compile(pattern)
    for s in subjects:
        assert ours.fullmatch(s) == bool(theirs.fullmatch(s)), (pattern, s)


_glob_parts = st.sampled_from(["a", "b", "*", "?", "a*", "*b", "{a,b}", "{a.b,c}", "x?y"])


@st.composite
def _globs(draw: st.DrawFn) -> str:
    segs = [draw(_glob_parts) for _ in range(draw(st.integers(1, 4)))]
    if draw(st.booleans()):
        segs.insert(draw(st.integers(0, len(segs))), "**")
    return ".".join(segs)


def _glob_regex(glob: str) -> str:
    """An independent reading of the glob language with Python's ``re`` (subjects are short, so
    its backtracking is harmless here)."""
    out, i = "", 0
    segs = glob.split(".") if "{" not in glob else None
    if segs is not None:
        pieces = []
        for k, seg in enumerate(segs):
            if seg == "**":
                pieces.append(None)
                continue
            pieces.append("".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c)
                                  for c in seg))
        rx = ""
        for k, piece in enumerate(pieces):
            if piece is None:
                rx += r"(?:[^.]+\.)*" if k == 0 else r"(?:\.[^.]+)*"
                if len(pieces) == 1:
                    return r"[^.]+(?:\.[^.]+)*"
                continue
            rx += ("" if k == 0 or (k == 1 and pieces[0] is None) else r"\.") + piece
        return rx
    while i < len(glob):  # braces: expand the first and recurse
        if glob[i] == "{":
            j = glob.index("}", i)
            return "(?:" + "|".join(_glob_regex(glob[:i] + alt + glob[j + 1:])
                                    for alt in glob[i + 1:j].split(",")) + ")"
        i += 1
    return out


@settings(max_examples=500, deadline=None)
@given(_globs(), st.lists(st.text(alphabet="ab.cxy", max_size=10), min_size=1, max_size=8))
def test_glob_patterns_match_what_the_glob_language_says(pattern: str,
                                                         subjects: list[str]) -> None:
    ours = compile_pattern(pattern)
    theirs = re.compile(_glob_regex(pattern))
    for s in subjects:
        assert ours.fullmatch(s) == bool(theirs.fullmatch(s)), (pattern, s)
