"""Shapes several rules share: assignment targets, setattr-like calls, namespace dicts."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator, Sequence
from typing import Final

import libcst as cst

from hyperrecipe.lint.rule import FileContext, LintRule

__all__ = [
    "TargetVisitor",
    "identifier",
    "is_namespace_dict",
    "keyword_arg",
    "looks_like_class",
    "patch_multiple_names",
    "positional_args",
    "setattr_like",
]


def identifier(name: cst.Name) -> str:
    """The identifier as the interpreter sees it (NFKC-normalised, as the tokenizer does)."""
    value = name.value
    return value if value.isascii() else unicodedata.normalize("NFKC", value)


def _flatten(target: cst.BaseExpression) -> Iterator[cst.BaseExpression]:
    """The individual targets of a (possibly nested tuple/list/starred) target."""
    if isinstance(target, (cst.Tuple, cst.List)):
        for element in target.elements:
            yield from _flatten(element.value)
    elif isinstance(target, cst.StarredElement):
        yield from _flatten(target.value)
    else:
        yield target


class TargetVisitor(LintRule):
    """A rule that inspects every binding or deletion target.

    Covers ``=`` (chained too), annotated assignment with a value, augmented assignment, ``for``
    and comprehension targets, ``with ... as`` targets and ``del``; tuple, list and starred
    targets are unpacked. Subclasses implement :meth:`check_target`.
    """

    def check_target(self, target: cst.BaseExpression, action: str) -> None:
        """Inspect one target; ``action`` is "assigns", "deletes", "binds" or "updates"."""
        raise NotImplementedError

    def _check_all(self, target: cst.BaseExpression, action: str) -> None:
        for single in _flatten(target):
            self.check_target(single, action)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._check_all(target.target, "assigns")

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:  # `x.forward: T` alone annotates; it does not assign
            self._check_all(node.target, "assigns")

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._check_all(node.target, "updates")

    def visit_For(self, node: cst.For) -> None:
        self._check_all(node.target, "binds")

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._check_all(node.target, "binds")

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._check_all(node.asname.name, "binds")

    def visit_Del(self, node: cst.Del) -> None:
        self._check_all(node.target, "deletes")


def positional_args(call: cst.Call) -> Sequence[cst.BaseExpression]:
    """The leading positional arguments of ``call``, up to the first ``*``/``**``/keyword."""
    values: list[cst.BaseExpression] = []
    for arg in call.args:
        if arg.star or arg.keyword is not None:
            break
        values.append(arg.value)
    return values


#: Spellings of "set an attribute by name" and where the name argument sits, by arity.
_DUNDER_NAME_INDEX: Final = {
    # bound: obj.__setattr__(name, value) / unbound: Cls.__setattr__(obj, name, value)
    "__setattr__": {2: 0, 3: 1},
    "__delattr__": {1: 0, 2: 1},
}
_BUILTIN_SETATTR: Final = ("builtins.setattr", "builtins.delattr")
_PATCH_OBJECT: Final = ("unittest.mock.patch.object", "mock.patch.object")
_PATCH_MULTIPLE: Final = ("unittest.mock.patch.multiple", "mock.patch.multiple")


def keyword_arg(call: cst.Call, *names: str) -> cst.BaseExpression | None:
    """The value passed to ``call`` by keyword under one of ``names``, if any."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in names:
            return arg.value
    return None


def _name_arg(
    call: cst.Call, args: Sequence[cst.BaseExpression], index: int, *keywords: str
) -> cst.BaseExpression | None:
    """The argument at positional ``index``, or passed by one of ``keywords``."""
    if len(args) > index:
        return args[index]
    return keyword_arg(call, *keywords) if keywords else None


def _ends_with_patch(node: cst.BaseExpression) -> bool:
    """``patch``, ``mock.patch``, ``mocker.patch``: the receiver of ``.object``/``.multiple``."""
    if isinstance(node, cst.Name):
        return node.value == "patch"
    return isinstance(node, cst.Attribute) and node.attr.value == "patch"


def setattr_like(call: cst.Call, context: FileContext) -> tuple[str, str] | None:
    """If ``call`` sets or deletes an attribute whose name is static, ``(name, spelling)``.

    Recognised: ``setattr``/``delattr`` (also aliased: ``from builtins import setattr as s``,
    ``builtins.setattr``), any ``.setattr(obj, name, ...)``/``.delattr(obj, name)`` method such
    as pytest's ``monkeypatch`` (the name also as ``name=``), ``__setattr__``/``__delattr__``
    called bound or unbound on any receiver (``object``, ``nn.Module``, ``super()``, ``type``),
    and ``patch.object(obj, name, ...)`` on any ``patch`` (``unittest.mock.patch``,
    pytest-mock's ``mocker.patch``; the name also as ``attribute=``).
    """
    func = call.func
    args = positional_args(call)
    if isinstance(func, cst.Name):
        if len(args) < 2:
            return None
        name = context.string_value(args[1])
        if name is None or not context.refers_to(func, *_BUILTIN_SETATTR):
            return None
        return name, f"{func.value}()"
    if not isinstance(func, cst.Attribute):
        return None
    method = func.attr.value
    if method in ("setattr", "delattr"):
        if not args:
            return None
        node = _name_arg(call, args, 1, "name")
        name = None if node is None else context.string_value(node)
        return None if name is None else (name, f".{method}()")
    if method in _DUNDER_NAME_INDEX:
        index = _DUNDER_NAME_INDEX[method].get(len(call.args))
        if index is None or len(args) <= index:
            return None
        name = context.string_value(args[index])
        return None if name is None else (name, f"{method}()")
    if method == "object" and (args or call.args):
        node = _name_arg(call, args, 1, "attribute")
        if node is None:
            return None
        name = context.string_value(node)
        if name is None:
            return None
        if not _ends_with_patch(func.value) and not context.refers_to(func, *_PATCH_OBJECT):
            return None
        return name, "patch.object()"
    return None


def patch_multiple_names(call: cst.Call, context: FileContext) -> list[str]:
    """The attribute names ``patch.multiple(obj, name=value, ...)`` sets, on any ``patch``.

    Keywords are attribute names (``forward=f``), as are the static string keys of a dict
    display unpacked with ``**``. Empty when ``call`` is not a ``patch.multiple``.
    """
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "multiple"):
        return []
    if not _ends_with_patch(func.value) and not context.refers_to(func, *_PATCH_MULTIPLE):
        return []
    names: list[str] = []
    for arg in call.args:
        if arg.keyword is not None:
            names.append(arg.keyword.value)
        elif arg.star == "**" and isinstance(arg.value, cst.Dict):
            for element in arg.value.elements:
                if isinstance(element, cst.DictElement):
                    key = context.string_value(element.key)
                    if key is not None:
                        names.append(key)
    return names


def looks_like_class(node: cst.BaseExpression) -> bool:
    """Whether ``node`` is spelled as a class: ``Block``, ``nn.Linear``, ``cls``, ``type(m)``,
    ``m.__class__``.

    ``__call__`` is looked up on the type, so assigning it changes what ``m(x)`` runs only on a
    class; an instance attribute named ``__call__`` is never called by ``m(x)``. The rules
    cannot know types, so they go by spelling (PEP 8 class names), and a class reached through
    a lower-case variable other than ``cls`` is missed (a documented false negative).
    """
    if isinstance(node, cst.Name):
        name = identifier(node)
        return name == "cls" or name[:1].isupper()
    if isinstance(node, cst.Attribute):
        name = identifier(node.attr)
        return name == "__class__" or name[:1].isupper()
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
        return node.func.value == "type" and len(node.args) == 1
    return False


def is_namespace_dict(node: cst.BaseExpression, context: FileContext) -> bool:
    """Whether ``node`` is an object's attribute dict: ``x.__dict__`` or ``vars(x)``."""
    if isinstance(node, cst.Attribute):
        return node.attr.value == "__dict__"
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and len(node.args) == 1:
        return context.refers_to(node.func, "builtins.vars")
    return False
