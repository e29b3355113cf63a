"""Likely causes of a divergence, offered only when a known pattern is actually seen.

Each heuristic tests a pattern on the numbers (or on the failure and the plan) and, when it
holds, returns a :class:`Suggestion` whose ``evidence`` says what was measured. When nothing
fits, there is no suggestion: a guess without evidence would send users the wrong way.

Patterns, in the order they are tried at the first divergence:

- **bias counted n times**: the error is the same vector at every position and equals an integer
  multiple ``k`` of a bias inside the blamed boundary (``k + 1`` = a mesh dim size is stated), or
  the whole output is ``n`` x the reference for a mesh dim of size ``n`` →
  :data:`BIAS_COUNTED_TP_TIMES`.
- **matches only after an all-reduce or a transpose**: summing the ranks' values over one mesh
  dim reproduces the reference, or the transposed value does → :data:`COLWISE_ROWWISE_SWAPPED`.
- **swapped layers seen in a failure**: a linear weight sharded on its input features received
  the full input (or one sharded on its output features received a sharded input), or a partial
  value reached a boundary that declares it whole while a row-wise weight inside the enclosing
  boundary has no boundary to reduce its output → :data:`COLWISE_ROWWISE_SWAPPED`.
- **undivided head count** (production mode only; validate mode computes with global shapes):
  a module in the blamed boundary has an integer attribute named like a head count
  (``num_heads``, ``n_head``, ``num_key_value_heads``, ``split_size``…) divisible by a mesh dim,
  the plan divides no such attribute, and a parameter there is sharded on that dim, seen either
  as wrong values or as a shape error in that boundary → :data:`HEAD_COUNT_UNDIVIDED`.
- **a whole parameter on a shard** (either mode): the module that raised a shape error holds a
  replicated parameter whose last dim is ``n`` x its input's, for a mesh dim of size ``n`` (a
  norm over all heads left whole after a column-wise projection) →
  :data:`WHOLE_PARAM_ON_SHARD`.
- **heads cut between ranks** (either mode): a shape error raised in forward by a module that
  states heads (a head size such as ``head_dim``, or an attribute named like a head count) while
  a parameter in it is sharded; the evidence lists the heads and each rank's
  share → :data:`HEADS_NOT_WHOLE`. Resolve refuses the splits it can see (a head size in the
  model tree); this names the ones it cannot (a head size the tree does not show).
- **a plain tensor meets a DTensor** (validate mode): a forward raised DTensor's "got mixed
  torch.Tensor and DTensor" (a buffer of the module's own added to its DTensor values) →
  :data:`PLAIN_TENSOR_MEETS_DTENSOR`.
- **forward right, gradients wrong** → :data:`GRADIENT_REDUCTION_MISSING` when the ranks'
  gradients of a parameter sum to the reference (named), otherwise
  :data:`GRADIENT_REDUCTION_WRONG` (a reduction missing, or one too many); when parameters got
  no gradient on a rank at all → :data:`PARAMS_UNUSED_ON_RANKS` (a per-head ``ModuleList``
  indexed from head 0 on every rank, StableLM's ``q_layernorm``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs
import torch
from torch import Tensor

from hyperrecipe.check.compare import ModeComparison, diff_tensors
from hyperrecipe.check.record import Failure, Trace
from hyperrecipe.model_tree import ModelTree
from hyperrecipe.placement import Shard
from hyperrecipe.plan import Plan
from hyperrecipe.resolve.head_counts import HEAD_SIZE_ATTRS
from hyperrecipe.runtime.mode import as_mode

__all__ = [
    "BIAS_COUNTED_TP_TIMES",
    "COLWISE_ROWWISE_SWAPPED",
    "DiagnosisContext",
    "GRADIENT_REDUCTION_MISSING",
    "GRADIENT_REDUCTION_WRONG",
    "HEAD_COUNT_UNDIVIDED",
    "HEADS_NOT_WHOLE",
    "OUTPUT_LEFT_SHARDED",
    "PARAMS_UNUSED_ON_RANKS",
    "PLAIN_TENSOR_MEETS_DTENSOR",
    "WHOLE_PARAM_ON_SHARD",
    "Suggestion",
    "suggest",
]

BIAS_COUNTED_TP_TIMES = "a bias (or partial value) counted tp times: defer_bias / rowwise"
HEAD_COUNT_UNDIVIDED = "a head count left undivided (head_counts)"
WHOLE_PARAM_ON_SHARD = ("a whole (replicated) parameter meets a sharded activation: gather "
                        "around it, or shard it like its input")
HEADS_NOT_WHOLE = ("heads cut between ranks: a head count the mesh does not divide, or a "
                   "sharded dim that is not whole heads per rank")
COLWISE_ROWWISE_SWAPPED = "colwise/rowwise swapped"
GRADIENT_REDUCTION_MISSING = ("a gradient reduction missing (replicated input consumed by "
                              "sharded parameters, reduce_grads)")
GRADIENT_REDUCTION_WRONG = ("a gradient reduced wrongly: a reduction missing (reduce_grads), or one "
                            "too many (a declared replicated input that bypasses the sharded "
                            "parameters, such as a residual)")
PARAMS_UNUSED_ON_RANKS = ("parameters a rank never used: per-head modules indexed from the first "
                          "head on every rank (a ModuleList of one module per head); gather the "
                          "heads around that module, as for norms over all heads")
OUTPUT_LEFT_SHARDED = "the model's output is left sharded (gather it: out_dst replicate)"
PLAIN_TENSOR_MEETS_DTENSOR = ("a plain tensor of the model's own (a buffer, a fresh tensor) meets "
                              "a DTensor in validate mode: make the module that raised a "
                              "`local_region: true` boundary, or add an adapter "
                              "(docs/adapters.md)")

_SHAPE_ERROR = re.compile(r"shape|size|mat1 and mat2|dimension|must match|unpack|split",
                          re.IGNORECASE)


@attrs.frozen(kw_only=True)
class Suggestion:
    cause: str
    evidence: str


@attrs.frozen(kw_only=True)
class DiagnosisContext:
    """What the heuristics may consult besides the traces.

    Attributes:
        plan: the compiled plan.
        tree: the model's structure (integer attributes, parameter shapes).
        reference_params: the reference model's parameters before any step, by FQN.
        mode: ``"production"`` or ``"validate"``.
        rank_ids: the rank of each trace passed to :func:`suggest`.
    """

    plan: Plan
    tree: ModelTree
    reference_params: Mapping[str, Tensor]
    mode: str
    rank_ids: tuple[int, ...]

    @property
    def sizes(self) -> dict[str, int]:
        return self.plan.mesh_shape


def _in(fqn: str, root: str) -> bool:
    return not root or fqn == root or fqn.startswith(f"{root}.")


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# ------------------------------------------------------------------------------ numbers


def _bias_offset(a: Tensor, b: Tensor, fqn: str, ctx: DiagnosisContext) -> Suggestion | None:
    """The error is one vector repeated at every position, an integer multiple of a bias."""
    if a.shape != b.shape or a.ndim < 1 or a.numel() == 0:
        return None
    d = (a.double() - b.double()).reshape(-1, a.shape[-1])
    scale = float(b.double().abs().max()) or 1.0
    row = d[0]
    norm = float(row.norm())
    if norm <= 1e-6 * scale or float((d - row).abs().max()) > 1e-4 * norm + 1e-7 * scale:
        return None
    for p in ctx.plan.params:
        if p.name != "bias" or not _in(p.module, fqn) or p.shape != (a.shape[-1],):
            continue
        beta = ctx.reference_params.get(p.fqn)
        if beta is None:
            continue
        beta = beta.double().reshape(-1)
        bb = float(beta @ beta)
        if bb == 0.0:
            continue
        k = float(row @ beta) / bb
        if round(k) < 1 or abs(k - round(k)) > 1e-2 or float((row - k * beta).norm()) > 1e-3 * norm:
            continue
        times = round(k) + 1
        dims = [n for n, s in ctx.sizes.items() if s == times]
        tp = f" ({dims[0]} has size {times})" if dims else ""
        deferred = next((bd for bd in ctx.plan.boundaries if bd.fqn == p.module), None)
        plan_note = ""
        if deferred is not None and "bias" not in deferred.defer_bias:
            plan_note = f"; the plan does not defer {p.fqn} (defer_bias is off)"
        evidence = (f"the error of {fqn} is the same at every position and equals {k:.3f} x "
                    f"{p.fqn}: the bias is added {times} times{tp}{plan_note}")
        return Suggestion(cause=BIAS_COUNTED_TP_TIMES, evidence=evidence)
    return None


def _scaled(a: Tensor, b: Tensor, fqn: str, ctx: DiagnosisContext) -> Suggestion | None:
    """The whole value is ``n`` x the reference for a mesh dim of size ``n``."""
    if a.shape != b.shape or a.numel() == 0:
        return None
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    yy = float(y @ y)
    if yy == 0.0:
        return None
    s = float(x @ y) / yy
    if float((x - s * y).norm()) > 1e-4 * float(x.norm()):
        return None
    for name, n in ctx.sizes.items():
        if n > 1 and abs(s - n) < 1e-3 * n:
            return Suggestion(cause=BIAS_COUNTED_TP_TIMES, evidence=(
                f"{fqn}'s value is {s:.4f} x the reference and {name} has size {n}: a value "
                f"every rank already held whole was summed over {name} as if it were partial"))
    return None


def _coords(plan: Plan, rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in reversed(plan.mesh):
        out[d.name] = rank % d.size
        rank //= d.size
    return out


def _sum_over(values: Mapping[int, Tensor], plan: Plan, dim: str) -> list[Tensor]:
    """Per group of ranks that differ only in their ``dim`` coordinate: the sum of their values."""
    groups: dict[tuple[tuple[str, int], ...], list[Tensor]] = {}
    for r, v in values.items():
        key = tuple((k, c) for k, c in sorted(_coords(plan, r).items()) if k != dim)
        groups.setdefault(key, []).append(v.double())
    return [torch.stack(vs).sum(0) for vs in groups.values()]


def _sums_to_reference(values: Mapping[int, Tensor], b: Tensor, ctx: DiagnosisContext,
                       atol: float, rtol: float) -> tuple[str, float] | None:
    """The mesh dim over which the ranks' values add up to ``b``, and the max error."""
    world = 1
    for d in ctx.plan.mesh:
        world *= d.size
    if len(values) != world or any(v.shape != b.shape for v in values.values()):
        return None
    for name, n in ctx.sizes.items():
        if n < 2:
            continue
        sums = _sum_over(values, ctx.plan, name)
        diffs = [diff_tensors(s, b, atol=atol * n, rtol=rtol) for s in sums]
        if all(d.ok for d in diffs):
            return name, max(d.max_abs or 0.0 for d in diffs)
    return None


def _after_all_reduce(values: Mapping[int, Tensor], b: Tensor, fqn: str, ctx: DiagnosisContext,
                      atol: float, rtol: float) -> Suggestion | None:
    found = _sums_to_reference(values, b, ctx, atol, rtol)
    if found is None:
        return None
    name, err = found
    return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
        f"summing the ranks' values of {fqn} over {name} reproduces the reference (max abs "
        f"error {_fmt(err)}): each rank holds a partial sum that is never reduced, as a row-wise "
        f"layer placed where a column-wise one belongs leaves it"))


def _after_transpose(a: Tensor, b: Tensor, fqn: str, atol: float, rtol: float
                     ) -> Suggestion | None:
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape != b.shape:
        return None
    d = diff_tensors(a.transpose(-1, -2), b, atol=atol, rtol=rtol)
    if not d.ok:
        return None
    return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
        f"{fqn}'s value transposed matches the reference (max abs error {_fmt(d.max_abs or 0)})"))


# ------------------------------------------------------------------------------ plan facts


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


def _undivided_heads(fqn: str, ctx: DiagnosisContext) -> str | None:
    """Evidence that a head-count attribute in ``fqn`` was left global while its module's
    parameters are sharded: named like a head count, divisible by a mesh dim, not divided by the
    plan, and used by the module's forward (when its source can be read)."""
    if as_mode(ctx.mode).parameters_are_dtensors:
        return None  # head counts are divided only where modules compute on local shards
    divided = {(h.module, h.attr) for h in ctx.plan.head_counts}
    for m in ctx.tree.subtree(fqn):
        uses = _forward_uses(m.cls)
        for dim, n in ctx.sizes.items():
            if n < 2:
                continue
            attrs_ = [(a, v) for a, v in m.int_attrs if _looks_like_head_count(a) and v % n == 0
                      and (m.fqn, a) not in divided and (uses is None or a in uses)]
            sharded = [p for p in ctx.plan.params if _in(p.module, m.fqn)
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


def _heads_cut(fqn: str, failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
    """A shape error where heads live: a module in ``fqn`` states heads (a head size or an
    attribute named like a head count) and a parameter there is sharded."""
    scope = failure.module if failure.module and _in(failure.module, fqn) else fqn
    # the module that raised must be the one stating heads (its own reshape failed); a child
    # that raised (a norm, a projection) has a cause of its own
    candidates = ([m for m in (ctx.tree.get(failure.module),) if m is not None]
                  if failure.module else list(ctx.tree.subtree(fqn)))
    for m in candidates:
        stated = [(a, v) for a, v in m.int_attrs
                  if a in HEAD_SIZE_ATTRS or _looks_like_head_count(a)]
        if not stated:
            continue
        sharded = [p for p in ctx.plan.params if _in(p.module, m.fqn)
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


def _whole_param_on_shard(failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
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
        inside = (_in(p.module, fqn) if fqn not in boundaries
                  else fqn in ctx.plan.boundary_chain(p.boundary))
        if p.name != "weight" or len(p.shape) != 2 or not inside:
            continue
        if p.module in boundaries:
            continue
        if any(isinstance(q, Shard) and q.dim in (1, -1) for _, q in p.placement.dims):
            out.append(p.fqn)
    return out


def _swapped_from_shapes(failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
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


def _swapped_from_placement(failure: Failure, ctx: DiagnosisContext) -> Suggestion | None:
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


# ------------------------------------------------------------------------------ entry point


def _event_values(ranks: Sequence[Trace], ctx: DiagnosisContext, key: tuple[str, int, str, str]
                  ) -> dict[int, Tensor]:
    out: dict[int, Tensor] = {}
    for r, t in zip(ctx.rank_ids, ranks):
        for e in t.events:
            if e.key == key and e.value is not None:
                out[r] = e.value
    return out


def _gradient_evidence(cmp: ModeComparison, reference: Trace, ranks: Sequence[Trace],
                       ctx: DiagnosisContext, atol: float, rtol: float) -> Suggestion:
    bad = cmp.diverged_gradients
    worst = max(bad, key=lambda g: g.diff.badness)
    metric = (f"max abs {_fmt(worst.diff.max_abs)}" if worst.diff.max_abs is not None
              else worst.diff.problem)
    evidence = (f"all {cmp.events_compared} boundary values and the final output agree, but "
                f"{len(bad)} of {len(cmp.gradients)} gradients differ (worst {worst.name}, "
                f"{metric})")
    unused = [g for g in bad if g.diff.problem == "no gradient"]
    if unused:
        names = [g.name for g in unused]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        many = len(names) > 1
        return Suggestion(cause=PARAMS_UNUSED_ON_RANKS, evidence=(
            f"{evidence}; {shown} got no gradient on rank {unused[0].rank} (in the reference "
            f"{'they do' if many else 'it does'}): the sharded forward never used "
            f"{'them' if many else 'it'}, and computed what {'they' if many else 'it'} should "
            f"have with other parameters (another head's)"))
    partial: list[str] = []
    for g in bad:
        ref = reference.grads.get(g.name)
        if ref is None:
            continue
        values = {r: t.grads[g.name] for r, t in zip(ctx.rank_ids, ranks) if g.name in t.grads}
        found = _sums_to_reference(values, ref, ctx, atol, rtol)
        if found is not None:
            partial.append(f"{g.name} (over {found[0]})")
    if partial:
        shown = ", ".join(partial[:3]) + (f" and {len(partial) - 3} more" if len(partial) > 3 else "")
        evidence += (f"; the ranks' gradients of {shown} sum to the reference: each rank holds a "
                     f"partial gradient that is never all-reduced")
        return Suggestion(cause=GRADIENT_REDUCTION_MISSING, evidence=evidence)
    scaled: list[str] = []
    for g in bad:
        ref = reference.grads.get(g.name)
        if ref is None:
            continue
        grads = [t.grads[g.name] for t in ranks if g.name in t.grads]
        for dim, n in ctx.sizes.items():
            if n > 1 and grads and all(
                    v.shape == ref.shape and diff_tensors(v, n * ref, atol=atol * n, rtol=rtol).ok
                    for v in grads):
                scaled.append(f"{g.name} ({n} x, {dim})")
                break
    if scaled:
        shown = ", ".join(scaled[:3]) + (f" and {len(scaled) - 3} more" if len(scaled) > 3 else "")
        evidence += (f"; every rank's gradient of {shown} is the reference times the mesh dim's "
                     f"size: a whole gradient reduced once too often (a reduce_grads on a "
                     f"parameter whose gradient is already whole, or a declared input whose "
                     f"gradient is)")
        return Suggestion(cause=GRADIENT_REDUCTION_WRONG, evidence=evidence)
    evidence += ("; no rank's gradients sum to the reference. Validate mode checks each declared "
                 "replicated input's gradient against the reduction production gives it, and "
                 "names an input whose gradient is already whole")
    return Suggestion(cause=GRADIENT_REDUCTION_WRONG, evidence=evidence)


def suggest(cmp: ModeComparison, reference: Trace, ranks: Sequence[Trace], ctx: DiagnosisContext,
            *, atol: float, rtol: float) -> Suggestion | None:
    """The likely cause of ``cmp``'s divergence, or ``None`` when no known pattern is seen."""
    first = cmp.first
    if first is None:
        if cmp.forward_agrees and cmp.diverged_gradients:
            return _gradient_evidence(cmp, reference, ranks, ctx, atol, rtol)
        return None
    if first.event_index is not None:
        event = reference.events[first.event_index]
        b = event.value
        assert b is not None
        values = _event_values(ranks, ctx, event.key)
        a = values.get(first.rank)
        if a is not None and a.shape == b.shape:
            for found in (_bias_offset(a, b, first.fqn, ctx) if event.kind == "output" else None,
                          _scaled(a, b, event.fqn, ctx),
                          _after_all_reduce(values, b, event.fqn, ctx, atol, rtol),
                          _after_transpose(a, b, event.fqn, atol, rtol)):
                if found is not None:
                    return found
        heads = _undivided_heads(first.fqn, ctx)
        if heads is not None:
            shape = "" if a is None or a.shape == b.shape else (
                f"; the value has shape {list(a.shape)}, the reference {list(b.shape)}")
            return Suggestion(cause=HEAD_COUNT_UNDIVIDED, evidence=heads + shape)
        return None
    if first.fqn == "<output>":
        out, ref = None, reference.output
        for t in ranks:
            if t.output is not None:
                out = t.output
                break
        if out is not None and ref is not None and out.shape != ref.shape and out.ndim == ref.ndim:
            for dim, n in ctx.sizes.items():
                if n > 1 and any(o * n == r for o, r in zip(out.shape, ref.shape)):
                    return Suggestion(cause=OUTPUT_LEFT_SHARDED, evidence=(
                        f"the output has shape {list(out.shape)} on rank {first.rank}, the "
                        f"reference {list(ref.shape)}: one dim is 1/{n} of it ({dim} = {n})"))
        return None
    failure = cmp.failure
    if failure is None:
        return None
    found = _swapped_from_placement(failure, ctx)
    if found is not None:
        return found
    if failure.phase == "forward" and "got mixed torch.Tensor and DTensor" in failure.error:
        where = failure.module or first.fqn
        return Suggestion(cause=PLAIN_TENSOR_MEETS_DTENSOR, evidence=(
            f"{where} raised in forward ({failure.error}); a local region computes on local "
            f"tensors in both modes (a router whose buffer, such as DeepSeek-V3's "
            f"e_score_correction_bias, is added to its DTensor scores)"))
    if failure.phase == "forward" and _SHAPE_ERROR.search(failure.error):
        heads = _undivided_heads(first.fqn, ctx)
        if heads is not None:
            return Suggestion(cause=HEAD_COUNT_UNDIVIDED, evidence=f"{heads} ({failure.error})")
        return (_swapped_from_shapes(failure, ctx) or _whole_param_on_shard(failure, ctx)
                or _heads_cut(first.fqn, failure, ctx))
    return None
