"""Human-readable views of a plan: the compile summary and ``--explain``.

Pure formatting over :class:`~hyperrecipe.plan.Plan`; repeated layers are folded into one row
(``model.layers.*.mlp ×32``) so the summary of an 80-layer model still fits a screen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import attrs

from hyperrecipe.errors import ExplainError, closest
from hyperrecipe.placement import Shard, parse_dtensor
from hyperrecipe.plan import (
    AdapterPlan,
    ArgLayout,
    BoundaryPlan,
    LossParallel,
    ParamPlan,
    PipelinePlan,
    Plan,
)
from hyperrecipe.recipe.patterns import compile_pattern, generalize_fqn

__all__ = ["PlanTotals", "explain", "pipeline_lines", "plan_totals", "summary"]

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@attrs.frozen(kw_only=True)
class PlanTotals:
    tensors: int
    sharded: int
    replicated: int
    unclaimed: int
    bytes_total: int
    bytes_per_rank: int
    forward_collectives: int
    backward_collectives: int
    ops: tuple[tuple[str, int], ...]


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bytes_per_rank(plan: Plan) -> int:
    """The local parameter bytes of the fullest rank: with a pipeline, a rank holds only its
    stages' parameters (a tie across stages is a copy on each)."""
    local = {p.fqn: _numel(p.local_shape) * _ITEMSIZE.get(p.dtype, 4) for p in plan.params}
    if plan.pipeline is None:
        return sum(local[p.fqn] for p in plan.params if p.tied_to is None)
    ranks: dict[int, set[str]] = {}
    for st in plan.pipeline.stages:
        ranks.setdefault(st.rank, set()).update(st.params)
    return max(sum(local[f] for f in fqns) for fqns in ranks.values())


def plan_totals(plan: Plan) -> PlanTotals:
    """Counts over a plan's own parameters (tied aliases counted once) and manifest."""
    owned = [p for p in plan.params if p.tied_to is None]
    size = {p.fqn: _ITEMSIZE.get(p.dtype, 4) for p in owned}
    ops = Counter(str(e.op.kind) for e in plan.manifest)
    return PlanTotals(
        tensors=len(owned),
        sharded=sum(1 for p in owned if any(isinstance(q, Shard) for _, q in p.placement.dims)),
        replicated=sum(1 for p in owned if p.placement.is_replicate),
        unclaimed=sum(1 for p in owned if p.provenance and p.provenance[-1].rule_index < 0),
        bytes_total=sum(_numel(p.shape) * size[p.fqn] for p in owned),
        bytes_per_rank=_bytes_per_rank(plan),
        forward_collectives=sum(1 for e in plan.manifest if e.direction == "forward"),
        backward_collectives=sum(1 for e in plan.manifest if e.direction == "backward"),
        ops=tuple(sorted(ops.items())),
    )


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _layout(b: BoundaryPlan) -> str:
    def one(prefix: str, items: Iterable[ArgLayout]) -> str:
        parts = []
        for a in items:
            text = f"{a.name} {a.src}" if a.src == a.dst else f"{a.name} {a.src} -> {a.dst}"
            parts.append(text if a.grad is None else f"{text} (grad {a.grad})")
        return f"{prefix} " + ", ".join(parts) if parts else ""

    text = "; ".join(t for t in (one("in", b.inputs), one("out", b.outputs)) if t)
    extras = []
    if b.defer_bias:
        extras.append("bias deferred")
    if b.inner_wrapper:
        extras.append(f"inner {' | '.join(b.inner_wrapper)}")
    if b.local_region:
        extras.append("local region")
    return "; ".join([text, *extras]) if extras else text


def _tree_order(plan: Plan, with_params: list[str], boundary_fqns: list[str]) -> list[str]:
    """Interleave boundaries with parameter-holding modules, each boundary before its subtree
    (the modules whose parameters the plan places inside it)."""
    rank: dict[str, float] = {m: float(i) for i, m in enumerate(with_params)}
    within: dict[str, set[str]] = {}
    for p in plan.params:
        for b in plan.boundary_chain(p.boundary):
            within.setdefault(b, set()).add(p.module)
    for j, b in enumerate(boundary_fqns):
        inside = [rank[m] for m in with_params if m in within.get(b, ())]
        rank[b] = min(inside) - 0.5 if inside and b not in rank else rank.get(b, len(rank) + j)
    return sorted(dict.fromkeys([*with_params, *boundary_fqns]), key=lambda m: rank[m])


def summary(plan: Plan) -> str:
    """The compile summary: one row per (folded) module, then totals."""
    by_module: dict[str, list[ParamPlan]] = {}
    for p in plan.params:
        by_module.setdefault(p.module, []).append(p)
    boundaries = {b.fqn: b for b in plan.boundaries}
    colls: dict[str, Counter[str]] = {}
    for e in plan.manifest:
        if e.stage == "param_grad":
            continue  # a bucket spans modules: its own line below the table
        colls.setdefault(e.boundary, Counter())[f"{'fwd' if e.direction == 'forward' else 'bwd'} "
                                         f"{e.op.kind}"] += 1
    rows: dict[tuple[str, str, str, str, str], int] = {}
    order: list[tuple[str, str, str, str, str]] = []
    modules = _tree_order(plan, list(by_module), list(boundaries))
    unclaimed: list[str] = []
    for fqn in modules:
        params = [p for p in by_module.get(fqn, []) if p.tied_to is None or fqn in boundaries
                  or not p.placement.is_replicate]
        b = boundaries.get(fqn)
        ruled = [p for p in params if not (p.provenance and p.provenance[-1].rule_index < 0)]
        unclaimed.extend(p.fqn for p in params if p not in ruled)
        if b is None and not ruled:
            continue
        kind = "boundary" if b else "params"
        ptext = ", ".join(f"{p.name} {p.placement}" + (" (tied)" if p.tied_to else "")
                          + (" (grad all-reduced)" if p.grad_reduce else "") for p in ruled) or "-"
        ltext = _layout(b) if b else "-"
        ctext = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(colls.get(fqn, Counter()).items())) or "-"
        row = (generalize_fqn(fqn), kind, ptext, ltext, ctext)
        if row not in rows:
            order.append(row)
            rows[row] = 0
        rows[row] += 1
    mesh = ",".join(f"{d.name}={d.size}" for d in plan.mesh)
    lines = [f"plan {plan.recipe!r} for mesh {mesh}  fingerprint {plan.fingerprint[:12]}  "
             f"({', '.join(plan.recipe_files)})", ""]
    header = ("module", "kind", "params", "layouts", "collectives/step")
    table = [header, *[(f"{r[0]}" + (f" x{rows[r]}" if rows[r] > 1 else ""), *r[1:]) for r in order]]
    widths = [min(max(len(row[i]) for row in table), 60) for i in range(4)]
    for row in table:
        cells = [row[i].ljust(widths[i]) for i in range(4)]
        lines.append("  ".join(cells) + "  " + row[4])
    t = plan_totals(plan)
    lines.append("")
    methods = [a for a in plan.adapters if not a.is_function]
    functions = [a for a in plan.adapters if a.is_function]
    if methods:
        lines.append("method adapters: " + ", ".join(_adapter_text(a) for a in methods))
    if functions:
        lines.append("function adapters: " + ", ".join(_adapter_text(a) for a in functions))
    if unclaimed:
        folded = Counter(generalize_fqn(f) for f in unclaimed)
        shown = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in folded.items())
        lines.append(f"replicated by default (no rule): {shown}")
    ratio = t.bytes_per_rank / t.bytes_total if t.bytes_total else 1.0
    lines.append(f"parameters: {t.tensors} tensors, {t.sharded} sharded, {t.replicated} "
                 f"replicated; {_mb(t.bytes_per_rank)} per rank of {_mb(t.bytes_total)} "
                 f"({ratio:.0%})")
    if plan.grad_buckets:
        lines.append(_buckets_text(plan))
    ops = ", ".join(f"{k} x{v}" for k, v in t.ops) or "none"
    lines.append(f"collectives per step: {t.forward_collectives} forward, "
                 f"{t.backward_collectives} backward ({ops})")
    loss = plan.loss_parallel
    if loss is not None:
        lines.append(f"loss on vocab shards: {loss.boundary} over {loss.mesh_dim} ({loss.vocab} "
                     f"-> {loss.local_vocab} per rank); {_loss_text(loss)}")
    if plan.pipeline is not None:
        lines.extend(pipeline_lines(plan.pipeline, plan))
    uncounted = _uncounted(plan)
    if uncounted:
        lines.append(f"not counted (issued by the wrapped code itself, not by layouts): "
                     f"{uncounted}")
    return "\n".join(lines) + "\n"


def pipeline_lines(pipe: PipelinePlan, plan: Plan) -> list[str]:
    """The pipeline's split, one line per stage, for the compile summary and ``explain``."""
    sizes = {p.fqn: _numel(p.local_shape) * _ITEMSIZE.get(p.dtype, 4) for p in plan.params}
    local = {st.index: sum(sizes[f] for f in st.params) for st in pipe.stages}
    lines = [f"pipeline over {pipe.mesh_dim}: {pipe.schedule}, {pipe.microbatches} microbatches, "
             f"{len(pipe.stages)} stages ({pipe.stages_per_rank} per rank) of {pipe.layers} "
             f"[{pipe.num_layers} layers]; split {pipe.split}"]
    for st in pipe.stages:
        extra = f" + {', '.join(st.modules)}" if st.modules else ""
        lines.append(f"  stage {st.index} on {pipe.mesh_dim} rank {st.rank}: "
                     f"{pipe.layers}[{st.start}:{st.stop}]{extra}; {len(st.params)} tensors, "
                     f"{_mb(st.param_bytes)}" + (f" ({_mb(local[st.index])} per rank)"
                                                 if local[st.index] != st.param_bytes else ""))
    for tie in pipe.tied:
        lines.append(f"  tied across stages {list(tie.stages)}: {', '.join(tie.params)} (a copy "
                     f"on each; gradients summed over those ranks)")
    lines.append(f"  sends: {pipe.sends}")
    return lines


def _buckets_text(plan: Plan) -> str:
    """``gradient buckets: 1 (17 parameters, 8.5 KiB per rank): bwd all_reduce[tp](sum) x1``."""
    params = sum(len(b.params) for b in plan.grad_buckets)
    size = sum(b.numel * _ITEMSIZE.get(b.dtype, 4) for b in plan.grad_buckets)
    ops = Counter(str(op) for b in plan.grad_buckets for op in b.ops)
    n = len(plan.grad_buckets)
    return (f"gradient buckets: {n} ({params} parameter{'s' if params != 1 else ''}, "
            f"{_mb(size)} per rank): " + ", ".join(f"bwd {k} x{v}" for k, v in ops.items()))


def _uncounted(plan: Plan) -> str:
    """Where communication happens that the manifest cannot list: inner wrappers and local
    regions decide their own collectives (a K/V all-gather, a token exchange) when they run."""
    chains = Counter(" | ".join(b.inner_wrapper) for b in plan.boundaries if b.inner_wrapper)
    regions = sum(1 for b in plan.boundaries if b.local_region)
    parts = [f"inner wrapper {chain} on {n} module{'s' if n != 1 else ''}"
             for chain, n in chains.items()]
    if regions:
        parts.append(f"local region{'s' if regions != 1 else ''} on {regions} "
                     f"module{'s' if regions != 1 else ''}")
    return "; ".join(parts)


def _loss_text(loss: LossParallel) -> str:
    if loss.kind == "model":
        return ("the model's own labels= loss runs on the shards, a call without labels gets "
                "gathered logits")
    return "the caller computes the loss with hyperrecipe.vocab_parallel_cross_entropy"


def _adapter_text(a: AdapterPlan) -> str:
    out = f" (outputs {a.out_src})" if a.out_src is not None else ""
    n = len(a.within)
    within = f" within {n} module{'s' if n != 1 else ''}" if a.is_function else ""
    return f"{a.target} {a.mode}{out}{within}"


def explain(plan: Plan, pattern: str) -> str:
    """Why each parameter and boundary whose FQN matches ``pattern`` was decided as it was;
    also each method adapter whose target (``pkg.mod:Class.method``, or ``Class.method``) it
    names.

    Raises:
        ExplainError: nothing matches (a ``ValueError``); the message lists the nearest FQNs.
    """
    rx = compile_pattern(pattern)
    out: list[str] = []
    for p in plan.params:
        if rx.fullmatch(p.fqn) or rx.fullmatch(p.module):
            out.append(f"{p.fqn}: {p.placement}  local {list(p.local_shape)} of {list(p.shape)} "
                       f"{p.dtype}" + (f"  (tied to {p.tied_to})" if p.tied_to else ""))
            out.extend(f"  {prov}" for prov in p.provenance)
            if p.deferred:
                out.append("  bias deferred: added once after the boundary's reduction")
            if p.no_dtensor is not None:
                out.append(f"  no DTensor placement ({p.no_dtensor}): production mode runs it, "
                           f"validate mode refuses it")
            elif parse_dtensor(p.dtensor).parts is not None:
                out.append("  unequal chunks: validate mode computes this linear layer part by "
                           "part, each part a Shard(0) DTensor")
            for op in p.grad_reduce:
                why = (f"deferred bias added to an output sharded on {op.mesh_dim}" if p.deferred
                       else f"replicated, but sees only this rank's slice of the data on "
                            f"{op.mesh_dim}")
                out.append(f"  gradient: {op} in backward ({why}, so its gradient is partial)")
    pipe = plan.pipeline
    if pipe is not None:
        if rx.fullmatch(pipe.layers) or rx.fullmatch(pipe.mesh_dim):
            out.extend(pipeline_lines(pipe, plan))
            out.append(f"  {pipe.provenance}")
        else:
            for st in pipe.stages:
                owned = [f for f in st.params if rx.fullmatch(f) or rx.fullmatch(
                    f.rpartition(".")[0])]
                if owned:
                    out.append(f"pipeline stage {st.index} (rank {st.rank} on {pipe.mesh_dim}) "
                               f"owns {', '.join(owned)}")
    for h in plan.head_counts:
        if rx.fullmatch(h.module) or rx.fullmatch(f"{h.module}.{h.attr}"):
            out.append(f"{h.module}.{h.attr}: {h.global_value} -> {h.local_value} in production "
                       f"(divided by {h.mesh_dim})")
            out.append(f"  {h.provenance}")
    for b in plan.boundaries:
        if rx.fullmatch(b.fqn):
            parent = f", inside {b.parent}" if b.parent else ""
            out.append(f"{b.fqn}: boundary (depth {b.depth}{parent})  {_layout(b)}")
            out.extend(f"  {prov}" for prov in b.provenance)
            if b.vocab_parallel is not None:
                out.append(f"  vocab-parallel lookup over {b.vocab_parallel}: production mode "
                           f"looks up the ids this rank owns, others read as zero rows")
            loss = plan.loss_parallel
            if loss is not None and loss.boundary == b.fqn:
                out.append(f"  loss on vocab shards over {loss.mesh_dim}: {_loss_text(loss)}")
                out.append(f"  {loss.provenance}")
            ep = b.expert_parallel
            if ep is not None:
                out.append(f"  expert parallel over {ep.mesh_dim}: {ep.kernel} kernel, "
                           f"{ep.local_experts} of {ep.experts} experts per rank")
            for t in b.transitions:
                why = f"; {t.reason}" if t.reason else ""
                out.append(f"  {t.stage} {t.name} on {t.mesh_dim}: {t.src} -> {t.dst}: forward "
                           f"{t.forward}, backward {t.backward}{why}")
    for a in plan.adapters:
        if pattern in (a.target, a.target.partition(":")[2]) or rx.fullmatch(a.target):
            kind = "function" if a.is_function else "method"
            out.append(f"{a.target}: {kind} adapter {a.mode}"
                       + (f", outputs {a.out_src}" if a.out_src is not None else
                          (", outputs placed like the first DTensor argument"
                           if a.mode == "marshal" else "")))
            if a.within:
                out.append(f"  replaced while these run: {', '.join(a.within)}")
            out.append(f"  {a.provenance}")
    if not out:
        names = [*{p.fqn for p in plan.params}, *{p.module for p in plan.params},
                 *{b.fqn for b in plan.boundaries}]
        near = closest(pattern, sorted({generalize_fqn(n) for n in names}), n=3)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        raise ExplainError(f"--explain {pattern!r} matches no parameter or boundary{hint}")
    return "\n".join(out) + "\n"
