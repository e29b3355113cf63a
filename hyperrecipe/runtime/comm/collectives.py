"""Production collectives on plain local tensors, with the gradient each transition needs.

The resolver lowers every placement transition to a pair of
:class:`~hyperrecipe.collective.CollectiveOp` (the forward op and the backward op that carries the
gradient back); this module executes such pairs on local shards, with no DTensor dispatch:

- :func:`transition` runs the forward op and, in backward, the backward op on the gradient, as
  one :class:`torch.autograd.Function`. Any pairing is accepted; choosing the right one is the
  resolver's job. Megatron's ``f`` is ``(identity, all_reduce)``, its ``g`` is
  ``(all_reduce, identity)``, the sequence-parallel gather is ``(all_gather d, reduce_scatter d)``.
- :func:`bind_transition` is :func:`transition` built once, at install time, for one pair of
  ops on one group: the op kinds are dispatched then, not on every call (the production
  boundary's hot path, :mod:`~hyperrecipe.runtime.forward.layouts`).
- :func:`execute` runs one op, outside autograd.
- :func:`count_collectives` records every communicating op issued through this module, so tests
  and the runtime can compare a step with the plan's expected-collectives manifest.
- :func:`group_for` turns a named mesh dim into the process group, its size and this rank's index.

Semantics of each kind on a local tensor ``x`` over a group of ``n`` ranks (``r`` is this rank):

- ``identity``: ``x``.
- ``all_reduce``: the elementwise sum (``reduce="avg"``: mean) of every rank's ``x``.
- ``all_gather``: every rank's ``x`` concatenated along ``gather_dim`` in rank order.
- ``reduce_scatter``: the reduced tensor's ``r``-th of ``n`` contiguous chunks along
  ``scatter_dim``.
- ``local_slice``: ``x``'s ``r``-th of ``n`` contiguous chunks along ``scatter_dim`` (no traffic).
- ``all_to_all``: ``x`` is sharded on ``gather_dim``; the result is sharded on ``scatter_dim``
  (``x`` is split along ``scatter_dim`` into ``n`` chunks, chunk ``j`` goes to rank ``j``, and
  the chunks received are concatenated along ``gather_dim`` in rank order).

Dims may be negative. Sharded dims must divide evenly by ``n``; otherwise
:class:`CollectiveShapeError` names the op, the dim and the sizes. Ranks must pass tensors of the
same shape (not checked: that would cost a collective). ``avg`` is a sum followed by a division
by ``n`` on every backend (gloo has no native average everywhere), so results do not depend on
the backend.

Why not ``torch.distributed.nn.functional``: its autograd treats the sum of every rank's loss as
the objective, so ``all_reduce``'s backward all-reduces the gradient again and data-parallel
gradients come out ``n`` times too large. Here backward does exactly the op it is given.

Backend notes (torch 2.13, gloo on CPU): ``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``all_to_all_single`` are all native. Older gloo builds lack the
last two; the first call that the backend rejects as unsupported (a local check every rank fails
alike, before any traffic) switches that group's backend to a fallback for the rest of the
process: ``reduce_scatter`` becomes ``all_reduce`` plus a local slice, ``all_to_all`` becomes
``all_gather`` plus a local slice. Both move ``n`` times more data; ``docs/launcher.md`` lists the
measured capabilities.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from hyperrecipe.collective import CollectiveKind, CollectiveOp
from hyperrecipe.errors import (
    CollectiveShapeError,
    PlanFormatError,
    PlanMismatchError,
    did_you_mean,
)
from hyperrecipe.runtime.comm.shared_table import SharedTable

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CollectiveLog",
    "CollectiveRecord",
    "CollectiveShapeError",
    "Direction",
    "MeshDimGroup",
    "bind_transition",
    "count_collectives",
    "execute",
    "gather_flat",
    "group_for",
    "transition",
    "unchanged_tensor",
]

Direction = Literal["forward", "backward"]


# ---------------------------------------------------------------------------------------------
# Process groups.


class MeshDimGroup(NamedTuple):
    """The process group of one mesh dim, its size and this rank's index in it."""

    group: ProcessGroup
    size: int
    rank: int


def group_for(mesh: DeviceMesh, mesh_dim: str) -> MeshDimGroup:
    """The process group over ``mesh_dim``, its size and this rank's index along it.

    Raises:
        PlanMismatchError: the mesh has no dim of that name (the message lists those it has).
    """
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim not in names:
        msg = (
            f"the device mesh has no dim {mesh_dim!r}. Declared: {list(names)}; "
            f"required: {mesh_dim!r}{did_you_mean(mesh_dim, names)}"
        )
        raise PlanMismatchError(msg)
    group = mesh.get_group(mesh_dim)
    return MeshDimGroup(group, dist.get_world_size(group), dist.get_rank(group))


# ---------------------------------------------------------------------------------------------
# Counting.


class CollectiveRecord(NamedTuple):
    """One communicating op issued through this module."""

    kind: CollectiveKind
    mesh_dim: str
    direction: Direction


class CollectiveLog:
    """The records of one :func:`count_collectives` block, in the order the ops ran."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def counts(self) -> Counter[CollectiveRecord]:
        """How many times each ``(kind, mesh_dim, direction)`` was issued."""
        return Counter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"CollectiveLog({self.records!r})"


_logs: list[CollectiveLog] = []
_logs_lock = threading.Lock()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every communicating op executed through this module while the block runs.

    Identity and local slices are not recorded (they send nothing). Blocks may nest; each sees
    every op issued while it is open, from any thread (backward may run on autograd's threads).

    Example::

        with count_collectives() as log:
            loss = model(x).sum()
            loss.backward()
        assert log.counts()[CollectiveRecord("all_reduce", "tp", "backward")] == 2
    """
    log = CollectiveLog()
    with _logs_lock:
        _logs.append(log)
    try:
        yield log
    finally:
        with _logs_lock:
            _logs.remove(log)


def _record(op: CollectiveOp, direction: Direction) -> None:
    if not _logs:
        return
    record = CollectiveRecord(op.kind, op.mesh_dim, direction)
    with _logs_lock:
        for log in _logs:
            log.records.append(record)


# ---------------------------------------------------------------------------------------------
# Execution.


def execute(
    x: Tensor,
    op: CollectiveOp,
    group: ProcessGroup,
    *,
    group_size: int,
    group_rank: int,
    direction: Direction = "forward",
) -> Tensor:
    """Run one collective on the local tensor ``x`` (no autograd; see :func:`transition`).

    Args:
        x: this rank's local tensor; it is never modified.
        op: what to do; ``op.mesh_dim`` is only used for counting and messages.
        group: the process group of ``op.mesh_dim``.
        group_size: the number of ranks in ``group``.
        group_rank: this rank's index in ``group``.
        direction: recorded by :func:`count_collectives` and named in errors.

    Returns:
        A new tensor (``x`` itself for ``identity``).

    Raises:
        CollectiveShapeError: a dim the op needs is missing, out of range, or not divisible by
            ``group_size``. Shapes are checked before anything is sent, so every rank of a
            group fails alike and none is left waiting in a collective.
    """
    with torch.no_grad():
        return _execute(x, op, group, group_size, group_rank, direction)


def _execute(
    x: Tensor,
    op: CollectiveOp,
    group: ProcessGroup,
    group_size: int,
    group_rank: int,
    direction: Direction,
) -> Tensor:
    kind: str = op.kind  # a plain str: plans come from files, so guard the Literal at run time
    if kind == "identity":
        return x
    if kind == "local_slice":
        dim = _sharded_dim(x, op, "scatter_dim", group_size, direction)
        return _chunk(x, dim, group_rank, group_size).clone(memory_format=torch.contiguous_format)
    if kind == "all_reduce":
        _record(op, direction)
        return _all_reduce(x, op, group, group_size)
    if kind == "all_gather":
        dim = _dim(x, op, "gather_dim", direction)
        _record(op, direction)
        return _all_gather(x, dim, group, group_size)
    if kind == "reduce_scatter":
        dim = _sharded_dim(x, op, "scatter_dim", group_size, direction)
        _record(op, direction)
        return _reduce_scatter(x, op, dim, group, group_size, group_rank)
    if kind == "all_to_all":
        gather = _dim(x, op, "gather_dim", direction)
        scatter = _sharded_dim(x, op, "scatter_dim", group_size, direction)
        if gather == scatter:
            msg = (
                f"{op} ({direction}): gather_dim and scatter_dim are the same dim {gather} of a "
                f"tensor of shape {tuple(x.shape)}; an all_to_all needs two different dims"
            )
            raise CollectiveShapeError(msg, op=op, shape=tuple(x.shape))
        _record(op, direction)
        return _all_to_all(x, gather, scatter, group, group_size, group_rank)
    msg = f"unknown collective kind {kind!r} in {op!r}; recompile the plan with this hyperrecipe"
    raise PlanFormatError(msg)


def transition(
    x: Tensor,
    forward: CollectiveOp,
    backward: CollectiveOp,
    group: ProcessGroup,
    *,
    group_size: int,
    group_rank: int,
) -> Tensor:
    """Run ``forward`` on ``x``; in backward, run ``backward`` on the incoming gradient.

    Args:
        x: this rank's local tensor.
        forward: the op applied to ``x``.
        backward: the op applied to the gradient of the result; it yields the gradient of ``x``.
        group: the process group both ops run over.
        group_size: the number of ranks in ``group``.
        group_rank: this rank's index in ``group``.

    Returns:
        The result of ``forward``, connected to ``x`` in the autograd graph when ``x`` requires
        a gradient.

    Raises:
        CollectiveShapeError: as :func:`execute`, in forward or in backward.

    Example::

        # Sequence parallelism: gather the sequence dim, reduce-scatter its gradient.
        full = transition(
            x_local,
            CollectiveOp(kind="all_gather", mesh_dim="tp", gather_dim=1),
            CollectiveOp(kind="reduce_scatter", mesh_dim="tp", scatter_dim=1),
            tp.group, group_size=tp.size, group_rank=tp.rank,
        )
    """
    out: Tensor = _Transition.apply(  # type: ignore[no-untyped-call]
        x, forward, backward, group, group_size, group_rank
    )
    return out


class _Transition(torch.autograd.Function):
    """One placement transition: the forward op in forward, the backward op on the gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        forward: CollectiveOp,
        backward: CollectiveOp,
        group: ProcessGroup,
        group_size: int,
        group_rank: int,
    ) -> Tensor:
        ctx.backward_op = backward
        ctx.group = group
        ctx.group_size = group_size
        ctx.group_rank = group_rank
        return _execute(x, forward, group, group_size, group_rank, "forward")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        grad_x = _execute(
            grad, ctx.backward_op, ctx.group, ctx.group_size, ctx.group_rank, "backward"
        )
        return grad_x, None, None, None, None, None


OpFn = Callable[[Tensor], Tensor]


def bind_transition(
    forward: CollectiveOp,
    backward: CollectiveOp,
    group: ProcessGroup,
    *,
    group_size: int,
    group_rank: int,
) -> OpFn:
    """:func:`transition` with everything bound: ``fn(x)`` runs ``forward`` on ``x`` and
    ``backward`` on its gradient, exactly as ``transition(x, forward, backward, group, ...)``
    does (the same checks, counting and results), with each op's kind dispatched here, once.

    A pair of identities is ``x`` itself (no autograd node: the gradient passes unchanged, as it
    would through one).

    Raises:
        PlanFormatError: an op of a kind this hyperrecipe does not know (at bind time).
    """
    if forward.kind == "identity" and backward.kind == "identity":
        return unchanged_tensor
    key = (forward, backward, group, group_size, group_rank)
    index = _PAIR_TABLE.acquire(key, lambda: _BoundPair(
        _bind_op(forward, group, group_size, group_rank, "forward"),
        _bind_op(backward, group, group_size, group_rank, "backward")))
    pair = _PAIRS[index]
    apply = _BoundTransition.apply

    def run(x: Tensor) -> Tensor:
        out: Tensor
        if _is_compiling():
            out = _compiled_transition(x, index)
        elif _DIRECT is None or _DIRECT.transforms_active():
            out = apply(x, pair)  # type: ignore[no-untyped-call]
        else:
            out = _DIRECT.apply(_DIRECT.unwrap_if_dead(x), pair)
        return out

    _PAIR_TABLE.release_with(run, key, index)
    return run


class _BoundPair(NamedTuple):
    forward: OpFn
    backward: OpFn


# Every pair :func:`bind_transition` bound, once per (ops, group): boundaries with the same
# transition share one. Under ``torch.compile`` a transition reads its pair from here by index,
# so dynamo guards one int per call site and each shared pair's closures once per graph
# (:mod:`~hyperrecipe.runtime.comm.shared_table` says why). An entry goes with the last
# transition bound to it (an installation restored or dropped), so the table never keeps a
# process group alive past its installations (a group that outlives
# ``destroy_process_group`` keeps gloo's workers into interpreter teardown: training.md).
_PairKey = tuple[CollectiveOp, CollectiveOp, "ProcessGroup", int, int]
_PAIR_TABLE: SharedTable[_PairKey, _BoundPair] = SharedTable()
_PAIRS = _PAIR_TABLE.entries


def _compiled_transition(x: Tensor, index: int) -> Tensor:
    out: Tensor = _BoundTransition.apply(x, _PAIRS[index])  # type: ignore[no-untyped-call]
    return out


def unchanged_tensor(x: Tensor) -> Tensor:
    return x


def _backward_once(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    return ctx.backward_fn(grad), None


# A double backward through a collective is refused, as ``once_differentiable`` refuses it.
_backward_once_differentiable = torch.autograd.function.once_differentiable(_backward_once)


class _BoundTransition(torch.autograd.Function):
    """:class:`_Transition` with its ops bound (:func:`bind_transition`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pair: _BoundPair) -> Tensor:
        ctx.backward_fn = pair.backward
        return pair.forward(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # Autograd runs a backward with grad mode on only under ``create_graph=True``; then
        # ``once_differentiable``'s guard. Otherwise its ``no_grad`` would change nothing, and
        # it costs more than an all-reduce's own Python on a step this small (bench_host).
        if _is_grad_enabled():
            return _backward_once_differentiable(ctx, grad)
        return ctx.backward_fn(grad), None


# ``Function.apply`` without its Python layer: the C++ ``apply`` it ends in, after the one step
# of that layer a plain call needs (``unwrap_dead_wrappers``, a tensor escaped from a finished
# functorch transform). Under a functorch transform or ``torch.compile`` ``run`` goes through
# ``Function.apply``, which they recognise. Per transition, twice a block, this is a tenth of
# hyperrecipe's host overhead per step (bench_host).
class _DirectApply(NamedTuple):
    apply: Callable[..., Tensor]
    transforms_active: Callable[[], bool]
    unwrap_if_dead: Callable[[Tensor], Tensor]


def _direct_apply() -> _DirectApply | None:
    """The three torch internals the shortcut needs, or None where this torch lacks one (a
    newer torch may move them): then every call goes through ``Function.apply``, as before."""
    functorch = getattr(torch._C, "_functorch", None)
    try:
        return _DirectApply(super(torch.autograd.Function, _BoundTransition).apply,
                            torch._C._are_functorch_transforms_active,
                            functorch.unwrap_if_dead)  # type: ignore[union-attr]
    except AttributeError:
        return None


_DIRECT = _direct_apply()
_is_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


def _bind_op(op: CollectiveOp, group: ProcessGroup, group_size: int, group_rank: int,
             direction: Direction) -> OpFn:
    """One op as a function of the local tensor, its kind dispatched now; runs what
    :func:`_execute` runs for it (no autograd of its own: it is called inside a Function)."""
    kind: str = op.kind
    if kind == "identity":
        return unchanged_tensor
    if kind == "all_reduce":  # _all_reduce inlined: Megatron's f and g, once per block
        sum_op, avg = dist.ReduceOp.SUM, op.reduce == "avg"

        def all_reduce(x: Tensor) -> Tensor:
            if _logs:
                _record(op, direction)
            out = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, op=sum_op, group=group)
            return out.div_(group_size) if avg else out

        return all_reduce
    if kind == "all_gather":  # the lm_head's gathered logits: once per step each way
        def all_gather(x: Tensor) -> Tensor:
            dim = _dim(x, op, "gather_dim", direction)
            if _logs:
                _record(op, direction)
            return _all_gather(x, dim, group, group_size)

        return all_gather
    if kind == "local_slice":
        def local_slice(x: Tensor) -> Tensor:
            dim = _sharded_dim(x, op, "scatter_dim", group_size, direction)
            part = _chunk(x, dim, group_rank, group_size)
            return part.clone(memory_format=torch.contiguous_format)

        return local_slice
    if kind in ("reduce_scatter", "all_to_all"):
        def other(x: Tensor) -> Tensor:
            return _execute(x, op, group, group_size, group_rank, direction)

        return other
    msg = f"unknown collective kind {kind!r} in {op!r}; recompile the plan with this hyperrecipe"
    raise PlanFormatError(msg)


def _dim(x: Tensor, op: CollectiveOp, field: str, direction: Direction) -> int:
    """``op``'s ``field`` normalised to ``0 <= dim < x.ndim``."""
    value = getattr(op, field)
    shape = tuple(x.shape)
    if value is None:
        msg = f"{op} ({direction}): {op.kind} needs {field}, which is not set"
        raise CollectiveShapeError(msg, op=op, shape=shape)
    if not -x.ndim <= value < x.ndim:
        msg = (
            f"{op} ({direction}): {field}={value} is out of range for a tensor of shape "
            f"{shape} ({x.ndim} dims)"
        )
        raise CollectiveShapeError(msg, op=op, shape=shape)
    return int(value) % x.ndim


def _sharded_dim(
    x: Tensor, op: CollectiveOp, field: str, group_size: int, direction: Direction
) -> int:
    """As :func:`_dim`, and the dim must split evenly into ``group_size`` chunks."""
    dim = _dim(x, op, field, direction)
    size = x.shape[dim]
    if size % group_size:
        msg = (
            f"{op} ({direction}): {field}={getattr(op, field)} of a tensor of shape "
            f"{tuple(x.shape)} has size {size}, which does not divide evenly into "
            f"{group_size} shards"
        )
        raise CollectiveShapeError(msg, op=op, shape=tuple(x.shape))
    return dim


def _chunk(x: Tensor, dim: int, index: int, parts: int) -> Tensor:
    """The ``index``-th of ``parts`` equal contiguous chunks of ``x`` along ``dim`` (a view)."""
    length = x.shape[dim] // parts
    return x.narrow(dim, index * length, length)


def _all_reduce(x: Tensor, op: CollectiveOp, group: ProcessGroup, group_size: int) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    if op.reduce == "avg":
        out.div_(group_size)
    return out


def _all_gather(x: Tensor, dim: int, group: ProcessGroup, group_size: int) -> Tensor:
    src = x.contiguous()
    out = src.new_empty((group_size, *src.shape))
    # Flat buffers: gloo wants the output as the inputs concatenated along dim 0.
    _gather_into(out.view(-1), src.view(-1), group)
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(
    x: Tensor,
    op: CollectiveOp,
    dim: int,
    group: ProcessGroup,
    group_size: int,
    group_rank: int,
) -> Tensor:
    if _falls_back("reduce_scatter", group):
        out = _chunk(_all_reduce(x, op, group, group_size), dim, group_rank, group_size)
        return out.contiguous()
    # Chunk j (along dim) must be block j of the flat input: stack the chunks in front.
    src = torch.stack(x.chunk(group_size, dim=dim))
    out = src.new_empty(src.shape[1:])
    try:
        _reduce_scatter_into(out.view(-1), src.view(-1), group)
    except RuntimeError as exc:
        if not _is_unsupported(exc):
            raise
        _unsupported.add(("reduce_scatter", _backend(group)))
        return _reduce_scatter(x, op, dim, group, group_size, group_rank)
    if op.reduce == "avg":
        out.div_(group_size)
    return out


def _all_to_all(
    x: Tensor,
    gather: int,
    scatter: int,
    group: ProcessGroup,
    group_size: int,
    group_rank: int,
) -> Tensor:
    if _falls_back("all_to_all", group):
        full = _all_gather(x, gather, group, group_size)
        return _chunk(full, scatter, group_rank, group_size).contiguous()
    # Block j of the input goes to rank j; block i of the output came from rank i.
    src = torch.stack(x.chunk(group_size, dim=scatter))
    out = torch.empty_like(src)
    try:
        dist.all_to_all_single(out.view(-1), src.view(-1), group=group)
    except RuntimeError as exc:
        if not _is_unsupported(exc):
            raise
        _unsupported.add(("all_to_all", _backend(group)))
        return _all_to_all(x, gather, scatter, group, group_size, group_rank)
    return torch.cat(out.unbind(0), dim=gather)


# Collectives a backend turned out not to implement, as (kind, backend name).
_unsupported: set[tuple[str, str]] = set()

_UNSUPPORTED_MARKERS = ("not supported", "does not support", "unsupported", "not implemented")


def _falls_back(kind: str, group: ProcessGroup) -> bool:
    return bool(_unsupported) and (kind, _backend(group)) in _unsupported


def _is_unsupported(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return isinstance(exc, NotImplementedError) or any(m in text for m in _UNSUPPORTED_MARKERS)


def _backend(group: ProcessGroup) -> str:
    return str(dist.get_backend(group))


# Newer torch (2.13 here) names these ``*_single`` and deprecates the ``*_tensor`` spellings.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_flat(out: Tensor, src: Tensor, op: CollectiveOp, group: ProcessGroup) -> None:
    """Every rank's contiguous ``src`` into the contiguous ``out``, one after the other in rank
    order (``out.numel() == group size * src.numel()``), counted as ``op`` (an all_gather). The
    caller decides where ``out`` lies (:mod:`~hyperrecipe.runtime.comm.gather_into`: inside the
    full tensor)."""
    _record(op, "forward")
    _gather_into(out, src, group)


def _gather_into(out: Tensor, src: Tensor, group: ProcessGroup) -> None:
    _gather_single(out, src, group=group)


def _reduce_scatter_into(out: Tensor, src: Tensor, group: ProcessGroup) -> None:
    _reduce_scatter_single(out, src, op=dist.ReduceOp.SUM, group=group)
