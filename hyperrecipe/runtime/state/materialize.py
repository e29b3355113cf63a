"""Meta-device models: allocate only this rank's shards, and give buffers real values.

A trainer that builds its model on the meta device (``with torch.device("meta")``) and applies a
plan never holds the whole model: each parameter is allocated at its local shape on the mesh's
device, as the plan says, and filled with NaN until weights are loaded, so that a step run on
unloaded weights fails loudly instead of training on whatever ``torch.empty`` returned.

Buffers are not in the plan (they are not sharded). A *persistent* buffer is allocated and left
for :meth:`~hyperrecipe.runtime.installation.Installation.load_weights` (checkpoints carry it). A
*non-persistent* buffer (rotary ``inv_freq``) is in no checkpoint, so it must be recomputed: the
only general recipe for that is the model's own initializer, so a transformers model's
``_init_weights`` is run on each parameter-free module that owns one, and a buffer that is still
unset afterwards is refused by name, with what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.integrations.transformers import model_initializer

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.rewriter import Rewrite

__all__ = ["allocate_unloaded", "is_meta", "materialize_buffers", "mesh_device"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on: the mesh's device type, the current index."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
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
    init = model_initializer(model)
    for fqn, module, lost in recompute:
        if init is not None and not any(True for _ in module.parameters(recurse=False)):
            with torch.no_grad():
                init(module)
        unset = [n for n in lost if _unset(module._buffers[n])]  # type: ignore[arg-type]
        if unset:
            listed = ", ".join(_join(fqn, n) for n in unset)
            msg = (f"non-persistent buffer(s) {listed} of {type(module).__name__} were on the meta "
                   f"device and no checkpoint holds them, and hyperrecipe cannot recompute them "
                   f"(only a transformers model's own _init_weights is known to); build this "
                   f"module on the real device before apply (the rest of the model may stay on "
                   f"meta)")
            raise PlanMismatchError(msg)
    return pending


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
