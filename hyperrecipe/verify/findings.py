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

import os
from pathlib import Path

import attrs

from hyperrecipe.errors import HyperrecipeError, RecipeError, SourceSpan
from hyperrecipe.plan import Plan, Provenance
from hyperrecipe.verify.trace import PartialReduced, Reshape

__all__ = ["Failure", "data_dependent", "partial_reduced_error", "recipe_error_at",
           "recipe_error_for", "reshape_error"]

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
        if failure.modules and _mha_out_proj(plan, failure.modules[0]):
            hint = (f"{failure.modules[0]} is a torch.nn.MultiheadAttention: its forward uses "
                    f"out_proj.weight without calling out_proj, so a rule on out_proj alone "
                    f"cannot shard it; give the attention `style: multihead_attention` and "
                    f"keep out_proj `style: rowwise` (docs/adapters.md#torchnnmultiheadattention"
                    f"-by-heads), or leave both replicated")
    return recipe_error_at(plan, module, problem, hint=hint)


_MHA_OUT_PROJ = "torch.nn.modules.linear.NonDynamicallyQuantizableLinear"
"""The class of ``nn.MultiheadAttention``'s ``out_proj`` (torch uses it nowhere else)."""


def _mha_out_proj(plan: Plan, fqn: str) -> bool:
    """Whether ``fqn`` is an ``nn.MultiheadAttention`` whose ``out_proj`` is a boundary of the
    plan while the attention itself runs no inner wrapper (its forward would never call it)."""
    classes = {b.fqn: b for b in plan.boundaries}
    inner = classes.get(f"{fqn}.out_proj")
    outer = classes.get(fqn)
    return (inner is not None and inner.module_class == _MHA_OUT_PROJ
            and (outer is None or not outer.inner_wrapper))


def _site(site: str) -> str:
    """``file:line``: an installed package's file from its package (``transformers/models/
    ...``), another relative to the working directory where it lies below it."""
    filename, _, line = site.rpartition(":")
    parts = Path(filename).parts
    if "site-packages" in parts:
        below = parts[len(parts) - parts[::-1].index("site-packages"):]
        return f"{Path(*below)}:{line}"
    try:
        shown = os.path.relpath(filename)
    except ValueError:  # another drive
        shown = filename
    return f"{shown if not shown.startswith('..') else filename}:{line}"


def reshape_error(plan: Plan, made: Reshape, shard: Reshape) -> RecipeError:
    """Production split a shard where the whole splits otherwise
    (:mod:`~hyperrecipe.verify.trace`), at the boundary rule around the module."""
    problem = (f"verification: production mode splits a shard otherwise than the whole in "
               f"{made.module or 'the model'} ({_site(made.site)}): it reshapes this rank's "
               f"{list(made.local_in)} into {list(made.local_out)}, where validate mode's "
               f"DTensor keeps this rank's shard of the whole as {list(shard.local_out)}; each "
               f"rank would compute parts of every head instead of its own heads, with no "
               f"error, and train wrong")
    hint = ("the module splits a sharded width with a count that is not divided by the plan (a "
            "head count fixed in the module: einops `h=`, `view(B, T, self.n_head, -1)`): "
            "divide it in production with `head_counts: {ATTR: tp}` on the module's rule where "
            "it is an integer attribute (`config.NAME` for a config field). A layer that fixes "
            "it at build (einops' `Rearrange(..., h=8)`) has nothing the plan can divide: split "
            "the heads with a count kept on the module (`rearrange(t, 'b n (h d) -> b h n d', "
            "h=self.heads)`) and divide that, or gather the module's input "
            "(`in_dst: replicate`) and compute it whole (docs/verification.md)")
    return recipe_error_at(plan, made.module or None, problem, hint=hint)


def partial_reduced_error(plan: Plan, reduced: PartialReduced) -> RecipeError:
    """Validate mode reduced a partial value inside the model's code, which production does not
    (:mod:`~hyperrecipe.verify.trace`), at the rule that placed what the module computes with."""
    problem = (f"verification: {reduced.module or 'the model'} ({_site(reduced.site)}) "
               f"reduces over a dim the plan shards over {reduced.mesh_dim}: validate mode's "
               f"DTensor sums the ranks' partial values before `{reduced.op}`, production mode "
               f"has no collective inside the module and computes with this rank's part of the "
               f"sum, with no error, and trains wrong")
    hint = ("compute the reduction on the whole: keep what it reduces over whole (replicate "
            "the module's parameters, or make the module a boundary that gathers its input, "
            "`in_dst: {x: replicate}`; docs/cookbook.md#qk-norms-over-all-heads-olmo-2), or "
            "shard only dims the module does not reduce over")
    return recipe_error_at(plan, reduced.module or None, problem, hint=hint)
