"""A linear-time matcher for recipe ``match`` patterns: no backtracking, bounded size.

Python's ``re`` backtracks: ``re:(.*)*Z`` against a 30-character FQN runs for minutes, and
``re:a{99999999999}`` overflows its compiler. A recipe is data from someone else, so its patterns
are compiled here instead, to a Thompson NFA whose subsets become DFA states lazily (cached per
pattern, up to :data:`MAX_DFA_STATES` states; past that the cache starts afresh). Matching
is one step per character whatever the pattern, and the NFA's size is bounded by
:data:`MAX_NFA_STATES`, checked *before* a counted repeat is expanded.

The regular-expression syntax is the regular part of Python's: literals, ``.``, classes
(``[a-z_]``, ``[^.]``), ``\\d \\w \\s`` and their negations (Unicode, as in ``re``), groups
``(...)``/``(?:...)``/``(?P<name>...)``, ``|``, and the quantifiers ``* + ? {m} {m,} {,n} {m,n}``
(lazy forms accepted: with a whole-FQN match they mean the same). Lookarounds, backreferences,
possessive quantifiers, inline flags and anchors other than a leading ``^``/trailing ``$`` are
refused: they are either not regular or mean nothing for a whole-FQN match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from hyperrecipe.errors import PatternSyntaxError

__all__ = ["MAX_DFA_STATES", "MAX_NFA_STATES", "MAX_PATTERN_LENGTH", "Automaton", "Node",
           "PatternSyntaxError", "any_char", "char_class", "concat", "alternation", "literal",
           "parse_regex", "repeat"]

MAX_NFA_STATES = 20_000
"""Largest NFA a pattern may compile to (``a{20001}`` is refused)."""
MAX_DFA_STATES = 4_096
"""DFA states cached per pattern; past that the cache starts afresh (matching stays linear)."""
MAX_PATTERN_LENGTH = 4_096
"""Longest pattern text accepted."""
MAX_GROUP_DEPTH = 32
"""Deepest nesting of groups (or glob braces)."""


# ----------------------------------------------------------------------------- syntax tree

CharTest = Callable[[str], bool]


@attrs.frozen
class Node:
    """A regular-expression syntax tree node.

    ``kind`` is ``"char"`` (``test`` decides one character), ``"cat"``/``"alt"`` (``parts``),
    ``"rep"`` (``parts[0]`` repeated ``low`` to ``high`` times, ``high`` ``None`` for
    unbounded) or ``"empty"``. ``size`` is the number of NFA states it compiles to.
    """

    kind: str
    parts: tuple[Node, ...] = ()
    test: CharTest | None = attrs.field(default=None, eq=False)
    low: int = 0
    high: int | None = 0
    text: str = ""  # the literal character, for "char" nodes made from one
    size: int = 1


def literal(ch: str) -> Node:
    return Node(kind="char", test=ch.__eq__, text=ch)


def any_char() -> Node:
    return Node(kind="char", test=lambda c: c != "\n")


def char_class(test: CharTest) -> Node:
    return Node(kind="char", test=test)


def concat(parts: Sequence[Node]) -> Node:
    flat = tuple(p for p in parts if p.kind != "empty")
    if not flat:
        return Node(kind="empty", size=0)
    if len(flat) == 1:
        return flat[0]
    return _sized(Node(kind="cat", parts=flat, size=sum(p.size for p in flat)))


def alternation(parts: Sequence[Node]) -> Node:
    if len(parts) == 1:
        return parts[0]
    return _sized(Node(kind="alt", parts=tuple(parts), size=1 + sum(p.size for p in parts)))


def repeat(node: Node, low: int, high: int | None) -> Node:
    """``node`` repeated ``low``..``high`` times; refused before expansion when too large."""
    if high is not None and high < low:
        raise PatternSyntaxError(f"repeat {{{low},{high}}}: the maximum is below the minimum")
    copies = max(low, 1) if high is None else high
    if copies > MAX_NFA_STATES or (node.size + 1) * copies > MAX_NFA_STATES:
        count = f"{low}" if high == low else f"{low},{'' if high is None else high}"
        msg = f"repeat {{{count}}} makes the pattern larger than {MAX_NFA_STATES} states"
        raise PatternSyntaxError(msg)
    return _sized(Node(kind="rep", parts=(node,), low=low, high=high,
                       size=(node.size + 1) * copies + 1))


def _sized(node: Node) -> Node:
    if node.size > MAX_NFA_STATES:
        raise PatternSyntaxError(f"the pattern is larger than {MAX_NFA_STATES} states")
    return node


# ----------------------------------------------------------------------------- regex parser

_CLASS_ESCAPES: dict[str, CharTest] = {
    "d": str.isdecimal,
    "D": lambda c: not c.isdecimal(),
    "w": lambda c: c.isalnum() or c == "_",
    "W": lambda c: not (c.isalnum() or c == "_"),
    "s": str.isspace,
    "S": lambda c: not c.isspace(),
}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}


class _RegexParser:
    """Recursive descent over the pattern text, depth-bounded by :data:`MAX_GROUP_DEPTH`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def error(self, problem: str) -> PatternSyntaxError:
        return PatternSyntaxError(f"{problem} at position {self.i}")

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def parse(self) -> Node:
        if self.text.startswith("^"):
            self.i = 1
        node = self.alternation(0)
        if self.i < len(self.text):
            raise self.error("unbalanced parenthesis")
        return node

    def alternation(self, depth: int) -> Node:
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(depth))
        return alternation(branches)

    def sequence(self, depth: int) -> Node:
        parts: list[Node] = []
        while self.i < len(self.text) and self.peek() not in "|)":
            if self.peek() == "$" and self.i == len(self.text) - 1:
                self.i += 1
                break
            atom = self.atom(depth)
            parts.append(self.quantified(atom))
        return concat(parts)

    def atom(self, depth: int) -> Node:
        ch = self.peek()
        if ch == "(":
            return self.group(depth)
        if ch == "[":
            return self.klass()
        if ch == "\\":
            return self.escape(in_class=False)
        if ch == ".":
            self.i += 1
            return any_char()
        if ch in "*+?{":
            if ch == "{" and not self._is_counted_repeat():
                self.i += 1
                return literal("{")
            raise self.error(f"nothing to repeat before {ch!r}")
        if ch in "^$":
            raise self.error(f"anchor {ch!r} inside the pattern (a match is always of the whole "
                             f"FQN; ^ and $ are only accepted at its ends)")
        self.i += 1
        return literal(ch)

    def group(self, depth: int) -> Node:
        if depth >= MAX_GROUP_DEPTH:
            raise self.error(f"groups nest deeper than {MAX_GROUP_DEPTH}")
        self.i += 1
        if self.text.startswith("?:", self.i):
            self.i += 2
        elif self.text.startswith("?P<", self.i):
            end = self.text.find(">", self.i)
            if end < 0:
                raise self.error("unterminated group name")
            self.i = end + 1
        elif self.peek() == "?":
            raise self.error("lookarounds, backreferences, flags and atomic groups are not "
                             "supported in recipe patterns (use a plain group)")
        node = self.alternation(depth + 1)
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.i += 1
        return node

    def _is_counted_repeat(self) -> bool:
        end = self.text.find("}", self.i)
        if end < 0:
            return False
        body = self.text[self.i + 1:end]
        low, _, high = body.partition(",")
        return bool(body) and body != "," and all(not p or p.isascii() and p.isdigit()
                                                  for p in (low, high))

    def quantified(self, atom: Node) -> Node:
        start = self.i
        ch = self.peek()
        if ch == "*":
            low, high, self.i = 0, None, self.i + 1
        elif ch == "+":
            low, high, self.i = 1, None, self.i + 1
        elif ch == "?":
            low, high, self.i = 0, 1, self.i + 1
        elif ch == "{" and self._is_counted_repeat():
            end = self.text.index("}", self.i)
            body = self.text[self.i + 1:end]
            lo_text, comma, hi_text = body.partition(",")
            if len(lo_text) > 9 or len(hi_text) > 9:
                raise self.error(f"repeat {{{body}}} is larger than {MAX_NFA_STATES} states")
            low = int(lo_text) if lo_text else 0
            high = (int(hi_text) if hi_text else None) if comma else low
            self.i = end + 1
        else:
            return atom
        if self.peek() == "?":  # lazy: the same set of whole matches
            self.i += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifiers are not supported in recipe patterns")
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._is_counted_repeat()):
            raise self.error("multiple repeat")
        try:
            return repeat(atom, low, high)
        except PatternSyntaxError as exc:
            self.i = start
            raise self.error(str(exc)) from None

    def escape(self, *, in_class: bool) -> Node:
        self.i += 1
        ch = self.peek()
        if not ch:
            raise self.error("bad escape (end of pattern)")
        self.i += 1
        if ch in _CLASS_ESCAPES:
            return char_class(_CLASS_ESCAPES[ch])
        if ch in _CHAR_ESCAPES:
            return literal(_CHAR_ESCAPES[ch])
        if ch.isascii() and (ch.isalnum() or ch == "_"):
            raise self.error(f"escape \\{ch} is not supported in recipe patterns")
        return literal(ch)

    def klass(self) -> Node:
        start = self.i
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        tests: list[CharTest] = []
        ranges: list[tuple[str, str]] = []
        first = True
        while True:
            ch = self.peek()
            if not ch:
                self.i = start
                raise self.error("unterminated character set")
            if ch == "]" and not first:
                self.i += 1
                break
            first = False
            if ch == "\\":
                node = self.escape(in_class=True)
                if node.text:
                    lo = node.text
                else:
                    assert node.test is not None
                    tests.append(node.test)
                    continue
            else:
                if ch == "[" and self.text.startswith("[:", self.i):
                    raise self.error("POSIX classes are not supported in recipe patterns")
                lo = ch
                self.i += 1
            if self.peek() == "-" and self.i + 1 < len(self.text) and self.text[self.i + 1] != "]":
                self.i += 1
                hi = self.peek()
                if hi == "\\":
                    node = self.escape(in_class=True)
                    if not node.text:
                        raise self.error("bad character range")
                    hi = node.text
                else:
                    self.i += 1
                if hi < lo:
                    raise self.error(f"bad character range {lo}-{hi}")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        frozen_ranges = tuple(ranges)
        frozen_tests = tuple(tests)

        def member(c: str) -> bool:
            hit = any(lo <= c <= hi for lo, hi in frozen_ranges) or any(t(c) for t in
                                                                       frozen_tests)
            return hit != negated

        return char_class(member)


def parse_regex(text: str) -> Node:
    """The syntax tree of a recipe regular expression (the text after ``re:``).

    Raises:
        PatternSyntaxError: malformed, outside the supported syntax, or too large.
    """
    if len(text) > MAX_PATTERN_LENGTH:
        raise PatternSyntaxError(f"the pattern is longer than {MAX_PATTERN_LENGTH} characters")
    return _RegexParser(text).parse()


# ----------------------------------------------------------------------------- automaton

_DEAD = -1


class Automaton:
    """A compiled pattern: ``fullmatch(text)`` in one step per character.

    NFA state ``i`` is either a character test with one successor, a split (epsilon edges) or
    the final state. DFA states are frozensets of NFA states, built on first use.
    """

    def __init__(self, node: Node) -> None:
        self._tests: list[CharTest | None] = []
        self._next: list[tuple[int, ...]] = []
        start = self._build(node, self._new_state(None, ()))
        self._final = 0
        self._numbers: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        self._moves: list[dict[str, int]] = []
        self._accepting: list[bool] = []
        self._start_set = self._closure((start,))
        self._start = self._dfa_state(self._start_set)
        self._literal = _literal_text(node)
        self._prefix, self._suffix = _affixes(node)

    # NFA construction: _build(node, next_state) returns the entry state of node's fragment,
    # built backwards so each state's successors already exist.
    def _new_state(self, test: CharTest | None, successors: tuple[int, ...]) -> int:
        self._tests.append(test)
        self._next.append(successors)
        return len(self._tests) - 1

    def _build(self, node: Node, out: int) -> int:
        if node.kind == "empty":
            return out
        if node.kind == "char":
            return self._new_state(node.test, (out,))
        if node.kind == "cat":
            for part in reversed(node.parts):
                out = self._build(part, out)
            return out
        if node.kind == "alt":
            return self._new_state(None, tuple(self._build(p, out) for p in node.parts))
        body = node.parts[0]
        if node.high is None:  # low copies, then a loop
            loop = self._new_state(None, ())
            entry = self._build(body, loop)
            self._next[loop] = (entry, out)
            state = loop
            for _ in range(node.low):
                state = self._build(body, state)
            return state
        state = out
        for _ in range(node.high - node.low):  # optional copies: skip or take
            state = self._new_state(None, (self._build(body, state), out))
            out = state
        for _ in range(node.low):
            state = self._build(body, state)
        return state

    def _closure(self, states: Sequence[int]) -> frozenset[int]:
        seen: set[int] = set()
        stack = list(states)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            if self._tests[s] is None:
                stack.extend(self._next[s])
        return frozenset(seen)

    def _dfa_state(self, nfa_states: frozenset[int]) -> int:
        """The DFA state number of a set of NFA states (numbered on first sight; -1 is dead)."""
        if not nfa_states:
            return _DEAD
        found = self._numbers.get(nfa_states)
        if found is None:
            found = len(self._sets)
            self._numbers[nfa_states] = found
            self._sets.append(nfa_states)
            self._moves.append({})
            self._accepting.append(self._final in nfa_states)
        return found

    def _step(self, state: int, ch: str) -> int:
        """The DFA move from ``state`` on ``ch``, computed from the NFA and cached. When
        :data:`MAX_DFA_STATES` states exist, the cache starts afresh (in place, so a match in
        progress keeps going): memory stays bounded and each step stays linear in the NFA."""
        moved: list[int] = []
        for s in self._sets[state]:
            test = self._tests[s]
            if test is not None and test(ch):
                moved.extend(self._next[s])
        closure = self._closure(moved)
        if not closure:
            self._moves[state][ch] = _DEAD
            return _DEAD
        if closure not in self._numbers and len(self._sets) >= MAX_DFA_STATES:
            self._numbers.clear()
            self._sets.clear()
            self._moves.clear()
            self._accepting.clear()
            self._start = self._dfa_state(self._start_set)
            return self._dfa_state(closure)
        result = self._dfa_state(closure)
        self._moves[state][ch] = result
        return result

    def fullmatch(self, text: str) -> bool:
        """Whether the whole of ``text`` matches."""
        if self._literal is not None:
            return text == self._literal
        if not (text.startswith(self._prefix) and text.endswith(self._suffix)):
            return False
        moves = self._moves
        state = self._start
        for ch in text:
            nxt = moves[state].get(ch)
            if nxt is None:
                nxt = self._step(state, ch)
            if nxt == _DEAD:
                return False
            state = nxt
        return self._accepting[state]


def _affixes(node: Node) -> tuple[str, str]:
    """Literal text every match starts and ends with (a cheap filter before the automaton)."""
    parts = node.parts if node.kind == "cat" else (node,)
    prefix = ""
    for p in parts:
        if not (p.kind == "char" and p.text):
            break
        prefix += p.text
    suffix = ""
    for p in reversed(parts):
        if not (p.kind == "char" and p.text):
            break
        suffix = p.text + suffix
    return prefix, suffix


def _literal_text(node: Node) -> str | None:
    """The one string ``node`` matches, if it is a plain literal (the fast path)."""
    if node.kind == "char" and node.text:
        return node.text
    if node.kind == "cat" and all(p.kind == "char" and p.text for p in node.parts):
        return "".join(p.text for p in node.parts)
    return None
