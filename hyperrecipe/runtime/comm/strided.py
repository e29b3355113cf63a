"""Splitting a fused, chunk-sharded DTensor into its parts, locally.

A chunked shard (``shard(d, chunks=k)``, equal chunks) is DTensor's
``_StridedShard(d, split_factor=k)``: the dim is ``k`` equal chunks, each split over the mesh
dim, and rank ``r`` holds piece ``r`` of every chunk, in chunk order. DTensor computes a linear
layer with such a weight exactly (the output is ``_StridedShard`` on its last dim), but torch
2.13 has no rule that splits a strided-sharded dim: ``split``, ``chunk`` and slicing gather it
to replicate. The values stay right; the placements do not — q, k and v of a fused projection
come out replicated where production mode holds whole heads of each on every rank, so a
recipe could not be validated.

Yet a split that falls on chunk boundaries needs no communication: rank ``r``'s local tensor is
its piece of chunk 0, then of chunk 1, …, so chunk ``i`` is a ``Shard(d)`` DTensor whose local
tensor is the ``i``-th of ``k`` equal local parts (``m`` consecutive chunks are
``_StridedShard(d, m)``). :func:`split_strided` does that for ``split``, ``chunk``, ``narrow``
and basic slicing (``qkv[..., :q_size]``), with ``to_local``/``from_local`` so autograd carries
each part's gradient back into the fused tensor's. A split that does not fall on chunk
boundaries, or a tensor whose dim another mesh dim also shards, is left to DTensor (replicate:
exact values, and the boundary's placement check refuses what production would not compute).
Validate mode runs it in every boundary's compute
(:func:`~hyperrecipe.runtime.forward.validate_scope.validate_compute`).

**Unequal chunks** (``shard(0, chunks=[64, 32, 32])``: a GQA ``qkv_proj``) have no DTensor
placement. Where the plan says ``chunk_parts`` (a linear layer's output features), the
parameter is this rank's plain local shard, marked with its parts (:func:`mark_parts`), and
``F.linear`` with it runs part by part (:func:`linear_by_parts`): each part of the weight (and
bias) a ``Shard(0)`` DTensor of the part's global shape, each output part ``Shard(-1)``. The
fused output is their concatenation as DTensor computes it (gathered: exact, whatever the model
does with it), and slicing it at a part's bounds returns that part as computed, sharded by head.
An elementwise op with numbers between the projection and its split (DBRX's ``clip_qkv``
clamp) is applied part by part (:func:`elementwise_by_parts`), so the split after it still
returns the parts. Once the fused output is changed in place, slicing it is DTensor's again
(exact). The parts are
not views of the fused output: a part changed in place leaves the fused output as it was, so a
model that changes ``q`` in place and then reads the fused ``qkv`` whole would read the old
values there (no model here does; they slice ``qkv`` once and drop it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

__all__ = ["SPLITS", "FusedParts", "elementwise_by_parts", "linear_by_parts", "mark_parts",
           "split_strided"]

NOT_HANDLED: Any = NotImplemented
_PARTS_ATTR = "_hyperrecipe_fused_parts"
_OUTPUT_PARTS_ATTR = "_hyperrecipe_output_parts"


@attrs.frozen(kw_only=True)
class FusedParts:
    """How a parameter of unequal chunks is held: dim ``dim`` of the global tensor is parts of
    ``sizes``, each sharded over mesh dim ``index`` of ``placements`` (which holds ``Shard(dim)``
    there and the parameter's other placements elsewhere)."""

    mesh: Any
    placements: tuple[Any, ...]
    index: int
    dim: int
    sizes: tuple[int, ...]
    ways: int


def mark_parts(param: torch.Tensor, parts: FusedParts) -> None:
    """Marks a plain local parameter as held in parts (validate mode, plan ``chunk_parts``)."""
    setattr(param, _PARTS_ATTR, parts)


def _parts_of(t: Any) -> FusedParts | None:
    parts = getattr(t, _PARTS_ATTR, None) if isinstance(t, torch.Tensor) else None
    return parts if isinstance(parts, FusedParts) else None


def _dtensor_parts(t: torch.Tensor, parts: FusedParts) -> list[Any]:
    from torch.distributed.tensor import DTensor

    local_sizes = [s // parts.ways for s in parts.sizes]
    out = []
    for local, size in zip(torch.split(t, local_sizes, dim=parts.dim), parts.sizes, strict=True):
        shape = list(t.shape)
        shape[parts.dim] = size
        for i, p in enumerate(parts.placements):
            if i != parts.index and p.is_shard():
                shape[p.dim] *= parts.mesh.size(i)
        out.append(DTensor.from_local(local, parts.mesh, parts.placements, run_check=False,
                                      shape=torch.Size(shape),
                                      stride=_contiguous_stride(shape)))
    return out


def linear_by_parts(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``F.linear(x, weight, bias)`` with a weight held in parts: part by part, as DTensors;
    ``NotImplemented`` when the weight is not held in parts."""
    from torch.distributed.tensor import DTensor

    x, weight, *rest = args
    bias = rest[0] if rest else kwargs.get("bias")
    parts = _parts_of(weight)
    if parts is None or not isinstance(x, DTensor):
        return NOT_HANDLED  # local code computes on the local shard, as in production
    weights = _dtensor_parts(weight, parts)
    bounds = _ranges(parts.sizes)
    if bias is None:
        biases: list[Any] = [None] * len(weights)
    elif _parts_of(bias) is not None:
        biases = _dtensor_parts(bias, _parts_of(bias))  # type: ignore[arg-type]
    else:
        biases = [bias[a:b] for a, b in bounds]
    outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    fused = torch.cat(outs, dim=-1)
    setattr(fused, _OUTPUT_PARTS_ATTR, (fused.ndim - 1, tuple(bounds), tuple(outs),
                                        fused._version))
    return fused


def _output_part(t: Any, dim: int, bounds: Sequence[tuple[int, int]]) -> list[Any] | None:
    """The parts of a by-parts linear's output asked for by ``bounds`` (each exactly one part's),
    or ``None``."""
    marked = getattr(t, _OUTPUT_PARTS_ATTR, None) if isinstance(t, torch.Tensor) else None
    if marked is None or marked[0] != dim or marked[3] != t._version:
        return None  # another dim, or changed in place since: DTensor slices it (exact)
    found = dict(zip(marked[1], marked[2], strict=True))
    if any(b not in found for b in bounds):
        return None
    return [found[b] for b in bounds]


def _strided_dim(t: Any, dim: int) -> tuple[int, int] | None:
    """``(mesh index, split_factor)`` when ``t`` is a DTensor whose dim ``dim`` is strided-sharded
    on exactly one mesh dim and sharded on no other."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not isinstance(t, DTensor):
        return None
    found: tuple[int, int] | None = None
    for i, p in enumerate(t.placements):
        if isinstance(p, (Shard, _StridedShard)) and p.dim % t.ndim == dim:
            if not isinstance(p, _StridedShard) or found is not None:
                return None
            found = (i, int(p.split_factor))
    return found


def _pieces(t: Any, dim: int, bounds: Sequence[tuple[int, int]]) -> list[Any] | None:
    """The DTensors for the global ranges ``bounds`` of ``t``'s dim ``dim``, split locally; None
    when ``t`` is not strided there or a range does not fall on chunk boundaries."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    computed = _output_part(t, dim, bounds)
    if computed is not None:
        return computed
    found = _strided_dim(t, dim)
    if found is None:
        return None
    mesh_index, k = found
    size = t.shape[dim]
    chunk = size // k
    ways = t.device_mesh.size(mesh_index)
    if chunk * k != size or any(a % chunk or b % chunk or not 0 <= a < b <= size
                                for a, b in bounds):
        return None  # off the chunk boundaries, or out of range: DTensor's (and its errors)
    local = t.to_local()
    local_chunk = chunk // ways
    if local_chunk * ways != chunk or local.shape[dim] != k * local_chunk:
        return None  # pieces of unequal size on the ranks: DTensor's
    out = []
    for a, b in bounds:
        m = (b - a) // chunk
        placements = list(t.placements)
        placements[mesh_index] = Shard(dim) if m == 1 else _StridedShard(dim, split_factor=m)
        part = local.narrow(dim, a // chunk * local_chunk, m * local_chunk)
        shape = list(t.shape)
        shape[dim] = b - a
        out.append(DTensor.from_local(part, t.device_mesh, placements, run_check=False,
                                      shape=torch.Size(shape), stride=t.stride()))
    return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def _split(t: Any, split_size_or_sections: Any = None, dim: int = 0, *,
           split_size: Any = None) -> Any:
    if split_size_or_sections is None:
        split_size_or_sections = split_size  # ``Tensor.split``'s own keyword
    d = _norm(dim, t.ndim)
    size = t.shape[d]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            return NOT_HANDLED
        sizes = [min(step, size - s) for s in range(0, size, step)]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if sum(sizes) != size:
            return NOT_HANDLED  # torch's error, from DTensor
    parts = _pieces(t, d, _ranges(sizes))
    return NOT_HANDLED if parts is None else tuple(parts)


def _chunk(t: Any, chunks: int, dim: int = 0) -> Any:
    d = _norm(dim, t.ndim)
    if chunks <= 0:
        return NOT_HANDLED
    step = -(-t.shape[d] // chunks)
    return _split(t, step, d)


def _narrow(t: Any, dim: int, start: Any, length: int) -> Any:
    if not isinstance(start, int):
        return NOT_HANDLED
    d = _norm(dim, t.ndim)
    start = _norm(start, t.shape[d])
    parts = _pieces(t, d, [(start, start + length)])
    return NOT_HANDLED if parts is None else parts[0]


def _getitem(t: Any, index: Any) -> Any:
    """``t[..., a:b]`` and the like: one slice on the strided dim, every other index ``:``."""
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1 or not all(
            i is Ellipsis or isinstance(i, slice) for i in items):
        return NOT_HANDLED
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = (slice(None),) * (t.ndim - len(items) + 1)
        items = items[:at] + fill + items[at + 1:]
    if len(items) > t.ndim:
        return NOT_HANDLED
    sliced = [d for d, s in enumerate(items) if s != slice(None)]
    if len(sliced) != 1:
        return NOT_HANDLED
    d = sliced[0]
    start, stop, step = items[d].indices(t.shape[d])
    if step != 1:
        return NOT_HANDLED
    parts = _pieces(t, d, [(start, stop)])
    return NOT_HANDLED if parts is None else parts[0]


SPLITS: dict[Callable[..., Any], Callable[..., Any]] = {
    torch.Tensor.split: _split,
    torch.split: _split,
    torch.Tensor.chunk: _chunk,
    torch.chunk: _chunk,
    torch.Tensor.narrow: _narrow,
    torch.narrow: _narrow,
    torch.Tensor.__getitem__: _getitem,
}
"""The functions :func:`split_strided` answers, by the torch function that reaches a mode."""


def split_strided(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` done locally when it splits a strided-sharded DTensor on chunk
    boundaries (see the module docstring); ``NotImplemented`` when it is anything else."""
    handler = SPLITS.get(func)
    if handler is None or not args or not (_strided_any(args[0])
                                           or hasattr(args[0], _OUTPUT_PARTS_ATTR)):
        return NOT_HANDLED
    try:
        return handler(*args, **kwargs)
    except TypeError:  # a signature we do not read (``out=``, a tensor of sizes): DTensor's
        return NOT_HANDLED


def _strided_any(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


_ELEMENTWISE = frozenset({
    "clamp", "clip", "clamp_min", "clamp_max", "tanh", "sigmoid", "neg", "abs", "exp",
    "mul", "div", "add", "sub", "__mul__", "__rmul__", "__truediv__", "__add__", "__radd__",
    "__sub__"})
"""Elementwise ops whose other arguments are numbers: applied to a by-parts linear's output
(DBRX's ``qkv.clamp(min=-clip_qkv, max=clip_qkv)`` between ``Wqkv`` and its split), they are
applied to each part, so the split after them still returns the parts sharded by head."""


def elementwise_by_parts(func: Callable[..., Any], args: Sequence[Any],
                         kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` part by part when ``args[0]`` is a by-parts linear's output
    (unchanged since) and ``func`` is an elementwise op of :data:`_ELEMENTWISE` whose other
    arguments are no tensors; the result is marked with its parts in turn. ``NotImplemented``
    otherwise (DTensor computes it on the gathered output: exact, but a split after it is
    replicated and the boundary's placement check refuses what production computes)."""
    name = getattr(func, "__name__", "")
    if name not in _ELEMENTWISE or not args or not isinstance(args[0], torch.Tensor):
        return NOT_HANDLED
    if func is not getattr(torch, name, None) and func is not getattr(torch.Tensor, name, None):
        return NOT_HANDLED
    marked = getattr(args[0], _OUTPUT_PARTS_ATTR, None)
    if marked is None or marked[3] != args[0]._version:
        return NOT_HANDLED
    rest = (*args[1:], *kwargs.values())
    if any(isinstance(a, torch.Tensor) for a in rest):
        return NOT_HANDLED
    dim, bounds, parts = marked[0], marked[1], marked[2]
    outs = [func(p, *args[1:], **kwargs) for p in parts]
    fused = torch.cat(outs, dim=dim)
    setattr(fused, _OUTPUT_PARTS_ATTR, (dim, bounds, tuple(outs), fused._version))
    return fused
