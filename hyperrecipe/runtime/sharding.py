"""Laying parameters out per the plan: full tensor → this rank's local shard, and back.

A named placement is applied mesh dim by mesh dim, in mesh order, each sharded dim split into
equal contiguous slices by the rank's coordinate on that mesh dim (the same layout DTensor uses
for ``[Shard(d), Shard(d)]``). A chunked shard splits each fused part separately and
concatenates the slices, so every rank holds whole heads of each of q, k and v.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.placement import NamedPlacement, Shard
from hyperrecipe.runtime.collectives import execute, group_for

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["gather_full", "local_shard"]


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _size(mesh: DeviceMesh, name: str) -> int:
    return mesh.size(tuple(mesh.mesh_dim_names or ()).index(name))


def _split_parts(x: Tensor, q: Shard, dim: int, full_size: int, ways: int) -> list[Tensor]:
    """The fused parts of ``x`` along ``dim``; ``full_size`` is the unsharded dim size and
    ``ways`` how many ranks already split it (so each part is ``part/ways`` long in ``x``)."""
    sizes = [s // ways for s in q.part_sizes(full_size)]
    return list(torch.split(x, sizes, dim=dim))


def local_shard(full: Tensor, placement: NamedPlacement, mesh: DeviceMesh,
                mesh_dims: Sequence[str]) -> Tensor:
    """This rank's slice of ``full`` (a new contiguous tensor, never a view of ``full``)."""
    x = full
    ways: dict[int, int] = {}
    for name in mesh_dims:
        q = placement.get(name)
        if not isinstance(q, Shard):
            continue
        d = _norm(q.dim, full.ndim)
        n = _size(mesh, name)
        r = mesh.get_local_rank(name)
        before = ways.get(d, 1)
        parts = _split_parts(x, q, d, full.shape[d], before)
        x = torch.cat([torch.chunk(p, n, dim=d)[r] for p in parts], dim=d)
        ways[d] = before * n
    return x.detach().clone().contiguous()


def gather_full(local: Tensor, placement: NamedPlacement, full_shape: Sequence[int],
                mesh: DeviceMesh, mesh_dims: Sequence[str]) -> Tensor:
    """The full tensor from every rank's ``local`` shard (a collective: call on all ranks)."""
    sharded = [(name, placement.get(name)) for name in mesh_dims
               if isinstance(placement.get(name), Shard)]
    ways: dict[int, int] = {}
    for _, q in sharded:
        assert isinstance(q, Shard)
        d = _norm(q.dim, len(full_shape))
        ways[d] = ways.get(d, 1)
    for name, q in sharded:
        assert isinstance(q, Shard)
        d = _norm(q.dim, len(full_shape))
        ways[d] *= _size(mesh, name)
    x = local.detach()
    for name, q in reversed(sharded):
        assert isinstance(q, Shard)
        d = _norm(q.dim, len(full_shape))
        g = group_for(mesh, name)
        parts = _split_parts(x, q, d, full_shape[d], ways[d])
        op = CollectiveOp(kind="all_gather", mesh_dim=name, gather_dim=d)
        x = torch.cat([execute(p.contiguous(), op, g.group, group_size=g.size, group_rank=g.rank)
                       for p in parts], dim=d)
        ways[d] //= g.size
    return x
