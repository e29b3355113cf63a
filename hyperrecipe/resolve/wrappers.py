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
from hyperrecipe.resolve.context import Claim, ResolveInput, span_of
from hyperrecipe.resolve.layouts import output_name
from hyperrecipe.wrappers import WrapperDeclaration, declared_wrapper

__all__ = ["check_wrappers", "declared_inner_out"]


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
