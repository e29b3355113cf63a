"""The libcst pass over one Python file: run the rules, apply suppressions, place findings.

All rules run in a single batched traversal. Positions (and, for the few rules that need them,
qualified names) are computed only when there is something to report, and then only for the
statements that hold it, so a file with no finding costs one parse and one traversal.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import libcst as cst

from hyperrecipe.lint.codes import by_code
from hyperrecipe.lint.findings import Finding, Severity
from hyperrecipe.lint.prefilter import (
    SUPPRESSION_HINT,
    InterpreterLimit,
    check_interpreter_limits,
)
from hyperrecipe.lint.rule import FileContext, LintRule, StatementPath, is_unit
from hyperrecipe.lint.rules import ALL_RULES
from hyperrecipe.lint.suppressions import DIRECTIVE, Suppression, parse_suppression

if TYPE_CHECKING:
    from libcst.metadata import CodeRange

__all__ = ["lint_source"]

_LINE_BREAK: Final = re.compile(r"\r\n|\r|\n")


_MethodTable = dict[str, tuple[str, ...]]
_METHOD_TABLES: dict[type, tuple[_MethodTable, _MethodTable]] = {}


def _method_table(cls: type) -> tuple[_MethodTable, _MethodTable]:
    """Node class name -> names of the ``visit_``/``leave_`` methods ``cls`` really defines."""
    cached = _METHOD_TABLES.get(cls)
    if cached is None:
        visits: dict[str, list[str]] = {}
        leaves: dict[str, list[str]] = {}
        for attribute in dir(cls):
            prefix, _, node = attribute.partition("_")
            if prefix not in ("visit", "leave") or not node or "_" in node:
                continue  # not a node visitor (or a per-attribute one, which rules do not use)
            if getattr(cls, attribute) is getattr(cst.BatchableCSTVisitor, attribute, None):
                continue  # the no-op default
            (visits if prefix == "visit" else leaves).setdefault(node, []).append(attribute)
        cached = (
            {k: tuple(v) for k, v in visits.items()},
            {k: tuple(v) for k, v in leaves.items()},
        )
        _METHOD_TABLES[cls] = cached
    return cached


#: Node class -> the names of its dataclass fields (children are found among them).
_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(kind: type) -> tuple[str, ...]:
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return names


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The nodes directly under ``node``: what ``node.children`` gives, in field order.

    ``node.children`` (like ``node.visit``) rebuilds ``node`` to find them; this reads the
    fields. The test-suite checks the two agree on every node of real files.
    """
    found: list[cst.CSTNode] = []
    for name in _fields(type(node)):
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            found.append(value)
        elif type(value) is tuple or type(value) is list:
            found.extend(item for item in value if isinstance(item, cst.CSTNode))
    return found


class _Dispatcher(cst.CSTVisitor):
    """Runs several batchable visitors in one traversal.

    Like :func:`libcst.visit_batched`, but the method tables are built once per visitor *class*
    (libcst rebuilds them with ``inspect.getmembers`` for every instance, i.e. every file), and
    :meth:`walk` does not rebuild the tree as it goes (``node.visit`` constructs and validates
    a copy of every node on its way back up: about half of a traversal's cost). It also keeps
    :attr:`FileContext.current_path` up to date, which reports and comments record so that
    :meth:`FileContext.locate` can place them cheaply.
    """

    def __init__(self, visitors: Sequence[cst.BatchableCSTVisitor], context: FileContext) -> None:
        super().__init__()
        self._context = context
        # id of a statement -> its index in module.body, or in the body of the class or
        # function it sits in (when that class or function is itself on a statement path).
        self._tops = {id(statement): index for index, statement in enumerate(context.module.body)}
        self._inner: dict[int, int] = {}
        visit: dict[str, list[Callable[[cst.CSTNode], object]]] = {}
        leave: dict[str, list[Callable[[cst.CSTNode], object]]] = {}
        for visitor in visitors:
            visits, leaves = _method_table(type(visitor))
            for node, names in visits.items():
                visit.setdefault(node, []).extend(getattr(visitor, n) for n in names)
            for node, names in leaves.items():
                leave.setdefault(node, []).extend(getattr(visitor, n) for n in names)
        self._visit = visit
        self._leave = leave

    def on_visit(self, node: cst.CSTNode) -> bool:
        key = id(node)
        top = self._tops.get(key)
        on_path = top is not None
        if on_path:
            self._context.current_path = (top,)  # type: ignore[assignment]
        else:
            index = self._inner.get(key)
            if index is not None and self._context.current_path is not None:
                self._context.current_path = (*self._context.current_path, index)
                on_path = True
        if on_path and is_unit(node):
            assert isinstance(node, (cst.ClassDef, cst.FunctionDef))
            assert isinstance(node.body, cst.IndentedBlock)
            for index, statement in enumerate(node.body.body):
                self._inner[id(statement)] = index
        for method in self._visit.get(type(node).__name__, ()):
            method(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        for method in self._leave.get(type(original_node).__name__, ()):
            method(original_node)
        key = id(original_node)
        if key in self._tops:
            self._context.current_path = None
        elif key in self._inner and self._context.current_path is not None:
            self._context.current_path = self._context.current_path[:-1]

    def walk(self, node: cst.CSTNode) -> None:
        """Visit ``node`` and its subtree as ``node.visit(self)`` does, parents before children
        and each node's leave after its subtree; siblings come in field order, not source
        order (no visitor here depends on it: findings are sorted in the end)."""
        self.on_visit(node)
        for name in _fields(type(node)):
            value = getattr(node, name)
            if isinstance(value, cst.CSTNode):
                self.walk(value)
            elif type(value) is tuple or type(value) is list:
                for item in value:
                    if isinstance(item, cst.CSTNode):
                        self.walk(item)
        self.on_leave(node)

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        return None

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        return None


class _StatementTracker(cst.BatchableCSTVisitor):
    """Tells the context which simple statement is being visited (for suppression ranges)."""

    def __init__(self, context: FileContext) -> None:
        super().__init__()
        self.context = context

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.context.current_statement = node

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.context.current_statement = None

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> None:
        self.context.current_statement = node

    def leave_SimpleStatementSuite(self, original_node: cst.SimpleStatementSuite) -> None:
        self.context.current_statement = None


@attrs.define
class _Comment:
    node: cst.Comment
    own_line: bool
    suppression: Suppression
    where: StatementPath


class _CommentCollector(cst.BatchableCSTVisitor):
    """Collects ``# hyperrecipe:`` comments, noting whether each stands on its own line."""

    def __init__(self, context: FileContext) -> None:
        super().__init__()
        self.context = context
        self.comments: list[_Comment] = []

    def _take(self, comment: cst.Comment | None, own_line: bool) -> None:
        if comment is None or DIRECTIVE.match(comment.value) is None:
            return
        parsed = parse_suppression(comment.value)
        if parsed is not None:
            self.comments.append(_Comment(comment, own_line, parsed, self.context.current_path))

    def visit_EmptyLine(self, node: cst.EmptyLine) -> None:
        self._take(node.comment, own_line=True)

    def visit_TrailingWhitespace(self, node: cst.TrailingWhitespace) -> None:
        self._take(node.comment, own_line=False)


def _finding(
    display: str,
    line: int,
    column: int,
    code: str,
    message: str,
    *,
    end_line: int | None = None,
    end_column: int | None = None,
) -> Finding:
    info = by_code(code)
    severity: Severity = "error" if info.kind == "error" else "finding"
    return Finding(path=display, line=line, column=column, code=code, name=info.name,
                   message=message, severity=severity,
                   end_line=line if end_line is None else end_line,
                   end_column=column if end_column is None else end_column)


def _syntax_error(source: bytes, display: str, error: Exception) -> Finding:
    """Report a file libcst cannot parse, in the interpreter's words when it agrees."""
    try:
        compile(source, display, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        return _finding(display, exc.lineno or 1, exc.offset or 1, "HR000",
                        f"cannot parse: {exc.msg}")
    except ValueError as exc:  # NUL bytes on some versions
        return _finding(display, 1, 1, "HR000", f"cannot parse: {exc}")
    if isinstance(error, cst.ParserSyntaxError):
        message = error.message.removeprefix("parser error: ")
        return _finding(display, error.raw_line, error.raw_column + 1, "HR000",
                        f"cannot parse: {message}")
    return _finding(display, 1, 1, "HR000", f"cannot parse: {type(error).__name__}: {error}")


def _next_code_line(lines: Sequence[str], after: int) -> int:
    """The first line after 1-based line ``after`` holding code (not blank, not a comment)."""
    for index in range(after, len(lines)):
        stripped = lines[index].strip()
        if stripped and not stripped.startswith("#"):
            return index + 1
    return after + 1


def lint_source(
    source: bytes,
    *,
    display: str,
    codes: Collection[str],
    allow_gated: bool = False,
    screened: bool = False,
) -> list[Finding]:
    """Lint one Python file with libcst.

    Args:
        source: the file's bytes.
        display: the path to show in findings.
        codes: the codes to report (see :func:`hyperrecipe.lint.codes.resolve_selection`).
        allow_gated: the file is a configured rewriter path: forward-gate rules do not run.
        screened: the screen already compiled the file; otherwise a source the interpreter
            refuses for a nesting limit is reported here (``HR000``) before libcst, whose native
            parser may crash on it, sees it.

    Returns:
        Findings and errors, unsorted. A file that does not parse yields one ``HR000`` error; a
        crash of the lint itself one ``HR999`` error; never an exception.
    """
    if not screened:
        try:
            check_interpreter_limits(source, display)
        except InterpreterLimit as limit:
            return [_finding(display, limit.line, limit.column, "HR000",
                             f"cannot parse: {limit.message}")]
    try:
        module = cst.parse_module(source)
    except Exception as exc:  # noqa: BLE001 - ParserSyntaxError, UnicodeDecodeError, ...
        return [_syntax_error(source, display, exc)]
    try:
        return _lint_module(module, source, display, codes, allow_gated)
    except Exception as exc:  # noqa: BLE001 - a rule bug must not become a traceback
        return [
            _finding(display, 1, 1, "HR999",
                     f"the lint crashed on this file: {type(exc).__name__}: {exc}")
        ]


def _lint_module(
    module: cst.Module,
    source: bytes,
    display: str,
    codes: Collection[str],
    allow_gated: bool,
) -> list[Finding]:
    context = FileContext(module)
    rules: list[LintRule] = [
        rule(context)
        for rule in ALL_RULES
        if rule.code in codes and not (rule.gated and allow_gated)
    ]
    visitors: list[cst.BatchableCSTVisitor] = [_StatementTracker(context), *rules]
    collector = _CommentCollector(context)
    if b"hyperrecipe" in source and SUPPRESSION_HINT.search(source):
        visitors.append(collector)
    elif not rules:
        return []
    _Dispatcher(visitors, context).walk(module)
    reports = context.reports
    comments = collector.comments
    if not reports and not comments:
        return []

    wanted: list[tuple[cst.CSTNode, StatementPath]] = []
    for report in reports:
        wanted.append((report.node, report.where))
        if report.statement is not None:
            wanted.append((report.statement, report.where))
    wanted.extend((comment.node, comment.where) for comment in comments)
    positions = context.locate(wanted)
    checked = {rule.code for rule in rules}
    lines: list[str] | None = None
    spans: list[tuple[_Comment, int, int]] = []  # comment, first and last line it covers
    for comment in comments:
        line = positions[comment.node].start.line
        if comment.own_line:
            if lines is None:
                lines = _LINE_BREAK.split(source.decode(module.encoding, errors="replace"))
            target = _next_code_line(lines, line)
            spans.append((comment, target, target))
        else:
            spans.append((comment, line, line))

    used: set[tuple[int, str]] = set()
    findings: list[Finding] = []
    for report in reports:
        where = positions[report.node]
        scope: CodeRange = positions[report.statement] if report.statement is not None else where
        first, last = scope.start.line, scope.end.line
        silenced = False
        for index, (comment, low, high) in enumerate(spans):
            if report.code in comment.suppression.codes and first <= high and low <= last:
                used.add((index, report.code))
                silenced = True
        if not silenced:
            findings.append(
                Finding(path=display, line=where.start.line, column=where.start.column + 1,
                        code=report.code, name=report.name, message=report.message,
                        end_line=where.end.line, end_column=where.end.column + 1)
            )

    for index, (comment, _, _) in enumerate(spans):
        start, end = positions[comment.node].start, positions[comment.node].end
        line, column = start.line, start.column + 1
        extent = {"end_line": end.line, "end_column": end.column + 1}
        if "HR901" in codes:
            for problem in comment.suppression.problems:
                findings.append(_finding(display, line, column, "HR901", problem, **extent))
        if "HR900" in codes:
            for code in comment.suppression.codes:
                if code in checked and (index, code) not in used:
                    info = by_code(code)
                    findings.append(
                        _finding(display, line, column, "HR900",
                                 f"unused suppression: no {code} ({info.name}) finding here "
                                 "to silence; remove the comment", **extent)
                    )
    return findings
