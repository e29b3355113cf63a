"""Plain tensors the model makes inside a validate-mode boundary, where they meet DTensors.

DTensor refuses an op that mixes a DTensor with a plain tensor, and validate mode does not treat
every plain tensor as replicated (DTensor's ``implicit_replication``): a plain tensor could be a
rank's local piece, and taking it for the whole tensor would be silently wrong. One kind is safe
all the same: a plain tensor that **broadcasts over every dim the DTensors are sharded on** (size
1 there, or no such dim). Whatever it is, each rank applies the same values to each of its
rows along those dims, so it is the same tensor whole or local. That is what real models build
in their attention: transformers' SDPA path for T5 masks its per-head position bias with a
causal mask it makes then and there (``torch.where(causal_mask, position_bias, min)``, the mask
``[1, 1, q, kv]``, the bias sharded by head), and an additive mask ``[batch, 1, q, kv]`` is
built the same way.

A plain tensor of zeros that requires no gradient is safe too: a state a model starts from
(``torch.zeros(batch, intermediate_size, state)``, made from a DTensor's global shape, in the
recurrence of transformers' torch Mamba scan). Every shard of it is zeros, so it is the same
tensor whole, as any rank's piece, or replicated; a rank's local piece of another shape meets
the DTensors' global shapes and fails loudly, as before.

:func:`replicate_broadcast_plain` converts such plain tensors into replicated DTensors after
DTensor refused the mix (the op is then run again); it declines (returns ``None``) when any plain
tensor has a sharded dim's size, or is a view of a local shard validate mode handed back to the
model's code (:mod:`~hyperrecipe.runtime.forward.handed_back`), and DTensor's refusal stands.

**The causal mask torch makes itself.** ``scaled_dot_product_attention(..., is_causal=True)``
on CPU falls back to its math kernel when the fused one does not fit (multi-head latent
attention: query and key heads of 192, values of 128), and that kernel builds the causal mask
as a plain tensor inside the op, where no model code can reach it. :func:`explicit_causal_mask`
gives the op the same mask instead, ``ones(q, kv).tril()`` (torch's documented meaning of
``is_causal``: aligned to the top left), as a replicated DTensor of the global sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hyperrecipe.runtime.forward.handed_back import is_handed_back_shard

__all__ = ["MIXED_TENSORS", "explicit_causal_mask", "plain_operands", "replicate_broadcast_plain"]

MIXED_TENSORS = "got mixed torch.Tensor and DTensor"
"""The text of DTensor's refusal of a plain tensor beside a DTensor."""


def _operands(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The tensors an op was given: its arguments, and those in a list or tuple argument."""
    out: list[Any] = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, Tensor))
    return out


def plain_operands(args: Any, kwargs: dict[str, Any]) -> list[Tensor]:
    """The plain (not DTensor) tensors an op was given (see :func:`_operands`)."""
    from torch.distributed.tensor import DTensor

    return [t for t in _operands(args, kwargs) if not isinstance(t, DTensor)]


def _broadcasts_over_shards(plain: Tensor, dtensors: list[Any]) -> bool:
    for d in dtensors:
        for p in d.placements:
            if not p.is_shard():
                continue
            index = p.dim % d.ndim + plain.ndim - d.ndim  # broadcasting aligns the last dims
            if 0 <= index < plain.ndim and plain.shape[index] != 1:
                return False
    return True


def _fresh_zeros(t: Tensor) -> bool:
    """A tensor of zeros that carries no gradient (a recurrence's initial state)."""
    return not t.requires_grad and t.numel() > 0 and not bool(t.any())


def replicate_broadcast_plain(args: Any, kwargs: dict[str, Any]
                              ) -> tuple[Any, dict[str, Any]] | None:
    """``(args, kwargs)`` with each plain tensor that broadcasts over every sharded dim of the
    DTensors beside it as a replicated DTensor; ``None`` when there is nothing to convert or a
    plain tensor does not qualify (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    operands = _operands(args, kwargs)
    dtensors = [t for t in operands if isinstance(t, DTensor)]
    plain = [t for t in operands if not isinstance(t, DTensor)]
    if not dtensors or not plain:
        return None
    mesh = dtensors[0].device_mesh
    if any(d.device_mesh != mesh for d in dtensors):
        return None
    for t in plain:
        if is_handed_back_shard(t) or not (_broadcasts_over_shards(t, dtensors)
                                           or _fresh_zeros(t)):
            return None
    replicated = tuple(Replicate() for _ in range(mesh.ndim))

    def convert(v: Any) -> Any:
        if isinstance(v, Tensor) and not isinstance(v, DTensor):
            return DTensor.from_local(v, mesh, replicated, run_check=False)
        if isinstance(v, (list, tuple)) and any(isinstance(t, Tensor) for t in v):
            items = [convert(t) for t in v]
            return items if isinstance(v, list) else tuple(items)
        return v

    return tuple(convert(v) for v in args), {k: convert(v) for k, v in kwargs.items()}


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def explicit_causal_mask(func: Any, args: Any, kwargs: dict[str, Any]
                         ) -> tuple[Any, dict[str, Any]] | None:
    """``(args, kwargs)`` of a DTensor ``scaled_dot_product_attention`` call with
    ``is_causal=True`` and no mask, rewritten to pass the causal mask explicitly as a replicated
    DTensor; ``None`` for any other call (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    if func is not torch.nn.functional.scaled_dot_product_attention or len(args) > len(_SDPA_ARGS):
        return None
    named = dict(zip(_SDPA_ARGS, args))
    if set(named) & set(kwargs):
        return None
    named.update(kwargs)
    query, key = named.get("query"), named.get("key")
    if (not named.get("is_causal") or named.get("attn_mask") is not None
            or not isinstance(query, DTensor) or not isinstance(key, DTensor)):
        return None
    mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                      device=query.to_local().device).tril()
    mesh = query.device_mesh
    named["attn_mask"] = DTensor.from_local(mask, mesh, tuple(Replicate() for _ in range(mesh.ndim)),
                                            run_check=False)
    named["is_causal"] = False
    return (), named
