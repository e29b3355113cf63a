"""Reading YAML and TOML documents while remembering where every value came from.

Both formats become the same thing: plain Python data (dicts, lists, str, int, float, bool,
None) plus a :class:`Positions` index from JSON-style paths to 1-based line/column, for keys
and for values. YAML positions are exact (from PyYAML's composer). ``tomllib`` keeps none, so
TOML positions come from a line scanner over headers and ``key =`` lines: exact for table and
key lines, best effort (the enclosing key's line) inside inline tables and multi-line arrays.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import yaml

from hyperrecipe._files import read_regular_file
from hyperrecipe.errors import RecipeError, SourceSpan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

__all__ = ["MAX_ALIAS_VALUES", "MAX_FILE_BYTES", "MAX_INT", "MAX_NESTING", "Document",
           "PathKey", "Positions", "format_path", "read_document"]

PathKey = tuple[str | int, ...]

MAX_NESTING = 64
"""Deepest nesting of mappings and lists a recipe document may have (recipes use about 5)."""
MAX_ALIAS_VALUES = 100_000
"""Values that YAML aliases may add by repeating a node (a shipped recipe adds a few hundred)."""
MAX_INT = 2**63 - 1
"""Largest integer magnitude a recipe may write (mesh sizes, positions, conditions)."""
MAX_FILE_BYTES = 16 * 2**20
"""Largest recipe file read."""


def format_path(path: PathKey) -> str:
    """``("rules", 2, "style")`` → ``$.rules[2].style`` (the cattrs path shape)."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


@attrs.define
class Positions:
    """Source positions of a document's keys and values, looked up by path."""

    file: str
    values: dict[PathKey, tuple[int, int]] = attrs.field(factory=dict)
    keys: dict[PathKey, tuple[int, int]] = attrs.field(factory=dict)

    def span(self, path: PathKey, *, key: bool = False) -> SourceSpan:
        """Span of the value (or key) at ``path``, else of the nearest ancestor that has one."""
        table = self.keys if key else self.values
        probe = tuple(path)
        while True:
            pos = table.get(probe) or self.values.get(probe) or self.keys.get(probe)
            if pos is not None:
                return SourceSpan(path=self.file, line=pos[0], column=pos[1])
            if not probe:
                return SourceSpan(path=self.file, line=1, column=1)
            probe = probe[:-1]


@attrs.frozen
class Document:
    """A parsed recipe document: its data, where each piece came from, and its text."""

    data: Any
    positions: Positions
    text: str


def read_document(path: str | Path, *, display: str | None = None) -> Document:
    """Read a ``.yaml``/``.yml``/``.toml`` file.

    Args:
        path: the file.
        display: the name used in error messages and provenance (default: ``path`` as given).

    Raises:
        RecipeError: the file cannot be read or is not valid YAML/TOML.
    """
    p = Path(path)
    name = display if display is not None else str(path)
    try:
        # a regular file of at most MAX_FILE_BYTES: a FIFO or /dev/zero is refused, not read
        # utf-8-sig: a byte order mark is not part of the text (TOML's parser refused it)
        text = read_regular_file(p, limit=MAX_FILE_BYTES).decode("utf-8-sig")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        msg = f"cannot read recipe file: {exc.strerror if isinstance(exc, OSError) else exc}"
        raise RecipeError(msg, span=SourceSpan(path=name, line=1, column=1)) from None
    suffix = p.suffix.lower()
    if suffix == ".toml":
        return parse_toml(text, name)
    if suffix in (".yaml", ".yml"):
        return parse_yaml(text, name)
    msg = f"unsupported recipe file type {suffix or '(none)'!r}; expected .yaml, .yml or .toml"
    raise RecipeError(msg, span=SourceSpan(path=name, line=1, column=1))


# --------------------------------------------------------------------------- YAML


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 30x faster


class _NoDatesLoader(_BaseLoader):  # type: ignore[misc]
    """The safe loader (libyaml's parser when installed) without timestamp magic, so
    `2024-01-01` stays a string like in TOML."""


class _PyNoDatesLoader(yaml.SafeLoader):
    """The pure-Python parser, for its fuller error messages."""


_NoDatesLoader.yaml_implicit_resolvers = _PyNoDatesLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_REPARSE_BYTES = 2**20  # below this, a syntax error is re-parsed for PyYAML's message
_SCALARS = yaml.constructor.SafeConstructor()
"""Builds scalar values; its scalar constructors keep no state, so one instance serves all."""


def parse_yaml(text: str, name: str) -> Document:
    """Parse YAML text, recording the position of every key and value.

    Bounded whatever the text: nesting deeper than :data:`MAX_NESTING`, aliases that expand to
    more than :data:`MAX_ALIAS_VALUES` values, a recursive alias, a tag outside YAML's core
    schema and an integer beyond :data:`MAX_INT` are each a located :class:`RecipeError`.
    """
    pure_python = _NoDatesLoader is _PyNoDatesLoader
    if pure_python and _bracket_depth(text) > MAX_NESTING:
        # PyYAML's scanner is quadratic in flow depth before any event reaches the check
        msg = f"the document nests deeper than {MAX_NESTING} levels"
        raise RecipeError(msg, span=SourceSpan(path=name, line=1, column=1))
    try:
        try:
            _check_yaml_events(text, name, _NoDatesLoader)
            node = yaml.compose(text, Loader=_NoDatesLoader)
        except yaml.YAMLError:
            if (pure_python or len(text) > _REPARSE_BYTES
                    or _bracket_depth(text) > MAX_NESTING):
                raise
            # libyaml's messages are terser than PyYAML's ("did not find expected ','"):
            # the pure-Python parser finds the same error and says what it got instead
            _check_yaml_events(text, name, _PyNoDatesLoader)
            raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        msg = f"invalid YAML: {problem}"
        raise RecipeError(msg, span=SourceSpan(path=name, line=line, column=col)) from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"invalid YAML: {exc}", span=SourceSpan(path=name, line=1, column=1)) from None
    positions = Positions(file=name)
    data = None if node is None else _YamlBuilder(name, positions).value(node, ())
    return Document(data=data, positions=positions, text=text)


_CORE_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null",
                                                          "seq", "map"))
_COLLECTION_TAGS = frozenset(("tag:yaml.org,2002:seq", "tag:yaml.org,2002:map"))


def _bracket_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of the raw text, quotes ignored: an upper bound of the flow
    depth, used only to keep the pure-Python scanner away from deep text."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}" and depth:
            depth -= 1
    return deepest


def _span_at(name: str, mark: Any) -> SourceSpan:
    if mark is None:
        return SourceSpan(path=name, line=1, column=1)
    return SourceSpan(path=name, line=mark.line + 1, column=mark.column + 1)


def _check_yaml_events(text: str, name: str, loader: Any) -> None:
    """Refuse deep nesting and foreign tags from the event stream, before anything recurses.

    PyYAML's parser is iterative; its composer and constructor recurse per nesting level, so
    depth is checked here first.
    """
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        tag = getattr(event, "tag", None)
        if tag is not None and tag != "!" and tag not in _CORE_TAGS:
            msg = (f"YAML tag {tag!r} is not allowed: recipes use only the core schema (str, "
                   f"int, float, bool, null, seq, map)")
            raise RecipeError(msg, span=_span_at(name, event.start_mark))
        if tag is not None and tag != "!":
            kind = ("map" if isinstance(event, yaml.MappingStartEvent) else
                    "seq" if isinstance(event, yaml.SequenceStartEvent) else "scalar")
            if (kind == "scalar") == (tag in _COLLECTION_TAGS) or (
                    kind != "scalar" and tag != f"tag:yaml.org,2002:{kind}"):
                what = "a mapping" if kind == "map" else "a list" if kind == "seq" else "a scalar"
                msg = f"YAML tag {tag!r} cannot be put on {what}"
                raise RecipeError(msg, span=_span_at(name, event.start_mark))
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                msg = f"the document nests deeper than {MAX_NESTING} levels"
                raise RecipeError(msg, span=_span_at(name, event.start_mark))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


class _YamlBuilder:
    """Plain data from a composed node graph, with positions; bounded against aliases.

    An alias makes a node reachable twice; each revisit counts against
    :data:`MAX_ALIAS_VALUES`, so a "billion laughs" document stops early, and a node reached
    again while it is being built (``&r [*r]``) is a recursive alias.
    """

    def __init__(self, name: str, positions: Positions) -> None:
        self.name = name
        self.pos = positions
        self.seen: set[int] = set()
        self.active: set[int] = set()
        self.repeated = 0

    def fail(self, msg: str, node: yaml.Node, path: PathKey) -> RecipeError:
        return RecipeError(msg, span=_span_at(self.name, node.start_mark), path=format_path(path))

    def value(self, node: yaml.Node, path: PathKey) -> Any:
        key = id(node)
        if key in self.active:
            raise self.fail("recursive alias: a node contains itself", node, path)
        if len(path) > MAX_NESTING:  # aliases of nested nodes inside nested nodes
            raise self.fail(f"the document nests deeper than {MAX_NESTING} levels (through "
                            f"aliases)", node, path[:8])
        if key in self.seen and not isinstance(node, yaml.ScalarNode):
            self.repeated += _node_count(node)
            if self.repeated > MAX_ALIAS_VALUES:
                msg = f"aliases expand to more than {MAX_ALIAS_VALUES} values"
                raise self.fail(msg, node, path)
        self.seen.add(key)
        self.pos.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, yaml.MappingNode):
            self.active.add(key)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                k = self.scalar(key_node, path)
                if isinstance(k, (dict, list)) or k is None:
                    raise self.fail("mapping keys must be strings or integers", key_node, path)
                child = (*path, k if isinstance(k, int) and not isinstance(k, bool) else str(k))
                self.pos.keys[child] = (key_node.start_mark.line + 1,
                                        key_node.start_mark.column + 1)
                if child[-1] in out:
                    msg = f"duplicate key {child[-1]!r}"
                    raise RecipeError(msg, span=self.pos.span(child, key=True),
                                      path=format_path(child))
                out[child[-1]] = self.value(value_node, child)
            self.active.discard(key)
            return out
        if isinstance(node, yaml.SequenceNode):
            self.active.add(key)
            items = [self.value(item, (*path, i)) for i, item in enumerate(node.value)]
            self.active.discard(key)
            return items
        return self.scalar(node, path)

    def scalar(self, node: yaml.Node, path: PathKey) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail("expected a scalar here", node, path)
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > _MAX_INT_TEXT:
            raise self.fail(f"integer {node.value[:20]}... is out of range (at most "
                            f"{MAX_INT.bit_length()} bits)", node, path)
        construct = _SCALARS.yaml_constructors.get(node.tag) if node.tag in _CORE_TAGS else None
        if construct is None:
            raise self.fail(f"YAML tag {node.tag!r} is not allowed on a scalar", node, path)
        try:
            value = construct(_SCALARS, node)
        except (yaml.YAMLError, ValueError, TypeError, AttributeError, OverflowError) as exc:
            problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) and exc.problem else exc
            msg = f"invalid YAML value {node.value[:40]!r} ({node.tag}): {problem}"
            raise self.fail(msg, node, path) from None
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise self.fail(_too_large(value), node, path)
        return value


_MAX_INT_TEXT = 100  # longer int text is out of range whatever its base or underscores


def _node_count(node: yaml.Node) -> int:
    """Values directly under a collection node (its subtree is counted as it is walked)."""
    return 1 + (len(node.value) if isinstance(node.value, list) else 0)


def _too_large(value: int) -> str:
    digits = len(str(abs(value))) if abs(value) < 10 ** 100 else "over 100"
    return f"integer with {digits} digits is out of range (at most {MAX_INT.bit_length()} bits)"


# --------------------------------------------------------------------------- TOML

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*(\]\]?)\s*(?:#.*)?$")
_KEY = re.compile(r"""^(\s*)((?:[A-Za-z0-9_\-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|"[^"]*"|'[^']*'))*)\s*=\s*""")


def _split_dotted(key: str) -> list[str]:
    parts = re.findall(r"""[A-Za-z0-9_\-]+|"[^"]*"|'[^']*'""", key)
    return [p[1:-1] if p[:1] in "\"'" else p for p in parts]


def parse_toml(text: str, name: str) -> Document:
    """Parse TOML text; positions come from a scan of header and key lines.

    Bounded like :func:`parse_yaml`: bracket nesting is checked before ``tomllib`` (which
    recurses per level) sees the text, and the parsed data's depth (dotted keys nest too) and
    integers after.
    """
    _check_toml_brackets(text, name)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, col = _toml_error_position(str(exc), text)
        msg = f"invalid TOML: {str(exc).split(' (at ')[0]}"
        raise RecipeError(msg, span=SourceSpan(path=name, line=line, column=col)) from None
    except (ValueError, RecursionError) as exc:  # int() past its digit limit, deep nesting
        long_int = re.search(r"[0-9_]{%d,}" % _MAX_INT_TEXT, text)
        if long_int is None:
            msg = f"invalid TOML: {exc}"
            raise RecipeError(msg, span=SourceSpan(path=name, line=1, column=1)) from None
        line = text.count("\n", 0, long_int.start()) + 1
        col = long_int.start() - (text.rfind("\n", 0, long_int.start()) + 1) + 1
        msg = (f"integer {long_int.group()[:20]}... is out of range (at most "
               f"{MAX_INT.bit_length()} bits)")
        raise RecipeError(msg, span=SourceSpan(path=name, line=line, column=col)) from None
    positions = Positions(file=name)
    _index_toml(text, positions)
    _check_data(data, positions)
    return Document(data=data, positions=positions, text=text)


def _check_toml_brackets(text: str, name: str) -> None:
    """Refuse ``[``/``{`` nesting deeper than :data:`MAX_NESTING`, outside strings and comments."""
    depth, line, col, i, n = 0, 1, 1, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            line, col, i = line + 1, 1, i + 1
            continue
        if ch == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if ch in "\"'":
            quote = text[i:i + 3] if text.startswith(ch * 3, i) else ch
            j = i + len(quote)
            while j < n and not text.startswith(quote, j):
                if text[j] == "\\" and ch == '"':
                    j += 1
                elif text[j] == "\n" and len(quote) == 1:
                    break  # the parser reports the unterminated string
                j += 1
            end = min(j + len(quote), n)
            line += text.count("\n", i, end)
            col = 1 if "\n" in text[i:end] else col + end - i
            i = end
            continue
        if ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                msg = f"the document nests deeper than {MAX_NESTING} levels"
                raise RecipeError(msg, span=SourceSpan(path=name, line=line, column=col))
        elif ch in "]}":
            depth = max(depth - 1, 0)
        i, col = i + 1, col + 1


def _check_data(data: Any, positions: Positions) -> None:
    """Depth and integer range of parsed data, iteratively (dotted TOML keys nest without
    brackets)."""
    stack: list[tuple[PathKey, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if len(path) > MAX_NESTING:
            msg = f"the document nests deeper than {MAX_NESTING} levels"
            raise RecipeError(msg, span=positions.span(path), path=format_path(path[:8]) + "...")
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise RecipeError(_too_large(value), span=positions.span(path),
                              path=format_path(path))


def _toml_error_position(message: str, text: str) -> tuple[int, int]:
    m = re.search(r"line (\d+), column (\d+)", message)
    if m:
        return int(m.group(1)), int(m.group(2))
    if "end of document" in message:
        return text.count("\n") + 1, 1
    return 1, 1


def _index_toml(text: str, pos: Positions) -> None:
    table: PathKey = ()
    array_counts: dict[PathKey, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = _HEADER.match(line)
        if m and not _KEY.match(line):
            keys = _split_dotted(m.group(2))
            base: PathKey = tuple(keys)
            col = line.index(m.group(1)) + 1
            if m.group(1) == "[[":
                idx = array_counts.get(base, 0)
                array_counts[base] = idx + 1
                table = (*base, idx)
                pos.keys.setdefault(base, (lineno, col))
            else:
                table = base
            pos.values.setdefault(table, (lineno, col))
            pos.keys.setdefault(table, (lineno, col))
            continue
        k = _KEY.match(line)
        if not k:
            continue
        key_path = (*table, *_split_dotted(k.group(2)))
        key_col = len(k.group(1)) + 1
        pos.keys.setdefault(key_path, (lineno, key_col))
        pos.values.setdefault(key_path, (lineno, k.end() + 1))
        _index_inline(line, k.end(), key_path, lineno, pos)


def _index_inline(line: str, start: int, base: PathKey, lineno: int, pos: Positions) -> None:
    """Positions for keys inside inline tables and items of one-line arrays."""
    stack: list[tuple[PathKey, int]] = []  # (path of container, next array index or -1 for table)
    i = start
    current: PathKey = base
    expecting_value_for: PathKey | None = base
    while i < len(line):
        ch = line[i]
        if ch in "\"'":
            end = line.find(ch, i + 1)
            end = len(line) - 1 if end < 0 else end
            if stack and stack[-1][1] >= 0 and expecting_value_for is None:
                path, n = stack[-1]
                pos.values.setdefault((*path, n), (lineno, i + 1))
            i = end + 1
            continue
        if ch == "#":
            break
        if ch == "{":
            container = expecting_value_for if expecting_value_for is not None else current
            if stack and stack[-1][1] >= 0 and expecting_value_for is None:
                path, n = stack[-1]
                container = (*path, n)
            pos.values.setdefault(container, (lineno, i + 1))
            stack.append((container, -1))
            expecting_value_for = None
        elif ch == "[":
            container = expecting_value_for if expecting_value_for is not None else current
            stack.append((container, 0))
            expecting_value_for = None
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == "," and stack and stack[-1][1] >= 0:
            path, n = stack[-1]
            stack[-1] = (path, n + 1)
        elif stack and stack[-1][1] == -1:
            m = _KEY.match(line[i:])
            if m:
                key_path = (*stack[-1][0], *_split_dotted(m.group(2)))
                pos.keys.setdefault(key_path, (lineno, i + len(m.group(1)) + 1))
                pos.values.setdefault(key_path, (lineno, i + m.end() + 1))
                expecting_value_for = key_path
                i += m.end()
                continue
        i += 1


def walk(data: Any, path: PathKey = ()) -> Iterator[tuple[PathKey, Any]]:
    """Every (path, value) of a document, parents before children."""
    yield path, data
    if isinstance(data, dict):
        for k, v in data.items():
            yield from walk(v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from walk(v, (*path, i))
