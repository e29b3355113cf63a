"""Whole tensors from what one rank holds, for comparing with the single-process reference.

A boundary's recorded value is whatever its caller sees: in validate mode a nested boundary hands
back a DTensor (made whole with ``full_tensor()``); in production mode, and at the outermost
boundary in validate mode, a plain local tensor laid out as the plan says (``in_src`` for an
input, ``out_dst`` for an output). :func:`full_view` reduces the partial mesh dims, then gathers
the sharded ones with :func:`hyperrecipe.runtime.comm.sharding.gather_full`.

Every call is a collective over the whole world (a small all-gather of local shapes first, so
that ranks holding differently shaped shards report it instead of hanging in a gather). All ranks
record the same boundaries in the same order, so every rank makes the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from hyperrecipe.errors import CheckError
from hyperrecipe.placement import NamedPlacement, Partial, Shard
from hyperrecipe.runtime import group_for
from hyperrecipe.runtime import gather_full

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["full_view"]

_MAX_NDIM = 8
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _shapes_everywhere(x: Tensor) -> list[tuple[int, ...]]:
    """Every rank's shape of ``x`` (a collective over the world)."""
    if x.ndim > _MAX_NDIM:
        raise CheckError(f"cannot compare tensors of more than {_MAX_NDIM} dims")
    row = torch.full((_MAX_NDIM + 1,), -1, dtype=torch.int64, device=x.device)
    row[0] = x.ndim
    if x.ndim:
        row[1:x.ndim + 1] = torch.tensor(x.shape, dtype=torch.int64, device=x.device)
    everyone = torch.empty(dist.get_world_size() * row.numel(), dtype=torch.int64, device=x.device)
    _gather_single(everyone, row)
    out: list[tuple[int, ...]] = []
    for r in everyone.view(dist.get_world_size(), -1).cpu().tolist():
        out.append(tuple(r[1:r[0] + 1]))
    return out


def full_view(value: Tensor, placement: NamedPlacement, mesh: DeviceMesh,
              mesh_dims: Sequence[str]) -> tuple[Tensor | None, str]:
    """The whole tensor behind this rank's ``value``, and ``""``; or ``None`` and why not.

    Args:
        value: a DTensor (any placement) or this rank's local tensor laid out as ``placement``.
        placement: the declared layout of a local ``value`` (ignored for a DTensor).
        mesh: the device mesh the plan runs on.
        mesh_dims: the plan's mesh dim names, in mesh order.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(value, DTensor):
            whole: Tensor = value.detach().full_tensor()  # type: ignore[attr-defined]
            return whole.clone(), ""
        x = value.detach()
        needs = [(n, placement.get(n)) for n in mesh_dims
                 if isinstance(placement.get(n), (Shard, Partial))
                 and mesh.size(tuple(mesh.mesh_dim_names or ()).index(n)) > 1]
        if not needs:
            return x.clone(), ""
        shapes = _shapes_everywhere(x)
        if len(set(shapes)) > 1:
            listed = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
            return None, f"ranks hold differently shaped shards ({listed})"
        full_shape = list(x.shape)
        for name, q in needs:
            g = group_for(mesh, name)
            if isinstance(q, Partial):
                x = x.clone()
                dist.all_reduce(x, group=g.group)
                if q.reduce == "avg":
                    x = x / g.size
            elif isinstance(q, Shard):
                d = q.dim + x.ndim if q.dim < 0 else q.dim
                if not 0 <= d < x.ndim:
                    return None, f"declared {placement} but the tensor has {x.ndim} dims"
                full_shape[d] *= g.size
        if any(isinstance(q, Shard) for _, q in needs):
            x = gather_full(x, placement, full_shape, mesh, mesh_dims)
        return x.clone(), ""
