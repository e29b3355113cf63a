"""Validate mode's check of how a gradient arrives at a boundary's declared input or output.

Production mode cannot see placements: at each declared tensor it runs the backward collective
the plan lowered, which assumes the gradient arrives partial (a sum still pending over a mesh
dim: all-reduce or reduce-scatter it) or whole (identity, or a local slice). The recipe says
which with ``in_grad`` / ``out_grad``; without them the resolver assumes partial where the
boundary's own region holds parameters sharded on that dim, whole elsewhere. DTensor knows:
here each gradient DTensor computes at such a slot is compared with the plan's assumption, so
that validate mode cannot agree where production would be wrong.

- A gradient that arrives ``Partial`` on a mesh dim where the plan takes it whole is an error
  where the recipe declared it whole, and where the boundary's own region holds parameters
  sharded on that dim: their gradients (and a sharded input's) cannot be summed later, so
  production would be wrong (a Mamba mixer's ``x_proj`` output read by the per-channel
  selective scan, without ``out_grad: {0: {tp: partial}}``). Into a region of replicated
  parameters a partial gradient may stay partial, as DTensor keeps it, and be reduced further
  back (a router in a local region, whose weight has ``reduce_grads`` and whose input's
  gradient the enclosing boundary reduces): the checks of those reductions stand.
- A declared partial gradient that arrives whole is an error too (production would count it
  once per rank), unless the plan runs local code inside boundaries (marshal adapters, local
  regions, inner wrappers), whose re-wrapping can reduce a partial gradient early; for inputs
  this direction is :mod:`~hyperrecipe.runtime.forward.input_grads`'s, use by use.

A declared partial output gradient is also reduced where production reduces it
(:func:`~hyperrecipe.runtime.forward.input_grads.reduce_grad_here`), so the parameters behind it
see the whole gradient in both modes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.placement import Replicate
from hyperrecipe.plan import ArgLayout, BoundaryPlan, Transition

__all__ = ["arriving_grad_check", "reduced_dims", "whole_dims"]

Stage = Literal["input", "output"]
_REDUCING = ("all_reduce", "reduce_scatter")


def reduced_dims(boundary: BoundaryPlan, layout: ArgLayout, stage: Stage,
                 mesh_dims: Sequence[str]) -> dict[int, Transition]:
    """The mesh dims (by index) on which production reduces this slot's gradient."""
    return {mesh_dims.index(t.mesh_dim): t for t in boundary.transitions
            if t.stage == stage and t.name == layout.name and t.mesh_dim in mesh_dims
            and t.backward.kind in _REDUCING}


def whole_dims(layout: ArgLayout, mesh_dims: Sequence[str], sizes: Sequence[int]
               ) -> tuple[int, ...]:
    """The mesh dims (by index, size above 1) on which the slot is replicated on the side its
    gradient arrives at (an input's ``dst``, an output's ``dst``): there a gradient is whole or
    partial, and the plan says which."""
    return tuple(i for i, d in enumerate(mesh_dims)
                 if sizes[i] > 1 and isinstance(layout.dst.get(d), Replicate))


def _declared(layout: ArgLayout, stage: Stage, dim: str) -> str:
    field = "in_grad" if stage == "input" else "out_grad"
    if layout.grad is None:
        return "(the resolver's default: no in_grad / out_grad declared)"
    return f"(declared {field}: {layout.grad})"


def arriving_grad_check(boundary: BoundaryPlan, layout: ArgLayout, stage: Stage,
                        mesh_dims: Sequence[str], sizes: Sequence[int], *,
                        check_whole: bool, sharded: frozenset[str] = frozenset()
                        ) -> Callable[[Any], None] | None:
    """A gradient hook for the slot's DTensor, or ``None`` when there is nothing to check.

    Args:
        sharded: the mesh dims on which the boundary's own region holds sharded parameters.

    Raises (from the hook):
        PlanMismatchError: the gradient arrives partial where production takes it whole, or
            (``check_whole``) whole where the recipe declared it partial.
    """
    dims = whole_dims(layout, mesh_dims, sizes)
    if not dims:
        return None
    reduced = reduced_dims(boundary, layout, stage, mesh_dims)
    field = "in_grad" if stage == "input" else "out_grad"
    key = layout.name if stage == "input" else (
        layout.position if layout.position is not None else layout.name)

    def check(grad: Any) -> None:
        placements = getattr(grad, "placements", None)
        if placements is None:
            return
        for i in dims:
            dim, t = mesh_dims[i], reduced.get(i)
            actual = placements[i]
            if actual.is_partial() and t is None and (layout.grad is not None or dim in sharded):
                op = next((s.backward.kind for s in boundary.transitions if s.stage == stage
                           and s.name == layout.name and s.mesh_dim == dim), "identity")
                msg = (f"{boundary.fqn}: the gradient of {stage} {layout.name!r} arrives "
                       f"partial on {dim} (each rank holds a share of a sum), but the plan takes "
                       f"it whole {_declared(layout, stage, dim)}: production mode runs "
                       f"{op} there and would hand each rank's share on as the gradient. "
                       f"Declare {field}: {{{key}: {{{dim}: partial}}}} so that production "
                       f"reduces it (Megatron's f)")
                raise PlanMismatchError(msg)
            if (check_whole and t is not None and actual.is_replicate()
                    and layout.grad is not None):
                msg = (f"{boundary.fqn}: the gradient of {stage} {layout.name!r} arrives whole "
                       f"on {dim} (replicate), but the plan takes it partial "
                       f"{_declared(layout, stage, dim)}: production mode runs "
                       f"{t.backward.kind} there and would count it {sizes[i]} times. Declare "
                       f"{field}: {{{key}: replicate}} (or drop the declaration)")
                raise PlanMismatchError(msg)

    return check
