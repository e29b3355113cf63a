"""Laying parameters out per the plan: full tensor → this rank's local shard, and back.

A named placement is applied mesh dim by mesh dim, in mesh order, each sharded dim split into
equal contiguous slices by the rank's coordinate on that mesh dim (the same layout DTensor uses
for ``[Shard(d), Shard(d)]``). A chunked shard splits each fused part separately and
concatenates the slices, so every rank holds whole heads of each of q, k and v.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.placement import NamedPlacement, Shard
from hyperrecipe.runtime.comm.collectives import execute, group_for
from hyperrecipe.runtime.comm.gather_into import gather_full_in_place

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Ranges", "gather_full", "local_shard", "read_ranges", "shard_ranges"]


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _size(mesh: DeviceMesh, name: str) -> int:
    return mesh.size(tuple(mesh.mesh_dim_names or ()).index(name))


def _split_parts(x: Tensor, q: Shard, dim: int, full_size: int, ways: int) -> list[Tensor]:
    """The fused parts of ``x`` along ``dim``; ``full_size`` is the unsharded dim size and
    ``ways`` how many ranks already split it (so each part is ``part/ways`` long in ``x``)."""
    sizes = [s // ways for s in q.part_sizes(full_size)]
    return list(torch.split(x, sizes, dim=dim))


Ranges = tuple[tuple[tuple[int, int], ...], ...]
"""Per tensor dim, the ``(start, stop)`` index ranges of the full tensor a rank holds, in order."""


def shard_ranges(placement: NamedPlacement, full_shape: Sequence[int], mesh: DeviceMesh,
                 mesh_dims: Sequence[str]) -> Ranges:
    """Which slices of the full tensor this rank's shard is made of.

    A sharded dim splits into equal contiguous slices per mesh dim, in mesh order; a chunked
    shard splits each fused part in turn, so the rank holds several ranges of that dim. The
    ranges follow the very split :func:`local_shard` performs (``torch.split`` into the fused
    parts, then ``torch.chunk`` of each), so a loader that reads only these ranges from a file
    gets exactly the shard ``local_shard`` makes.
    """
    splits = [(placement.get(name), _size(mesh, name), mesh.get_local_rank(name))
              for name in mesh_dims]
    return ranges_of(full_shape, splits)


def ranges_of(full_shape: Sequence[int],
              splits: Sequence[tuple[object, int, int]]) -> Ranges:
    """:func:`shard_ranges` given, per mesh dim in order, (its placement, its size, this rank's
    coordinate). Works on (start, stop) runs, never on index vectors: a loader asks this for
    every parameter, and an index vector of a 150,000-row embedding cost milliseconds."""
    ndim = len(full_shape)
    runs: list[list[tuple[int, int]]] = [[(0, n)] if n else [] for n in full_shape]
    ways: dict[int, int] = {}
    for q, n, r in splits:
        if not isinstance(q, Shard):
            continue
        d = _norm(q.dim, ndim)
        before = ways.get(d, 1)
        taken: list[tuple[int, int]] = []
        start = 0
        length = sum(b - a for a, b in runs[d])
        sizes = [s // before for s in q.part_sizes(full_shape[d])]
        if sum(sizes) != length:  # what torch.split says of these sizes
            msg = (f"split_with_sizes expects split_sizes to sum exactly to {length} (input "
                   f"tensor's size at dimension 0), but got split_sizes={sizes}")
            raise RuntimeError(msg)
        for size in sizes:
            step = -(-size // n)  # torch.chunk: chunks of ceil(size / n), fewer when short
            if size == 0:  # torch.chunk of an empty part gives n empty chunks
                continue
            if r * step >= size:
                raise IndexError("list index out of range")  # torch.chunk(p, n)[r]
            taken.extend(_slice_runs(runs[d], start + r * step, start + min(size, (r + 1) * step)))
            start += size
        runs[d] = _merged(taken)
        ways[d] = before * n
    return tuple(tuple(rs) for rs in runs)


def _slice_runs(runs: Sequence[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Positions ``[a, b)`` of the index vector that ``runs`` spell out, as runs."""
    out, pos = [], 0
    for lo, hi in runs:
        n = hi - lo
        s, e = max(a - pos, 0), min(b - pos, n)
        if s < e:
            out.append((lo + s, lo + e))
        pos += n
        if pos >= b:
            break
    return out


def _merged(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in runs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def read_ranges(read: Callable[[tuple[slice, ...]], Tensor], ranges: Ranges) -> Tensor:
    """The tensor made of ``ranges`` (see :func:`shard_ranges`), reading each block with
    ``read(slices)``: a full tensor's ``__getitem__`` or a safetensors slice's, so a file is read
    only where this rank needs it. Blocks are concatenated dim by dim; one block is returned as
    ``read`` gave it (a view when ``read`` is indexing)."""
    return _read_block(read, ranges, (), 0)


def _read_block(read: Callable[[tuple[slice, ...]], Tensor], ranges: Ranges,
                prefix: tuple[slice, ...], dim: int) -> Tensor:
    # A module-level recursion, not a nested closure: a closure that refers to itself is a
    # reference cycle, which would keep ``read`` (and the full tensor it indexes) alive until
    # the garbage collector runs, so a model being sharded would be held twice.
    if dim == len(ranges):
        return read(prefix)
    blocks = [_read_block(read, ranges, prefix + (slice(a, b),), dim + 1) for a, b in ranges[dim]]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)


def local_shard(full: Tensor, placement: NamedPlacement, mesh: DeviceMesh,
                mesh_dims: Sequence[str]) -> Tensor:
    """This rank's slice of ``full`` (a new contiguous tensor, never a view of ``full``),
    copied once."""
    ranges = shard_ranges(placement, full.shape, mesh, mesh_dims)
    x = read_ranges(lambda slices: full.detach()[slices], ranges)
    if all(len(r) == 1 for r in ranges):  # one block: a view of ``full`` so far
        return x.clone(memory_format=torch.contiguous_format)
    return x  # torch.cat made a new contiguous tensor


def gather_full(local: Tensor, placement: NamedPlacement, full_shape: Sequence[int],
                mesh: DeviceMesh, mesh_dims: Sequence[str]) -> Tensor:
    """The full tensor from every rank's ``local`` shard (a collective: call on all ranks).

    Sharded over one mesh dim, each block is gathered straight into its place in the full
    tensor (:mod:`~hyperrecipe.runtime.comm.gather_into`); otherwise mesh dim by mesh dim."""
    direct = gather_full_in_place(local, placement, full_shape, mesh, mesh_dims)
    if direct is not None:
        return direct
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
