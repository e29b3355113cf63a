"""``resolve_recipe``: (Recipe, ModelTree, mesh shape) → Plan, a pure function.

An orchestrator that only orders the stages; each stage is a function over the frozen output of
the ones before it:

1. :meth:`ResolveInput.checked <hyperrecipe.resolve.context.ResolveInput.checked>`: the mesh
   against the recipe.
2. :func:`~hyperrecipe.resolve.claims.match_rules`: every active rule's claims, per (module,
   field, key) (:class:`~hyperrecipe.resolve.claims.ClaimTable`).
3. :func:`~hyperrecipe.resolve.boundaries.find_boundaries`: the boundaries and each module's
   region; :func:`~hyperrecipe.resolve.boundaries.build_boundaries`: each boundary's plan
   (layouts, nesting, transitions, wrappers, local kernels).
4. :func:`~hyperrecipe.resolve.params.settle_params`: every parameter's plan;
   :func:`~hyperrecipe.resolve.head_counts.check_whole_heads`: no rank holds part of a head;
   :func:`~hyperrecipe.resolve.grad_buckets.plan_grad_buckets`: their gradient reductions,
   bucketed.
5. :func:`~hyperrecipe.resolve.head_counts.divide_head_counts`,
   :func:`~hyperrecipe.resolve.loss.plan_loss_parallel` (the loss on vocab shards),
   :func:`~hyperrecipe.resolve.manifest.list_collectives`,
   :func:`~hyperrecipe.resolve.adapters.plan_adapters`,
   :func:`~hyperrecipe.resolve.pipeline.plan_pipeline` (the pipeline stages and schedule).

Same inputs give the same plan, byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping

from hyperrecipe.model_tree import ModelTree
from hyperrecipe.plan import PLAN_FORMAT, Plan, compute_fingerprint
from hyperrecipe.recipe.schema import Recipe
from hyperrecipe.resolve.adapters import plan_adapters
from hyperrecipe.resolve.boundaries import build_boundaries, find_boundaries
from hyperrecipe.resolve.claims import match_rules
from hyperrecipe.resolve.context import ResolveInput
from hyperrecipe.resolve.grad_buckets import plan_grad_buckets
from hyperrecipe.resolve.head_counts import check_whole_heads, divide_head_counts
from hyperrecipe.resolve.loss import loss_manifest, plan_loss_parallel
from hyperrecipe.resolve.manifest import list_collectives
from hyperrecipe.resolve.params import settle_params
from hyperrecipe.resolve.pipeline import plan_pipeline

__all__ = ["resolve_recipe"]


def resolve_recipe(recipe: Recipe, tree: ModelTree, mesh_shape: Mapping[str, int]) -> Plan:
    """Resolve a recipe against a model structure and mesh shape.

    Args:
        recipe: from :func:`hyperrecipe.recipe.load_recipe`.
        tree: from :func:`hyperrecipe.model_tree.snapshot` (a model built on the meta device).
        mesh_shape: mesh dim name → size, e.g. ``{"dp": 2, "tp": 4}``; recipe dims not given
            have size 1 for ``when`` conditions and may not hold placements.

    Returns:
        The frozen plan. Pure: same inputs, same plan (and the same JSON bytes).

    Raises:
        RecipeError: any refusal, naming file:line:col, the rule and what was expected.
    """
    inp = ResolveInput.checked(recipe, tree, mesh_shape)
    claims = match_rules(inp)
    regions = find_boundaries(inp, claims)
    boundaries = build_boundaries(inp, claims, regions)
    params = settle_params(inp, claims, regions, boundaries)
    check_whole_heads(inp, claims, params)
    grad_buckets = plan_grad_buckets(params)
    loss = plan_loss_parallel(inp, claims, boundaries.plans)
    manifest = (list_collectives(inp, boundaries.plans, params, grad_buckets)
                + loss_manifest(loss))
    adapters = plan_adapters(recipe, tree)
    head_counts = divide_head_counts(inp, claims)
    pipeline = plan_pipeline(inp, params, (b.fqn for b in boundaries.plans))
    model_digest = tree.digest()
    return Plan(
        format=PLAN_FORMAT, recipe=recipe.name, recipe_files=recipe.files,
        recipe_digest=recipe.digest, model_digest=model_digest, mesh=inp.mesh,
        fingerprint=compute_fingerprint(recipe.digest, model_digest, inp.mesh),
        rules=claims.rules, params=params, boundaries=boundaries.plans,
        head_counts=head_counts, manifest=manifest, adapters=adapters, loss_parallel=loss,
        grad_buckets=grad_buckets, pipeline=pipeline,
    ).sealed()
