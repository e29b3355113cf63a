"""The gradient norm of a sharded model, and clipping by it, equal to one process on every rank.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` sees what each rank holds. In
production mode those are plain local shards: every rank computes the norm of its own pieces
(replicated parameters, such as norms, counted on every rank), so the ranks clip by different
coefficients and replicated weights drift apart without an error. In validate mode the
parameters are DTensors, except replicated ones outside every boundary, which are plain; torch's
call then refuses to mix the two. (``torch_clip_guard`` hands torch's call this module's norm
while an installation lives.)

Here the norm is computed from what the plan records: for each parameter, the mesh dims its
placement shards it over (``ParamPlan.placement``, never re-derived from the live tensor), plus
the dims a data-parallel wrapper (``fully_shard`` on a dim the plan replicates) split this
rank's shard over. Each rank sums ``|g|^p`` of its local pieces per set of such dims; one
all-reduce per mesh dim sums (or, for the inf norms, takes the max or min of) the sets that
shard over it; a replicated parameter is counted once because every rank holds all of it.
Every rank ends with the same total, the norm one process computes over the full gradients.

What this module does not do: gradients taken by hand (``torch.autograd.grad``), a parameter
added after apply (it has no place in the plan: refused by name), and a plan whose gradient
buckets were lost to ``fully_shard`` (refused, as ``optimizer.step()`` refuses).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.placement import Shard
from hyperrecipe.plan import ParamPlan
from hyperrecipe.runtime.comm.collectives import group_for

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["clip_grads_by_norm", "per_parameter_grad_norms", "total_grad_norm"]


def _plan_dims(p: ParamPlan, mesh_dims: Sequence[str]) -> tuple[str, ...]:
    """The mesh dims the plan shards ``p`` over, in mesh order."""
    return tuple(d for d in mesh_dims if isinstance(p.placement.get(d), Shard))


def _wrapper_dims(live: LiveParams, p: ParamPlan, param: Any) -> tuple[str, ...]:
    """The dims of this mesh over which a data-parallel wrapper split this rank's shard of
    ``p`` (``param`` is a DTensor on a sub-mesh of it), or a refusal naming what it is."""
    names = tuple(live.mesh.mesh_dim_names or ())
    wrapper = param.device_mesh
    wnames = tuple(wrapper.mesh_dim_names or ())
    coordinate = live.mesh.get_coordinate()
    fits = (bool(wnames) and all(n in names for n in wnames) and coordinate is not None
            and tuple(param.shape) == p.local_shape
            and all(not isinstance(p.placement.get(n), Shard) for n in wnames))
    if fits:
        assert coordinate is not None
        index = tuple(slice(None) if n in wnames else coordinate[i] for i, n in enumerate(names))
        sub = live.mesh.mesh[index]
        order = [names.index(n) for n in wnames]
        fits = order == sorted(order) and torch.equal(sub, wrapper.mesh)
    if not fits:
        msg = (f"grad_norm: {p.fqn} is a DTensor on mesh {wnames} of shape "
               f"{list(param.shape)}, which is neither the plan's layout nor a data-parallel "
               f"wrapper's (fully_shard on a dim of {names} the plan replicates) split of this "
               f"rank's shard {list(p.local_shape)}; where its gradient lies in the full one "
               f"is unknown")
        raise PlanMismatchError(msg)
    if any(q.is_partial() for q in param.placements):
        msg = f"grad_norm: {p.fqn} is partial on {wnames}; a reduced gradient is needed"
        raise PlanMismatchError(msg)
    return tuple(n for n, q in zip(wnames, param.placements, strict=True) if q.is_shard())


def _local_grads(live: LiveParams, only: Collection[int] | None = None
                 ) -> list[tuple[tuple[str, ...], Tensor | None]]:
    """For each of the plan's own parameters (a tied one once): the mesh dims its gradient is
    split over and this rank's piece of it (``None`` without a gradient, or with one whose id
    is not in ``only``). The dims come from the plan and the parameter, never from which
    gradients exist or are asked for, so every rank issues the same collectives."""
    from torch.distributed.tensor import DTensor

    mesh_dims = tuple(live.plan.mesh_dims)
    out: list[tuple[tuple[str, ...], Tensor | None]] = []
    for p in live.own:
        param = live.param(p)
        dims = _plan_dims(p, mesh_dims)
        if isinstance(param, DTensor) and param.device_mesh != live.mesh:
            wrapped = set(dims) | set(_wrapper_dims(live, p, param))
            dims = tuple(d for d in mesh_dims if d in wrapped)
        grad = param.grad
        if grad is None or (only is not None and id(grad) not in only):
            out.append((dims, None))
            continue
        if isinstance(grad, DTensor):
            if any(q.is_partial() for q in grad.placements):
                msg = (f"grad_norm: the gradient of {p.fqn} is partial "
                       f"({list(grad.placements)}); it is not reduced yet")
                raise PlanMismatchError(msg)
            local = grad._local_tensor
            piece = param._local_tensor if isinstance(param, DTensor) else param
            expected = p.local_shape if grad.device_mesh == live.mesh else tuple(piece.shape)
        else:
            local, expected = grad, p.local_shape
        if tuple(local.shape) != tuple(expected):
            msg = (f"grad_norm: the gradient of {p.fqn} has local shape {list(local.shape)}, "
                   f"this rank's piece is {list(expected)}")
            raise PlanMismatchError(msg)
        out.append((dims, local))
    return out


def _check_all_planned(live: LiveParams) -> None:
    """A parameter with a gradient that the plan does not know (added after apply: an adapter,
    a new head) has no layout to count it by; silently leaving it out would be a wrong norm."""
    known = {id(live.param(p)) for p in live.own}
    extra = [n for n, q in live.model.named_parameters()
             if id(q) not in known and q.grad is not None]
    if extra:
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        msg = (f"grad_norm: {shown} are not in the plan (added after apply?), so their layout "
               f"on the mesh is unknown; add them to the model before compiling and applying")
        raise PlanMismatchError(msg)


def _order(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or not (p > 0 or p == -math.inf):
        msg = f"grad_norm: norm_type must be positive or ±inf, got {norm_type}"
        raise ValueError(msg)
    return p


def total_grad_norm(live: LiveParams, norm_type: float = 2.0, foreach: bool | None = None,
                    only: Collection[int] | None = None) -> Tensor:
    """The norm of the full gradients, ``torch.nn.utils.get_total_norm``'s, on every rank (a
    collective: one all-reduce of a few numbers per mesh dim that splits a gradient).

    ``only``: the ids of the gradient objects to count (a subset of the model's, as torch's
    ``clip_grad_norm_`` over some parameters is given; every rank must pass the same subset);
    parameters outside the plan are then not looked at.

    Returns a float32 scalar on the gradients' device (``0.`` when no parameter has one).
    """
    p = _order(norm_type)
    if only is None:
        _check_all_planned(live)
    return _norm_of(live, _local_grads(live, only), p, foreach)


def per_parameter_grad_norms(live: LiveParams, norm_type: float = 2.0,
                             foreach: bool | None = None) -> dict[str, Tensor]:
    """Each parameter's full gradient norm, FQN → float32 scalar, the same on every rank and
    equal to ``p.grad.norm(norm_type)`` on the whole model in one process (a collective: one
    all-reduce per mesh dim that splits a gradient, of one number per parameter).

    Parameters without a gradient are left out; a tied one appears once, under its owner's
    FQN.
    """
    p = _order(norm_type)
    _check_all_planned(live)
    pieces = _local_grads(live)
    present = [g for _, g in pieces if g is not None]
    device = present[0].device if present else live.mesh.device_type
    identity = math.inf if p == -math.inf else 0.0
    partial = torch.full((len(pieces),), identity, dtype=torch.float32, device=device)
    for i, (_, grad) in enumerate(pieces):
        if grad is not None:
            partial[i] = _reduce_local([grad], p, foreach).to(device)
    if p in (math.inf, -math.inf):
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.MIN
    else:
        op = dist.ReduceOp.SUM
    for dim in live.plan.mesh_dims:
        index = [i for i, (dims, _) in enumerate(pieces) if dim in dims]
        if not index:
            continue
        over = group_for(live.mesh, dim)
        if over.size == 1:
            continue
        sub = partial[index].contiguous()
        dist.all_reduce(sub, op=op, group=over.group)
        partial[index] = sub
    norms = partial if p in (math.inf, -math.inf) else partial.pow(1.0 / p)
    return {q.fqn: norms[i]
            for i, (q, (_, grad)) in enumerate(zip(live.own, pieces, strict=True))
            if grad is not None}


def _norm_of(live: LiveParams, pieces: list[tuple[tuple[str, ...], Tensor | None]], p: float,
             foreach: bool | None) -> Tensor:
    present = [g for _, g in pieces if g is not None]
    device = present[0].device if present else live.mesh.device_type
    keys = sorted({dims for dims, _ in pieces},
                  key=lambda k: [live.plan.mesh_dims.index(d) for d in k])
    identity = math.inf if p == -math.inf else 0.0
    partial = torch.full((len(keys),), identity, dtype=torch.float32, device=device)
    for i, key in enumerate(keys):
        grads = [g for dims, g in pieces if dims == key and g is not None]
        if grads:
            partial[i] = _reduce_local(grads, p, foreach).to(device)
    if p in (math.inf, -math.inf):
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.MIN
    else:
        op = dist.ReduceOp.SUM
    for dim in live.plan.mesh_dims:
        index = [i for i, k in enumerate(keys) if dim in k]
        if not index:
            continue
        g = group_for(live.mesh, dim)
        if g.size == 1:
            continue
        sub = partial[index].contiguous()
        dist.all_reduce(sub, op=op, group=g.group)
        partial[index] = sub
    if not present:  # torch's answer for no gradients (the ranks agree on having none)
        return torch.zeros((), dtype=torch.float32, device=device)
    if p == math.inf:
        return partial.max()
    if p == -math.inf:
        return partial.min()
    return partial.sum().pow(1.0 / p)


def _reduce_local(grads: list[Tensor], p: float, foreach: bool | None) -> Tensor:
    """``sum |g|^p`` (or the max/min of ``|g|``) over ``grads``, in float32. Empty pieces
    (a data-parallel wrapper's split of a small shard) add nothing; the inf norms of an empty
    tensor would raise."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.tensor(math.inf if p == -math.inf else 0.0, dtype=torch.float32)
    use_foreach = foreach if foreach is not None else all(g.is_cuda for g in grads)
    norms: Sequence[Tensor]
    if use_foreach and len({(g.device, g.dtype) for g in grads}) == 1:
        norms = torch._foreach_norm(grads, p, dtype=torch.float32)
    else:
        norms = [torch.linalg.vector_norm(g, p, dtype=torch.float32) for g in grads]
    stacked = torch.stack(list(norms))
    if p == math.inf:
        return stacked.max()
    if p == -math.inf:
        return stacked.min()
    return stacked.pow(p).sum()


def clip_grads_by_norm(live: LiveParams, max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Scale every gradient in place by ``max_norm / (norm + 1e-6)`` when that is below 1, as
    ``torch.nn.utils.clip_grad_norm_`` does in one process; return the norm before clipping."""
    p = _order(norm_type)
    _check_all_planned(live)
    pieces = _local_grads(live)
    total = _norm_of(live, pieces, p, foreach)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        msg = (f"The total norm of order {float(norm_type)} for gradients from "
               f"`parameters` is non-finite, so it cannot be clipped. To disable this error "
               f"and scale the gradients by the non-finite norm anyway, set "
               f"`error_if_nonfinite=False`")
        raise RuntimeError(msg)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [g for _, g in pieces if g is not None]
    by_key: dict[tuple[Any, ...], list[Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_key.items():
        scale = coef.to(device)
        if foreach is not False and (foreach or device.type == "cuda"):
            torch._foreach_mul_(group, scale)
        else:
            for g in group:
                g.mul_(scale)
    return total
