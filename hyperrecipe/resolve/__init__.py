"""Resolving recipes against models: the pure function from (Recipe, ModelTree, mesh) to Plan.

What lives here: rule matching and merging, every check that needs the model or the mesh
(coverage, uniqueness, divisibility, head counts, mesh dims), and the lowering of placement
transitions to collectives (``lowering``). What does not: process groups, real tensors, or any
mutation of a model; resolving imports torch not at all.
"""

from hyperrecipe.resolve.lowering import canonical_grad, lower_transition
from hyperrecipe.resolve.resolver import resolve_recipe

__all__ = ["canonical_grad", "lower_transition", "resolve_recipe"]
