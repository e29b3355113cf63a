"""Validate mode's memory of its sharded DTensor parameters, to refuse a forward that unwraps one.

In validate mode a boundary's parameters are DTensors, and the forward is meant to compute with
them as whole tensors. Some modules unwrap a DTensor parameter themselves: torchtitan's
``Embedding.forward`` (0.3) calls ``self.weight.to_local()`` (its own vocab-parallel path, for
the process group its ``parallelize`` sets, which a hyperrecipe plan never calls) and then
looks the global token ids up in this rank's rows of the vocabulary. The plain shard then meets
the DTensor input, DTensor refuses the mix, and validate mode would take a plain tensor that
broadcasts over the sharded dims for a replicated one
(:mod:`~hyperrecipe.runtime.forward.plain_tensors`): this rank's vocab rows as the whole table.
With token ids past the shard that failed with a bare ``IndexError`` from ``F.embedding``;
with ids inside it, it would have computed wrong rows without a word.

So validate mode remembers the local tensor of each sharded parameter it makes (by storage,
weakly), and a plain operand that views one of them is refused by
:func:`refuse_unwrapped_param`, naming the boundary, the op, the parameter and its placement.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
from torch import Tensor

from hyperrecipe.errors import ValidateShardingError

__all__ = ["refuse_unwrapped_param", "remember_sharded_param"]

_LIMIT = 4096


@attrs.frozen(kw_only=True)
class _Sharded:
    ref: Any  # weakref.ref[Tensor]: the DTensor parameter's local tensor
    fqn: str
    placement: str


_SHARDED: dict[int, _Sharded] = {}


def _storage(t: Tensor) -> int | None:
    """Which storage ``t`` views; ``None`` on the meta device, where there is no data to share
    (the compile-time verification runs validate mode there)."""
    if t.is_meta or t.numel() == 0:
        return None
    return int(t.untyped_storage().data_ptr())


def remember_sharded_param(param: Any, fqn: str, placement: str) -> None:
    """Remember validate-mode DTensor parameter ``param`` (``fqn``, placed ``placement``) when
    it is sharded on some mesh dim."""
    if not any(p.is_shard() for p in param.placements):
        return
    local = param._local_tensor  # noqa: SLF001  (DTensor's local shard, not copied)
    key = _storage(local)
    if key is None:
        return
    if len(_SHARDED) >= _LIMIT:
        for k in [k for k, v in _SHARDED.items() if v.ref() is None]:
            del _SHARDED[k]
        if len(_SHARDED) >= _LIMIT:
            _SHARDED.clear()
    _SHARDED[key] = _Sharded(ref=weakref.ref(local), fqn=fqn, placement=placement)


def _entry_of(value: Tensor) -> _Sharded | None:
    key = _storage(value)
    entry = None if key is None else _SHARDED.get(key)
    if entry is None:
        return None
    origin = entry.ref()
    if origin is None or _storage(origin) != key:
        return None
    return entry


def refuse_unwrapped_param(func: Any, plain: list[Tensor], fqn: str) -> None:
    """Raise when a plain tensor among ``plain`` (the operands of ``func`` beside DTensors, in
    boundary ``fqn``'s validate-mode compute) views a sharded parameter's local tensor.

    Raises:
        ValidateShardingError: naming the boundary, the op, the parameter and its placement.
    """
    for t in plain:
        entry = _entry_of(t)
        if entry is None:
            continue
        op = getattr(func, "__name__", str(func))
        msg = (f"{fqn}: validate mode: {op} got this rank's shard of parameter {entry.fqn!r} "
               f"(placed {entry.placement}) as a plain tensor beside DTensors: the module's "
               f"forward unwrapped the DTensor parameter itself (to_local()), so it computes "
               f"with the shard as if it were the whole parameter (torchtitan's Embedding does "
               f"this: it looks the global token ids up in this rank's vocab rows). Validate "
               f"mode cannot check that forward; check this model in production mode "
               f"(apply(..., mode=\"production\"), as hyperrecipe.trainers.torchtitan does, "
               f"against one process)")
        raise ValidateShardingError(msg, fqn=fqn, op=op)
