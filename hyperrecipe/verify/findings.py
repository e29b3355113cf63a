"""A failed verification step, turned into an error at the recipe line responsible.

The runtime's own errors name what they concern first (``model.layers.0.self_attn.k_norm.weight:
its gradient comes back partial ...``; a ``PlacementMismatchError`` or a validate-mode refusal
carries its module as ``fqn``). A raw torch error from production mode (a shape that does not
fit the shards) carries nothing, so the step records the module that was running. Either way
the name is mapped to the plan's provenance: a parameter's placing rule, else the innermost
boundary around the module, else the recipe's first rule.

Fake tensors have no values: an op whose output shape depends on them (``nonzero``, ``.item()``,
a routing table read back to the host) cannot run. That is no finding about the recipe; the
step stops there and the plan notes what was left to ``check``.
"""

from __future__ import annotations

import attrs

from hyperrecipe.errors import HyperrecipeError, RecipeError, SourceSpan
from hyperrecipe.plan import Plan, Provenance

__all__ = ["Failure", "data_dependent", "recipe_error_at", "recipe_error_for"]

_NO_VALUES = (
    "cannot be called on meta tensors",
    "Cannot copy out of meta tensor",
    "data-dependent",
    "DataDependentOutputException",
    "_local_scalar_dense",
    "aten::nonzero",
    "aten.nonzero",
    "aten::_unique",
    "aten::bincount",
    "aten::masked_select",
    "meta tensors have no data",
    "is_nonzero",
)
"""Words of the errors an op raises on the meta device because it needs values."""


_DEPENDS_ON_DATA = "its output's shape depends on the data"
"""How validate mode's refusal of a data-dependent op says so (``validate_scope``)."""


@attrs.frozen(kw_only=True)
class Failure:
    """How one mode's step failed: the exception's type and text, the module that was running
    (innermost first; empty in backward), and the phase."""

    mode: str
    phase: str
    error_type: str
    message: str
    modules: tuple[str, ...]
    named: str | None
    """What the error itself names first (a parameter or module of the plan), if anything."""
    project_error: bool
    """Raised by hyperrecipe on purpose (a refusal), not by torch or the model."""
    error: BaseException | None = attrs.field(default=None, eq=False, repr=False)
    """The exception itself: ``apply``'s own refusals (ranks that disagree, an adapter that
    cannot be imported) are raised as they are, not as findings about the step."""


def data_dependent(failure: Failure) -> bool:
    """The op needed values the meta device does not have, or its output's shape depends on
    them, which no placement describes (validate mode refuses ``nonzero`` on DTensors, which
    production runs on local tensors): no finding about the recipe."""
    if failure.project_error:
        return (failure.error_type == "ValidateUnsupportedError"
                and _DEPENDS_ON_DATA in failure.message)
    return any(w in failure.message for w in _NO_VALUES)


def named_in(exc: BaseException, plan: Plan | None, modules: set[str]) -> str | None:
    """The plan's parameter or the model's module an error names first (``fqn`` attribute, or
    the text before its first ``": "``)."""
    fqn = getattr(exc, "fqn", None)
    if isinstance(fqn, str) and fqn:
        return fqn
    head = str(exc).split(": ", 1)[0].strip()
    params = {p.fqn for p in plan.params} if plan is not None else set()
    return head if head in params or head in modules else None


def is_project_error(exc: BaseException) -> bool:
    return isinstance(exc, HyperrecipeError)


def _provenance(plan: Plan, fqn: str) -> Provenance | None:
    """The recipe position that decided ``fqn``: a parameter's placing rule; for a parameter
    that only the recipe-wide default placed, and for a module, the innermost boundary that is
    or encloses it (the rule a fix amends), else the first rule placing a parameter of the
    module or of a module inside it (``nn.MultiheadAttention`` computes with its
    ``out_proj``'s weight), going outwards, else the recipe-wide default."""
    by_param = {p.fqn: p for p in plan.params}
    chain: list[str] = []
    if fqn in by_param:
        p = by_param[fqn]
        ruled = [v for v in p.provenance if v.rule_index >= 0]
        if ruled:
            return ruled[-1]
        # placed by the recipe-wide default: the boundary it computes in is the rule to amend
        chain = [p.boundary if p.boundary is not None else p.module]
    else:
        chain = [fqn]
    boundaries = {b.fqn: b for b in plan.boundaries}
    module = chain[0]
    while True:
        if module in boundaries and boundaries[module].provenance:
            return boundaries[module].provenance[-1]
        inside = [p for p in plan.params if p.module == module
                  or p.module.startswith(f"{module}.") or not module]
        ruled = [v for p in inside for v in p.provenance if v.rule_index >= 0]
        if ruled:  # the rule that placed something the module computes with
            return ruled[0]
        if not module:
            break
        module = module.rpartition(".")[0]
    placed = by_param[fqn].provenance if fqn in by_param else ()
    return placed[-1] if placed else None


def _span(plan: Plan, fqn: str | None) -> tuple[SourceSpan | None, str, int | None]:
    where = _provenance(plan, fqn) if fqn is not None else None
    rule = next((r for r in plan.rules if where is not None and r.file == where.file
                 and r.index == where.rule_index), None)
    if rule is not None:  # the rule's own line (its `match:`), not the field's
        return (SourceSpan(path=rule.file, line=rule.line, column=max(rule.column, 1)),
                f"$.rules[{rule.index}]", _own_index(plan, rule.file, rule.index))
    if where is not None and where.file and where.line > 0:
        path = f"$.rules[{where.rule_index}]" if where.rule_index >= 0 else "$"
        return (SourceSpan(path=where.file, line=where.line, column=max(where.column, 1)), path,
                None)
    active = [r for r in plan.rules if r.active]
    if active:
        first = active[0]
        return (SourceSpan(path=first.file, line=first.line, column=max(first.column, 1)),
                f"$.rules[{first.index}]", _own_index(plan, first.file, first.index))
    return None, "$", None


def _own_index(plan: Plan, file: str, index: int) -> int | None:
    """A rule's index in the recipe's own ``rules`` (``RecipeError.rule_index``), when the
    rule is the recipe's own rather than one it extends."""
    own = plan.recipe_files[-1] if plan.recipe_files else None
    return index if own is not None and file == own else None


def recipe_error_at(plan: Plan, fqn: str | None, problem: str, *, hint: str = "") -> RecipeError:
    """A :class:`RecipeError` located at the recipe position that decided ``fqn``."""
    span, path, index = _span(plan, fqn)
    return RecipeError(problem, span=span, path=path, rule_index=index, hint=hint)


_FIXES = {
    "PlacementMismatchError": "declare the layout the module really produces, or change the "
                              "placements that make it",
    "ValidateShardingError": "",
    "ValidateUnsupportedError": "",
    "PlanMismatchError": "",
}


def recipe_error_for(plan: Plan, failure: Failure) -> RecipeError:
    """The finding of one failed step, at the recipe line responsible."""
    module = failure.named or (failure.modules[0] if failure.modules else None)
    where = (f" in {failure.modules[0]}" if failure.modules and failure.modules[0] != module
             else "")
    if failure.project_error:
        problem = (f"verification ({failure.mode} mode, one training step on fake tensors) "
                   f"refused the plan{where}: {failure.message}")
        hint = _FIXES.get(failure.error_type, "")
    else:
        running = (f"while {failure.modules[0]} ran its {failure.phase}" if failure.modules
                   else f"in the {failure.phase}")
        problem = (f"verification: {failure.mode} mode cannot run one training step of this "
                   f"plan: {failure.error_type} {running}: {failure.message}")
        hint = ("the module computes a shape the shards do not fit: a width or head count read "
                "off the input or fixed in a layer (einops `h=`), not divided by the plan; "
                "gather its input (`in_dst: replicate`) or compute it whole, or shard what it "
                "reads (docs/cookbook.md)")
    return recipe_error_at(plan, module, problem, hint=hint)
