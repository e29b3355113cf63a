"""Stage 3: every parameter's :class:`~hyperrecipe.plan.ParamPlan`.

In ``named_modules`` order: the placement its rule claimed (replicated when none did, refused
when the recipe says ``unclaimed: error``), checked against its shape and the mesh (dims in
range, chunks that add up, every part divisible by the mesh dims sharding it); its local shape;
its enclosing boundary; its DTensor placement or why it has none; and the backward collectives
its gradient needs (a replicated parameter inside a boundary whose inputs arrive sharded, a
deferred bias added to a sharded output, an explicit ``reduce_grads``). A tied parameter repeats
its owner's decision.
"""

from __future__ import annotations

import attrs

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import ModuleInfo, ParamInfo
from hyperrecipe.placement import (
    REPLICATED,
    NamedPlacement,
    Replicate,
    Shard,
    chunk_parts_layout,
    dtensor_layout,
)
from hyperrecipe.plan import ParamPlan, Provenance
from hyperrecipe.resolve.boundaries import BoundaryTree, BuiltBoundaries
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import Claim, ResolveInput, provenance_of
from hyperrecipe.resolve.kernels import (
    refuse_experts_split_outside_a_region,
    refuse_whole_biases_of_split_experts,
)

__all__ = ["settle_params"]


def settle_params(inp: ResolveInput, claims: ClaimTable, tree: BoundaryTree,
                  built: BuiltBoundaries) -> tuple[ParamPlan, ...]:
    """Every parameter's plan (see the module docstring).

    Raises:
        RecipeError: a placement that does not fit the parameter or the mesh, a misplaced
            ``reduce_grads``, or (with ``unclaimed: error``) parameters no rule claims.
    """
    recipe = inp.recipe
    out: list[ParamPlan] = []
    unclaimed: list[str] = []
    owners: dict[str, ParamPlan] = {}
    for module in inp.tree.modules:
        refuse_whole_biases_of_split_experts(inp, claims, module)
        refuse_experts_split_outside_a_region(inp, claims, module)
        for p in module.params:
            claim = claims.get(p.tied_to or p.fqn, "params")
            if claim is None:
                if recipe.unclaimed == "error":
                    unclaimed.append(p.fqn)
                placement = REPLICATED
                span = recipe.span("unclaimed")
                provenance: tuple[Provenance, ...] = (Provenance(
                    file=span.path, line=span.line, column=span.column, rule_index=-1,
                    reason="claimed by no rule; unclaimed parameters are replicated"),)
            else:
                placement = claim.value.canonical(recipe.mesh)
                provenance = provenance_of(claim, "placed", "params", p.name)
                _check_param(inp, claim, p, placement)
            if p.tied_to and p.tied_to in owners:
                base = owners[p.tied_to]
                last = provenance[-1]
                out.append(attrs.evolve(
                    base, fqn=p.fqn, module=module.fqn, name=p.name, tied_to=p.tied_to,
                    grad_reduce=(), boundary=tree.regions.get(module.fqn),
                    provenance=(*provenance, Provenance(
                        file=last.file, line=last.line, column=last.column,
                        rule_index=last.rule_index, reason=f"shares storage with {p.tied_to}"))))
                continue
            is_deferred = p.fqn in built.deferred
            dtensor, no_dtensor = _dtensor(module, p, placement, inp.mesh_dims)
            plan = ParamPlan(fqn=p.fqn, module=module.fqn, name=p.name, shape=p.shape,
                             dtype=p.dtype, placement=placement,
                             local_shape=_local_shape(inp, p.shape, placement),
                             deferred=is_deferred,
                             grad_reduce=_grad_reduce(inp, claims, tree, built, p, module,
                                                      placement, is_deferred),
                             boundary=tree.regions.get(module.fqn), dtensor=dtensor,
                             no_dtensor=no_dtensor, provenance=provenance)
            owners[p.fqn] = plan
            out.append(plan)
    if unclaimed:
        shown = ", ".join(unclaimed[:5]) + (f" and {len(unclaimed) - 5} more"
                                            if len(unclaimed) > 5 else "")
        raise RecipeError(f"{len(unclaimed)} parameter(s) claimed by no rule: {shown}",
                          span=recipe.span("unclaimed"), path="$.unclaimed",
                          hint="add rules for them, or set `unclaimed: replicate`")
    return tuple(out)


_LINEAR = "torch.nn.modules.linear.Linear"


def _dtensor(module: ModuleInfo, p: ParamInfo, placement: NamedPlacement,
             mesh_dims: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """The parameter's DTensor placement texts, or why it has none. Unequal chunks of a linear
    layer's output features (its ``weight`` or ``bias`` dim 0: a GQA ``qkv_proj``) are held as
    one DTensor per part (``chunk_parts``): validate mode computes the linear part by part."""
    dtensor, why = dtensor_layout(placement, p.shape, mesh_dims)
    if why == "unequal chunks" and module.is_a(_LINEAR) and p.name in ("weight", "bias"):
        parts = chunk_parts_layout(placement, p.shape, mesh_dims)
        if parts is not None and any(t.startswith("chunk_parts(0,") for t in parts):
            return parts, None
    if why == "unequal chunks":
        why = "unequal chunks, and not of an nn.Linear's output features"
    return dtensor, why


def _grad_reduce(inp: ResolveInput, claims: ClaimTable, tree: BoundaryTree,
                 built: BuiltBoundaries, p: ParamInfo, module: ModuleInfo,
                 placement: NamedPlacement, deferred: bool) -> tuple[CollectiveOp, ...]:
    mesh = inp.recipe.mesh
    if deferred:
        # added after the reduction, to an output that may be sharded (sequence parallel):
        # then each rank's bias gradient covers only its slice and is partial
        dims = built.deferred.get(p.fqn, frozenset())
        return tuple(CollectiveOp(kind="all_reduce", mesh_dim=d) for d in mesh if d in dims)
    region = tree.regions.get(module.fqn)
    reduce = set(built.sharded_inputs.get(region, frozenset())) if region is not None else set()
    explicit = claims.get(module.fqn, "reduce_grads", p.name)
    if explicit is not None:
        dim = explicit.value
        if not isinstance(placement.get(dim), Replicate):
            rule = explicit.rule
            raise RecipeError(
                f"reduce_grads: parameter {p.fqn!r} is placed {placement}; only a replicated "
                f"parameter's gradient is all-reduced over {dim}",
                span=rule.span("reduce_grads", p.name, key=True),
                path=f"{rule.json_path}.reduce_grads.{p.name}", rule_index=rule.index)
        reduce.add(dim)
    return tuple(CollectiveOp(kind="all_reduce", mesh_dim=dim) for dim in mesh
                 if dim in reduce and inp.size(dim) > 1
                 and isinstance(placement.get(dim), Replicate))


def _check_param(inp: ResolveInput, claim: Claim, p: ParamInfo,
                 placement: NamedPlacement) -> None:
    rule = claim.rule
    span = rule.span("params", p.name) if p.name in rule.explicit_params else rule.span("match")
    path = f"{rule.json_path}.params.{p.name}"
    per_dim: dict[int, list[tuple[str, Shard]]] = {}
    for dim, q in placement.dims:
        if not inp.has(dim):
            raise RecipeError(
                f"parameter {p.fqn!r} is placed on mesh dim {dim!r}, which the mesh lacks",
                span=span, path=path, rule_index=rule.index,
                hint=f"mesh: {inp.mesh_text()}; add {dim}=1 or guard the rule with `when`")
        if isinstance(q, Shard):
            nd = len(p.shape)
            d = q.dim + nd if q.dim < 0 else q.dim
            if not 0 <= d < nd:
                raise RecipeError(
                    f"{q} on {dim} is out of range for parameter {p.fqn!r} of shape "
                    f"{list(p.shape)}", span=span, path=path, rule_index=rule.index,
                    hint=f"valid dims: {-nd}..{nd - 1}")
            per_dim.setdefault(d, []).append((dim, q))
    for d, entries in per_dim.items():
        size = p.shape[d]
        ways = 1
        for dim, q in entries:
            ways *= inp.size(dim)
        q0 = entries[0][1]
        if q0.chunk_sizes and sum(q0.chunk_sizes) != size:
            raise RecipeError(
                f"{q0} declares chunks summing to {sum(q0.chunk_sizes)}, but dim {d} of "
                f"parameter {p.fqn!r} has size {size}", span=span, path=path,
                rule_index=rule.index)
        if q0.chunks > 1 and not q0.chunk_sizes and size % q0.chunks:
            raise RecipeError(
                f"dim {d} of parameter {p.fqn!r} (size {size}) is not divisible into "
                f"{q0.chunks} equal chunks ({q0})", span=span, path=path,
                rule_index=rule.index)
        dims_text = " x ".join(f"{dim}={inp.size(dim)}" for dim, _ in entries)
        for part in q0.part_sizes(size):
            if part % ways:
                what = f"chunk of size {part} of dim {d}" if q0.is_chunked else f"dim {d}"
                raise RecipeError(
                    f"parameter {p.fqn!r}: {what} (size {size}) is not divisible by mesh dim "
                    f"{dims_text} ({q0})",
                    span=span, path=path, rule_index=rule.index,
                    hint=f"shape {list(p.shape)}; each rank must hold an equal slice")


def _local_shape(inp: ResolveInput, shape: tuple[int, ...],
                 placement: NamedPlacement) -> tuple[int, ...]:
    local = list(shape)
    for dim, q in placement.dims:
        if isinstance(q, Shard):
            d = q.dim + len(shape) if q.dim < 0 else q.dim
            local[d] //= inp.size(dim)
    return tuple(local)
