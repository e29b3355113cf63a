"""Placements: how a tensor is laid out over one mesh dim, and over a named set of mesh dims.

The recipe language, the plan and the runtime all speak these classes; only
:func:`to_torch_placements` knows torch's own placement types, and it imports torch lazily so the
recipe loader and the lint stay torch-free.

Grammar (one mesh dim)::

    replicate
    partial | partial(sum) | partial(avg)
    shard(D)                         # D may be negative
    shard(D, chunks=K)               # dim D is K equal chunks (fused q/k/v); each is sharded
    shard(D, chunks=[S1, S2, ...])   # ... or chunks of the declared sizes

A *named* placement maps mesh dim names to those: ``{tp: shard(0), dp: replicate}``; a mesh dim
it does not name is replicate.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Union

import attrs

from hyperrecipe.errors import PlacementError, PlacementSyntaxError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torch.distributed.tensor.placement_types import Placement as TorchPlacement

__all__ = [
    "DTensorEntry",
    "DTensorLayout",
    "NamedPlacement",
    "Partial",
    "Placement",
    "PlacementSyntaxError",
    "Replicate",
    "Shard",
    "chunk_parts_layout",
    "dtensor_layout",
    "parse_dtensor",
    "parse_named_placement",
    "parse_placement",
    "to_torch_placements",
]

ReduceOp = Literal["sum", "avg"]


@attrs.frozen(kw_only=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "replicate"


@attrs.frozen(kw_only=True)
class Partial:
    """Every rank holds a full-shaped tensor; the value is their sum (or mean)."""

    reduce: ReduceOp = "sum"

    def __str__(self) -> str:
        return "partial" if self.reduce == "sum" else f"partial({self.reduce})"


@attrs.frozen(kw_only=True)
class Shard:
    """Each rank holds one slice of ``dim``.

    With ``chunks`` > 1 the dim is a concatenation of parts (a fused q/k/v projection) and each
    part is sharded in turn, so every rank holds its slice of every part. ``chunk_sizes`` gives
    unequal parts explicitly; when empty the ``chunks`` parts are equal.
    """

    dim: int
    chunks: int = 1
    chunk_sizes: tuple[int, ...] = ()

    @property
    def is_chunked(self) -> bool:
        return self.chunks > 1

    def part_sizes(self, dim_size: int) -> tuple[int, ...]:
        """Sizes of the fused parts of a dim of ``dim_size`` (one part when not chunked)."""
        if self.chunk_sizes:
            return self.chunk_sizes
        return (dim_size // self.chunks,) * self.chunks

    def __str__(self) -> str:
        if self.chunk_sizes:
            return f"shard({self.dim}, chunks=[{', '.join(map(str, self.chunk_sizes))}])"
        if self.chunks > 1:
            return f"shard({self.dim}, chunks={self.chunks})"
        return f"shard({self.dim})"


Placement = Union[Shard, Replicate, Partial]
REPLICATE = Replicate()


# ASCII digits only (`shard(٠)` is not a placement), at most 9 of them (no 5000-digit int())
_SHARD_RE = re.compile(
    r"^shard\(\s*(?P<dim>-?[0-9]{1,9})\s*"
    r"(?:,\s*chunks\s*=\s*(?P<chunks>[0-9]{1,9}|\[[0-9\s,]*\])\s*)?\)$", re.ASCII)
_PARTIAL_RE = re.compile(r"^partial(?:\(\s*(?P<op>\w+)\s*\))?$", re.ASCII)
PLACEMENT_FORMS = ("replicate", "partial", "partial(sum)", "partial(avg)", "shard(D)",
                   "shard(D, chunks=K)", "shard(D, chunks=[S1, S2, ...])")


def _short(text: str) -> str:
    """``text`` cut for an error message (a recipe value may be megabytes long)."""
    return text if len(text) <= 80 else text[:77] + "..."


def parse_placement(text: str) -> Placement:
    """Parse one mesh dim's placement.

    Raises:
        PlacementSyntaxError: the text is not a placement; the message lists the valid forms.
    """
    s = text.strip()
    if s == "replicate":
        return REPLICATE
    m = _PARTIAL_RE.match(s)
    if m:
        op = m.group("op") or "sum"
        if op not in ("sum", "avg"):
            msg = f"unknown reduce op {op!r} in {_short(text)!r}; expected partial(sum) or partial(avg)"
            raise PlacementSyntaxError(msg)
        return Partial(reduce="sum" if op == "sum" else "avg")
    m = _SHARD_RE.match(s)
    if m:
        dim = int(m.group("dim"))
        raw = m.group("chunks")
        if raw is None:
            return Shard(dim=dim)
        if raw.startswith("["):
            parts = [p.strip() for p in raw[1:-1].split(",") if p.strip()]
            if any(len(p) > 9 for p in parts):
                msg = f"chunks=[...] sizes have at most 9 digits, found {_short(text)!r}"
                raise PlacementSyntaxError(msg)
            sizes = tuple(int(p) for p in parts)
            if len(sizes) < 2 or any(v <= 0 for v in sizes):
                msg = f"chunks=[...] needs two or more positive sizes, found {_short(text)!r}"
                raise PlacementSyntaxError(msg)
            return Shard(dim=dim, chunks=len(sizes), chunk_sizes=sizes)
        chunks = int(raw)
        if chunks < 1:
            msg = f"chunks must be at least 1, found {_short(text)!r}"
            raise PlacementSyntaxError(msg)
        return Shard(dim=dim, chunks=chunks)
    msg = f"unknown placement {_short(text)!r}; expected one of {', '.join(PLACEMENT_FORMS)}"
    raise PlacementSyntaxError(msg)


@attrs.frozen(kw_only=True)
class NamedPlacement:
    """A placement per named mesh dim; dims not listed are replicate.

    ``dims`` holds only non-replicate entries, in the order given, so two named placements that
    mean the same compare equal once :meth:`canonical` puts them in mesh order.
    """

    dims: tuple[tuple[str, Placement], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, Placement] | Iterable[tuple[str, Placement]]) -> NamedPlacement:
        items = mapping.items() if isinstance(mapping, Mapping) else mapping
        return cls(dims=tuple((k, v) for k, v in items if not isinstance(v, Replicate)))

    def get(self, mesh_dim: str) -> Placement:
        for name, placement in self.dims:
            if name == mesh_dim:
                return placement
        return REPLICATE

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def is_replicate(self) -> bool:
        return not self.dims

    def canonical(self, mesh_order: Sequence[str]) -> NamedPlacement:
        """The same placement with entries in mesh order (what the plan stores)."""
        rank = {name: i for i, name in enumerate(mesh_order)}
        return NamedPlacement(dims=tuple(sorted(self.dims, key=lambda kv: rank.get(kv[0], 1 << 30))))

    def __str__(self) -> str:
        if not self.dims:
            return "replicate"
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.dims) + "}"


REPLICATED = NamedPlacement()


def parse_named_placement(value: object) -> NamedPlacement:
    """Parse ``"replicate"`` or a mapping of mesh dim name to placement string.

    Raises:
        PlacementSyntaxError: not a mapping of strings, or a placement inside is malformed.
    """
    if isinstance(value, str):
        if value.strip() == "replicate":
            return REPLICATED
        msg = (
            f"a placement other than replicate must name its mesh dim, e.g. {{tp: {value.strip()}}}; "
            f"found the bare string {value!r}"
        )
        raise PlacementSyntaxError(msg)
    if not isinstance(value, Mapping):
        msg = f"expected 'replicate' or a mapping of mesh dim to placement, found {type(value).__name__}"
        raise PlacementSyntaxError(msg)
    entries: list[tuple[str, Placement]] = []
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            msg = f"expected mesh dim name: placement string, found {k!r}: {v!r}"
            raise PlacementSyntaxError(msg)
        entries.append((k, parse_placement(v)))
    return NamedPlacement.of(entries)


def parse_named_text(text: str) -> NamedPlacement:
    """Inverse of ``str(NamedPlacement)``: used by the plan's JSON converter."""
    s = text.strip()
    if s == "replicate":
        return REPLICATED
    if not (s.startswith("{") and s.endswith("}")):
        msg = f"not a named placement: {_short(text)!r}"
        raise PlacementSyntaxError(msg)
    body = s[1:-1]
    entries: list[tuple[str, Placement]] = []
    # Split on commas that are not inside (...) or [...].
    depth, start = 0, 0
    parts: list[str] = []
    for i, ch in enumerate(body):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    for part in parts:
        if not part.strip():
            continue
        name, _, rest = part.partition(":")
        entries.append((name.strip(), parse_placement(rest)))
    return NamedPlacement.of(entries)


def to_torch_placements(p: NamedPlacement, mesh_dims: Sequence[str]) -> tuple[TorchPlacement, ...]:
    """Torch placements, one per mesh dim in ``mesh_dims`` order.

    Chunked shards have no single torch placement; the runtime lays those out itself.

    Raises:
        PlacementError: a chunked shard was given (a ``ValueError``).
    """
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    out: list[TorchPlacement] = []
    for name in mesh_dims:
        q = p.get(name)
        if isinstance(q, Shard):
            if q.is_chunked:
                msg = f"{q} has no torch placement; lay it out with the runtime's chunked shard"
                raise PlacementError(msg)
            out.append(TShard(q.dim))
        elif isinstance(q, Partial):
            out.append(TPartial(q.reduce))
        else:
            out.append(TReplicate())
    return tuple(out)


def dtensor_layout(p: NamedPlacement, shape: Sequence[int], mesh_dims: Sequence[str]
                   ) -> tuple[tuple[str, ...], str | None]:
    """The DTensor placement of a parameter placed ``p``, one text per mesh dim, or why none.

    ``replicate`` and ``shard(d)`` are DTensor's own; ``k`` equal chunks of dim ``d`` sharded over
    one mesh dim are ``strided_shard(d, k)`` (DTensor's ``_StridedShard(d, split_factor=k)``:
    rank ``r`` holds piece ``r`` of every chunk, the layout of the runtime's chunked shard, while
    the DTensor keeps the parameter's global, unpermuted meaning). Unequal chunks, or a chunked
    dim that another mesh dim shards too, have no DTensor placement.

    Returns:
        ``(placements, None)``, or ``((), reason)`` when DTensor cannot represent the shard.
    """
    nd = len(shape)
    dims = {name: (q.dim + nd) % nd for name, q in p.dims if isinstance(q, Shard) and nd}
    chunked = any(isinstance(q, Shard) and q.is_chunked for _, q in p.dims)
    out: list[str] = []
    for name in mesh_dims:
        q = p.get(name)
        if not isinstance(q, Shard):
            out.append("replicate")
        elif not chunked:
            out.append(f"shard({q.dim})")
        else:
            shared = [n for n, d in dims.items() if d == dims[name] and n != name]
            if q.is_chunked and (len(set(q.part_sizes(shape[dims[name]]))) > 1 or shared):
                why = (f"tensor dim {dims[name]} is also sharded on {', '.join(shared)}"
                       if shared else "unequal chunks")
                return (), why
            out.append(f"strided_shard({dims[name]}, {q.chunks})" if q.is_chunked
                       else f"shard({dims[name]})")
    return tuple(out), None


def chunk_parts_layout(p: NamedPlacement, shape: Sequence[int], mesh_dims: Sequence[str]
                       ) -> tuple[str, ...] | None:
    """Per mesh dim, the plan's ``dtensor`` texts for unequal chunks held as one DTensor per part,
    or ``None`` when ``p`` is not unequal chunks of one dim sharded over one mesh dim.

    The chunked mesh dim's text is ``chunk_parts(d, [S1, S2, ...])``: validate mode computes the
    parameter's module part by part, each part a ``Shard(d)`` DTensor of global size ``Si``
    (the resolver records it only where the runtime can: a linear layer's output features).
    The other mesh dims keep their ``replicate`` / ``shard(d)`` text."""
    nd = len(shape)
    chunked = [(name, q) for name, q in p.dims if isinstance(q, Shard) and q.is_chunked]
    if len(chunked) != 1 or not nd:
        return None
    ((name, q),) = chunked
    d = (q.dim + nd) % nd
    if any(isinstance(o, Shard) and (o.dim + nd) % nd == d for n, o in p.dims if n != name):
        return None
    sizes = q.part_sizes(shape[d])
    if len(set(sizes)) == 1:
        return None
    out = []
    for mesh_dim in mesh_dims:
        other = p.get(mesh_dim)
        if mesh_dim == name:
            out.append(f"chunk_parts({d}, [{', '.join(map(str, sizes))}])")
        elif isinstance(other, Shard):
            out.append(f"shard({(other.dim + nd) % nd})")
        else:
            out.append("replicate")
    return tuple(out)


_DTENSOR_ENTRY = re.compile(r"^(?:(replicate)|shard\((-?\d+)\)|strided_shard\((\d+), (\d+)\)"
                            r"|chunk_parts\((\d+), \[([\d, ]+)\]\))$")


@attrs.frozen(kw_only=True)
class DTensorEntry:
    """One mesh dim of a plan's ``dtensor`` text, parsed: ``replicate``, ``shard`` (``dim``),
    ``strided_shard`` (``dim``, ``split_factor``) or ``chunk_parts`` (``dim``, ``sizes``)."""

    kind: Literal["replicate", "shard", "strided_shard", "chunk_parts"]
    dim: int = 0
    split_factor: int = 1
    sizes: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class DTensorLayout:
    """A parameter's DTensor placement as the plan records it (``ParamPlan.dtensor``), parsed
    once (:func:`parse_dtensor`): the typed value every runtime reader uses instead of the text.

    ``parts`` is ``(mesh dim index, tensor dim, part sizes)`` when one mesh dim shards unequal
    chunks (one ``Shard(d)`` DTensor per part in validate mode), else ``None``.
    """

    entries: tuple[DTensorEntry, ...]

    @property
    def parts(self) -> tuple[int, int, tuple[int, ...]] | None:
        for i, e in enumerate(self.entries):
            if e.kind == "chunk_parts":
                return i, e.dim, e.sizes
        return None

    def torch_placements(self, *, parts_as_shard: bool = False) -> tuple[TorchPlacement, ...]:
        """The torch placements, one per mesh dim. ``parts_as_shard``: the unequal-chunks dim
        as the ``Shard(d)`` each of its parts is.

        Raises:
            PlacementError: the layout has unequal chunks and ``parts_as_shard`` is false (no
                single DTensor holds them).
        """
        from torch.distributed.tensor import Replicate as TReplicate
        from torch.distributed.tensor import Shard as TShard
        from torch.distributed.tensor.placement_types import _StridedShard

        out: list[TorchPlacement] = []
        for e in self.entries:
            if e.kind == "shard" or (e.kind == "chunk_parts" and parts_as_shard):
                out.append(TShard(e.dim))
            elif e.kind == "strided_shard":
                out.append(_StridedShard(e.dim, split_factor=e.split_factor))
            elif e.kind == "replicate":
                out.append(TReplicate())
            else:
                raise PlacementError("unequal chunks have no single DTensor placement")
        return tuple(out)


def parse_dtensor(texts: Sequence[str]) -> DTensorLayout:
    """The :class:`DTensorLayout` of a plan's ``dtensor`` texts (what :func:`dtensor_layout` and
    :func:`chunk_parts_layout` wrote), cached: a plan's texts are parsed once per process.

    Raises:
        PlacementError: a text that is none of ``replicate``, ``shard(d)``,
            ``strided_shard(d, k)``, ``chunk_parts(d, [s, ...])``.
    """
    return _parse_dtensor(tuple(texts))


@functools.lru_cache(maxsize=4096)
def _parse_dtensor(texts: tuple[str, ...]) -> DTensorLayout:
    entries = []
    for text in texts:
        m = _DTENSOR_ENTRY.match(text)
        if m is None:
            raise PlacementError(f"{text!r} is not a DTensor placement of a plan")
        if m.group(1) is not None:
            entries.append(DTensorEntry(kind="replicate"))
        elif m.group(2) is not None:
            entries.append(DTensorEntry(kind="shard", dim=int(m.group(2))))
        elif m.group(3) is not None:
            entries.append(DTensorEntry(kind="strided_shard", dim=int(m.group(3)),
                                        split_factor=int(m.group(4))))
        else:
            sizes = tuple(int(s) for s in m.group(6).split(","))
            entries.append(DTensorEntry(kind="chunk_parts", dim=int(m.group(5)), sizes=sizes))
    return DTensorLayout(entries=tuple(entries))
