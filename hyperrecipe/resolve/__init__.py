"""Resolving recipes against models: the pure function from (Recipe, ModelTree, mesh) to Plan.

What lives here, one stage per module, each a function over the frozen output of the ones
before (``resolver`` only orders them): ``context`` (the checked inputs, claims, provenance),
``claims`` (rule matching and merging into a claim table), ``boundaries`` (regions and each
boundary's plan) with ``layouts`` (declared layouts), ``transitions`` and ``lowering``
(placement transitions to collectives), ``wrappers`` (inner-wrapper chains against their
declarations) and ``kernels`` (the vocab-parallel lookup and the expert-parallel kernel),
``params`` (placements, divisibility, local shapes, DTensor placements, gradient reductions),
``grad_buckets`` (those reductions grouped into buckets, one collective each),
``head_counts``, ``loss`` (the loss on vocab shards), ``manifest`` (the expected
collectives), ``adapters`` and ``pipeline`` (the pipeline stages, their owners and schedule). Every decision the
runtime needs is made here and recorded in the plan, and every refusal is a
:class:`~hyperrecipe.errors.RecipeError` at a recipe line.

What does not: process groups, real tensors, any mutation of a model, or any module of
:mod:`hyperrecipe.runtime` (built-in wrappers are read from the torch-free registry in
:mod:`hyperrecipe.wrappers`); resolving imports torch not at all.
"""

from hyperrecipe.resolve.lowering import canonical_grad, lower_transition
from hyperrecipe.resolve.resolver import resolve_recipe

__all__ = ["canonical_grad", "lower_transition", "resolve_recipe"]
