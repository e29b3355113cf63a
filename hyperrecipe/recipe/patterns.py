"""FQN patterns: the `match` language of recipe rules.

Glob form, segment-aware: ``*`` matches within one dot-separated segment, ``**`` matches any
number of whole segments (zero included), ``?`` one character, ``{a,b}`` alternatives (which may
contain dots and wildcards). ``re:<regex>`` matches the whole FQN with Python's ``re``.
"""

from __future__ import annotations

import functools
import re

from hyperrecipe.errors import PatternError

__all__ = ["PatternError", "compile_pattern", "generalize_fqn"]


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a recipe ``match`` pattern to a regex matched with ``fullmatch``.

    Raises:
        PatternError: empty pattern, unbalanced braces, empty segment, or a bad regex.
    """
    if pattern.startswith("re:"):
        try:
            return re.compile(pattern[3:])
        except re.error as exc:
            raise PatternError(f"bad regular expression: {exc}") from None
    if not pattern:
        raise PatternError("empty pattern")
    return re.compile(_glob(pattern))


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


def _segment(seg: str) -> str:
    """Regex for glob text that lies within segments (alternatives may span dots)."""
    out, i = [], 0
    while i < len(seg):
        ch = seg[i]
        if ch == "{":
            depth, j = 1, i + 1
            while depth:
                if seg[j] == "{":
                    depth += 1
                elif seg[j] == "}":
                    depth -= 1
                j += 1
            alts = _split_top(seg[i + 1 : j - 1], ",")
            if any(a == "" for a in alts):
                raise PatternError("empty alternative in {...}")
            out.append("(?:" + "|".join(_glob(a) for a in alts) + ")")
            i = j
            continue
        if ch == "*":
            if seg[i : i + 2] == "**":
                raise PatternError("'**' must be a whole segment, e.g. 'model.**.q_proj'")
            out.append("[^.]*")
        elif ch == "?":
            out.append("[^.]")
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def _glob(pattern: str) -> str:
    segs = _split_top(pattern, ".")
    if segs == ["**"]:
        return r"[^.]+(?:\.[^.]+)*"
    rx = ""
    for i, seg in enumerate(segs):
        if seg == "":
            raise PatternError("empty segment (two dots in a row, or a leading/trailing dot)")
        if seg == "**":
            rx += r"(?:[^.]+\.)*" if i == 0 else r"(?:\.[^.]+)*"
            continue
        sep = "" if i == 0 or (i == 1 and segs[0] == "**") else r"\."
        rx += sep + _segment(seg)
    return rx


_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


def generalize_fqn(fqn: str) -> str:
    """``model.layers.3.mlp`` → ``model.layers.*.mlp``: a suggestion for patterns."""
    return _NUM.sub("*", fqn)
