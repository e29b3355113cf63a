"""Stage 2: boundaries and regions, then each boundary's plan.

:func:`find_boundaries` reads which modules are boundaries and gives every module its *region*:
its nearest enclosing boundary (itself when it is one). :func:`build_boundaries` then builds each
boundary's :class:`~hyperrecipe.plan.BoundaryPlan`, in tree order: declared layouts, nesting,
``no_grad``, lowered transitions, the deferred bias, the inner-wrapper chain and the local
kernels (vocab-parallel lookup, expert parallel), with the provenance of every field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from hyperrecipe.errors import RecipeError, did_you_mean
from hyperrecipe.model_tree import ModuleInfo
from hyperrecipe.placement import NamedPlacement, Partial, Shard
from hyperrecipe.plan import ArgLayout, BoundaryPlan, Provenance
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import Claim, ResolveInput, provenance, provenance_of, span_of
from hyperrecipe.resolve.kernels import expert_parallel, vocab_parallel
from hyperrecipe.resolve.layouts import DeclaredLayouts, declared_layouts
from hyperrecipe.resolve.transitions import lower_boundary
from hyperrecipe.resolve.wrappers import check_wrapper_needs, check_wrappers, declared_inner_out

__all__ = ["BoundaryTree", "BuiltBoundaries", "build_boundaries", "find_boundaries"]

_BOUNDARY_ONLY = ("in_src", "in_dst", "out_src", "out_dst", "defer_bias", "out_names",
                  "local_region", "no_grad", "loss_parallel", "in_grad", "out_grad")


@attrs.frozen(kw_only=True)
class BoundaryTree:
    """The boundaries in tree order, and each module's region (its nearest enclosing boundary,
    itself when it is one; ``None`` outside every boundary)."""

    names: tuple[str, ...]
    regions: Mapping[str, str | None]

    def parent(self, fqn: str) -> str | None:
        """The boundary enclosing boundary ``fqn``."""
        return self.regions.get(fqn.rsplit(".", 1)[0]) if "." in fqn else self.regions.get("")


@attrs.frozen(kw_only=True)
class BuiltBoundaries:
    """Every boundary's plan, and what the parameter stage needs from them: the mesh dims on
    which each boundary's inputs arrive sharded, and the mesh dims a deferred bias's output is
    sharded on."""

    plans: tuple[BoundaryPlan, ...]
    sharded_inputs: Mapping[str, frozenset[str]]
    deferred: Mapping[str, frozenset[str]]


def find_boundaries(inp: ResolveInput, claims: ClaimTable) -> BoundaryTree:
    """The boundaries and every module's region.

    Raises:
        RecipeError: a layout field set on a module that is not a boundary.
    """
    is_boundary = {fqn for (fqn, field, _), c in claims.slots.items()
                   if field == "boundary" and c.value is True}
    regions: dict[str, str | None] = {}
    for m in inp.tree.modules:
        parent = m.fqn.rsplit(".", 1)[0] if "." in m.fqn else ("" if m.fqn else None)
        if m.fqn in is_boundary:
            regions[m.fqn] = m.fqn
        else:
            regions[m.fqn] = regions.get(parent) if parent is not None else None
    dropped = {fqn: c for (fqn, field, _), c in claims.slots.items()
               if field == "boundary" and c.value is False}
    for (fqn, field, _), c in claims.slots.items():
        if field in _BOUNDARY_ONLY and fqn not in is_boundary:
            off = dropped.get(fqn)
            if off is not None and off.rule is not c.rule:
                # a later rule (usually of a recipe that extends this one) turned the boundary
                # off: blame that rule, which is what the user just wrote
                raise RecipeError(
                    f"{off.rule.label()} sets boundary: false on {fqn!r}, but "
                    f"{c.rule.label()} ({c.rule.span()}) declares its {field}",
                    span=off.rule.span("boundary"), path=f"{off.rule.json_path}.boundary",
                    rule_index=off.rule.index,
                    hint="boundary: false drops only the layouts of its own rule's style; a "
                         "module another rule (or the base recipe) made a boundary stays one. "
                         "Keep the boundary, or copy the base's rules instead of extending it")
            raise RecipeError(
                f"{c.rule.label()} sets {field} on {fqn!r}, which is not a boundary",
                span=c.rule.span(field) if field in c.rule.explicit else c.rule.span("match"),
                path=f"{c.rule.json_path}.{field}", rule_index=c.rule.index,
                hint="add `boundary: true` (or use a style that declares one)")
    return BoundaryTree(names=tuple(m.fqn for m in inp.tree.modules if m.fqn in is_boundary),
                        regions=regions)


def build_boundaries(inp: ResolveInput, claims: ClaimTable, tree: BoundaryTree
                     ) -> BuiltBoundaries:
    """Every boundary's plan, in tree order (see the module docstring).

    Raises:
        RecipeError: any refusal of a boundary's layouts, wrappers or kernels.
    """
    members: dict[str | None, list[ModuleInfo]] = {}
    for m in inp.tree.modules:
        members.setdefault(tree.regions.get(m.fqn), []).append(m)
    plans: list[BoundaryPlan] = []
    sharded_inputs: dict[str, frozenset[str]] = {}
    deferred: dict[str, frozenset[str]] = {}
    for fqn in tree.names:
        plan, inputs = _build_one(inp, claims, tree, members.get(fqn, []), fqn)
        plans.append(plan)
        sharded_inputs[fqn] = frozenset(inputs)
        for name in plan.defer_bias:
            deferred[f"{fqn}.{name}"] = frozenset(
                d for d, q in plan.outputs[0].dst.dims if isinstance(q, Shard) and inp.size(d) > 1)
    return BuiltBoundaries(plans=tuple(plans), sharded_inputs=sharded_inputs, deferred=deferred)


def _sharded_dims(inp: ResolveInput, claims: ClaimTable, members: Sequence[ModuleInfo],
                  in_dst: Sequence[NamedPlacement]) -> tuple[set[str], set[str]]:
    """Mesh dims on which the boundary's own region (nested boundaries excluded) holds
    sharded parameters, and those on which its declared inputs arrive sharded."""
    params: set[str] = set()
    for m in members:
        for p in m.params:
            claim = claims.get(p.tied_to or p.fqn, "params")
            if claim is not None:
                params.update(d for d, q in claim.value.dims if isinstance(q, Shard)
                              and inp.size(d) > 1)
    inputs: set[str] = set()
    for placement in in_dst:
        inputs.update(d for d, q in placement.dims if isinstance(q, Shard) and inp.size(d) > 1)
    return params, inputs


def _build_one(inp: ResolveInput, claims: ClaimTable, tree: BoundaryTree,
               members: Sequence[ModuleInfo], fqn: str) -> tuple[BoundaryPlan, set[str]]:
    module = inp.tree.module(fqn)
    provenances: list[Provenance] = []
    for field, key, c in claims.of(fqn):
        if field != "params":
            what = f"{field}[{key}]" if key is not None else field
            provenances.extend(provenance_of(c, f"set {what} to", field))
    layouts = declared_layouts(inp, claims, fqn)
    inputs, outputs = layouts.inputs, layouts.outputs
    parent = tree.parent(fqn)
    depth, up = 0, parent
    while up is not None:
        depth += 1
        up = tree.parent(up) if up else None
    sharded_params, sharded_inputs = _sharded_dims(inp, claims, members,
                                                   [a.dst for a in inputs])
    no_grad = _no_grad(inp, claims, fqn, inputs)
    _check_declared_grads(layouts, no_grad)
    transitions = lower_boundary(inp, layouts, sharded_params, no_grad)
    deferred = _defer_bias(claims, module, outputs)
    local_region = claims.get(fqn, "local_region")
    if local_region is not None and local_region.value and not outputs:
        c = local_region
        raise RecipeError(f"local_region on {fqn!r} needs out_src: a local region's outputs "
                          f"must declare their placement", span=c.rule.span("local_region"),
                          path=f"{c.rule.json_path}.local_region", rule_index=c.rule.index)
    inner_out = list(layouts.inner_out)
    wrapper = claims.get(fqn, "inner_wrapper")
    if wrapper is not None:
        specs = check_wrappers(inp, fqn, wrapper)
        check_wrapper_needs(inp, claims, tree.names, fqn, wrapper, specs)
        if not inner_out:
            inner_out = declared_inner_out(inp, fqn, wrapper, specs, layouts.out_names,
                                           sharded_params | sharded_inputs)
            provenances.append(provenance(
                wrapper.rule, f"set inner_out_src to the wrappers' declaration: "
                f"{', '.join(f'{a.name} {a.src}' for a in inner_out)}",
                *(("inner_wrapper",) if "inner_wrapper" in wrapper.rule.explicit else ())))
    is_region = bool(local_region and local_region.value)
    experts = (expert_parallel(inp, claims, module, local_region, layouts)
               if local_region is not None and is_region else None)
    plan = BoundaryPlan(
        fqn=fqn, module_class=module.cls, depth=depth, parent=parent, inputs=inputs,
        outputs=outputs, out_names=layouts.out_names, defer_bias=deferred,
        inner_wrapper=wrapper.value if wrapper else (),
        inner_out_src=tuple(inner_out), local_region=is_region,
        no_grad=no_grad, vocab_parallel=vocab_parallel(inp, claims, module),
        expert_parallel=experts, transitions=transitions, provenance=tuple(provenances))
    return plan, sharded_inputs


def _check_declared_grads(layouts: DeclaredLayouts, no_grad: Sequence[str]) -> None:
    """An ``in_grad`` of a ``no_grad`` input says two contrary things."""
    for a in layouts.inputs:
        if a.grad is not None and a.name in no_grad:
            span, path, index = layouts.span("input", a.name, prefer="grad")
            raise RecipeError(
                f"in_grad declares how the gradient of input {a.name!r} of {layouts.fqn!r} comes "
                f"back, but no_grad says it carries none", span=span, path=path,
                rule_index=index, hint=f"drop {a.name!r} from one of in_grad and no_grad")


def _defer_bias(claims: ClaimTable, module: ModuleInfo,
                outputs: Sequence[ArgLayout]) -> tuple[str, ...]:
    defer = claims.get(module.fqn, "defer_bias")
    if defer is None or not defer.value or module.param("bias") is None:
        return ()
    first = outputs[0] if outputs else None
    if first is None or any(isinstance(q, Partial) for _, q in first.dst.dims):
        span, path = span_of(defer, "defer_bias")
        raise RecipeError(
            f"defer_bias on {module.fqn!r}: the bias is added after this boundary's reduction, "
            f"but its first output leaves {first.dst if first else 'undeclared'}; "
            f"reduce it here (out_dst replicate or shard) or do not defer the bias",
            span=span, path=path, rule_index=defer.rule.index)
    return ("bias",)


def _no_grad(inp: ResolveInput, claims: ClaimTable, fqn: str,
             inputs: Sequence[ArgLayout]) -> tuple[str, ...]:
    """The boundary's gradient-free inputs: declared ones (each must be a declared input,
    or there would be nothing to skip) and the integer inputs of torch's own modules."""
    claim: Claim | None = claims.get(fqn, "no_grad")
    declared = [a.name for a in inputs]
    names: list[str] = list(claim.value) if claim else []
    for i, name in enumerate(names):
        if name not in declared:
            assert claim is not None
            span = (claim.rule.span("no_grad", i) if "no_grad" in claim.rule.explicit
                    else claim.rule.span("match"))
            raise RecipeError(
                f"no_grad names input {name!r} of {fqn!r}, which has no declared layout"
                f"{did_you_mean(name, declared)}", span=span,
                path=f"{claim.rule.json_path}.no_grad[{i}]", rule_index=claim.rule.index,
                hint=f"declared inputs: {', '.join(declared) or 'none'}; no_grad only "
                     f"affects inputs named in in_src / in_dst")
    known = frozenset(inp.tree.module(fqn).index_inputs)
    names += [n for n in declared if n in known and n not in names]
    return tuple(names)

