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
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Final

import attrs
import libcst as cst

if TYPE_CHECKING:
    from libcst.metadata import CodeRange, QualifiedName

__all__ = ["FileContext", "Invalid", "LintRule", "Report", "Valid"]


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
    """A rule fired on ``node``; ``statement`` (if any) widens where a suppression may sit."""

    code: str
    name: str
    message: str
    node: cst.CSTNode
    statement: cst.CSTNode | None


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
        self._wrapper: cst.MetadataWrapper | None = None
        self._qualified: Mapping[cst.CSTNode, Collection[QualifiedName]] | None = None
        self._constants: dict[str, list[tuple[cst.Name, str | None]]] | None = None

    # -- reports ------------------------------------------------------------------------------

    def add_report(self, rule: LintRule, node: cst.CSTNode, message: str) -> None:
        """Record that ``rule`` fired on ``node``."""
        self.reports.append(
            Report(rule.code, rule.name, message, node, self.current_statement)
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

    def qualified_names(self, node: cst.CSTNode) -> frozenset[str]:
        """The qualified names ``node`` (a name or attribute) may refer to.

        Follows imports and aliases (``from builtins import setattr as s`` makes ``s`` refer to
        ``builtins.setattr``), and knows when a local definition shadows a builtin.
        """
        from libcst.metadata import QualifiedNameProvider

        if self._qualified is None:
            self._qualified = self.wrapper.resolve(QualifiedNameProvider)
        found = self._qualified.get(node)
        if not found:
            return frozenset()
        return frozenset(q.name for q in found)

    def refers_to(self, node: cst.CSTNode, *qualified: str) -> bool:
        """Whether ``node`` may refer to one of the ``qualified`` names."""
        return not self.qualified_names(node).isdisjoint(qualified)

    # -- static strings -----------------------------------------------------------------------

    def string_value(self, node: cst.BaseExpression) -> str | None:
        """The value of ``node`` when it is statically a string, else ``None``.

        Literals, their concatenations (implicit or ``+``), f-strings without placeholders, and
        names bound exactly once at module level to such a literal (not shadowed where used).
        Imported constants and computed names are not followed.
        """
        value = literal_string(node)
        if value is not None or not isinstance(node, cst.Name):
            return value
        return self.module_constant(node)

    def module_constant(self, name: cst.Name) -> str | None:
        """The literal string a module-level constant holds, if ``name`` refers to one."""
        if self._constants is None:
            self._constants = _module_level_bindings(self.module)
        bindings = self._constants.get(name.value)
        if not bindings or len(bindings) != 1 or bindings[0][1] is None:
            return None
        target, value = bindings[0]
        from libcst.metadata import GlobalScope, ScopeProvider

        scopes = self.wrapper.resolve(ScopeProvider)
        scope = scopes.get(name)
        if scope is None:
            return None
        visible = scope[name.value]
        if len(visible) != 1:
            return None  # reassigned (also via `global` in a function), or shadowed locally
        (assignment,) = visible
        if not isinstance(assignment.scope, GlobalScope) or getattr(assignment, "node", None) is not target:
            return None
        return value


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


def _module_level_bindings(module: cst.Module) -> dict[str, list[tuple[cst.Name, str | None]]]:
    """Names bound by plain assignment at module level, with their literal value (or ``None``).

    Only ``NAME = literal``/``NAME: T = literal`` count as constant bindings; the scope check in
    :meth:`FileContext.module_constant` rejects names that are bound any other way as well.
    """
    bindings: dict[str, list[tuple[cst.Name, str | None]]] = {}
    pending: list[Sequence[cst.BaseStatement]] = [module.body]
    while pending:
        for statement in pending.pop():
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    if isinstance(small, cst.Assign):
                        value = literal_string(small.value)
                        for target in small.targets:
                            if isinstance(target.target, cst.Name):
                                bindings.setdefault(target.target.value, []).append(
                                    (target.target, value)
                                )
                    elif (
                        isinstance(small, cst.AnnAssign)
                        and small.value is not None
                        and isinstance(small.target, cst.Name)
                    ):
                        bindings.setdefault(small.target.value, []).append(
                            (small.target, literal_string(small.value))
                        )
            elif isinstance(statement, cst.BaseCompoundStatement) and not isinstance(
                statement, (cst.FunctionDef, cst.ClassDef)
            ):
                pending.extend(_blocks_of(statement))
    return bindings


def _blocks_of(statement: cst.BaseCompoundStatement) -> list[Sequence[cst.BaseStatement]]:
    """The statement lists directly inside a module-level compound statement (same scope)."""
    suites: list[cst.BaseSuite] = [statement.body]
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
