"""Stage 4: integer module attributes divided by a mesh dim in production mode
(``head_counts: {num_heads: tp}``), checked for existence and divisibility."""

from __future__ import annotations

from hyperrecipe.errors import RecipeError, did_you_mean
from hyperrecipe.plan import HeadCount
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import ResolveInput, provenance_of

__all__ = ["divide_head_counts"]


def divide_head_counts(inp: ResolveInput, claims: ClaimTable) -> tuple[HeadCount, ...]:
    """Every claimed head count, in module order then attribute name.

    Raises:
        RecipeError: the module has no such integer attribute, the mesh lacks the dim, or the
            value is not divisible by the dim's size.
    """
    out: list[HeadCount] = []
    slots = sorted(((fqn, key), c) for (fqn, field, key), c in claims.slots.items()
                   if field == "head_counts")
    for (fqn, attr), claim in sorted(slots, key=lambda s: (inp.order[s[0][0]], s[0][1])):
        module = inp.tree.module(fqn)
        dim = claim.value
        value = module.int_attr(attr)
        rule = claim.rule
        span = rule.span("head_counts", attr, key=True)
        path = f"{rule.json_path}.head_counts.{attr}"
        if value is None:
            names = module.int_attr_names(attr)
            raise RecipeError(
                f"module {fqn!r} has no integer attribute {attr!r}{did_you_mean(attr, names)}",
                span=span, path=path, rule_index=rule.index,
                hint=f"its integer attributes: [{', '.join(names)}]")
        if not inp.has(dim):
            raise RecipeError(f"head count {attr!r} is divided by mesh dim {dim!r}, which the "
                              f"mesh lacks", span=span, path=path, rule_index=rule.index,
                              hint=f"mesh: {inp.mesh_text()}")
        n = inp.size(dim)
        if value % n:
            raise RecipeError(
                f"head count {fqn}.{attr} = {value} is not divisible by mesh dim {dim} of "
                f"size {n}", span=span, path=path, rule_index=rule.index,
                hint="every rank must hold whole heads")
        out.append(HeadCount(module=fqn, attr=attr, mesh_dim=dim, global_value=value,
                             local_value=value // n,
                             provenance=provenance_of(claim, f"divide {attr} by",
                                                      "head_counts")[-1]))
    return tuple(out)
