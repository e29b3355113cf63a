"""Full tensors gathered straight into their place: one buffer, no ``torch.cat`` reassembly.

:func:`~hyperrecipe.runtime.comm.sharding.gather_full` rebuilds a full tensor by gathering
each shard into a staging buffer and concatenating: two full-size copies per tensor, and the
concatenation runs while the peers wait. When a parameter is sharded over one mesh dim (the
usual tensor-parallel layout), the gather can land each rank's block where it belongs:

- sharded on dim 0 (column-parallel weights, embeddings, the lm_head), every rank's block is a
  contiguous slice of the full tensor, so the all-gather writes into the full tensor itself
  (per fused part for a chunked shard: each part is a contiguous slice too); no copy at all;
- sharded on another dim (row-parallel weights), the blocks are strided in the full tensor, which
  a collective cannot write; they are gathered into one staging buffer and copied into the
  full tensor once (what ``cat`` did, without the second allocation).

Other layouts (several mesh dims, or a dim sharded twice) are left to ``gather_full``.

An export needs the full tensor on one rank only. :func:`gather_to_writer` sends every other
rank's blocks to that rank alone, point to point in chunks of :data:`CHUNK_BYTES`, each
received straight into its place: half the traffic of an all-gather at tp=2, and on gloo
several times its speed (a 64 MiB all-gather moved 80-160 MiB/s on the loaded 2-core machine
where 8 MiB sends moved 800-1000 MiB/s; docs/benchmarks.md, "The export at the floor").

When the ranks can write the writer's file themselves (one host), no block needs to travel:
:func:`own_blocks` says where each run of this rank's shard lies in the full tensor, so a rank
writes its block straight to its place in the file (``state/direct_write.py``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.placement import NamedPlacement, Shard
from hyperrecipe.runtime.comm.collectives import MeshDimGroup, gather_flat, group_for

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CHUNK_BYTES", "OwnBlocks", "gather_full_in_place", "gather_to_writer", "give_back",
           "own_blocks"]

CHUNK_BYTES = 8 << 20
"""The largest single send of :func:`gather_to_writer` (gloo is slowest on large messages)."""


def _even_shard_over_one_dim(local: Tensor, placement: NamedPlacement,
                             full_shape: Sequence[int], mesh: DeviceMesh,
                             mesh_dims: Sequence[str]
                             ) -> tuple[str, Shard, int, MeshDimGroup, Tensor] | None:
    """(mesh dim, its shard, the tensor dim it splits, that mesh dim's group, ``local``
    detached) when ``local`` is an even shard over exactly one mesh dim, else ``None``: the
    same answer on every rank, before any traffic (the general path then says why)."""
    sharded = [(name, q) for name in mesh_dims
               if isinstance(q := placement.get(name), Shard)]
    if len(sharded) != 1:
        return None
    name, q = sharded[0]
    assert isinstance(q, Shard)
    ndim = len(full_shape)
    d = q.dim + ndim if q.dim < 0 else q.dim
    g = group_for(mesh, name)
    x = local.detach()
    expected = tuple(full_shape[:d]) + (full_shape[d] // g.size,) + tuple(full_shape[d + 1:])
    if tuple(x.shape) != expected or full_shape[d] % g.size:
        return None
    return name, q, d, g, x


def gather_full_in_place(local: Tensor, placement: NamedPlacement, full_shape: Sequence[int],
                         mesh: DeviceMesh, mesh_dims: Sequence[str]) -> Tensor | None:
    """The full tensor from every rank's ``local`` shard, gathered into one preallocated
    tensor (a collective: call on all ranks), or ``None`` when the placement is not sharded
    over exactly one mesh dim (then every rank returns ``None`` alike, before any traffic).
    """
    found = _even_shard_over_one_dim(local, placement, full_shape, mesh, mesh_dims)
    if found is None:
        return None
    name, q, d, g, x = found
    op = CollectiveOp(kind="all_gather", mesh_dim=name, gather_dim=d)
    full = x.new_empty(tuple(full_shape))
    offset = 0  # where the part starts in the full tensor
    local_offset = 0
    for size in q.part_sizes(full_shape[d]):
        part = x.narrow(d, local_offset, size // g.size).contiguous()
        _gather_part(full.narrow(d, offset, size), part, d, op, g)
        offset += size
        local_offset += size // g.size
    return full


def _gather_part(slot: Tensor, part: Tensor, dim: int, op: CollectiveOp, g: MeshDimGroup) -> None:
    """Every rank's ``part`` into ``slot`` (this part's range of the full tensor), in rank
    order along ``dim``."""
    if dim == 0:  # rank j's block is rows [j*l, (j+1)*l) of the slot: contiguous
        gather_flat(slot.view(-1), part.view(-1), op, g.group)
        return
    staged = part.new_empty((g.size, *part.shape))
    gather_flat(staged.view(-1), part.view(-1), op, g.group)
    # staged[j] is rank j's block; the slot holds them side by side along ``dim``
    blocks = slot.unflatten(dim, (g.size, part.shape[dim]))  # type: ignore[no-untyped-call]
    blocks.copy_(staged.movedim(0, dim))


def gather_to_writer(local: Tensor, placement: NamedPlacement, full_shape: Sequence[int],
                     mesh: DeviceMesh, mesh_dims: Sequence[str], writer: int) -> Tensor | None:
    """The full tensor on global rank ``writer``, an empty tensor on the ranks that sent it
    their blocks (or had none to send), or ``None`` on every rank alike, before any traffic,
    when the layout is not one :func:`gather_full_in_place` handles (then gather that way).

    Every rank of the writer's group along the sharded mesh dim must call it, in the same
    order for every tensor; ranks of other groups (another data-parallel replica) return at
    once. A point-to-point exchange, so not counted as a collective of a step.
    """
    found = _even_shard_over_one_dim(local, placement, full_shape, mesh, mesh_dims)
    if found is None:
        return None
    name, q, d, g, x = found
    ranks = dist.get_process_group_ranks(g.group)
    if writer not in ranks:
        return x.new_empty((0,))
    me = dist.get_rank()
    full = _take(x, tuple(full_shape)) if me == writer else None
    offset = 0
    local_offset = 0
    for size in q.part_sizes(full_shape[d]):
        part = x.narrow(d, local_offset, size // g.size).contiguous()
        if full is None:
            _send(part.view(-1), writer)
        else:
            blocks = full.narrow(d, offset, size).unflatten(  # type: ignore[no-untyped-call]
                d, (g.size, size // g.size))
            for j, src in enumerate(ranks):
                block = blocks.select(d, j)
                if src == me:
                    block.copy_(part)
                elif block.is_contiguous():  # dim 0: straight into place
                    _recv(block.view(-1), src)
                else:  # strided in the full tensor: staged once, copied into place
                    staged = part.new_empty(part.shape)
                    _recv(staged.view(-1), src)
                    block.copy_(staged)
        offset += size
        local_offset += size // g.size
    return full if full is not None else x.new_empty((0,))


@attrs.frozen(kw_only=True)
class OwnBlocks:
    """This rank's blocks of one full tensor, as runs of elements laid out row-major: run
    ``(o, p)`` is ``length[p]`` elements from ``data[o * local_stride + local_start[p]]`` to the
    full tensor's flat element ``o * full_stride + full_start[p]`` (``o`` over ``outer``: one
    run per part for a dim-0 shard, one per row and part for a row-parallel block).

    ``peers`` (on the writer) are the ranks that write their own blocks; ``writer`` is where the
    others report that theirs are written. A rank outside the writer's group has no runs."""

    data: Tensor
    """This rank's shard, contiguous (a view of the parameter when it already is)."""
    outer: int
    full_stride: int
    local_stride: int
    full_start: tuple[int, ...]
    local_start: tuple[int, ...]
    length: tuple[int, ...]
    writer: int
    peers: tuple[int, ...]

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """``(full element offset, local element offset, elements)`` in the full tensor's order."""
        parts = list(zip(self.full_start, self.local_start, self.length, strict=True))
        for o in range(self.outer):
            for full, local, n in parts:
                yield o * self.full_stride + full, o * self.local_stride + local, n


def own_blocks(local: Tensor, placement: NamedPlacement, full_shape: Sequence[int],
               mesh: DeviceMesh, mesh_dims: Sequence[str], writer: int) -> OwnBlocks | None:
    """Where this rank's shard lies in the full tensor (no traffic), or ``None`` on every rank
    alike when the layout is not one :func:`gather_to_writer` handles. The runs of the ranks of
    the writer's group tile the full tensor exactly; ranks of other groups (another
    data-parallel replica) get none, and the writer's ``peers`` are the group's other ranks."""
    found = _even_shard_over_one_dim(local, placement, full_shape, mesh, mesh_dims)
    if found is None:
        return None
    _, q, d, g, x = found
    ranks = dist.get_process_group_ranks(g.group)
    me = dist.get_rank()
    inner = math.prod(full_shape[d + 1:])
    outer = math.prod(full_shape[:d])
    local_d = x.shape[d]
    full_start: list[int] = []
    local_start: list[int] = []
    length: list[int] = []
    if writer in ranks:
        j = ranks.index(me)
        offset = local_offset = 0
        for size in q.part_sizes(full_shape[d]):
            lp = size // g.size
            full_start.append((offset + j * lp) * inner)
            local_start.append(local_offset * inner)
            length.append(lp * inner)
            offset += size
            local_offset += lp
    peers = tuple(r for r in ranks if r != writer) if me == writer else ()
    return OwnBlocks(data=x.contiguous(), outer=outer if length else 0,
                     full_stride=full_shape[d] * inner, local_stride=local_d * inner,
                     full_start=tuple(full_start), local_start=tuple(local_start),
                     length=tuple(length), writer=writer, peers=peers)


def _send(flat: Tensor, dst: int) -> None:
    """Every piece posted at once, then waited for: the pieces stream back to back (gloo
    matches a pair's messages of one tag in the order they were posted)."""
    step = max(1, CHUNK_BYTES // max(flat.element_size(), 1))
    works = [dist.isend(flat[start:start + step], dst) for start in range(0, flat.numel(), step)]
    for work in works:
        if work is not None:
            work.wait()


def _recv(flat: Tensor, src: int) -> None:
    step = max(1, CHUNK_BYTES // max(flat.element_size(), 1))
    works = [dist.irecv(flat[start:start + step], src) for start in range(0, flat.numel(), step)]
    for work in works:
        if work is not None:
            work.wait()


# One spare full tensor's memory, handed back by the writer once written: freshly allocated
# memory costs a page fault per 4 KiB on first touch, which halved the receive rate here, and a
# model repeats its shapes layer after layer. At most one spare, so at most one tensor more.
_spare_lock = threading.Lock()
_spare: list[Tensor] = []
_produced: collections.deque[weakref.ref[Tensor]] = collections.deque(maxlen=4)
"""The last full tensors :func:`gather_to_writer` returned (compared by identity: ``==`` on
tensors is elementwise)."""


def _take(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    nbytes = math.prod(shape) * like.element_size()
    with _spare_lock:
        spare = _spare.pop() if _spare else None
    if spare is not None and spare.numel() == nbytes and spare.device == like.device:
        full = spare.view(like.dtype).view(shape)
    else:
        full = like.new_empty(shape)
    with _spare_lock:
        _produced.append(weakref.ref(full))
    return full


def give_back(full: Tensor) -> None:
    """Let the next :func:`gather_to_writer` reuse ``full``'s memory: call it once nothing
    reads ``full`` any more. Anything :func:`gather_to_writer` did not return is ignored (a
    model's own buffer handed to an export, say), so it is always safe to call."""
    with _spare_lock:
        ours = [r for r in _produced if r() is full]
        if not ours or not full.is_contiguous():
            return
        _produced.remove(ours[0])
        _spare[:] = [full.view(-1).view(torch.uint8)]
