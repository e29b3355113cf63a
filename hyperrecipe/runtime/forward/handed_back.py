"""Validate mode's memory of the sharded local tensors it hands back to the model's own code.

Between boundaries the model's code runs on local tensors in both modes: under sequence
parallelism the residual stream leaves a block sharded on the sequence and the next block
takes it as such. That code may also reshape the stream with sizes it computed for the whole
tensor: ``GPT2Model`` views ``ln_f``'s output with ``(-1, seq, hidden)``, and a causal LM's
``generate()`` keeps the last token's row (``hidden_states[:, -1:, :]``). A local shard of
``[batch, seq / tp, hidden]`` has the same number of elements as ``[batch / tp, seq, hidden]``,
so the view succeeds, folds this rank's rows together, and a boundary that takes the result as
sequence-sharded computes wrong rows in both modes, with no error anywhere (only ``check``, by
comparing with one process, saw it).

So validate mode remembers each sharded local tensor a boundary hands back (by its storage,
weakly), and a boundary that receives a plain tensor declared sharded checks whether it is a
view of one of them whose leading dims, up to the sharded one, changed: then the model's code
refolded a shard, and :class:`~hyperrecipe.errors.PlanMismatchError` names both boundaries and
where to gather instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import attrs
from torch import Tensor

from hyperrecipe.errors import PlanMismatchError

__all__ = ["is_handed_back_shard", "refuse_refolded_shard", "remember_handed_back"]

_LIMIT = 512


@attrs.frozen(kw_only=True)
class _HandedBack:
    ref: Any  # weakref.ref[Tensor]
    fqn: str
    key: str  # the output's key in out_dst: its position, else its name
    shape: tuple[int, ...]
    sharded: tuple[tuple[int, str], ...]  # (tensor dim, mesh dim name)


_HANDED_BACK: dict[int, _HandedBack] = {}


def _storage(t: Tensor) -> int:
    """Which storage ``t`` views. Meta tensors have no data (every ``data_ptr()`` is 0, so
    every meta tensor would seem a view of every other): theirs is told by the storage object
    itself, as the verification step at compile runs validate mode on the meta device."""
    storage = t.untyped_storage()
    return int(storage._cdata) if t.is_meta else int(storage.data_ptr())


def remember_handed_back(local: Tensor, placements: Sequence[Any], mesh_dims: Sequence[str], *,
                         fqn: str, key: str) -> None:
    """Remember ``local``, handed back by boundary ``fqn`` with DTensor ``placements``, when
    it is sharded on a tensor dim."""
    sharded = tuple((p.dim % local.ndim, name) for p, name in zip(placements, mesh_dims)
                    if p.is_shard())
    if not sharded or local.numel() == 0:
        return
    if len(_HANDED_BACK) >= _LIMIT:
        for k in [k for k, v in _HANDED_BACK.items() if v.ref() is None]:
            del _HANDED_BACK[k]
        if len(_HANDED_BACK) >= _LIMIT:
            _HANDED_BACK.clear()
    _HANDED_BACK[_storage(local)] = _HandedBack(ref=weakref.ref(local), fqn=fqn, key=key,
                                                shape=tuple(local.shape), sharded=sharded)


def _entry_of(value: Tensor) -> _HandedBack | None:
    if value.numel() == 0:
        return None
    entry = _HANDED_BACK.get(_storage(value))
    if entry is None:
        return None
    origin = entry.ref()
    if origin is None or _storage(origin) != _storage(value):
        return None
    return entry


def is_handed_back_shard(value: Tensor) -> bool:
    """Whether ``value`` is (a view of) a sharded local tensor a boundary handed back."""
    return _entry_of(value) is not None


def refuse_refolded_shard(value: Tensor, *, fqn: str, name: str, declared: str) -> None:
    """Raise when ``value``, which boundary ``fqn`` takes as input ``name`` declared
    ``declared`` (sharded), is a view of a shard handed back earlier whose leading dims up to
    its sharded dim changed (see the module docstring).

    Raises:
        PlanMismatchError: naming the boundary that handed the shard back and where to gather.
    """
    entry = _entry_of(value)
    if entry is None:
        return
    shape = tuple(value.shape)
    for dim, mesh_dim in entry.sharded:
        if shape[:dim + 1] == entry.shape[:dim + 1]:
            continue
        msg = (f"{fqn}: input {name!r} (declared {declared}) arrived with local shape "
               f"{list(shape)}, a view of the local shard that {entry.fqn} handed back as output "
               f"{entry.key} (shape {list(entry.shape)}, dim {dim} sharded over {mesh_dim}): the "
               f"model's code between them reshaped or sliced it as if it were whole (a view "
               f"with the whole tensor's sizes folds this rank's rows together; a slice by "
               f"whole-tensor positions, such as the last token, picks this rank's rows "
               f"instead), and production mode computes the same wrong rows without an error. "
               f"Gather it before that code: `out_dst: {{{entry.key}: replicate}}` on "
               f"{entry.fqn}, and take it replicated at {fqn}")
        raise PlanMismatchError(msg)
