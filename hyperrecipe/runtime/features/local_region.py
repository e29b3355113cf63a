"""Local compute regions: a boundary whose forward runs on plain local tensors in both modes.

Some forwards cannot run on DTensors: MoE token dispatch picks rows by data-dependent expert ids
(``nonzero``, ``where``, sorting by expert), and an expert-parallel kernel must see *this rank's*
experts, not a global tensor. A boundary marked ``local_region: true`` runs its compute on local
tensors in both modes and declares what it produces (``out_src``); the boundary's output converter
wraps the plain result with that placement (validate mode) or runs the lowered collectives
(production mode).

:func:`local_region_forward` is the edge. In production mode the region's inputs and parameters
are local already and it changes nothing. In validate mode:

- declared DTensor inputs are unwrapped with ``to_local(grad_placements=...)``: the gradient the
  region hands back is declared with the placement the resolver lowered production's backward
  from, i.e. *partial* where a replicated input is consumed by parameters sharded on that mesh dim
  (Megatron's *f*), so DTensor reduces it exactly as production does; undeclared DTensors go
  through :func:`~hyperrecipe.runtime.forward.marshal.to_local_tree` (their gradient keeps their placement);
- the region's DTensor parameters are swapped for their ``to_local()`` views in
  ``module._parameters`` for the call and put back in ``finally`` (gradients reach the DTensor
  parameter through ``to_local``, placed as the parameter is);
- the call is marked as local code: a boundary nested in the region keeps its DTensor
  parameters, takes the local tensors it is called with, and hands local tensors back
  (:mod:`~hyperrecipe.runtime.forward.validate_scope`).

Which inputs get which gradient placement, and which parameters are swapped, is decided once at
install time; a call only indexes and unwraps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.placement import Shard, to_torch_placements
from hyperrecipe.plan import ArgLayout, BoundaryPlan, HeadCount, ParamPlan, Plan
from hyperrecipe.runtime.forward.arguments import Slot, map_declared
from hyperrecipe.rewriter import installed_forward_owner
from hyperrecipe.runtime.forward.marshal import to_local_tree
from hyperrecipe.runtime.forward.validate_scope import running_local_code
from hyperrecipe.runtime.mode import answers

__all__ = ["input_grad_placements", "local_grad_placements", "local_region_forward",
           "mark_local_grad", "region_partial_dims", "runs_on_local_tensors", "unwrap_declared",
           "with_local_parameters"]

Forward = Callable[..., Any]

_LOCAL_GRAD_ATTR = "_hyperrecipe_local_grad_placements"
_PARTIAL_GRAD_OPS = ("all_reduce", "reduce_scatter")
"""Backward ops that consume a partial gradient: the region hands that input's gradient back
partial on the transition's mesh dim."""


def input_grad_placements(boundary: BoundaryPlan, layout: ArgLayout,
                          mesh_dims: Sequence[str]) -> tuple[Any, ...]:
    """Torch placements of the gradient a local region hands back for one declared input.

    The input's ``in_dst`` placement, except partial on every mesh dim whose lowered backward
    reduces (the resolver's Megatron *f*: a replicated input consumed by sharded parameters).
    """
    from torch.distributed.tensor import Partial as TPartial

    out = list(to_torch_placements(layout.dst, mesh_dims))
    for t in boundary.transitions:
        if (t.stage == "input" and t.name == layout.name
                and t.backward.kind in _PARTIAL_GRAD_OPS):
            out[list(mesh_dims).index(t.mesh_dim)] = TPartial(t.backward.reduce)
    return tuple(out)


def unwrap_declared(value: Any, grad_placements: tuple[Any, ...]) -> Any:
    """A declared input's local tensor, its gradient declared ``grad_placements``
    (:func:`input_grad_placements`); anything but a DTensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local(grad_placements=grad_placements)
    return value


def _dtensor_parameters(module: nn.Module) -> tuple[tuple[nn.Module, str], ...]:
    """The DTensor parameters of ``module``'s own code: not those of a boundary nested in it
    (a submodule with an installed forward; boundaries are installed innermost first), which
    computes on its DTensor parameters itself when local code calls it."""
    from torch.distributed.tensor import DTensor

    found: list[tuple[nn.Module, str]] = []

    def visit(m: nn.Module, root: bool) -> None:
        if not root and installed_forward_owner(m) is not None:
            return
        found.extend((m, name) for name, p in m._parameters.items() if isinstance(p, DTensor))
        for child in m.children():
            visit(child, False)

    visit(module, True)
    return tuple(dict.fromkeys(found))  # a module reached twice (shared) is swapped once


def runs_on_local_tensors(fqn: str, boundaries: Sequence[BoundaryPlan]) -> bool:
    """Whether module ``fqn``'s own code computes on local tensors in validate mode too: the
    innermost boundary that is ``fqn`` or encloses it is a local region. (A boundary nested in a
    region computes on DTensors again.) Such a module needs its head counts divided in both
    modes, as production divides them everywhere."""
    best: BoundaryPlan | None = None
    for b in boundaries:
        if fqn == b.fqn or fqn.startswith(b.fqn + ".") or not b.fqn:
            if best is None or len(b.fqn) > len(best.fqn):
                best = b
    return best is not None and bool(best.local_region)


def region_partial_dims(region: BoundaryPlan, params: Sequence[ParamPlan]) -> frozenset[str]:
    """The mesh dims along which a local region's code computes on this rank's part of the
    data: a parameter in the region (nested boundaries included) or a declared input is sharded
    on them. A replicated parameter's gradient computed there is this rank's partial sum, which
    ``reduce_grads`` all-reduces in both modes.

    On any other mesh dim the region computes on whole data, and a ``reduce_grads`` there
    stands for gradients that arrive partial at the region's outputs in production (a router
    whose scores feed sharded experts); validate mode's output edge has reduced those already
    (DTensor redistributes the arriving gradient to the declared ``out_src``), so they are left
    as the parameter is placed there."""
    inside = region.fqn + "."
    dims = {d for p in params if p.module == region.fqn or p.module.startswith(inside)
            for d in p.placement.mesh_dims if isinstance(p.placement.get(d), Shard)}
    dims.update(d for a in region.inputs for d in a.dst.mesh_dims
                if isinstance(a.dst.get(d), Shard))
    return frozenset(dims)


def local_grad_placements(placements: Sequence[Any], grad_reduce: Sequence[CollectiveOp],
                          mesh_dims: Sequence[str]) -> tuple[Any, ...] | None:
    """The gradient placement local code hands a DTensor parameter back with: its own
    ``placements``, except partial on every mesh dim the plan's ``grad_reduce`` all-reduces
    (``reduce_grads``: a replicated parameter applied to this rank's part of a sharded value).
    ``None`` where the plan reduces nothing: the gradient is placed as the parameter is."""
    from torch.distributed.tensor import Partial as TPartial

    out = list(placements)
    for op in grad_reduce:
        if op.kind == "all_reduce" and op.mesh_dim in mesh_dims:
            out[list(mesh_dims).index(op.mesh_dim)] = TPartial(op.reduce)
    return tuple(out) if out != list(placements) else None


def mark_local_grad(param: Any, grad_placements: tuple[Any, ...] | None) -> None:
    """Marks a DTensor parameter with the gradient placement its ``to_local()`` view declares
    when local code (a local region, a forward inner wrapper) computes with it."""
    if grad_placements is not None:
        setattr(param, _LOCAL_GRAD_ATTR, grad_placements)


def _local_view(param: Any) -> Any:
    return param.to_local(grad_placements=getattr(param, _LOCAL_GRAD_ATTR, None))


def with_local_parameters(module: nn.Module, inner: Forward) -> Forward:
    """``inner`` called while ``module``'s DTensor parameters (found now) are swapped for their
    ``to_local()`` views in ``_parameters``, put back in ``finally``; gradients reach the DTensor
    parameters through ``to_local``, placed as the parameter is, or partial where the plan
    reduces them (:func:`mark_local_grad`: production's bucket all-reduce and validate mode's
    then agree). With no DTensor parameter (production) it is ``inner``.
    Parameters of a boundary nested in ``module`` stay DTensors (see ``_dtensor_parameters``)."""
    params = _dtensor_parameters(module)
    if not params:
        return inner

    def forward(*args: Any, **kwargs: Any) -> Any:
        saved: list[tuple[nn.Module, str, Any]] = []  # (module, name, the DTensor parameter)
        try:
            for m, name in params:
                param: Any = m._parameters[name]
                saved.append((m, name, param))
                m._parameters[name] = _local_view(param)
            return inner(*args, **kwargs)
        finally:
            for m, name, param in saved:
                m._parameters[name] = param

    return forward


def local_region_forward(module: nn.Module, inner: Forward, boundary: BoundaryPlan,
                         mesh_dims: Sequence[str]) -> Forward:
    """``inner`` run on local tensors: DTensor inputs and parameters unwrapped for the call.

    Args:
        module: the boundary module; its DTensor parameters (validate mode) are found now.
        inner: the compute (the class forward or a local kernel); it must return plain tensors.
        boundary: the plan's boundary entry (``local_region`` set).
        mesh_dims: the plan's mesh dims, in mesh order.

    Returns:
        A callable with ``inner``'s arguments.
    """
    declared: tuple[Slot, ...] = tuple(
        (a.position, a.name, functools.partial(
            unwrap_declared, grad_placements=input_grad_placements(boundary, a, mesh_dims)))
        for a in boundary.inputs)
    local_inner = with_local_parameters(module, inner)

    def forward(*args: Any, **kwargs: Any) -> Any:
        args_l = list(args)
        map_declared(args_l, kwargs, declared)
        with running_local_code():
            return local_inner(*to_local_tree(args_l), **to_local_tree(kwargs))

    return forward


@answers("divided_head_counts", "production")
def _all_head_counts(plan: Plan) -> tuple[HeadCount, ...]:
    return plan.head_counts


@answers("divided_head_counts", "validate")
def _local_region_head_counts(plan: Plan) -> tuple[HeadCount, ...]:
    # DTensor computes with global shapes, so the attributes stay global, except in modules
    # whose code runs on local tensors (a local region) in both modes
    return tuple(h for h in plan.head_counts if runs_on_local_tensors(h.module, plan.boundaries))
