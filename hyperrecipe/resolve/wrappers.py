"""A boundary's inner-wrapper chain, checked against its declarations.

Every candidate must be declared (:func:`hyperrecipe.wrappers.declared_wrapper`: a built-in's
registry entry, or a ``pkg.mod:factory``'s decorator) and find its mesh dims in the mesh. When
the rule gives no ``inner_out_src``, the candidates' own declarations supply it, provided they
agree and name every mesh dim the boundary is sharded on.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.errors import RecipeError
from hyperrecipe.plan import ArgLayout
from hyperrecipe.placement import REPLICATED
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import Claim, ResolveInput, span_of
from hyperrecipe.recipe.patterns import generalize_fqn as generalize
from hyperrecipe.resolve.layouts import output_name
from hyperrecipe.wrappers import WrapperDeclaration, declared_wrapper

__all__ = ["check_wrapper_needs", "check_wrappers", "declared_inner_out"]


def check_wrappers(inp: ResolveInput, fqn: str, claim: Claim) -> list[WrapperDeclaration]:
    """Every candidate of an inner-wrapper chain is declared and finds its mesh dims; returns
    their declarations.

    A built-in's declaration is registry data (nothing is imported); a custom reference's
    module is imported (nothing runs but the decorator), so a typo fails here, not on a
    cluster.

    Raises:
        RecipeError: a candidate that does not load or is not an inner wrapper, or that works
            over a mesh dim the mesh lacks.
    """
    specs: list[WrapperDeclaration] = []
    rule = claim.rule
    for i, ref in enumerate(claim.value):
        sub: tuple[str | int, ...] = ("inner_wrapper", i) if len(claim.value) > 1 else (
            "inner_wrapper",)
        span = rule.span(*sub) if "inner_wrapper" in rule.explicit else rule.span("match")
        path = f"{rule.json_path}.inner_wrapper"
        try:
            spec = declared_wrapper(ref)
        except Exception as exc:  # noqa: BLE001 - user code: report it at the recipe line
            raise RecipeError(f"inner wrapper of {fqn!r}: {exc}", span=span, path=path,
                              rule_index=rule.index) from None
        missing = [d for d in spec.mesh_dims if not inp.has(d)]
        if missing:
            raise RecipeError(
                f"inner wrapper {ref!r} of {fqn!r} works over mesh dim(s) "
                f"{', '.join(missing)}, which the mesh lacks", span=span, path=path,
                rule_index=rule.index,
                hint=f"mesh: {inp.mesh_text()}; declared by the wrapper: "
                     f"{list(spec.mesh_dims)}")
        specs.append(spec)
    return specs


def declared_inner_out(inp: ResolveInput, fqn: str, claim: Claim,
                       specs: Sequence[WrapperDeclaration], out_names: tuple[str, ...],
                       sharded: set[str]) -> list[ArgLayout]:
    """``inner_out_src`` from the chain's own declarations, when the recipe gives none.

    Every candidate must declare the same layout (whichever installs, validate mode wraps
    its results with the one plan entry), and the boundary must not be sharded on a mesh
    dim the declaration leaves out: a wrapper over ``cp`` cannot know that its inputs are
    also split over ``tp`` heads.

    Raises:
        RecipeError: a candidate declares no layout, candidates disagree, or the declaration
            leaves out a mesh dim the boundary is sharded on.
    """
    span, path = span_of(claim, "inner_wrapper")
    rule = claim.rule
    refs = list(claim.value)
    example = ("e.g. `inner_out_src: {0: {cp: shard(1)}}` for attention output "
               "[batch, seq, heads, head_dim] over a sequence split on cp, or "
               "`{0: replicate}`")
    layouts = {ref: spec.inner_out_src for ref, spec in zip(refs, specs, strict=True)}
    if not all(layouts.values()):
        missing = [r for r, lay in layouts.items() if not lay]
        raise RecipeError(
            f"inner wrapper {', '.join(map(repr, missing))} of {fqn!r} declares no output "
            f"layout, so the rule must give inner_out_src: the layout of the local tensors "
            f"the wrapper returns (validate mode wraps them with it)", span=span, path=path,
            rule_index=rule.index, hint=example)
    if len(set(layouts.values())) > 1:
        found = "; ".join(f"{r}: " + ", ".join(f"{k}: {v}" for k, v in lay)
                          for r, lay in layouts.items())
        raise RecipeError(
            f"the inner wrappers of {fqn!r} declare different output layouts ({found}); "
            f"give inner_out_src for the one plan entry whichever installs", span=span,
            path=path, rule_index=rule.index, hint=example)
    declared = layouts[refs[0]]
    named = {d for _, placement in declared for d in placement.mesh_dims}
    other = sorted(d for d in sharded if d not in named and inp.size(d) > 1)
    if other:
        layout = ", ".join(f"{k}: {v}" for k, v in declared)
        raise RecipeError(
            f"inner wrapper {refs[0]!r} of {fqn!r} declares its output layout over "
            f"{', '.join(sorted(named)) or 'no mesh dim'} ({layout}), but {fqn!r} is also "
            f"sharded over {', '.join(other)}; give inner_out_src naming every dim",
            span=span, path=path, rule_index=rule.index,
            hint="e.g. `inner_out_src: {attn_output: {tp: shard(2), cp: shard(1)}}` for "
                 "attention heads over tp and the sequence over cp")
    out: list[ArgLayout] = []
    for pos, placement in declared:
        placed = placement.canonical(inp.recipe.mesh)
        out.append(ArgLayout(name=output_name(pos, out_names), position=pos, src=placed,
                             dst=placed))
    return out


def check_wrapper_needs(inp: ResolveInput, claims: ClaimTable, boundaries: Sequence[str],
                        fqn: str, claim: Claim, specs: Sequence[WrapperDeclaration]) -> None:
    """The parameter placements and nested boundaries a wrapper declares it computes with
    (``WrapperDeclaration.params`` / ``.boundaries``) are what the recipe gives.

    A wrapper that reads a fused weight chunk by chunk (``mha_heads``: q, k and v rows of
    ``in_proj_weight``) computes silently wrong on any other shard of the same shape, and one
    that calls an output projection as a module needs that projection's boundary to reduce;
    so either is refused here, at the rule's line, naming the rule to write.

    Raises:
        RecipeError: a declared parameter is missing from the module or placed otherwise, or a
            declared submodule is not a boundary.
    """
    span, path = span_of(claim, "inner_wrapper")
    rule = claim.rule
    for ref, spec in zip(claim.value, specs, strict=True):
        for rel, required in spec.params:
            owner, _, name = f"{fqn}.{rel}".rpartition(".")
            info = inp.tree.get(owner)
            param = info.param(name) if info is not None else None
            if param is None:
                if name.endswith("bias") and info is not None:
                    continue  # a bias-free projection: nothing to place
                separate = inp.tree.module(fqn).param("q_proj_weight") is not None
                why = (" (its kdim or vdim differs from embed_dim, so q, k and v are separate "
                       "q_proj_weight, k_proj_weight and v_proj_weight)" if separate else "")
                raise RecipeError(
                    f"inner wrapper {ref!r} of {fqn!r} computes with parameter {rel!r}, which "
                    f"{fqn!r} ({inp.tree.module(fqn).cls}) does not have{why}", span=span,
                    path=path, rule_index=rule.index,
                    hint=(f"{spec.name} needs {', '.join(r for r, _ in spec.params)}; leave "
                          f"this module replicated (no rule on it) or rewrite it with "
                          f"nn.Linear projections"))
            placed = claims.get(param.tied_to or param.fqn, "params")
            actual = placed.value if placed is not None else REPLICATED
            dims = sorted(set(actual.mesh_dims) | set(required.mesh_dims))
            if any(actual.get(d) != required.get(d) for d in dims if inp.size(d) > 1):
                raise RecipeError(
                    f"inner wrapper {ref!r} of {fqn!r} computes with {rel} placed {required}, "
                    f"but the recipe places {param.fqn} {actual}", span=span, path=path,
                    rule_index=rule.index,
                    hint=("it reads the parameter chunk by chunk (each rank's whole heads), so "
                          "any other placement is wrong without a shape error; declare: "
                          + "; ".join(f"{r}: {p}" for r, p in spec.params)))
        for rel in spec.boundaries:
            if f"{fqn}.{rel}" not in boundaries:
                raise RecipeError(
                    f"inner wrapper {ref!r} of {fqn!r} calls {fqn}.{rel} as a module and needs "
                    f"it to be a boundary nested in {fqn!r}, which reduces its output",
                    span=span, path=path, rule_index=rule.index,
                    hint=f"add a rule `match: {generalize(fqn)}.{rel}` with `style: rowwise`")
