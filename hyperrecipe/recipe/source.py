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

from hyperrecipe.errors import RecipeError, SourceSpan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

__all__ = ["Document", "PathKey", "Positions", "format_path", "read_document"]

PathKey = tuple[str | int, ...]


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
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
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


class _NoDatesLoader(yaml.SafeLoader):
    """SafeLoader without timestamp magic, so `2024-01-01` stays a string like in TOML."""


_NoDatesLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def parse_yaml(text: str, name: str) -> Document:
    """Parse YAML text, recording the position of every key and value."""
    try:
        node = yaml.compose(text, Loader=_NoDatesLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        msg = f"invalid YAML: {problem}"
        raise RecipeError(msg, span=SourceSpan(path=name, line=line, column=col)) from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"invalid YAML: {exc}", span=SourceSpan(path=name, line=1, column=1)) from None
    positions = Positions(file=name)
    data = None if node is None else _yaml_value(node, (), positions, name)
    return Document(data=data, positions=positions, text=text)


def _yaml_value(node: yaml.Node, path: PathKey, pos: Positions, name: str) -> Any:
    pos.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _yaml_scalar(key_node, path, name)
            if isinstance(key, (dict, list)) or key is None:
                msg = "mapping keys must be strings or integers"
                span = SourceSpan(path=name, line=key_node.start_mark.line + 1,
                                  column=key_node.start_mark.column + 1)
                raise RecipeError(msg, span=span, path=format_path(path))
            child = (*path, key if isinstance(key, int) and not isinstance(key, bool) else str(key))
            pos.keys[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if child[-1] in out:
                msg = f"duplicate key {child[-1]!r}"
                raise RecipeError(msg, span=pos.span(child, key=True), path=format_path(child))
            out[child[-1]] = _yaml_value(value_node, child, pos, name)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_yaml_value(item, (*path, i), pos, name) for i, item in enumerate(node.value)]
    return _yaml_scalar(node, path, name)


def _yaml_scalar(node: yaml.Node, path: PathKey, name: str) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        msg = "expected a scalar here"
        span = SourceSpan(path=name, line=node.start_mark.line + 1, column=node.start_mark.column + 1)
        raise RecipeError(msg, span=span, path=format_path(path))
    loader = _NoDatesLoader("")
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        span = SourceSpan(path=name, line=node.start_mark.line + 1, column=node.start_mark.column + 1)
        raise RecipeError(f"invalid YAML value: {exc}", span=span, path=format_path(path)) from None
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- TOML

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*(\]\]?)\s*(?:#.*)?$")
_KEY = re.compile(r"""^(\s*)((?:[A-Za-z0-9_\-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|"[^"]*"|'[^']*'))*)\s*=\s*""")


def _split_dotted(key: str) -> list[str]:
    parts = re.findall(r"""[A-Za-z0-9_\-]+|"[^"]*"|'[^']*'""", key)
    return [p[1:-1] if p[:1] in "\"'" else p for p in parts]


def parse_toml(text: str, name: str) -> Document:
    """Parse TOML text; positions come from a scan of header and key lines."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, col = _toml_error_position(str(exc), text)
        msg = f"invalid TOML: {str(exc).split(' (at ')[0]}"
        raise RecipeError(msg, span=SourceSpan(path=name, line=line, column=col)) from None
    positions = Positions(file=name)
    _index_toml(text, positions)
    return Document(data=data, positions=positions, text=text)


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
