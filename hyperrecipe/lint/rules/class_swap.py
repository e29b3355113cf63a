"""HR004 class-swap: ``x.__class__ = Other`` (or by ``setattr``) outside the rewriter."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from hyperrecipe.lint.rule import Invalid, Valid
from hyperrecipe.lint.rules._patterns import TargetVisitor, identifier, setattr_like

__all__ = ["ClassSwap"]


class ClassSwap(TargetVisitor):
    """#### What it does
    Flags assignments to an object's `__class__` — `x.__class__ = Other` in any binding form,
    and `setattr(x, "__class__", Other)` in every spelling HR002 knows.

    #### Why is this bad?
    Swapping the class replaces every method at once, `forward` included: it is a forward
    rewrite the other rules cannot see, and one that the rewriter cannot validate, roll back or
    restore. (`torch.distributed.fsdp.fully_shard` does this on purpose; in a project that
    installs forwards through hyperrecipe, do it in the rewriter or suppress with a reason.)

    #### Example
    ```python
    module.__class__ = type("Sharded" + cls.__name__, (ShardedMixin, cls), {})
    ```

    #### Use instead
    ```python
    with Rewrite(label="apply") as tx:
        tx.install_forward(module, sharded_forward, fqn=fqn)
    ```
    """

    code: ClassVar[str] = "HR004"
    name: ClassVar[str] = "class-swap"
    message: ClassVar[str] = (
        "swaps `__class__` outside the rewriter, replacing `forward` with the new class's; "
        "install the forward through hyperrecipe.rewriter instead"
    )

    VALID: ClassVar[tuple[Valid, ...]] = (
        Valid("cls = module.__class__"),
        Valid("name = self.__class__.__name__"),
        Valid("same = type(a) is b.__class__"),
        Valid("obj = module.__class__(config)"),
        Valid('setattr(module, "__class_name__", "x")'),
        Valid("__class__ = Foo  # a plain name, not an attribute"),
        Valid("module.__class__: type  # annotation only"),
    )
    INVALID: ClassVar[tuple[Invalid, ...]] = (
        Invalid("module.__class__ = Sharded", line=1, column=1),
        Invalid("a.__class__, b.__class__ = X, Y", count=2),
        Invalid("module.__class__ = new_cls = make()"),
        Invalid('setattr(module, "__class__", Sharded)', line=1, column=1),
        Invalid('object.__setattr__(module, "__class__", Sharded)'),
        Invalid('import builtins\nbuiltins.setattr(module, "__class__", Sharded)'),
        Invalid("with swap() as module.__class__:\n    pass"),
        Invalid(
            """
            def replicate(module):
                cls = module.__class__
                module.__class__ = type(cls.__name__, (Mixin, cls), {})
            """,
            line=4,
            column=5,
        ),
    )

    def check_target(self, target: cst.BaseExpression, action: str) -> None:
        if action == "deletes":
            return  # `del x.__class__` raises TypeError; nothing is swapped
        if isinstance(target, cst.Attribute) and identifier(target.attr) == "__class__":
            self.report(target)

    def visit_Call(self, node: cst.Call) -> None:
        found = setattr_like(node, self.context)
        if found is not None and found[0] == "__class__" and "del" not in found[1]:
            self.report(node)
