"""The recipe's data model: what a loaded, validated recipe *is*.

These attrs classes are the output of :mod:`hyperrecipe.recipe.validate` and the input of the
resolver. They hold parsed placements, not strings, and every rule keeps the file and path it
came from so any later error or plan decision can point back at the recipe line.
"""

from __future__ import annotations

from typing import Literal

import attrs

from hyperrecipe.errors import SourceSpan
from hyperrecipe.placement import NamedPlacement
from hyperrecipe.recipe.pipeline import PipelineSpec
from hyperrecipe.recipe.source import PathKey, Positions

__all__ = [
    "AdapterSpec",
    "Condition",
    "Layout",
    "LayoutKey",
    "Recipe",
    "Rule",
    "RuleFields",
    "StyleDef",
    "RULE_FIELD_NAMES",
    "MAPPING_FIELDS",
]

LayoutKey = str | int
"""An argument or output: its name, or its position (0 = first positional argument / output)."""

Layout = tuple[tuple[LayoutKey, NamedPlacement], ...]
ConditionOp = Literal[">", ">=", "<", "<=", "==", "!="]


@attrs.frozen(kw_only=True)
class Condition:
    """``when: {cp: ">1"}``: the rule is active only if the mesh dim's size satisfies this."""

    mesh_dim: str
    op: ConditionOp
    value: int

    def holds(self, size: int) -> bool:
        return {
            ">": size > self.value,
            ">=": size >= self.value,
            "<": size < self.value,
            "<=": size <= self.value,
            "==": size == self.value,
            "!=": size != self.value,
        }[self.op]

    def __str__(self) -> str:
        return f"{self.mesh_dim}{self.op}{self.value}"


@attrs.frozen(kw_only=True)
class RuleFields:
    """The decisions a rule (or style) makes; ``None`` means "this rule says nothing here"."""

    params: tuple[tuple[str, NamedPlacement], ...] | None = None
    boundary: bool | None = None
    in_src: Layout | None = None
    in_dst: Layout | None = None
    out_src: Layout | None = None
    out_dst: Layout | None = None
    out_names: tuple[str, ...] | None = None
    defer_bias: bool | None = None
    head_counts: tuple[tuple[str, str], ...] | None = None
    reduce_grads: tuple[tuple[str, str], ...] | None = None
    inner_wrapper: tuple[str, ...] | None = None
    inner_out_src: Layout | None = None
    local_region: bool | None = None
    no_grad: tuple[str, ...] | None = None
    loss_parallel: bool | None = None
    in_grad: Layout | None = None
    out_grad: Layout | None = None

    def set_fields(self) -> tuple[str, ...]:
        return tuple(f for f in RULE_FIELD_NAMES if getattr(self, f) is not None)

    def over(self, base: RuleFields) -> RuleFields:
        """These fields layered over ``base``: mappings merge key by key, this side winning."""
        changes: dict[str, object] = {}
        for name in RULE_FIELD_NAMES:
            mine = getattr(self, name)
            theirs = getattr(base, name)
            if mine is None:
                changes[name] = theirs
            elif name in MAPPING_FIELDS and theirs is not None:
                merged = dict(theirs)
                merged.update(dict(mine))
                changes[name] = tuple(merged.items())
            else:
                changes[name] = mine
        return RuleFields(**changes)  # type: ignore[arg-type]


RULE_FIELD_NAMES: tuple[str, ...] = tuple(a.name for a in attrs.fields(RuleFields))
MAPPING_FIELDS = frozenset({"params", "in_src", "in_dst", "out_src", "out_dst", "head_counts",
                            "reduce_grads",
                            "inner_out_src", "in_grad", "out_grad"})


@attrs.frozen(kw_only=True)
class StyleDef:
    """A named bundle of rule fields: built in (``colwise``) or a recipe's own macro."""

    name: str
    fields: RuleFields
    doc: str = ""
    builtin: bool = False
    file: str = "<builtin>"
    line: int = 0


@attrs.frozen(kw_only=True)
class AdapterSpec:
    """A third-party method or function adapter (``adapters:``), carried into the plan.

    ``target`` is ``pkg.mod:Class.method`` (a method, adapted at class level) or
    ``pkg.mod:function`` (a module-level function, replaced only while the modules matching
    ``within``, a module FQN pattern, run). ``out_src`` (``marshal`` only) declares the
    placements of the tensor outputs; without it they take those of the first DTensor argument.
    """

    target: str
    mode: Literal["wrap", "marshal"]
    file: str
    line: int
    column: int
    out_src: NamedPlacement | None = None
    within: str | None = None


@attrs.frozen(kw_only=True)
class Rule:
    """One entry of ``rules``, with its style already expanded into :attr:`fields`.

    ``layer`` is the rule's depth in the ``extends`` chain (0 = the most basic recipe); two rules
    of the same layer may not decide the same thing, a deeper layer refines a shallower one.
    """

    file: str
    index: int
    layer: int
    match: str
    when: tuple[Condition, ...]
    style: str | None
    style_chain: tuple[str, ...]
    fields: RuleFields
    explicit: frozenset[str]
    explicit_params: frozenset[str] = frozenset()
    note: str = ""
    positions: Positions = attrs.field(eq=False, repr=False)
    path: PathKey = attrs.field(eq=False, repr=False)

    def span(self, *sub: str | int, key: bool = False) -> SourceSpan:
        """Where ``rules[i].<sub...>`` is written (the rule itself when ``sub`` is empty)."""
        return self.positions.span((*self.path, *sub), key=key)

    @property
    def json_path(self) -> str:
        return f"$.rules[{self.index}]"

    def label(self) -> str:
        return f"rule {self.index} (match {self.match!r})"

    def active(self, mesh: dict[str, int]) -> bool:
        return all(c.holds(mesh.get(c.mesh_dim, 1)) for c in self.when)


@attrs.frozen(kw_only=True)
class Recipe:
    """A loaded recipe with its ``extends`` chain flattened: base rules first."""

    name: str
    version: int
    mesh: tuple[str, ...]
    file: str
    files: tuple[str, ...]
    styles: tuple[StyleDef, ...]
    rules: tuple[Rule, ...]
    unclaimed: Literal["replicate", "error"]
    adapters: tuple[AdapterSpec, ...]
    digest: str
    description: str = ""
    pipeline: PipelineSpec | None = None
    """The ``pipeline`` section (this file's, else the one it extends)."""
    positions: Positions = attrs.field(eq=False, repr=False)

    def span(self, *path: str | int, key: bool = False) -> SourceSpan:
        return self.positions.span(tuple(path), key=key)
