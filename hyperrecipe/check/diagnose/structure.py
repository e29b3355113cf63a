"""Patterns in the plan and the model tree behind a failure: head counts left undivided, heads
cut between ranks, whole parameters on shards, column-/row-wise layers swapped."""

from __future__ import annotations

import re
from collections.abc import Sequence

from hyperrecipe.check.diagnose.causes import (
    COLWISE_ROWWISE_SWAPPED,
    HEADS_NOT_WHOLE,
    WHOLE_PARAM_ON_SHARD,
    DiagnosisContext,
    Suggestion,
    within,
)
from hyperrecipe.check.record import Failure
from hyperrecipe.placement import Shard
from hyperrecipe.resolve.head_counts import HEAD_SIZE_ATTRS
from hyperrecipe.runtime import runs_on_local_tensors
from hyperrecipe.runtime import as_mode

__all__ = ["heads_cut", "swapped_from_placement", "swapped_from_shapes", "undivided_heads",
           "whole_param_on_shard"]




def _looks_like_head_count(attr: str) -> bool:
    name = attr.lower()
    return name == "split_size" or ("head" in name and "dim" not in name and "size" not in name)


def _forward_uses(cls_path: str) -> set[str] | None:
    """The ``self.<name>`` attributes the class's forward mentions; ``None`` without source.

    Looks the class up among imported modules only (the model was built, so it is imported)."""
    import inspect
    import sys

    mod_name, _, qualname = cls_path.rpartition(".")
    target: object = sys.modules.get(mod_name)
    if target is None:
        return None
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    try:
        source = inspect.getsource(target.forward)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return None
    return set(re.findall(r"self\.(\w+)", source))


def undivided_heads(fqn: str, ctx: DiagnosisContext) -> str | None:
    """Evidence that a head-count attribute in ``fqn`` was left global while its module's
    parameters are sharded: named like a head count, divisible by a mesh dim, not divided by the
    plan, and used by the module's forward (when its source can be read). In validate mode only
    modules whose code runs on local tensors (a local region) count."""
    # head counts matter only where modules compute on local shards: everywhere in production
    # mode, in validate mode only in local regions (DTensor computes with global shapes)
    local_only = as_mode(ctx.mode).parameters_are_dtensors
    divided = {(h.module, h.attr) for h in ctx.plan.head_counts}
    for m in ctx.tree.subtree(fqn):
        if local_only and not runs_on_local_tensors(m.fqn, ctx.plan.boundaries):
            continue
        uses = _forward_uses(m.cls)
        for dim, n in ctx.sizes.items():
            if n < 2:
                continue
            attrs_ = [(a, v) for a, v in m.int_attrs if _looks_like_head_count(a) and v % n == 0
                      and (m.fqn, a) not in divided and (uses is None or a in uses)]
            sharded = [p for p in ctx.plan.params if within(p.module, m.fqn)
                       and isinstance(p.placement.get(dim), Shard)]
            if not attrs_ or not sharded:
                continue
            where = m.fqn or "<root>"
            listed = ", ".join(f"{a} = {v}" for a, v in attrs_)
            cls = m.cls.rpartition(".")[2]
            used = (f"{cls}.forward uses self.{attrs_[0][0]}" if uses is not None and
                    len(attrs_) == 1 else
                    f"{cls}.forward uses {', '.join('self.' + a for a, _ in attrs_)}"
                    if uses is not None else f"the source of {cls}.forward is not available")
            fix = ", ".join(f"{a}: {dim}" for a, _ in attrs_)
            found = (f"{where}.{listed} is an integer attribute named like a head count and the "
                     f"plan does not divide it" if len(attrs_) == 1 else
                     f"{where} has integer attributes named like head counts ({listed}) and the "
                     f"plan divides none of them")
            return (f"{found} ({used}), while {sharded[0].fqn} is sharded "
                    f"{sharded[0].placement}: each rank holds 1/{n} of what it counts; add "
                    f"head_counts: {{{fix}}} to the rule for {where}")
    return None


def heads_cut(fqn: str, failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
    """A shape error where heads live: a module in ``fqn`` states heads (a head size or an
    attribute named like a head count) and a parameter there is sharded."""
    scope = failure.module if failure.module and within(failure.module, fqn) else fqn
    # the module that raised must be the one stating heads (its own reshape failed); a child
    # that raised (a norm, a projection) has a cause of its own
    candidates = ([m for m in (ctx.tree.get(failure.module),) if m is not None]
                  if failure.module else list(ctx.tree.subtree(fqn)))
    for m in candidates:
        stated = [(a, v) for a, v in m.int_attrs
                  if a in HEAD_SIZE_ATTRS or _looks_like_head_count(a)]
        if not stated:
            continue
        sharded = [p for p in ctx.plan.params if within(p.module, m.fqn)
                   and any(isinstance(q, Shard) and ctx.sizes.get(d, 1) > 1
                           for d, q in p.placement.dims)]
        if not sharded:
            continue
        p = sharded[0]
        sizes = [ctx.sizes.get(d, 1) for d, q in p.placement.dims if isinstance(q, Shard)]
        ways = 1
        for n in sizes:
            ways *= n
        mesh = " x ".join(f"{d}={ctx.sizes.get(d, 1)}" for d, q in p.placement.dims
                          if isinstance(q, Shard))
        listed = ", ".join(f"{a} = {v}" + (f", not divisible by {mesh}"
                                           if a not in HEAD_SIZE_ATTRS and v % ways else "")
                           for a, v in stated)
        where = m.fqn or "<root>"
        states = "it states" if where == scope else f"{where} states"
        return Suggestion(cause=HEADS_NOT_WHOLE, evidence=(
            f"{scope} raised a shape error in forward where {states} heads ({listed}) and "
            f"{p.fqn} is sharded {p.placement} (local {list(p.local_shape)} of "
            f"{list(p.shape)}): every rank must hold whole heads of every projection (heads and "
            f"kv heads divisible by {mesh}) and each head count the forward reads must be "
            f"divided (head_counts)" + _heads_already_divided(m.fqn, stated, ways, ctx)))
    return None


def _heads_already_divided(fqn: str, stated: Sequence[tuple[str, int]], ways: int,
                           ctx: DiagnosisContext) -> str:
    """When the plan already divides this module's head counts and they divide evenly, the
    heads are whole: the likelier culprit is an input built for every head."""
    divided = sorted(h.attr for h in ctx.plan.head_counts if h.module == fqn)
    if not divided or any(a not in HEAD_SIZE_ATTRS and v % ways for a, v in stated):
        return ""
    return (f"; the plan already divides {', '.join(divided)} and the heads divide evenly, so "
            f"look at the inputs: one built outside {fqn} for every head (a per-head bias "
            f"flattened with the batch, ALiBi's [batch * heads, 1, kv]) has no layout that is "
            f"one rank's heads; compute this attention whole (gather its fused projection, "
            f"docs/cookbook.md#alibi-and-residual-arguments-bloom)")


def whole_param_on_shard(failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
    """The module that raised holds a replicated parameter sized for the whole feature dim,
    and received an input holding 1/n of those features."""
    if failure.module is None or not failure.module_inputs or not failure.module_inputs[0]:
        return None
    got = failure.module_inputs[0][-1]
    for p in ctx.plan.params:
        if p.module != failure.module or not p.shape:
            continue
        if any(isinstance(q, Shard) and ctx.sizes.get(d, 1) > 1 for d, q in p.placement.dims):
            continue
        for dim, n in ctx.sizes.items():
            if n < 2 or p.shape[-1] != got * n:
                continue
            return Suggestion(cause=WHOLE_PARAM_ON_SHARD, evidence=(
                f"{p.fqn} is replicated (shape {list(p.shape)}) but {failure.module} received "
                f"an input with {got} of its {p.shape[-1]} features ({dim} = {n}) "
                f"({failure.error}): a layer that acts across the whole dim (a norm over all "
                f"heads) needs its input gathered first (a nested boundary: in_dst replicate, "
                f"out_dst back to the shard); one that acts on each slice needs its parameter "
                f"sharded like the input"))
    return None


def _rowwise_without_reduction(fqn: str, ctx: DiagnosisContext) -> list[str]:
    """Weights inside ``fqn`` sharded on their input features whose module is not a boundary:
    nothing reduces their partial outputs."""
    boundaries = {b.fqn for b in ctx.plan.boundaries}
    out: list[str] = []
    for p in ctx.plan.params:
        inside = (within(p.module, fqn) if fqn not in boundaries
                  else fqn in ctx.plan.boundary_chain(p.boundary))
        if p.name != "weight" or len(p.shape) != 2 or not inside:
            continue
        if p.module in boundaries:
            continue
        if any(isinstance(q, Shard) and q.dim in (1, -1) for _, q in p.placement.dims):
            out.append(p.fqn)
    return out


def swapped_from_shapes(failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
    if failure.module is None or not failure.module_inputs:
        return None
    weight = next((p for p in ctx.plan.params
                   if p.module == failure.module and p.name == "weight" and len(p.shape) == 2), None)
    if weight is None or not failure.module_inputs[0]:
        return None
    got = failure.module_inputs[0][-1]
    out_features, in_features = weight.shape
    for dim, q in weight.placement.dims:
        n = ctx.sizes.get(dim, 1)
        if not isinstance(q, Shard) or n < 2:
            continue
        if q.dim in (1, -1) and got == in_features:
            return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
                f"{failure.module}.weight is sharded on its input features ({weight.placement}, "
                f"row-wise: local in_features {in_features // n}) but {failure.module} received "
                f"an input with all {in_features} features ({failure.error})"))
        if q.dim in (0, -2) and got == in_features // n and in_features % n == 0:
            return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
                f"{failure.module}.weight is sharded on its output features ({weight.placement}, "
                f"column-wise, needs the whole input) but {failure.module} received an input "
                f"with {got} of {in_features} features ({failure.error})"))
    return None


def swapped_from_placement(failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
    if failure.placement is None:
        return None
    fqn, what, declared, actual = failure.placement
    if "partial" not in actual or "partial" in declared:
        return None
    enclosing = next((b.parent for b in ctx.plan.boundaries if b.fqn == fqn), None)
    scope = enclosing if enclosing is not None else fqn
    unreduced = _rowwise_without_reduction(scope, ctx)
    if not unreduced:
        return None
    return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
        f"{fqn} ({what}) arrived {actual} where {declared} is declared: a partial sum reached it "
        f"unreduced; {', '.join(unreduced)} {'is' if len(unreduced) == 1 else 'are'} sharded on "
        f"input features (row-wise) inside {scope or '<root>'} with no boundary to reduce the "
        f"output"))
