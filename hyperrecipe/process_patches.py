"""The rewriter's process-wide half: every patch hyperrecipe makes to code it does not own,
declared in one table, and the one place that assigns the process-wide ones.

:mod:`hyperrecipe.rewriter` changes one model inside a transaction. A few seams exist only
outside any model (torch's ``clip_grad_norm_`` looks its helper up in its module's globals;
``GradScaler`` decides a step from a method on its class), so the runtime has to replace a
function of torch itself while an installation needs it. Such a patch outlives the transaction
that applied one model and is shared by every installation alive, so it is *held*, not
installed: :func:`hold_process_patches` puts the replacement in on the first hold (or when
another library has since replaced ours) and the last :meth:`ProcessHold.release` puts back
what ours wrapped, the way the transaction restores a model.

Why a table: a patch of torch is invisible at its call sites and changes every caller in the
process. :data:`PROCESS_PATCHES` lists each one the package makes (held here, made in a
model's transaction, or registered into a global registry), with its supplier, why it is
needed and how it is undone, and ``hyperrecipe lint`` (``HR005 process-patch``) refuses a
patch of an imported module or class anywhere but the configured rewriter paths, so the
table cannot silently fall behind the code. ``tests/test_process_patches.py`` checks that the
table names exactly what the package patches and that each hold puts the original back.

Chains: another library may wrap a function after us (as ours wraps torch's). Every
replacement made here carries ``__wrapped__`` (what it wrapped) and is remembered by identity,
so a hold finds ours anywhere in a chain of ``__wrapped__`` and does not wrap twice, and
the last release puts back ``__wrapped__`` only while ours is still on top; below another
patch, ours stays in the chain as a pass-through (its supplier answers with the function it
wrapped when no installation is left).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs

from hyperrecipe.errors import RewriteError

__all__ = ["PROCESS_PATCHES", "ProcessHold", "ProcessPatch", "declared_patch",
           "hold_process_patches", "is_held", "resolve_owner"]

PatchRoute = Literal["held", "transaction", "registration"]
"""How a patch is made and undone: ``held`` by :func:`hold_process_patches` (process-wide,
shared by every live installation); ``transaction`` inside one model's
:class:`~hyperrecipe.rewriter.Rewrite` (restored with it); ``registration`` through torch's
own registry function (see each entry for its undo)."""


@attrs.frozen(kw_only=True)
class ProcessPatch:
    """One patch of code hyperrecipe does not own.

    Args:
        key: the table key, ``"<owner>:<attribute>"``, as call sites name it.
        owner: the patched module or class, dotted (``torch.amp.GradScaler``); for a
            ``transaction`` patch, what the changed object is.
        attribute: the replaced attribute (or registry entry).
        route: how it is made and undone (:data:`PatchRoute`).
        supplier: the hyperrecipe module that supplies the replacement.
        why: why no narrower seam exists.
        undo: how it is undone.
    """

    key: str
    owner: str
    attribute: str
    route: PatchRoute
    supplier: str
    why: str
    undo: str


_CLIP = "hyperrecipe.runtime.grads.torch_clip_guard"
_CLIP_WHY = ("trainers clip with torch's function, which on production shards computes each "
             "rank's own norm; torch looks this up at every call, so it is the only seam")
_HELD_UNDO = "the last installation's restore() (or its garbage collection) puts torch's back"


def _held(owner: str, attribute: str, supplier: str, why: str) -> ProcessPatch:
    return ProcessPatch(key=f"{owner}:{attribute}", owner=owner, attribute=attribute,
                        route="held", supplier=supplier, why=why, undo=_HELD_UNDO)


#: Every patch the package makes to code it does not own; nothing else may patch (HR005).
PROCESS_PATCHES: Final[tuple[ProcessPatch, ...]] = (
    _held("torch.nn.utils.clip_grad", "_get_total_norm", _CLIP, _CLIP_WHY),
    _held("torch.nn.utils", "get_total_norm", _CLIP, _CLIP_WHY + " (its public alias)"),
    _held("torch.nn.utils.clip_grad", "_clip_grads_with_norm_", _CLIP,
          "validate mode's gradients mix DTensor and plain tensors, which torch's "
          "multi-tensor scaling refuses; scaled tensor by tensor instead"),
    _held("torch.nn.utils", "clip_grads_with_norm_", _CLIP,
          "the public alias of _clip_grads_with_norm_ (same reason)"),
    _held("torch.nn.utils.clip_grad", "clip_grad_norm_", _CLIP,
          "only on a torch without _get_total_norm: the clipping function itself"),
    _held("torch.nn.utils", "clip_grad_norm_", _CLIP,
          "only on a torch without _get_total_norm: its public alias"),
    _held("torch.amp.GradScaler", "_unscale_grads_", "hyperrecipe.runtime.grads.scaler_guard",
          "GradScaler skips a step from this rank's shards' inf flags; every rank must agree, "
          "and no hook sees the decision before optimizer.step()"),
    ProcessPatch(key="torch.nn.Module:_apply", owner="torch.nn.Module", attribute="_apply",
                 route="transaction", supplier="hyperrecipe.runtime.state.materialize",
                 why="to_empty() after a meta apply wipes non-persistent buffers that no "
                     "checkpoint restores; an instance _apply writes their values back",
                 undo="an instance attribute of each such module, set in its own Rewrite "
                      "and deleted by the installation's restore()"),
    ProcessPatch(key="transformers.PreTrainedModel:_loss_function",
                 owner="transformers.PreTrainedModel", attribute="_loss_function",
                 route="transaction", supplier="hyperrecipe.runtime.features.vocab_loss",
                 why="the model's labels= loss on vocab shards is the only way its own loss "
                     "runs on sharded logits",
                 undo="Rewrite.set_attribute on the model instance, restored with apply's "
                      "transaction"),
    ProcessPatch(key="transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS:<impl>",
                 owner="transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
                 attribute="<attn_implementation>", route="transaction",
                 supplier="hyperrecipe.runtime.features.inner",
                 why="inner attention wrappers reach the attention kernel only through "
                     "transformers' registry, which every model of the process looks up",
                 undo="Rewrite.set_item, restored with apply's transaction"),
    ProcessPatch(key="torch.distributed.tensor:register_sharding",
                 owner="torch.distributed.tensor.experimental", attribute="register_sharding",
                 route="registration", supplier="hyperrecipe.runtime.comm.dtensor_rules",
                 why="DTensor has no rule for the CPU flash-attention kernel, so validate mode "
                     "dies in the first attention without one",
                 undo="never undone: torch offers no unregister, DTensor caches propagation "
                      "per op, and only ops torch has no strategy for are registered"),
    ProcessPatch(key="torch.optim.optimizer:register_optimizer_step_pre_hook",
                 owner="torch.optim.optimizer", attribute="register_optimizer_step_pre_hook",
                 route="registration", supplier="hyperrecipe.runtime.state.scoped_hooks",
                 why="an optimizer built by the trainer is only reachable through torch's "
                     "global step pre-hooks",
                 undo="the handle is removed by restore() or when the model is collected"),
)

_BY_KEY: Final[Mapping[str, ProcessPatch]] = {p.key: p for p in PROCESS_PATCHES}
_MISSING: Final = object()
_LOCK = threading.RLock()
_HOLDERS: dict[str, int] = {}  # key -> live holds
#: Every replacement made here -> its key. By identity, not by a mark attribute: a patch over
#: ours made with ``functools.wraps`` copies our function's attributes, and must not pass for
#: ours.
_OURS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _ours(fn: object, key: str) -> bool:
    try:
        return _OURS.get(fn) == key
    except TypeError:  # not weak-referenceable: never one of ours
        return False


def declared_patch(key: str) -> ProcessPatch:
    """The table entry for ``key``.

    Raises:
        RewriteError: ``key`` is not in :data:`PROCESS_PATCHES` (declare it there, with why).
    """
    found = _BY_KEY.get(key)
    if found is None:
        msg = (f"process patch {key!r} is not declared in hyperrecipe.process_patches."
               f"PROCESS_PATCHES; declare it there, with why and how it is undone")
        raise RewriteError(msg)
    return found


def resolve_owner(patch: ProcessPatch) -> Any:
    """The live module or class ``patch.owner`` names (``torch.amp.GradScaler``)."""
    parts = patch.owner.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    msg = f"process patch {patch.key!r}: cannot import {patch.owner!r}"
    raise RewriteError(msg)


def _ours_in_chain(fn: object, key: str) -> bool:
    """Whether ``fn`` is our replacement for ``key`` or wraps it through ``__wrapped__``."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        if _ours(fn, key):
            return True
        seen.add(id(fn))
        fn = getattr(fn, "__wrapped__", None)
    return False


def is_held(key: str) -> bool:
    """Whether some installation holds the patch ``key`` now."""
    with _LOCK:
        return _HOLDERS.get(key, 0) > 0


Builder = Callable[[Any], Callable[..., Any]]
"""Given the current attribute (torch's function, or the patch on it), the replacement that
stands in for it and calls it. The replacement must be a fresh function object: this module
sets its ``__wrapped__`` and remembers it as ours."""


class ProcessHold:
    """What :func:`hold_process_patches` returns; :meth:`release` lets go (idempotent)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = keys

    @property
    def keys(self) -> tuple[str, ...]:
        """The declared patches this hold keeps in effect (those the running torch has)."""
        return self._keys

    def release(self) -> None:
        """Let go; the last holder of a patch puts back what ours wrapped, unless another
        patch has since been put over ours (it then stays in the chain, passing through)."""
        keys, self._keys = self._keys, ()
        with _LOCK:
            for key in reversed(keys):
                _release(key)


def hold_process_patches(builders: Mapping[str, Builder]) -> ProcessHold:
    """Keep each declared patch in effect until the hold is released.

    For each key (all-or-nothing: a failure puts back what this call installed): when our
    replacement is not already in the attribute's ``__wrapped__`` chain, ``build(current)``
    makes one and it is assigned. An owner without the attribute (a torch that dropped it) is
    skipped and left out of :attr:`ProcessHold.keys`.

    Args:
        builders: table key -> :data:`Builder`.

    Raises:
        RewriteError: a key is not declared, or not a ``held`` patch.
    """
    with _LOCK:
        done: list[str] = []
        try:
            for key, build in builders.items():
                patch = declared_patch(key)
                if patch.route != "held":
                    msg = (f"process patch {key!r} is made by {patch.route}, not held; "
                           f"{patch.supplier} makes it")
                    raise RewriteError(msg)
                owner = resolve_owner(patch)
                current = inspect.getattr_static(owner, patch.attribute, _MISSING)
                if current is _MISSING:
                    continue
                if not _ours_in_chain(current, key):
                    replacement = build(current)
                    replacement.__wrapped__ = current  # type: ignore[attr-defined]
                    _OURS[replacement] = key
                    setattr(owner, patch.attribute, replacement)
                _HOLDERS[key] = _HOLDERS.get(key, 0) + 1
                done.append(key)
        except BaseException:
            for key in reversed(done):
                _release(key)
            raise
        return ProcessHold(tuple(done))


def _release(key: str) -> None:
    count = _HOLDERS.get(key, 0) - 1
    if count > 0:
        _HOLDERS[key] = count
        return
    _HOLDERS.pop(key, None)
    patch = _BY_KEY[key]
    owner = resolve_owner(patch)
    top = inspect.getattr_static(owner, patch.attribute, _MISSING)
    if _ours(top, key):  # ours on top: put back what it wrapped
        setattr(owner, patch.attribute, getattr(top, "__wrapped__"))
    # else another patch wraps ours: the chain stays whole, ours passes through
