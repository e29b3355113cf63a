"""What the plan alone shows is wrong, before any step runs.

A parameter sharded over a mesh dim is a shard only to code that knows it: a boundary's
wrapper, or a module inside a boundary whose layouts say how its values arrive. A module
outside every boundary reads its parameters as whole tensors. A sharded parameter there (a
tied embedding sharded through its tie onto a module that is no boundary: the "forgot the
embedding" mistake) computes on its rank's rows as if they were the whole table, and in
production mode nothing fails when every token id happens to fall inside rank 0's share.
"""

from __future__ import annotations

from hyperrecipe.placement import Shard
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.verify.findings import recipe_error_at

__all__ = ["refuse_sharded_outside_boundaries"]


def _sharded_dims(p: ParamPlan) -> tuple[str, ...]:
    return tuple(d for d in p.placement.mesh_dims if isinstance(p.placement.get(d), Shard))


def refuse_sharded_outside_boundaries(plan: Plan) -> None:
    """Refuse a sharded parameter whose module lies outside every boundary.

    A tied parameter is one tensor read by two modules: each must be inside a boundary (the
    plan lists the tie's other end with ``tied_to``).

    Raises:
        RecipeError: at the rule that shards the parameter, naming the module and the fix.
    """
    by_fqn = {p.fqn: p for p in plan.params}
    for p in plan.params:
        owner = by_fqn.get(p.tied_to) if p.tied_to is not None else None
        source = owner if owner is not None else p
        dims = _sharded_dims(source)
        if not dims or p.boundary is not None:
            continue
        ties = sorted({q.fqn for q in plan.params if q.tied_to == source.fqn and q is not p}
                      | ({source.fqn} if owner is not None else set()))
        through = f", sharded through its tie to {', '.join(ties)}" if ties else ""
        problem = (f"{p.fqn} is sharded over {', '.join(dims)}{through}, but its module "
                   f"{p.module or '<root>'} lies outside every boundary: its forward reads this "
                   f"rank's {source.placement} shard as the whole tensor (no error in production "
                   f"mode, wrong values)")
        hint = (f"make {p.module or 'the module'} a boundary with the layout its shard needs "
                f"(an embedding: `style: vocab_parallel`), or untie/replicate it")
        raise recipe_error_at(plan, source.fqn, problem, hint=hint)
