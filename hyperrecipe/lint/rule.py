"""The shape of a lint rule, the test cases it carries, and the per-file context it queries.

A rule is a :class:`LintRule` subclass: a libcst batchable visitor with a stable ``code`` and
``name``, a default ``message``, documentation in its docstring (*What it does / Why is this
bad? / Example / Use instead*) and embedded :class:`Valid`/:class:`Invalid` cases from which the
test-suite generates one test per case.

Rules run in a single batched traversal per file. They do not declare metadata up front: they ask
the :class:`FileContext` for qualified names or module constants only after a cheap structural
match, so scope analysis (the costly part of libcst metadata) runs only in the rare file that
needs it.
"""

from __future__ import annotations

import ast
import textwrap
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Final

import attrs
import libcst as cst

from hyperrecipe.lint.targets import ENTRY_NAMES, PATCHED_METHOD_NAMES, TARGET_NAMES

if TYPE_CHECKING:
    from libcst.metadata import CodeRange, QualifiedName

__all__ = [
    "ENTRY_NAMES",
    "WATCHED_NAMES",
    "StatementPath", "FileContext", "Invalid", "LintRule", "Report", "Valid"]

#: Where a node sits: the index of its top-level statement in ``module.body``, then the index
#: in the body of each enclosing class or function on the way down (``(3, 0, 2)``: statement
#: 2 of the first method of the class at top-level position 3). ``None`` outside every
#: statement (a comment in the module header).
StatementPath = tuple[int, ...] | None

#: The attribute names the rules care about; name constants are resolved only for these.
#: :data:`ENTRY_NAMES` (from ``targets``) are the attributes that decide what ``m(x)`` runs.
WATCHED_NAMES: Final = TARGET_NAMES | PATCHED_METHOD_NAMES


@attrs.frozen
class Valid:
    """Source a rule must not report."""

    code: str = attrs.field(converter=textwrap.dedent)


@attrs.frozen
class Invalid:
    """Source a rule must report, ``count`` times; the first report at ``line``/``column``.

    Args:
        code: the source (dedented).
        line: 1-based line of the first report, when the case wants it checked.
        column: 1-based column of the first report.
        count: how many reports of this rule the source produces.
    """

    code: str = attrs.field(converter=textwrap.dedent)
    line: int | None = attrs.field(default=None, kw_only=True)
    column: int | None = attrs.field(default=None, kw_only=True)
    count: int = attrs.field(default=1, kw_only=True)


@attrs.frozen
class Report:
    """A rule fired on ``node``; ``statement`` (if any) widens where a suppression may sit.

    ``where`` is the :data:`StatementPath` of the statement holding the node.
    """

    code: str
    name: str
    message: str
    node: cst.CSTNode
    statement: cst.CSTNode | None
    where: StatementPath


class LintRule(cst.BatchableCSTVisitor):
    """Base class of every rule.

    Subclasses set the class attributes and implement ``visit_<Node>`` methods that call
    :meth:`report`. One instance lints one file.

    Args:
        context: the file being linted.
    """

    code: ClassVar[str]
    name: ClassVar[str]
    message: ClassVar[str]
    #: Part of the forward gate: not run in the configured rewriter paths.
    gated: ClassVar[bool] = True
    #: Reported only where selected by its exact code or name, never by default or by a prefix
    #: (see :class:`hyperrecipe.lint.codes.CodeInfo`).
    opt_in: ClassVar[bool] = False
    VALID: ClassVar[tuple[Valid, ...]] = ()
    INVALID: ClassVar[tuple[Invalid, ...]] = ()

    def __init__(self, context: FileContext) -> None:
        super().__init__()
        self.context = context

    def report(self, node: cst.CSTNode, message: str | None = None) -> None:
        """Report ``node`` with ``message`` (the rule's default message when ``None``)."""
        self.context.add_report(self, node, self.message if message is None else message)


_EMPTY_MODULE: Final = cst.Module(body=[])


class FileContext:
    """What rules may ask about the file they are visiting.

    Metadata is resolved lazily and at most once per file: the first call that needs qualified
    names runs libcst's scope analysis; files that never ask never pay for it.

    Args:
        module: the parsed file.
    """

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self.reports: list[Report] = []
        self.current_statement: cst.CSTNode | None = None
        self.current_path: StatementPath = None
        self._wrapper: cst.MetadataWrapper | None = None
        self._qualified: Mapping[cst.CSTNode, Collection[QualifiedName]] | None = None
        self._constants: dict[str, list[tuple[cst.Name, cst.BaseExpression]]] | None = None
        self._imports: dict[str, list[str]] | None = None
        self._line_breaks_cache: dict[int, int] = {}

    # -- reports ------------------------------------------------------------------------------

    def add_report(self, rule: LintRule, node: cst.CSTNode, message: str) -> None:
        """Record that ``rule`` fired on ``node``."""
        self.reports.append(
            Report(rule.code, rule.name, message, node, self.current_statement, self.current_path)
        )

    # -- metadata -----------------------------------------------------------------------------

    @property
    def wrapper(self) -> cst.MetadataWrapper:
        """A metadata wrapper over the very nodes the rules see (no copy)."""
        if self._wrapper is None:
            self._wrapper = cst.MetadataWrapper(self.module, unsafe_skip_copy=True)
        return self._wrapper

    def positions(self) -> Mapping[cst.CSTNode, CodeRange]:
        """Line/column ranges of every node (computed on first use)."""
        from libcst.metadata import PositionProvider

        return self.wrapper.resolve(PositionProvider)

    def locate(self, nodes: Iterable[tuple[cst.CSTNode, StatementPath]]) -> dict[cst.CSTNode, CodeRange]:
        """The ranges :class:`~libcst.metadata.PositionProvider` gives ``nodes``, computed cheaply.

        Positions cost a code generation of the whole file with bookkeeping for every node.
        Findings are few, so only the innermost class or function body statement holding each
        one is generated with positions — wrapped in its enclosing classes and functions cut
        down to that one statement, so indentation is exactly as in the file — and the lines
        before it are only counted. Code generation is compositional, so the result is what the
        provider gives on the whole module (the test-suite checks this, node for node, on real
        files).

        Args:
            nodes: each node with its :data:`StatementPath`; nodes outside every statement fall
                back to the full provider.
        """
        from libcst.metadata import CodePosition, CodeRange, PositionProvider

        found: dict[cst.CSTNode, CodeRange] = {}
        by_path: dict[tuple[int, ...], list[cst.CSTNode]] = {}
        module = self.module
        body = module.body
        for node, path in nodes:
            if path is None:
                found[node] = self.positions()[node]
                continue
            if path[0] == len(body) - 1 and not module.has_trailing_newline:
                path = path[:1]  # the file's last line has no newline: keep the real ending
            by_path.setdefault(path, []).append(node)
        if not by_path:
            return found

        # Lines before each top-level statement: count once, in order, up to the last needed.
        tops = sorted({path[0] for path in by_path})
        lines_before_top: dict[int, int] = {}
        lines = sum(_line_breaks(module.code_for_node(h)) for h in module.header)
        for index in range(tops[-1] + 1):
            if index in tops:
                lines_before_top[index] = lines
            if index < tops[-1]:
                lines += self._breaks(body[index])

        for path, wanted in by_path.items():
            chain: list[cst.CSTNode] = [body[path[0]]]
            lines = lines_before_top[path[0]]
            for index in path[1:]:
                block = _def_body(chain[-1])
                lines += sum(self._breaks(statement) for statement in block.body[:index])
                chain.append(block.body[index])
            unit = chain[-1]
            for parent in reversed(chain[:-1]):
                block = _def_body(parent)
                unit = parent.with_changes(body=block.with_changes(body=(unit,), footer=()))
            last = len(path) == 1 and path[0] == len(body) - 1
            alone = module.with_changes(
                header=(),
                body=(unit,),
                footer=(),
                has_trailing_newline=module.has_trailing_newline if last else True,
            )
            ranges = cst.MetadataWrapper(alone, unsafe_skip_copy=True).resolve(PositionProvider)
            for node in wanted:
                r = ranges[node]
                found[node] = CodeRange(
                    CodePosition(r.start.line + lines, r.start.column),
                    CodePosition(r.end.line + lines, r.end.column),
                )
        return found

    def _breaks(self, node: cst.CSTNode) -> int:
        """Line breaks in ``node``'s code (which does not depend on where it is indented)."""
        key = id(node)
        count = self._line_breaks_cache.get(key)
        if count is None:
            count = self._line_breaks_cache[key] = _line_breaks(self.module.code_for_node(node))
        return count

    def qualified_names(self, node: cst.CSTNode) -> frozenset[str]:
        """The qualified names ``node`` (a name or attribute) may refer to.

        Follows imports and aliases (``from builtins import setattr as s`` makes ``s`` refer to
        ``builtins.setattr``), and knows when a local definition shadows a builtin.
        """
        return frozenset(q.name for q in self._qualified_of(node))

    def _qualified_of(self, node: cst.CSTNode) -> Collection[QualifiedName]:
        from libcst.metadata import QualifiedNameProvider

        if self._qualified is None:
            self._qualified = self.wrapper.resolve(QualifiedNameProvider)
        found: object = self._qualified.get(node)
        if callable(found):  # libcst computes qualified names lazily per node
            found = found()
        if not isinstance(found, Collection):
            return ()
        return found

    def imported_as(self, name: cst.Name) -> str | None:
        """The dotted name an import binds ``name`` to where it is used, else ``None`` (a
        local, a parameter, a builtin, a name bound only by assignment).

        The file's imports are read first (cheap); scope analysis (not the costlier qualified
        names) runs only for a name some import binds, to tell it from a local of that name.
        """
        if self._imports is None:
            self._imports = _imported_names(self.module)
        if name.value not in self._imports:
            return None
        from libcst.metadata import ScopeProvider

        scope = self.wrapper.resolve(ScopeProvider).get(name)
        if scope is None:
            return None
        for assignment in scope[name.value]:
            node = getattr(assignment, "node", None)
            if isinstance(node, (cst.Import, cst.ImportFrom)):
                return _bound_by(node, name.value)
        return None

    def refers_to(self, node: cst.CSTNode, *qualified: str) -> bool:
        """Whether ``node`` may refer to one of the ``qualified`` names.

        Scope analysis is the costly part of a lint, so it is skipped when the file's imports
        already rule the match out: a name can only be ``builtins.dict`` if it is spelled
        ``dict`` or was imported, and only an import from a module on the way to one of the
        ``qualified`` names can make it one. The answer is the same either way.
        """
        if not self._could_refer_to(node, qualified):
            return False
        return not self.qualified_names(node).isdisjoint(qualified)

    def _could_refer_to(self, node: cst.CSTNode, qualified: tuple[str, ...]) -> bool:
        parts: list[str] = []
        current: cst.CSTNode = node
        while isinstance(current, cst.Attribute):
            parts.append(current.attr.value)
            current = current.value
        if not isinstance(current, cst.Name):
            return True  # `super().x`, `f().x`: let the provider decide
        parts.append(current.value)
        parts.reverse()
        spelled = ".".join(parts)
        if self._imports is None:
            self._imports = _imported_names(self.module)
        sources = self._imports.get(parts[0], ())
        for target in qualified:
            if target.endswith("." + spelled) or target == spelled:
                return True  # spelled as the name itself (a builtin, or `mock.patch.object`)
            for source in sources:
                full = source + spelled[len(parts[0]):]
                if full == target or target.endswith("." + full) or full.endswith("." + target):
                    return True
        return False

    # -- static strings -----------------------------------------------------------------------

    def string_value(self, node: cst.BaseExpression) -> str | None:
        """The value of ``node`` when it is statically a string, else ``None``.

        Literals, their concatenations (implicit or ``+``), f-strings without placeholders, and
        names bound exactly once in their scope (the module, or the function using them) to
        such a literal, and not otherwise rebound or shadowed where used. Names are followed
        only when they hold one of :data:`WATCHED_NAMES` — the only values a rule compares
        with — so scope analysis runs only where it can matter. Imported constants and
        computed names are not followed.
        """
        value = literal_string(node)
        if value is not None or not isinstance(node, cst.Name):
            return value
        bound = self.bound_value(node)
        if bound is None:
            return None
        value = literal_string(bound)
        return value if value in WATCHED_NAMES else None

    def bound_value(self, name: cst.Name) -> cst.BaseExpression | None:
        """The expression ``name`` is bound to, if it is bound exactly once where it is used.

        Only ``NAME = value``/``NAME: T = value`` bindings whose value is a watched string
        literal or a dict display with a watched literal key are followed (anything else is
        ``None`` without scope analysis). Scope analysis then requires that the one binding
        visible at the use is that assignment: a parameter, a second assignment, a ``global``
        rebinding or a ``for`` target make it ``None``.
        """
        if self._constants is None:
            self._constants = _literal_bindings(self.module)
        bindings = self._constants.get(name.value)
        if not bindings:
            return None
        from libcst.metadata import ScopeProvider

        scopes = self.wrapper.resolve(ScopeProvider)
        scope = scopes.get(name)
        if scope is None:
            return None
        visible = scope[name.value]
        if len(visible) != 1:
            return None  # reassigned (also via `global` in a function), or shadowed locally
        (assignment,) = visible
        node = getattr(assignment, "node", None)
        for target, value in bindings:
            if node is target:
                return value
        return None

    def module_constant(self, name: cst.Name) -> str | None:
        """The literal string a constant holds, if ``name`` refers to one (:meth:`string_value`)."""
        return self.string_value(name)


_NEWLINE: Final = re.compile(r"\r\n?|\n")  # what PositionProvider counts as a line break


def _line_breaks(code: str) -> int:
    return len(_NEWLINE.findall(code))


def is_unit(node: cst.CSTNode) -> bool:
    """A class or function with an indented body: :meth:`FileContext.locate` can descend into it."""
    return isinstance(node, (cst.ClassDef, cst.FunctionDef)) and isinstance(
        node.body, cst.IndentedBlock
    )


def _def_body(node: cst.CSTNode) -> cst.IndentedBlock:
    assert isinstance(node, (cst.ClassDef, cst.FunctionDef))
    assert isinstance(node.body, cst.IndentedBlock)
    return node.body


def literal_string(node: cst.BaseExpression) -> str | None:
    """The value of a string expression built only from literals, else ``None``.

    Handles plain and implicitly concatenated literals, ``+`` of literals and f-strings without
    placeholders; bytes are not strings.
    """
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    if isinstance(node, cst.ConcatenatedString):
        left = literal_string(node.left)
        if left is None:
            return None
        right = literal_string(node.right)
        return None if right is None else left + right
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
        left = literal_string(node.left)
        if left is None:
            return None
        right = literal_string(node.right)
        return None if right is None else left + right
    if isinstance(node, cst.FormattedString):
        if not all(isinstance(part, cst.FormattedStringText) for part in node.parts):
            return None
        # Let the interpreter apply the escapes and `{{`: the code is a placeholder-free literal.
        source = _EMPTY_MODULE.code_for_node(node.with_changes(lpar=(), rpar=()))
        try:
            parsed = ast.parse(source, mode="eval").body
        except SyntaxError:
            return None
        if isinstance(parsed, ast.JoinedStr):
            texts = [v.value for v in parsed.values if isinstance(v, ast.Constant)]
            return "".join(str(t) for t in texts)
        if isinstance(parsed, ast.Constant) and isinstance(parsed.value, str):
            return parsed.value
    return None


def _literal_bindings(
    module: cst.Module,
) -> dict[str, list[tuple[cst.Name, cst.BaseExpression]]]:
    """Names bound by plain assignment anywhere, to a watched literal or a dict display with one.

    Only ``NAME = value``/``NAME: T = value`` count; :meth:`FileContext.bound_value` rejects
    names that are bound any other way as well. Only statements are walked, all the way into
    functions and classes, which is far cheaper than a full traversal.
    """
    bindings: dict[str, list[tuple[cst.Name, cst.BaseExpression]]] = {}

    def record(target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name) and _is_watched_value(value):
            bindings.setdefault(target.value, []).append((target, value))

    pending: list[Sequence[cst.BaseStatement]] = [module.body]
    while pending:
        for statement in pending.pop():
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    if isinstance(small, cst.Assign):
                        for target in small.targets:
                            record(target.target, small.value)
                    elif isinstance(small, cst.AnnAssign) and small.value is not None:
                        record(small.target, small.value)
            elif isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
                if isinstance(statement.body, cst.IndentedBlock):
                    pending.append(statement.body.body)
                elif isinstance(statement.body, cst.SimpleStatementSuite):
                    pending.append([cst.SimpleStatementLine(body=statement.body.body)])
            elif isinstance(statement, cst.BaseCompoundStatement):
                pending.extend(_blocks_of(statement))
    return bindings


def _is_watched_value(value: cst.BaseExpression) -> bool:
    if isinstance(value, cst.Dict):
        return any(
            isinstance(element, cst.DictElement) and literal_string(element.key) in WATCHED_NAMES
            for element in value.elements
        )
    return literal_string(value) in WATCHED_NAMES


def _blocks_of(statement: cst.BaseCompoundStatement) -> list[Sequence[cst.BaseStatement]]:
    """The statement lists directly inside a compound statement (same scope)."""
    suites: list[object] = [getattr(statement, "body", None)]  # `match` has only cases
    other: object = getattr(statement, "orelse", None)
    while isinstance(other, (cst.If, cst.Else)):
        suites.append(other.body)
        other = other.orelse if isinstance(other, cst.If) else None
    final = getattr(statement, "finalbody", None)
    if isinstance(final, cst.Finally):
        suites.append(final.body)
    for handler in getattr(statement, "handlers", ()):
        suites.append(handler.body)
    for case in getattr(statement, "cases", ()):
        suites.append(case.body)
    return [suite.body for suite in suites if isinstance(suite, cst.IndentedBlock)]


def _imported_names(module: cst.Module) -> dict[str, list[str]]:
    """Local name -> the dotted names imports bind it to, anywhere in the module.

    ``import a.b`` binds ``a`` to ``a``; ``import a.b as c`` binds ``c`` to ``a.b``;
    ``from a import b as c`` binds ``c`` to ``a.b``. Only statements are walked (imports are
    statements), which is far cheaper than a full traversal.
    """
    bound: dict[str, list[str]] = {}
    pending: list[Sequence[cst.BaseStatement]] = [module.body]
    while pending:
        for statement in pending.pop():
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    if isinstance(small, cst.Import):
                        for alias in small.names:
                            dotted = _dotted(alias.name)
                            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                                bound.setdefault(alias.asname.name.value, []).append(dotted)
                            else:
                                head = dotted.split(".")[0]
                                bound.setdefault(head, []).append(head)
                    elif isinstance(small, cst.ImportFrom) and not isinstance(
                        small.names, cst.ImportStar
                    ):
                        source = "." * len(small.relative)
                        if small.module is not None:
                            source += _dotted(small.module)
                        for alias in small.names:
                            name = _dotted(alias.name)
                            local = name
                            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                                local = alias.asname.name.value
                            bound.setdefault(local, []).append(f"{source}.{name}".lstrip("."))
            elif isinstance(statement, cst.BaseCompoundStatement):
                pending.extend(_blocks_of(statement))
    return bound


def _bound_by(node: cst.Import | cst.ImportFrom, local: str) -> str:
    """The dotted name ``node`` binds ``local`` to (as :func:`_imported_names` spells it)."""
    if isinstance(node, cst.ImportFrom):
        source = "." * len(node.relative) + (_dotted(node.module) if node.module else "")
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                asname = alias.asname.name if alias.asname is not None else None
                name = _dotted(alias.name)
                if (asname.value if isinstance(asname, cst.Name) else name) == local:
                    return f"{source}.{name}".lstrip(".")
        return local
    for alias in node.names:
        dotted = _dotted(alias.name)
        asname = alias.asname.name if alias.asname is not None else None
        if isinstance(asname, cst.Name) and asname.value == local:
            return dotted
        if asname is None and dotted.split(".")[0] == local:
            return local
    return local


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""
