"""Lowering one boundary's declared layouts to :class:`~hyperrecipe.plan.Transition` steps.

Per input and output, per mesh dim: the forward collective (:func:`lower_transition`) and the
backward one its gradient needs. A replicated input consumed by parameters sharded on the same
dim gets a partial gradient (Megatron's *f*); a ``no_grad`` input has no backward collective.
A declared gradient layout (``in_grad`` / ``out_grad``, recorded as ``ArgLayout.grad``) replaces
that default on the mesh dims where the value is replicated: a partial one is reduced (an
all-reduce, or a reduce-scatter onto a sharded ``src``), a whole one is not (identity, or a local
slice): the gradient of a sequence gather into a block that computes replicated, and Megatron's
*f* on an output whose caller feeds it to sharded compute (a Mamba mixer's ``x_proj``).
On a mesh dim of size 1 nothing communicates; a step that does nothing either way is left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.collective import IDENTITY
from hyperrecipe.errors import ImpossibleTransition, RecipeError
from hyperrecipe.placement import NamedPlacement, Partial, Placement, Replicate, Shard
from hyperrecipe.plan import ArgLayout, Stage, Transition
from hyperrecipe.resolve.context import ResolveInput
from hyperrecipe.resolve.layouts import DeclaredLayouts
from hyperrecipe.resolve.lowering import canonical_grad, lower_transition

__all__ = ["lower_boundary"]


def lower_boundary(inp: ResolveInput, layouts: DeclaredLayouts, sharded: set[str],
                   no_grad: Sequence[str]) -> tuple[Transition, ...]:
    """The transitions of one boundary, inputs then outputs, in mesh order.

    Args:
        sharded: mesh dims on which the boundary's own region holds sharded parameters.
        no_grad: the inputs that carry no gradient.

    Raises:
        RecipeError: a transition no collective performs, at the layout's recipe line.
    """
    out: list[Transition] = []
    stages: tuple[tuple[Stage, tuple[ArgLayout, ...]], ...] = (
        ("input", layouts.inputs), ("output", layouts.outputs))
    for stage, args in stages:
        for arg in args:
            for dim in inp.recipe.mesh:
                if not inp.has(dim):
                    continue
                t = _lower(inp, layouts, stage, arg.name, dim, arg.src.get(dim),
                           arg.dst.get(dim), sharded, arg.grad,
                           no_grad=stage == "input" and arg.name in no_grad)
                if t is not None:
                    out.append(t)
    return tuple(out)


def _grad_text(p: Placement) -> str:
    return "partial (a sum over ranks)" if isinstance(p, Partial) else "whole on every rank"


def _lower(inp: ResolveInput, layouts: DeclaredLayouts, stage: Stage, name: str, dim: str,
           s: Placement, d: Placement, sharded: set[str], grad: NamedPlacement | None, *,
           no_grad: bool = False) -> Transition | None:
    fqn = layouts.fqn
    try:
        fwd = lower_transition(s, d, dim)
    except ImpossibleTransition as exc:
        claims = layouts.claims.get((stage, name), ())
        claim = claims[0] if claims else None
        prefix = "in" if stage == "input" else "out"
        field = next((f for f in (f"{prefix}_dst", f"{prefix}_src")
                      if claim is not None and getattr(claim.rule.fields, f)), f"{prefix}_dst")
        rule = claim.rule if claim else None
        raise RecipeError(
            f"{fqn!r} {stage} {name!r} on {dim}: {exc}",
            span=(rule.span(field, key=True) if field in rule.explicit else rule.span("match"))
            if rule else None,
            path=f"{rule.json_path}.{field}" if rule else "$", rule_index=rule.index if rule
            else None) from None
    declared = grad.get(dim) if grad is not None else None
    if no_grad:
        reason = f"{s} -> {d}, no gradient (no_grad): no backward collective"
        bwd = IDENTITY
    elif stage == "input":
        inner_grad = canonical_grad(d)
        reason = "input"
        if declared is not None and not isinstance(d, Shard):
            inner_grad = declared
            reason = (f"declared in_grad: the gradient comes back {_grad_text(declared)} "
                      f"inside")
        elif isinstance(d, Replicate) and dim in sharded and inp.size(dim) > 1:
            inner_grad = Partial()
            reason = (f"replicated input consumed by parameters sharded on {dim}: its "
                      f"gradient is partial and is all-reduced (Megatron's f)")
        bwd = lower_transition(inner_grad, canonical_grad(s), dim)
    else:
        reason = "output"
        outer_grad = canonical_grad(d)
        if declared is not None and not isinstance(d, Shard):
            outer_grad = declared
            reason = (f"declared out_grad: the caller's gradient comes back "
                      f"{_grad_text(declared)}")
        bwd = lower_transition(outer_grad, canonical_grad(s), dim)
    if inp.size(dim) == 1:
        fwd, bwd = (IDENTITY if fwd.communicates else fwd), (IDENTITY if bwd.communicates
                                                              else bwd)
    if fwd == IDENTITY and bwd == IDENTITY:
        return None
    if reason in ("input", "output"):
        reason = ""
    return Transition(boundary=fqn, stage=stage, name=name, mesh_dim=dim, src=s, dst=d,
                      forward=fwd, backward=bwd, reason=reason)
