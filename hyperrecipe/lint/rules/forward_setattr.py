"""HR002 forward-setattr: ``setattr(x, "forward", ...)`` and every other setattr spelling."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from hyperrecipe.lint.rule import ENTRY_NAMES, Invalid, LintRule, Valid
from hyperrecipe.lint.rules._patterns import (
    keyword_arg,
    looks_like_class,
    patch_multiple_names,
    positional_args,
    setattr_like,
)

__all__ = ["ForwardSetattr"]


class ForwardSetattr(LintRule):
    """#### What it does
    Flags calls that set or delete an attribute named `forward` by name: `setattr` and
    `delattr` (also imported under another name, or as `builtins.setattr`),
    `object.__setattr__`, `nn.Module.__setattr__`, `torch.nn.Module.__setattr__`,
    `super().__setattr__`, `type.__setattr__`, a `.setattr(obj, "forward", ...)` method such as
    pytest's `monkeypatch.setattr` (also with `name="forward"`), `patch.object(obj,
    "forward", ...)` on any `patch` (`unittest.mock.patch`, pytest-mock's `mocker.patch`; also
    with `attribute="forward"`), and `patch.multiple(obj, forward=f)`. The same holds for the
    other attributes that decide what `m(x)` runs (`_call_impl`, `_compiled_call_impl`, and
    `__call__` on a receiver spelled as a class; see HR001). The name counts when it is a string literal (also concatenated, or
    a placeholder-free f-string) or a name bound exactly once, in the module or in the
    function using it, to such a literal.

    #### Why is this bad?
    It is `x.forward = ...` (HR001) spelled so that a grep for `.forward =` misses it, with the
    same consequences: no signature check, no rollback, no restore, double wrapping.

    #### Example
    ```python
    FORWARD = "forward"
    object.__setattr__(module, FORWARD, wrapper)
    ```

    #### Use instead
    ```python
    with Rewrite(label="apply") as tx:
        tx.install_forward(module, wrapper, fqn=fqn)
    ```
    """

    code: ClassVar[str] = "HR002"
    name: ClassVar[str] = "forward-setattr"
    message: ClassVar[str] = (
        "sets `forward` by name outside the rewriter; hand the replacement to "
        "hyperrecipe.rewriter (Rewrite.install_forward)"
    )

    VALID: ClassVar[tuple[Valid, ...]] = (
        Valid('setattr(module, "weight", param)'),
        Valid("setattr(module, name, value)  # a name that is not static is not guessed"),
        Valid('getattr(module, "forward")(x)'),
        Valid('hasattr(module, "forward")'),
        Valid(
            """
            def setattr(obj, name, value):  # shadows the builtin: not an attribute write
                registry[name] = value

            setattr(module, "forward", f)
            """
        ),
        Valid(
            """
            FORWARD = "forward"

            def install(module, f, FORWARD="weight"):
                setattr(module, FORWARD, f)  # the parameter shadows the constant
            """
        ),
        Valid(
            """
            NAME = "forward"
            NAME = "weight"
            setattr(module, NAME, f)  # rebound: not a constant
            """
        ),
        Valid('setattr(module, "ｆorward", f)  # strings are not NFKC-normalised: another name'),
        Valid('setattr(module, b"forward", f)'),
        Valid('module.__setattr__("weight", w)'),
        Valid('obj.__setattr__(key, "forward")  # sets `key` to the string "forward"'),
        Valid('mock.patch("pkg.Block.forward", f)  # dotted targets are not followed'),
        Valid('setattr(*args)'),
        Valid('mocker.patch.object(module, "weight", w)'),
        Valid('setattr(criteria, "__call__", compiled)  # an instance: its call is unchanged'),
        Valid('monkeypatch.setattr(module, name="weight", value=w)'),
        Valid('from unittest import mock\nmock.patch.multiple(module, weight=w)'),
        Valid(
            """
            def install(module, f):
                name = "forward"
                name = pick(name)  # rebound in the same scope: not a constant
                setattr(module, name, f)
            """
        ),
        Valid(
            """
            def install(module, f, name="weight"):
                setattr(module, name, f)  # a parameter is not a constant

            name = "forward"
            """
        ),
    )
    INVALID: ClassVar[tuple[Invalid, ...]] = (
        Invalid('setattr(module, "forward", f)', line=1, column=1),
        Invalid("setattr(module, 'forward', f)"),
        Invalid('delattr(module, "forward")'),
        Invalid('import builtins\nbuiltins.setattr(module, "forward", f)', line=2, column=1),
        Invalid('import builtins as b\nb.setattr(module, "forward", f)'),
        Invalid('from builtins import setattr as s\ns(module, "forward", f)', line=2, column=1),
        Invalid('object.__setattr__(module, "forward", f)'),
        Invalid('object.__delattr__(module, "forward")'),
        Invalid('nn.Module.__setattr__(self, "forward", f)'),
        Invalid('torch.nn.Module.__setattr__(self, "forward", f)'),
        Invalid('type.__setattr__(Block, "forward", f)'),
        Invalid(
            """
            class Block(nn.Module):
                def __init__(self):
                    super().__init__()
                    super().__setattr__("forward", self._fast)
            """,
            line=5,
            column=9,
        ),
        Invalid('self.__setattr__("forward", f)'),
        Invalid(
            """
            FORWARD = "forward"
            setattr(module, FORWARD, f)
            """,
            line=3,
            column=1,
        ),
        Invalid(
            """
            FORWARD: Final = "forward"

            def install(module, f):
                object.__setattr__(module, FORWARD, f)
            """
        ),
        Invalid('setattr(module, "for" "ward", f)'),
        Invalid('setattr(module, "for" + "ward", f)'),
        Invalid('setattr(module, ("fo"\n    "rward"), f)'),
        Invalid('setattr(module, f"forward", f)'),
        Invalid('setattr(module, "\\x66orward", f)'),
        Invalid('setattr(module, "\\N{LATIN SMALL LETTER F}orward", f)'),
        Invalid('monkeypatch.setattr(module, "forward", f)'),
        Invalid('from unittest import mock\nmock.patch.object(module, "forward", f)'),
        Invalid(
            """
            from unittest.mock import patch

            @patch.object(Block, "forward", autospec=True)
            def test_block(mocked):
                pass
            """,
            line=4,
            column=2,
        ),
        Invalid('setattr(a, "forward", setattr(b, "forward", f))', count=2),
        Invalid('mocker.patch.object(module, "forward", f)', line=1, column=1),
        Invalid('from unittest import mock\nmock.patch.object(module, attribute="forward")'),
        Invalid('monkeypatch.setattr(module, name="forward", value=f)'),
        Invalid('monkeypatch.delattr(module, name="forward")'),
        Invalid('from unittest import mock\nmock.patch.multiple(module, forward=f)',
                line=2, column=1),
        Invalid('mocker.patch.multiple(module, **{"forward": f})'),
        Invalid(
            """
            def install(module, f):
                name = "forward"
                setattr(module, name, f)
            """,
            line=4,
            column=5,
        ),
        Invalid('setattr(module, "_call_impl", f)'),
        Invalid('object.__setattr__(module, "_compiled_call_impl", f)'),
        Invalid('setattr(Block, "__call__", f)'),
        Invalid('type.__setattr__(Block, "__call__", f)'),
        Invalid('monkeypatch.setattr(Block, "__call__", f)'),
    )

    def visit_Call(self, node: cst.Call) -> None:
        for name in patch_multiple_names(node, self.context):
            args = positional_args(node)
            if name == "__call__" and not (args and looks_like_class(args[0])):
                continue  # an instance's `__call__` is never what `m(x)` calls
            if name in ENTRY_NAMES:
                self.report(node, f"sets `{name}` by name (patch.multiple()) outside the "
                            "rewriter; hand the replacement to hyperrecipe.rewriter "
                            "(Rewrite.install_forward)")
                return
        found = setattr_like(node, self.context)
        if found is None or found[0] not in ENTRY_NAMES:
            return
        name, spelling = found
        if name == "__call__":
            args = positional_args(node)
            receiver = args[0] if args else keyword_arg(node, "target")
            if receiver is None or not looks_like_class(receiver):
                return  # an instance's `__call__` is never what `m(x)` calls
        verb = "deletes" if "del" in spelling else "sets"
        if verb == "deletes":
            self.report(
                node,
                f"deletes `{name}` by name ({spelling}) outside the rewriter; undo an installed "
                "forward with Rewritten.restore() from hyperrecipe.rewriter",
            )
        else:
            self.report(
                node,
                f"sets `{name}` by name ({spelling}) outside the rewriter; hand the replacement "
                "to hyperrecipe.rewriter (Rewrite.install_forward)",
            )
