"""Meta-device models: allocate only this rank's shards, and give buffers real values.

A trainer that builds its model on the meta device (``with torch.device("meta")``) and applies a
plan never holds the whole model: each parameter is allocated at its local shape on the mesh's
device, as the plan says, and filled with NaN until weights are loaded, so that a step run on
unloaded weights fails loudly instead of training on whatever ``torch.empty`` returned.

Buffers are not in the plan (they are not sharded). A *persistent* buffer is allocated and left
for :meth:`~hyperrecipe.runtime.installation.TrainingState.load_weights` (checkpoints carry it). A
*non-persistent* buffer (rotary ``inv_freq``) is in no checkpoint, so it must be recomputed: the
only general recipe for that is the model's own initializer (its model library's answer,
:mod:`hyperrecipe.models`), run on each parameter-free module that owns one, and a buffer that is still
unset afterwards is refused by name, with what to do instead.

``model.to_empty(device=...)`` after apply (torchtitan's Trainer's order, ``tools/train.py``
before it loads) replaces every buffer with uninitialised memory, and nothing reloads a
non-persistent one, so :func:`keep_non_persistent_buffers` gives each module that owns one an
``_apply`` that writes the values back after torch's own (a device move or dtype cast writes
what the conversion would have produced; ``to_empty`` gets its values back).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.models import LIBRARY

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.rewriter import Rewrite, Rewritten

__all__ = ["BufferKeeper", "allocate_unloaded", "is_meta", "keep_non_persistent_buffers",
           "materialize_buffers", "mesh_device", "shards_on_meta"]


_SHARDS_ON_META: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hyperrecipe_shards_on_meta", default=False)


@contextlib.contextmanager
def shards_on_meta() -> Iterator[None]:
    """While inside, a meta-built model's shards stay on the meta device whatever the mesh's
    device type: the verification step at compile applies a plan to a copy of the model on
    any mesh (a ``cpu`` mesh under the fake process group, or the job's own) and allocates
    nothing. Collectives on meta tensors return without communicating."""
    token = _SHARDS_ON_META.set(True)
    try:
        yield
    finally:
        _SHARDS_ON_META.reset(token)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on: the mesh's device type, the current index (the
    meta device inside :func:`shards_on_meta`)."""
    if _SHARDS_ON_META.get():
        return torch.device("meta")
    kind = mesh.device_type
    if kind in ("cpu", "meta"):  # meta: a dry run (hyperrecipe.simulate) allocates nothing
        return torch.device(kind)
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(kind, index)


def is_meta(t: Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


def allocate_unloaded(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor that has no value yet: NaN where the dtype has one (so use before loading is
    loud), zeros otherwise."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    else:
        out.zero_()
    return out


def _unset(t: Tensor) -> bool:
    return bool((t.is_floating_point() or t.is_complex()) and t.numel() and torch.isnan(t).all())


def materialize_buffers(model: nn.Module, tx: Rewrite, device: torch.device) -> list[str]:
    """Allocate every meta buffer on ``device`` inside the transaction; recompute the
    non-persistent ones. Returns the FQNs of persistent buffers that still need loading.

    Raises:
        PlanMismatchError: a non-persistent buffer could not be recomputed (named, with the fix).
    """
    pending: list[str] = []
    recompute: list[tuple[str, nn.Module, list[str]]] = []
    for fqn, module in model.named_modules():
        names = [n for n, b in module._buffers.items() if is_meta(b)]
        for name in names:
            buf = module._buffers[name]
            assert buf is not None
            new = allocate_unloaded(tuple(buf.shape), buf.dtype, device)
            tx.set_item(module._buffers, name, new, fqn=_join(fqn, name))
            if name not in module._non_persistent_buffers_set:
                pending.append(_join(fqn, name))
        lost = [n for n in names if n in module._non_persistent_buffers_set]
        if lost:
            recompute.append((fqn, module, lost))
    if device.type == "meta":
        return pending  # a dry run: no buffer has a value to recompute or check
    init = LIBRARY.initializer(model)
    for fqn, module, lost in recompute:
        if init is not None and not any(True for _ in module.parameters(recurse=False)):
            with torch.no_grad():
                init(module)
        unset = [n for n in lost if _unset(module._buffers[n])]  # type: ignore[arg-type]
        if unset:
            listed = ", ".join(_join(fqn, n) for n in unset)
            msg = (f"non-persistent buffer(s) {listed} of {type(module).__name__} were on the meta "
                   f"device and no checkpoint holds them, and hyperrecipe cannot recompute them "
                   f"(only a model library's own initializer, such as a transformers model's, is known to); build this "
                   f"module on the real device before apply (the rest of the model may stay on "
                   f"meta)")
            raise PlanMismatchError(msg)
    return pending


_VALUES = "_hr_non_persistent_values"


def _apply_keeping_buffers(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` that keeps this module's non-persistent buffers' values.

    Bound to the module with ``types.MethodType`` (not a closure over it), so a
    ``copy.deepcopy`` of the model rebinds it to the copy with the copy's values."""
    values: dict[str, Tensor] = vars(self).get(_VALUES, {})
    for name in values:
        buf = self._buffers.get(name)
        if buf is not None and not is_meta(buf) and not _unset(buf):
            values[name] = buf.detach().to("cpu", copy=True)  # what the user has now
    out: nn.Module = type(self)._apply(self, fn, recurse)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, value in values.items():
            buf = self._buffers.get(name)
            if buf is not None and not is_meta(buf):
                buf.copy_(value)
    return out


class BufferKeeper:
    """What :func:`keep_non_persistent_buffers` installed; ``remove()`` (``restore()``)
    takes it off again (idempotent)."""

    def __init__(self, rewritten: Rewritten) -> None:
        self._rewritten = rewritten

    def remove(self) -> None:
        if not self._rewritten.restored:
            self._rewritten.restore()


def keep_non_persistent_buffers(model: nn.Module) -> BufferKeeper:
    """Give every module owning a non-persistent buffer with a value an ``_apply`` that
    writes the values back after ``to_empty`` (which no checkpoint load would repair).

    The instance ``_apply`` is the declared patch ``torch.nn.Module:_apply``
    (:data:`hyperrecipe.process_patches.PROCESS_PATCHES`), made in a rewriter transaction of
    its own, so ``remove()`` is that transaction's restore. The values are kept on the CPU
    (rotary ``inv_freq``: ``head_dim / 2`` floats). A dry run's meta buffers have no value and
    are left alone."""
    from hyperrecipe.rewriter import Rewrite

    with Rewrite(label="keep non-persistent buffers") as tx:
        for fqn, module in model.named_modules():
            values = {name: buf.detach().to("cpu", copy=True)
                      for name, buf in module._buffers.items()
                      if name in module._non_persistent_buffers_set and buf is not None
                      and not is_meta(buf)}
            if not values or "_apply" in vars(module):
                continue
            where = fqn or "<root>"
            tx.set_attribute(module, _VALUES, values, fqn=where)
            tx.set_attribute(module, "_apply", types.MethodType(_apply_keeping_buffers, module),
                             fqn=where)
    return BufferKeeper(tx.result)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
