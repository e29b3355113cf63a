"""HR001 forward-assignment: ``x.forward = ...`` in any assignment form, or ``del x.forward``."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from hyperrecipe.lint.rule import ENTRY_NAMES, Invalid, Valid
from hyperrecipe.lint.rules._patterns import TargetVisitor, identifier, looks_like_class

__all__ = ["ForwardAssignment"]


class ForwardAssignment(TargetVisitor):
    """#### What it does
    Flags any assignment whose target is an attribute named `forward` — on an instance
    (`self.forward = f`, `model.layer.forward = f`) or a class (`Linear.forward = f`,
    `type(m).forward = f`) — in every binding form: plain and chained `=`, annotated with a
    value, augmented, tuple/list/starred unpacking, `for` and comprehension targets,
    `with ... as` targets, and `del x.forward`. The same goes for the other attributes that
    decide what `m(x)` runs: `nn.Module`'s call implementations `_call_impl` and
    `_compiled_call_impl` (`m._call_impl = f` makes `m(x)` run `f`), and `__call__` on a class
    (`Block.__call__ = f`, `type(m).__call__ = f`, `cls.__call__ = f` replace the call of every
    instance; `obj.__call__ = f` on an instance changes nothing `obj(x)` runs and is not flagged).

    #### Why is this bad?
    A forward installed by hand skips what `hyperrecipe.rewriter` guarantees: the replacement's
    signature is not checked against the original, nothing rolls it back when a later step
    fails, `restore()` cannot undo it, and a second `apply` wraps it again. Deleting an instance
    forward by hand un-installs a wrapper behind the rewriter's back.

    #### Example
    ```python
    module.forward = functools.partial(sharded_forward, module)
    ```

    #### Use instead
    ```python
    with Rewrite(label="apply") as tx:
        tx.install_forward(module, functools.partial(sharded_forward, module), fqn=fqn)
    ```
    """

    code: ClassVar[str] = "HR001"
    name: ClassVar[str] = "forward-assignment"
    message: ClassVar[str] = (
        "assigns `forward` outside the rewriter; hand the replacement to "
        "hyperrecipe.rewriter (Rewrite.install_forward)"
    )

    VALID: ClassVar[tuple[Valid, ...]] = (
        Valid("y = model.forward(x)"),
        Valid("fn = model.forward"),
        Valid(
            """
            class Block(nn.Module):
                def forward(self, x):
                    return x
            """
        ),
        Valid(
            """
            class Block(nn.Module):
                forward = shared_forward  # a class-body definition, not a rewrite
            """
        ),
        Valid("model.forward_hook = hook"),
        Valid("model._forward = f"),
        Valid("model.forward: Callable[..., Tensor]  # annotation only, nothing is assigned"),
        Valid("forward = make_forward()"),
        Valid("model.forward.__doc__"),
        Valid('text = "m.forward = f"'),
        Valid("model.register_forward_hook(hook)"),
        Valid("(a, b) = model.forward, other"),
        Valid("for layer in model.layers:\n    out = layer.forward(out)"),
        Valid("out = m._call_impl(x)"),
        Valid("m._wrapped_call_impl_count = 0"),
        Valid("class Block:\n    __call__ = _wrapped_call_impl  # a class-body definition"),
        Valid("fn = type(m).__call__"),
        Valid("criteria.__call__ = compiled  # an instance: `criteria(x)` still calls the class's"),
        Valid("self.__call__ = self._fast"),
    )
    INVALID: ClassVar[tuple[Invalid, ...]] = (
        Invalid("model.forward = f", line=1, column=1),
        Invalid("self.block.forward = f", line=1, column=1),
        Invalid("nn.Linear.forward = f", line=1, column=1),
        Invalid("type(m).forward = f", line=1, column=1),
        Invalid("m.forward: Callable[..., Tensor] = f", line=1, column=1),
        Invalid("m.forward += f"),
        Invalid("a, m.forward = f, g", line=1, column=4),
        Invalid("[m.forward, n.forward] = f, g", count=2),
        Invalid("first, *m.forward = fns", line=1, column=9),
        Invalid("((a, (b, m.forward)), c) = value", line=1, column=10),
        Invalid("a = m.forward = f", line=1, column=5),
        Invalid("m.forward = n.forward = f", count=2),
        Invalid("del m.forward", line=1, column=5),
        Invalid("del a, (b, m.forward)"),
        Invalid("for m.forward in candidates:\n    pass", line=1, column=5),
        Invalid(
            "async def f():\n    async for m.forward in candidates:\n        pass",
            line=2,
            column=15,
        ),
        Invalid("fns = [m(x) for m.forward in candidates]"),
        Invalid("with make() as m.forward:\n    pass", line=1, column=16),
        Invalid("with a() as x, b() as (y, m.forward):\n    pass"),
        Invalid("(m.forward) = f", line=1, column=2),
        Invalid("m.\\\n    forward = f", line=1, column=1),
        Invalid("m.ｆorward = f  # NFKC: the interpreter reads this as m.forward"),
        Invalid(
            """
            class Wrapper:
                def __init__(self, inner):
                    self.forward = inner.forward
            """,
            line=4,
            column=9,
        ),
        Invalid("if ok: m.forward = f", line=1, column=8),
        Invalid("m.forward = f; n.forward = g", count=2),
        Invalid("m._call_impl = f", line=1, column=1),
        Invalid("m._compiled_call_impl = torch.compile(f)", line=1, column=1),
        Invalid("Block.__call__ = f", line=1, column=1),
        Invalid("type(m).__call__ = patched_call"),
        Invalid("nn.Module.__call__ = patched_call"),
        Invalid("m.__class__.__call__ = patched_call"),
        Invalid("def patch(cls, f):\n    cls.__call__ = f", line=2, column=5),
        Invalid("del m._compiled_call_impl"),
        Invalid("m._call_impl, m.forward = f, g", count=2),
    )

    def check_target(self, target: cst.BaseExpression, action: str) -> None:
        if not isinstance(target, cst.Attribute):
            return
        name = identifier(target.attr)
        if name not in ENTRY_NAMES:
            return
        if name == "__call__" and not looks_like_class(target.value):
            return  # an instance's `__call__` is never what `m(x)` calls
        if action == "deletes":
            self.report(
                target,
                f"deletes `{name}` outside the rewriter; undo an installed forward with "
                "Rewritten.restore() from hyperrecipe.rewriter",
            )
        elif name == "forward":
            self.report(target, f"{action} `forward` outside the rewriter; hand the "
                        "replacement to hyperrecipe.rewriter (Rewrite.install_forward)")
        else:
            self.report(target, f"{action} `{name}` outside the rewriter, which changes what "
                        "`m(x)` runs; install a forward through hyperrecipe.rewriter "
                        "(Rewrite.install_forward) instead")
