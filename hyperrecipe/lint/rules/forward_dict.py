"""HR003 forward-dict: writing ``forward`` into an object's ``__dict__`` (or ``vars()``)."""

from __future__ import annotations

from typing import ClassVar, Final

import libcst as cst

from hyperrecipe.lint.rule import ENTRY_NAMES, Invalid, Valid
from hyperrecipe.lint.rules._patterns import (
    TargetVisitor,
    is_namespace_dict,
    keyword_arg,
    positional_args,
)

__all__ = ["ForwardDict"]

#: Methods of a dict that write or remove the key in their first argument.
_KEYED_METHODS: Final = frozenset({"setdefault", "pop", "__setitem__", "__delitem__"})
_OPERATOR_KEYED: Final = (
    "operator.setitem", "operator.delitem", "_operator.setitem", "_operator.delitem",
)
_PATCH_DICT: Final = ("unittest.mock.patch.dict", "mock.patch.dict")
#: Keys whose write into an attribute dict changes what ``m(x)`` runs. Not ``__call__``: an
#: instance's is never called by ``m(x)``, and a class's ``__dict__`` is a read-only proxy.
_DICT_NAMES: Final = ENTRY_NAMES - {"__call__"}


class ForwardDict(TargetVisitor):
    """#### What it does
    Flags writes of the key `"forward"` into an object's attribute dict, `x.__dict__` or
    `vars(x)`: item assignment and deletion (`x.__dict__["forward"] = f`,
    `del vars(x)["forward"]`), `update({"forward": f})`, `update(forward=f)`,
    `update(dict(forward=f))`, `|= {"forward": f}`, `setdefault`/`pop`/`__setitem__`/
    `__delitem__` with the key, the unbound `dict.update(x.__dict__, ...)` forms,
    `operator.setitem(vars(x), "forward", f)`, a `.setitem`/`.delitem` method such as pytest's
    `monkeypatch.setitem(m.__dict__, "forward", f)`, `unittest.mock.patch.dict(x.__dict__,
    ...)`, an update from a name bound once to a dict display with the key
    (`d = {"forward": f}; m.__dict__.update(d)`), and copying another object's attribute dict
    (`m.__dict__.update(other.__dict__)`, `vars(m).update(vars(other))`), which brings its
    `forward` along if it has one. `nn.Module`'s call implementations `_call_impl` and
    `_compiled_call_impl` (see HR001) count as `forward` does.

    #### Why is this bad?
    Writing the instance dict installs an instance forward exactly as `x.forward = f` does
    (HR001), while bypassing even `__setattr__` — none of the rewriter's checks, rollback or
    restore apply.

    #### Example
    ```python
    vars(module).update(forward=wrapper, _hr_spec=spec)
    ```

    #### Use instead
    ```python
    with Rewrite(label="apply") as tx:
        tx.install_forward(module, wrapper, fqn=fqn, companions={"_hr_spec": spec})
    ```
    """

    code: ClassVar[str] = "HR003"
    name: ClassVar[str] = "forward-dict"
    message: ClassVar[str] = (
        "writes `forward` into an attribute dict outside the rewriter; hand the replacement "
        "to hyperrecipe.rewriter (Rewrite.install_forward)"
    )

    VALID: ClassVar[tuple[Valid, ...]] = (
        Valid('fn = module.__dict__["forward"]'),
        Valid('installed = "forward" in vars(module)'),
        Valid('module.__dict__["weight"] = w'),
        Valid('counts["forward"] = 0  # an ordinary dict'),
        Valid('stats["forward"]["calls"] += 1'),
        Valid('self.comm_counts["Global"]["forward"] = defaultdict(int)'),
        Valid('module.__dict__.get("forward")'),
        Valid('vars(module).update(weight=w)'),
        Valid('config.update({"forward": "fused"})  # not an attribute dict'),
        Valid(
            """
            def vars(obj):  # shadows the builtin
                return obj.settings

            vars(module)["forward"] = "fast"
            """
        ),
        Valid('module.__dict__.pop("forward_pre_hooks")'),
        Valid('module.__dict__[key] = value  # a key that is not static is not guessed'),
        Valid('monkeypatch.setitem(module.__dict__, "weight", w)'),
        Valid('monkeypatch.setitem(config, "forward", "fused")  # not an attribute dict'),
        Valid('module.__dict__.update(defaults)  # a mapping whose keys are not known'),
        Valid('state.update(other.__dict__)  # copies into an ordinary dict'),
        Valid('d = {"weight": w}\nmodule.__dict__.update(d)'),
        Valid('vars(criteria)["__call__"] = compiled  # an instance dict: its call is unchanged'),
    )
    INVALID: ClassVar[tuple[Invalid, ...]] = (
        Invalid('module.__dict__["forward"] = f', line=1, column=1),
        Invalid('vars(module)["forward"] = f', line=1, column=1),
        Invalid('type(module).__dict__["forward"] = f'),
        Invalid('del module.__dict__["forward"]', line=1, column=5),
        Invalid('del vars(module)["forward"]'),
        Invalid('module.__dict__["forward"]: Callable = f'),
        Invalid('a, module.__dict__["forward"] = 1, f'),
        Invalid('module.__dict__.update({"forward": f})', line=1, column=1),
        Invalid('vars(module).update({"weight": w, "forward": f})'),
        Invalid('module.__dict__.update(forward=f)'),
        Invalid('module.__dict__.update(**{"forward": f})'),
        Invalid('vars(module).update(dict(forward=f))'),
        Invalid('vars(module).update(dict(forward=f), forward=g)'),
        Invalid('module.__dict__ |= {"forward": f}'),
        Invalid('vars(module).setdefault("forward", f)'),
        Invalid('module.__dict__.pop("forward")'),
        Invalid('module.__dict__.pop("forward", None)'),
        Invalid('vars(module).__setitem__("forward", f)'),
        Invalid('module.__dict__.__delitem__("forward")'),
        Invalid('dict.update(module.__dict__, forward=f)'),
        Invalid('dict.__setitem__(vars(module), "forward", f)'),
        Invalid('import operator\noperator.setitem(vars(module), "forward", f)', line=2, column=1),
        Invalid('from operator import setitem\nsetitem(module.__dict__, "forward", f)'),
        Invalid('from unittest import mock\nmock.patch.dict(module.__dict__, {"forward": f})'),
        Invalid('monkeypatch.setitem(module.__dict__, "forward", f)', line=1, column=1),
        Invalid('monkeypatch.delitem(vars(module), "forward")'),
        Invalid('monkeypatch.setitem(dic=module.__dict__, name="forward", value=f)'),
        Invalid('module.__dict__.update(other.__dict__)', line=1, column=1),
        Invalid('vars(module).update(vars(other))'),
        Invalid('module.__dict__.update(**other.__dict__)'),
        Invalid('patch = {"forward": f}\nmodule.__dict__.update(patch)', line=2, column=1),
        Invalid(
            """
            def install(module, f):
                extra = {"forward": f, "_hr": 1}
                vars(module).update(extra)
            """,
            line=4,
            column=5,
        ),
        Invalid('module.__dict__["_call_impl"] = f'),
        Invalid('vars(module).update(_compiled_call_impl=f)'),
        Invalid('from builtins import vars as v\nv(module)["forward"] = f'),
        Invalid('KEY = "forward"\nmodule.__dict__[KEY] = f', line=2, column=1),
        Invalid('module.__dict__["for" "ward"] = f'),
    )

    # -- item stores and deletes: x.__dict__["forward"] = f -----------------------------------

    def check_target(self, target: cst.BaseExpression, action: str) -> None:
        if not isinstance(target, cst.Subscript):
            return
        if len(target.slice) != 1 or not isinstance(target.slice[0].slice, cst.Index):
            return
        key = self.context.string_value(target.slice[0].slice.value)
        if key in _DICT_NAMES and is_namespace_dict(target.value, self.context):
            if action == "deletes":
                self.report(target, "deletes `forward` from an attribute dict outside the "
                            "rewriter; undo an installed forward with Rewritten.restore()")
            else:
                self.report(target)

    # -- dict methods and operators -----------------------------------------------------------

    def _mapping_has_key(self, node: cst.BaseExpression) -> bool:
        """A dict display with a static "forward" key, or ``dict(forward=...)``."""
        if isinstance(node, cst.Dict):
            return any(
                isinstance(element, cst.DictElement)
                and self.context.string_value(element.key) in _DICT_NAMES
                for element in node.elements
            )
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            has_key = any(
                arg.keyword is not None and arg.keyword.value in _DICT_NAMES for arg in node.args
            )
            return has_key and self.context.refers_to(node.func, "builtins.dict")
        if isinstance(node, cst.Name):
            bound = self.context.bound_value(node)  # `d = {"forward": f}` once in scope
            return isinstance(bound, cst.Dict) and self._mapping_has_key(bound)
        return False

    def _update_writes_forward(self, args: list[cst.Arg]) -> bool:
        for arg in args:
            if arg.keyword is not None:
                if arg.keyword.value in _DICT_NAMES:
                    return True
            elif arg.star == "**" or not arg.star:
                if self._mapping_has_key(arg.value):
                    return True
                if is_namespace_dict(arg.value, self.context):
                    return True  # another object's attribute dict: its forward comes along
        return False

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            receiver = func.value
            if method == "update":
                # bound: ns.update(...); unbound: dict.update(ns, ...)
                if self._update_writes_forward(list(node.args)) and is_namespace_dict(
                    receiver, self.context
                ):
                    self.report(node)
                    return
                if (
                    node.args
                    and not node.args[0].star
                    and node.args[0].keyword is None
                    and self._update_writes_forward(list(node.args[1:]))
                    and is_namespace_dict(node.args[0].value, self.context)
                    and self.context.refers_to(receiver, "builtins.dict")
                ):
                    self.report(node)
                return
            if method in _KEYED_METHODS:
                args = positional_args(node)
                if args and self.context.string_value(args[0]) in _DICT_NAMES:
                    if is_namespace_dict(receiver, self.context):
                        self.report(node)
                elif (
                    len(args) >= 2
                    and self.context.string_value(args[1]) in _DICT_NAMES
                    and is_namespace_dict(args[0], self.context)
                    and self.context.refers_to(receiver, "builtins.dict")
                ):
                    self.report(node)
                return
            if method in ("setitem", "delitem"):  # pytest's monkeypatch.setitem(dic, name, ...)
                args = positional_args(node)
                namespace = args[0] if args else keyword_arg(node, "dic")
                key = args[1] if len(args) >= 2 else keyword_arg(node, "name")
                if (
                    namespace is not None
                    and key is not None
                    and self.context.string_value(key) in _DICT_NAMES
                    and is_namespace_dict(namespace, self.context)
                ):
                    self.report(node)
                    return
        args = positional_args(node)
        if len(args) >= 2 and self.context.string_value(args[1]) in _DICT_NAMES:
            if is_namespace_dict(args[0], self.context) and self.context.refers_to(
                func, *_OPERATOR_KEYED
            ):
                self.report(node)
                return
        if args and isinstance(func, cst.Attribute) and func.attr.value == "dict":
            if self._update_writes_forward(list(node.args[1:])) and is_namespace_dict(
                args[0], self.context
            ) and self.context.refers_to(func, *_PATCH_DICT):
                self.report(node)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        super().visit_AugAssign(node)
        if isinstance(node.operator, cst.BitOrAssign) and self._mapping_has_key(node.value):
            if is_namespace_dict(node.target, self.context):
                self.report(node)
