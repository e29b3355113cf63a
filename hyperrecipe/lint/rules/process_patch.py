"""HR005 process-patch: replacing an attribute of an imported module or class (``torch.nn.utils
.clip_grad_norm_ = f``), or a module's ``_apply``, outside the rewriter."""

from __future__ import annotations

from typing import ClassVar, Final

import libcst as cst

from hyperrecipe.lint.rule import Invalid, Valid
from hyperrecipe.lint.rules._patterns import TargetVisitor, identifier, positional_args
from hyperrecipe.lint.targets import METADATA_NAMES, PATCHED_METHOD_NAMES

__all__ = ["ProcessPatch"]

_BUILTIN_SETATTR: Final = ("builtins.setattr", "builtins.delattr")
#: ``__setattr__``/``__delattr__``: positional arity -> (receiver index or None for the bound
#: receiver, name index).
_DUNDER: Final = {
    "__setattr__": {2: (None, 0), 3: (0, 1)},
    "__delattr__": {1: (None, 0), 2: (0, 1)},
}
_INSTEAD: Final = ("declare it in hyperrecipe.process_patches.PROCESS_PATCHES and make it "
                   "through the rewriter (hold_process_patches, or a Rewrite transaction)")


def _root(node: cst.BaseExpression) -> tuple[cst.Name, str] | None:
    """The name an attribute chain starts from, and the chain as spelled (``torch.nn.utils``)."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(identifier(node.attr))
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    parts.append(identifier(node))
    return node, ".".join(reversed(parts))


class ProcessPatch(TargetVisitor):
    """#### What it does
    Flags, outside the configured rewriter paths, a replacement of an attribute of an
    *imported* module or class, and of a module's `_apply`:

    * `owner.attr = value` (and `+=`, annotated, tuple, `for`/`with` targets, `del`) where
      `owner` is a name bound by an `import` in this file or an attribute chain starting from
      one (`torch.nn.utils.clip_grad_norm_ = f`, `GradScaler._unscale_grads_ = f` after
      `from torch.amp import GradScaler`), found by scope analysis, so a local or parameter of
      the same name is not one;
    * `setattr(owner, name, value)`/`delattr(owner, name)` (also aliased by import or as
      `builtins.setattr`) and `object.__setattr__(owner, name, value)` (any receiver of a
      bound or unbound `__setattr__`/`__delattr__`) with such an `owner`, whatever the name;
    * `x._apply = f`, `setattr(x, "_apply", f)`, `object.__setattr__(x, "_apply", f)` on any
      receiver: an instance `_apply` changes what every `.to()`, `.float()` and `to_empty()`
      of that module does.

    Setting `__doc__`, `__module__`, `__name__` or `__qualname__` (re-exporting a function
    under a package's name) describes the object and is not reported. Classes and functions
    defined in the file, and objects reached through a local variable, are not reported:
    the rule cannot know what a variable holds (`scaler = torch.amp.GradScaler;
    scaler.x = f` is a false negative, as are `importlib.import_module(...)` results and
    `sys.modules[...]`). pytest's `monkeypatch.setattr` and `mock.patch.object` restore what
    they patch and are left alone.

    #### Why is this bad?
    A patch of torch (or any library) changes every caller in the process, is invisible at the
    call sites, and needs its own undo, its own reference counting when several installations
    live at once, and its own answer to another library patching the same function. Made
    anywhere but the rewriter, it escapes the one table that lists what hyperrecipe patches
    (`hyperrecipe.process_patches.PROCESS_PATCHES`) and the rewriter's rollback and restore.

    #### Example
    ```python
    import torch

    torch.nn.utils.clip_grad_norm_ = sharded_clip_grad_norm
    setattr(torch.amp.GradScaler, "_unscale_grads_", agreeing)
    ```

    #### Use instead
    ```python
    from hyperrecipe.process_patches import hold_process_patches

    hold = hold_process_patches({"torch.nn.utils:clip_grad_norm_": sharded_clip_grad_norm})
    ...
    hold.release()
    ```
    """

    code: ClassVar[str] = "HR005"
    name: ClassVar[str] = "process-patch"
    #: hyperrecipe's own discipline: users' code (tests, compatibility shims) patches imported
    #: modules legitimately, so the rule runs only where a project selects it by code or name.
    opt_in: ClassVar[bool] = True
    message: ClassVar[str] = (
        f"patches an imported module or class outside the rewriter; {_INSTEAD}"
    )

    VALID: ClassVar[tuple[Valid, ...]] = (
        Valid("import torch\nx = torch.nn.utils.clip_grad_norm_"),
        Valid("import torch\nmodel.weight = torch.nn.Parameter(w)"),
        Valid("class A:\n    pass\nA.method = f"),
        Valid("def f(torch):\n    torch.x = 1\nimport torch"),
        Valid("import torch\nself.scaler = torch.amp.GradScaler()"),
        Valid("from torch.amp import GradScaler\nscaler = GradScaler()\nscaler.x = 1"),
        Valid("import torch\nfn.__module__ = 'torch'"),
        Valid("from a import fn\nfn.__module__ = 'pkg'\nfn.__doc__ = 'x'"),
        Valid("import torch\nmonkeypatch.setattr(torch, 'x', f)"),
        Valid("import torch\nwith mock.patch.object(torch, 'x', f):\n    pass"),
        Valid("import torch\nsetattr(param, '_hr_parts', parts)"),
        Valid("module._apply(fn)"),
        Valid("y = module._apply"),
        Valid("import torch\ntorch.x: int  # annotation only"),
        Valid("torch.x = 1  # not imported here"),
    )
    INVALID: ClassVar[tuple[Invalid, ...]] = (
        Invalid("import torch\ntorch.nn.utils.clip_grad_norm_ = f", line=2, column=1),
        Invalid("from torch.amp import GradScaler\nGradScaler._unscale_grads_ = f", line=2,
                column=1),
        Invalid("import torch\nsetattr(torch.amp.GradScaler, '_unscale_grads_', f)", line=2,
                column=1),
        Invalid("import torch\nsetattr(torch.amp.GradScaler, NAME, f)"),
        Invalid("from torch.nn.utils import clip_grad\ndelattr(clip_grad, '_get_total_norm')"),
        Invalid("import torch.nn.utils as u\nobject.__setattr__(u, 'clip_grad_norm_', f)"),
        Invalid("import torch\ntorch.__setattr__('x', 1)"),
        Invalid("from builtins import setattr as s\nimport torch\ns(torch, 'x', 1)"),
        Invalid("import torch\ndel torch.nn.utils.clip_grad_norm_"),
        Invalid("import torch\ntorch.x += 1"),
        Invalid("import torch\ntorch.a, torch.b = f, g", count=2),
        Invalid("def install():\n    import torch\n    torch.x = 1", line=3, column=5),
        Invalid("module._apply = f", line=1, column=1),
        Invalid("setattr(module, '_apply', f)"),
        Invalid("object.__setattr__(module, '_apply', bound)"),
        Invalid("APPLY = '_apply'\nobject.__setattr__(module, APPLY, bound)"),
    )

    def check_target(self, target: cst.BaseExpression, action: str) -> None:
        if not isinstance(target, cst.Attribute):
            return
        attribute = identifier(target.attr)
        if attribute in PATCHED_METHOD_NAMES:
            self.report(target, self._method_message(attribute))
        elif attribute not in METADATA_NAMES:
            owner = self._imported(target.value)
            if owner is not None:
                self.report(target, self._patch_message(owner, attribute))

    def visit_Call(self, node: cst.Call) -> None:
        found = self._set_by_name(node)
        if found is None:
            return
        receiver, name_node = found
        name = None if name_node is None else self.context.string_value(name_node)
        if name in PATCHED_METHOD_NAMES:
            self.report(node, self._method_message(name))
        elif name not in METADATA_NAMES:
            owner = self._imported(receiver)
            if owner is not None:
                self.report(node, self._patch_message(owner, name or "<computed name>"))

    def _set_by_name(
        self, call: cst.Call
    ) -> tuple[cst.BaseExpression, cst.BaseExpression | None] | None:
        """``(receiver, name)`` when ``call`` sets or deletes an attribute by name through
        builtins or ``__setattr__``/``__delattr__``; the name node may be absent."""
        func = call.func
        args = positional_args(call)
        if isinstance(func, cst.Attribute) and func.attr.value in _DUNDER:
            where = _DUNDER[func.attr.value].get(len(call.args))
            if where is None or len(args) <= where[1]:
                return None
            receiver_index, name_index = where
            receiver = func.value if receiver_index is None else args[receiver_index]
            return receiver, args[name_index]
        builtin = isinstance(func, cst.Name) or (
            isinstance(func, cst.Attribute) and func.attr.value in ("setattr", "delattr"))
        if not builtin or not args or not self.context.refers_to(func, *_BUILTIN_SETATTR):
            return None
        return args[0], args[1] if len(args) > 1 else None

    def _imported(self, node: cst.BaseExpression) -> str | None:
        """The dotted owner when ``node`` is an imported name or an attribute chain from one."""
        found = _root(node)
        if found is None:
            return None
        name, spelled = found
        imported = self.context.imported_as(name)
        if imported is None:
            return None
        return imported + spelled[len(name.value):]

    @staticmethod
    def _patch_message(owner: str, attribute: str) -> str:
        return (f"replaces `{attribute}` of the imported `{owner}` outside the rewriter, for "
                f"the whole process; {_INSTEAD}")

    @staticmethod
    def _method_message(attribute: str) -> str:
        return (f"replaces a module's `{attribute}` outside the rewriter; set it in a Rewrite "
                f"transaction (tx.set_attribute) and declare it in "
                f"hyperrecipe.process_patches.PROCESS_PATCHES")

