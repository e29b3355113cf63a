"""Patterns in the plan and the model tree behind a failure: head counts left undivided, heads
cut between ranks, attentions whose heads cannot be divided at all, whole parameters on shards,
column-/row-wise layers swapped."""

from __future__ import annotations

import re
from collections.abc import Sequence

from hyperrecipe.check.diagnose.causes import (
    COLWISE_ROWWISE_SWAPPED,
    HEADS_FIXED_IN_EINOPS,
    HEADS_NOT_WHOLE,
    MHA_READS_ITS_OWN_WEIGHTS,
    WHOLE_PARAM_ON_SHARD,
    WIDTH_READ_OFF_INPUT,
    DiagnosisContext,
    Suggestion,
    within,
)
from hyperrecipe.check.record import Failure, Trace
from hyperrecipe.forward_hazards import HEAD_COUNT_NAMES, ForwardHazard
from hyperrecipe.placement import Shard
from hyperrecipe.plan import ParamPlan
from hyperrecipe.resolve.head_counts import HEAD_SIZE_ATTRS
from hyperrecipe.runtime import runs_on_local_tensors
from hyperrecipe.runtime import as_mode

__all__ = ["forward_hazard_in", "heads_cut", "swapped_from_placement", "swapped_from_shapes", "undivided_heads",
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


def _reaches_forward_sharded(fqn: str, hazard: ForwardHazard, ctx: DiagnosisContext
                             ) -> list[tuple[ParamPlan, str, int]]:
    """The parameters inside ``fqn`` sharded on a mesh dim of size > 1 whose values reach its
    forward as one rank's piece, with that dim and its size.

    ``nn.MultiheadAttention`` reads every weight itself, so any sharded one counts; in another
    attention a projection that is a boundary handing out only whole values (gathered,
    ``colwise_gather_output``, or reduced, ``rowwise``) computes as the forward expects, and
    does not count: that is the recipe docs/bring-your-own-model.md gives for these hazards."""
    gathered = {b.fqn for b in ctx.plan.boundaries
                if b.fqn != fqn and b.outputs and all(o.dst.is_replicate for o in b.outputs)}
    out: list[tuple[ParamPlan, str, int]] = []
    for p in ctx.plan.params:
        if not within(p.module, fqn) or (hazard.kind != "mha" and p.module in gathered):
            continue
        for dim, q in p.placement.dims:
            if isinstance(q, Shard) and ctx.sizes.get(dim, 1) > 1:
                out.append((p, dim, ctx.sizes[dim]))
                break
    return out


def _never_ran(fqn: str, reference: Trace, ctx: DiagnosisContext) -> list[str]:
    """Boundaries strictly inside ``fqn`` that recorded no event in the reference."""
    ran = {e.fqn for e in reference.events}
    return [b.fqn for b in ctx.plan.boundaries
            if b.fqn != fqn and within(b.fqn, fqn) and b.fqn not in ran]


def forward_hazard_in(fqn: str, failure: Failure | None, reference: Trace,
                      ctx: DiagnosisContext) -> Suggestion | None:
    """An attention whose heads cannot be divided (:mod:`hyperrecipe.forward_hazards`) is in
    the blamed boundary ``fqn`` (or holds it, or raised) and the plan hands its forward a
    sharded projection: no head count division fixes that, only another forward or leaving it
    replicated. For heads fixed by ``h=self.<attr>`` in an einops call that the plan already
    divides (``head_counts``) the pattern holds on a shard, and this is not the cause."""
    raised = failure.module if failure is not None else None
    for where, hazard in ctx.hazards.items():
        if not (within(where, fqn) or within(fqn, where)
                or (raised is not None and within(raised, where))):
            continue
        divided = {h.attr: h.mesh_dim for h in ctx.plan.head_counts if h.module == where}
        if hazard.kind == "einops" and hazard.count_attr in divided:
            continue
        sharded = _reaches_forward_sharded(where, hazard, ctx)
        if not sharded:
            continue
        p, dim, n = sharded[0]
        name = where or "<root>"
        info = ctx.tree.get(where)
        cls = info.cls.rpartition(".")[2] if info is not None else "its class"
        piece = (f"{p.fqn} is sharded {p.placement} (local {list(p.local_shape)} of "
                 f"{list(p.shape)})")
        error = f" ({failure.error})" if failure is not None else ""
        if hazard.kind == "width":
            counts = ", ".join(f"{a} = {v}" for a, v in (info.int_attrs if info else ())
                               if a in HEAD_COUNT_NAMES)
            already = (f"; the plan divides {', '.join(sorted(divided))} (head_counts), and the "
                       f"width is still read whole" if divided else
                       f"; dividing {counts or 'its head count'} (head_counts) does not change "
                       f"the width read off the input")
            return Suggestion(cause=WIDTH_READ_OFF_INPUT, evidence=(
                f"{name} ({cls}): {hazard.why}, while {piece}: each rank's q, k and v hold 1/{n} "
                f"of that width ({dim} = {n}){already}; shape the heads by a head size "
                f"(self.head_dim) and reshape(B, T, -1), or leave {name} replicated{error}"))
        if hazard.kind == "einops":
            attr = hazard.count_attr
            fix = (f"; h=self.{attr} reads an attribute the plan can divide: add head_counts: "
                   f"{{{attr}: {dim}}} to the rule for {name}, or fix d= instead" if attr else
                   f"; the plan divides {', '.join(sorted(divided))} (head_counts), which the "
                   f"pattern, built with its count, never reads; fix the head size (d=) "
                   f"instead, or leave {name} replicated" if divided else
                   f"; fix the head size (d=) instead, or leave {name} replicated")
            return Suggestion(cause=HEADS_FIXED_IN_EINOPS, evidence=(
                f"{name} ({cls}): {hazard.why}, while {piece}: a rank splits its 1/{n} of the "
                f"width into all the heads, each 1/{n} as wide ({dim} = {n}){fix}{error}"))
        silent = _never_ran(where, reference, ctx)
        idle = (f"; the boundar{'y' if len(silent) == 1 else 'ies'} {', '.join(silent)} "
                f"recorded nothing in the reference: never called" if silent else "")
        return Suggestion(cause=MHA_READS_ITS_OWN_WEIGHTS, evidence=(
            f"{name} is nn.MultiheadAttention: {hazard.seen} reads {name}.in_proj_weight and "
            f"{name}.out_proj.weight itself and takes head_dim from the input's width, never "
            f"calling {name}.out_proj, while {piece} ({dim} = {n}){idle}{error}"))
    return None
