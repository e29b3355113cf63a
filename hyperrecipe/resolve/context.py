"""What every resolve stage reads: the inputs (recipe, model tree, mesh) and how a decision
points back at the recipe line that made it.

Nothing here decides anything. :class:`ResolveInput` is the frozen bundle of the three inputs
with the mesh checked against the recipe; :class:`Claim` is one rule's say over one slot of one
module; :func:`provenance_of` and :func:`span_of` turn a claim into the provenance a plan stores
and the location a :class:`~hyperrecipe.errors.RecipeError` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hyperrecipe.errors import RecipeError, SourceSpan
from hyperrecipe.model_tree import ModelTree
from hyperrecipe.plan import MeshDim, Provenance
from hyperrecipe.recipe.schema import Recipe, Rule

__all__ = ["MAX_MESH_SIZE", "Claim", "ResolveInput", "mesh_text", "provenance", "provenance_of",
           "span_of"]

MAX_MESH_SIZE = 999_999_999
"""Largest mesh dim size (9 digits, as ``--mesh``, ``shard(D)`` and chunk sizes): a plan's
integers stay far below 2^63, so every plan compile writes, ``load_plan`` reads back."""


@attrs.frozen(kw_only=True)
class ResolveInput:
    """The resolver's inputs, the mesh checked against the recipe (:meth:`checked`).

    ``mesh_shape`` is the mesh as given; ``mesh`` the plan's dims in the recipe's order (only
    those given); ``order`` each module's index in ``named_modules`` order.
    """

    recipe: Recipe
    tree: ModelTree
    mesh_shape: Mapping[str, int]
    mesh: tuple[MeshDim, ...]
    order: Mapping[str, int]

    @classmethod
    def checked(cls, recipe: Recipe, tree: ModelTree, mesh_shape: Mapping[str, int]
                ) -> ResolveInput:
        """The inputs of one resolve.

        Raises:
            RecipeError: a mesh dim the recipe does not declare, or a size that is not an
                integer >= 1.
        """
        if not isinstance(mesh_shape, Mapping):
            raise RecipeError(
                f"the mesh shape must be a mapping of mesh dim name to size, e.g. {{'tp': 2}}; "
                f"found {type(mesh_shape).__name__} {str(mesh_shape)[:60]!r}",
                span=recipe.span("mesh"), path="$.mesh")
        given = dict(mesh_shape)
        for name, size in given.items():
            if name not in recipe.mesh:
                raise RecipeError(
                    f"mesh dim {name!r} is not declared by recipe {recipe.name!r}",
                    span=recipe.span("mesh"), path="$.mesh",
                    hint=f"declared: [{', '.join(recipe.mesh)}]; mesh: {mesh_text(given)}")
            if (not isinstance(size, int) or isinstance(size, bool) or not
                    1 <= size <= MAX_MESH_SIZE):
                raise RecipeError(f"mesh dim {name!r} has size {str(size)[:40]}; sizes are "
                                  f"integers from 1 to {MAX_MESH_SIZE}",
                                  span=recipe.span("mesh"), path="$.mesh")
        mesh = tuple(MeshDim(name=d, size=given[d]) for d in recipe.mesh if d in given)
        return cls(recipe=recipe, tree=tree, mesh_shape=given, mesh=mesh,
                   order={m.fqn: i for i, m in enumerate(tree.modules)})

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.mesh)

    def size(self, dim: str) -> int:
        """A mesh dim's size (1 for a recipe dim the mesh does not give)."""
        return self.mesh_shape.get(dim, 1)

    def has(self, dim: str) -> bool:
        return dim in self.mesh_shape

    def mesh_text(self) -> str:
        return mesh_text(self.mesh_shape)


def mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items()) or "(empty)"


@attrs.frozen(kw_only=True)
class Claim:
    """One rule's value for one slot (module, field, key), and the claims it overrode (a
    recipe that ``extends`` another refines its base's claims)."""

    value: Any
    rule: Rule
    via: str
    through_alias: bool = False
    overridden: tuple[Claim, ...] = ()


def provenance(rule: Rule, reason: str, *sub: str | int) -> Provenance:
    """Provenance pointing at ``rules[i].<sub...>`` (the rule itself when ``sub`` is empty)."""
    span = rule.span(*sub) if sub else rule.span()
    return Provenance(file=span.path, line=span.line, column=span.column, rule_index=rule.index,
                      reason=reason)


def provenance_of(claim: Claim, what: str, *sub: str | int) -> tuple[Provenance, ...]:
    """Provenance of a claim and of the claims it overrode, pointing at the field when the rule
    wrote it itself (at the rule's `match` when it came from a style)."""
    def at(c: Claim) -> tuple[str | int, ...]:
        return sub if sub and sub[0] in c.rule.explicit else ("match",)

    out = [provenance(c.rule, f"{what} {_fmt(c.value)} ({c.via}); overridden by rule "
                              f"{claim.rule.index} of {claim.rule.file}", *at(c))
           for c in claim.overridden]
    out.append(provenance(claim.rule, f"{what} {_fmt(claim.value)} ({claim.via})", *at(claim)))
    return tuple(out)


def span_of(claim: Claim, field: str, *sub: str | int, key: bool = False
            ) -> tuple[SourceSpan, str]:
    """Where a claim's ``field`` (``<sub...>``) is written, and its JSON path: the field when
    the rule wrote it, the rule's ``match`` when a style did."""
    rule = claim.rule
    span = rule.span(field, *sub, key=key) if field in rule.explicit else rule.span("match")
    path = f"{rule.json_path}.{field}" + "".join(f".{s}" for s in sub)
    return span, path


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
