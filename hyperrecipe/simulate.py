"""A dry run at real scale on one machine: what each rank will hold and send, before renting it.

:func:`simulate` applies a compiled plan to a model built on the meta device, once per rank,
under torch's fake process group (``init_process_group("fake")``: collectives return without
communicating) and a ``DeviceMesh`` on the meta device, so the real ``apply`` runs (the same
sharding code, preflight and installs as on the cluster) and allocates nothing. It then reads
each rank's parameters, gradients and optimizer state off the applied model, and the
collectives of one training step off the plan's manifest. A 70B model at world size 8 takes
seconds and no memory.

Given a sequence length, it also runs one training step (forward with ``labels``, backward) of
one sequence on the meta device (:func:`trace_step`): the boundaries' outputs give the
activation bytes each rank holds per token as the plan lays them out (replicated, sequence
sharded, vocab sharded), and every collective issued is measured with its buffer's size,
inner wrappers' own (context parallel's K/V gathers) included, which the manifest does not
list. The same trace runs on a real applied model, which is how the tests hold the dry run to
a real gloo run.

What lives here: the dry run and its report (table and JSON). What does not: the sharding itself
(:mod:`hyperrecipe.runtime`).
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyperrecipe.errors import UsageError
from hyperrecipe.plan import Plan
from hyperrecipe.simulate_pipeline import ADAMW_STATE_BYTES, PipelineSimulation, simulate_pipeline

__all__ = ["ADAMW_STATE_BYTES", "BoundaryActivation", "MeasuredCollective", "RankMemory",
           "Simulation", "StepCollective", "StepTrace", "render_table", "simulate", "trace_step"]

@attrs.frozen(kw_only=True)
class BoundaryActivation:
    """What one boundary hands on in one step: the bytes of its outputs on this rank (after
    their transitions: a sequence-sharded output holds this rank's tokens only), for one
    sequence of the traced length."""

    boundary: str
    bytes: int


@attrs.frozen(kw_only=True)
class MeasuredCollective:
    """The collectives of one kind, mesh dim and direction one traced step issued on a rank.

    ``bytes`` sums, over those collectives, the largest buffer each one touches on this rank
    (the full tensor of a gather or reduce-scatter; the tensor of an all-reduce).
    ``in_manifest`` is how many of them the plan's manifest lists; the rest are an inner
    wrapper's own (context parallel's K/V gathers)."""

    kind: str
    mesh_dim: str
    direction: str
    count: int
    bytes: int
    in_manifest: int


@attrs.frozen(kw_only=True)
class StepTrace:
    """One training step of one sequence of ``seq_len`` tokens, as one rank ran it."""

    seq_len: int
    activations: tuple[BoundaryActivation, ...]
    collectives: tuple[MeasuredCollective, ...]

    @property
    def activation_bytes(self) -> int:
        """Every boundary's outputs together (nested boundaries' outputs are other tensors)."""
        return sum(a.bytes for a in self.activations)

    @property
    def activation_bytes_per_token(self) -> float:
        return self.activation_bytes / self.seq_len


@attrs.frozen(kw_only=True)
class RankMemory:
    """What one rank holds once the plan is applied (bytes; tied parameters counted once).

    ``gradient`` is one gradient per trainable parameter, in its dtype; ``optimizer`` is
    :data:`ADAMW_STATE_BYTES` per trainable element; ``buffers`` are the model's buffers
    (replicated, not in the plan)."""

    rank: int
    coords: tuple[tuple[str, int], ...]
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    step: StepTrace | None = None
    """The traced step (``simulate(..., seq_len=N)``), else None."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers


@attrs.frozen(kw_only=True)
class StepCollective:
    """How many times one step issues a collective kind over a mesh dim, per the manifest."""

    kind: str
    mesh_dim: str
    direction: str
    count: int


@attrs.frozen(kw_only=True)
class Simulation:
    """The dry run's report: per-rank memory and the collectives of one step."""

    recipe: str
    mesh: tuple[tuple[str, int], ...]
    mode: str
    ranks: tuple[RankMemory, ...]
    collectives: tuple[StepCollective, ...]
    grad_bucket_bytes: int
    """Bytes each rank reduces in gradient buckets per step (the plan's buckets' elements)."""
    seconds: float
    pipeline: PipelineSimulation | None = None
    """A pipelined plan's report (:mod:`hyperrecipe.simulate_pipeline`); its ``ranks`` are
    then empty: the plan is not applied."""

    def to_json(self) -> dict[str, Any]:
        extra = {} if self.pipeline is None else {"pipeline": self.pipeline.to_json()}
        return {
            "recipe": self.recipe, "mesh": dict(self.mesh), "mode": self.mode,
            "ranks": [{"rank": r.rank, "coords": dict(r.coords), "parameter_bytes": r.parameters,
                       "gradient_bytes": r.gradients, "optimizer_bytes": r.optimizer,
                       "buffer_bytes": r.buffers, "total_bytes": r.total,
                       **_step_json(r.step)} for r in self.ranks],
            "collectives_per_step": [attrs.asdict(c) for c in self.collectives],
            "grad_bucket_bytes_per_step": self.grad_bucket_bytes,
            "seconds": round(self.seconds, 3),
            **extra,
        }


def _step_json(step: StepTrace | None) -> dict[str, Any]:
    if step is None:
        return {}
    return {"seq_len": step.seq_len,
            "activation_bytes": step.activation_bytes,
            "activation_bytes_per_token": step.activation_bytes_per_token,
            "activations": [attrs.asdict(a) for a in step.activations],
            "collectives_measured": [attrs.asdict(c) for c in step.collectives]}


def simulate(model: nn.Module, plan: Plan, *, ranks: Iterable[int] | None = None,
             mode: str = "production", seq_len: int | None = None,
             batch: int | None = None) -> Simulation:
    """Apply ``plan`` to a copy of the meta-built ``model`` as each rank would, under a fake
    process group of the plan's world size, and report what each rank holds.

    Args:
        model: the model built on the meta device (``hyperrecipe.model_tree.build_model``);
            it is copied for each rank and left as it is.
        plan: the compiled plan (its mesh gives the world size and the mesh's shape).
        ranks: the ranks to simulate (default every rank of the mesh).
        mode: ``"production"`` (default) or ``"validate"``.
        seq_len: also trace one training step of one sequence of this many tokens on each
            rank (:func:`trace_step`): activation bytes per token and every collective with
            its bytes. The model's forward must take ``input_ids`` and ``labels``.
        batch: a pipelined plan's global batch in sequences (default one per microbatch).

    A plan with a ``pipeline`` is not applied: :func:`~hyperrecipe.simulate_pipeline.
    simulate_pipeline` reports it per stage and per pipeline rank (``Simulation.pipeline``),
    with ``ranks`` and ``seq_len`` meaning pipeline ranks and the microbatches' sequence
    length.

    Returns:
        The :class:`Simulation`.

    Raises:
        UsageError: a process group is already initialized in this process (the dry run needs
            the default group for the fake one), a parameter of ``model`` is not on the meta
            device, a rank is outside the mesh, or ``seq_len`` is not positive or given with
            ``mode="validate"``.
        Anything ``apply`` (or, with ``seq_len``, the model's forward) raises for this plan
        and model.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        msg = ("simulate() runs its own fake process group and this process already has one; "
               "run the dry run in a process of its own (`hyperrecipe simulate`)")
        raise UsageError(msg)
    real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if real:
        msg = (f"simulate() needs the model built on the meta device; {real[0]!r} is on "
               f"{model.get_parameter(real[0]).device}: build it with "
               f"hyperrecipe.model_tree.build_model(...) or under `with torch.device('meta')`")
        raise UsageError(msg)
    if seq_len is not None and seq_len <= 0:
        msg = f"simulate(): seq_len must be a positive number of tokens, not {seq_len}"
        raise UsageError(msg)
    if plan.pipeline is not None:
        return _simulate_pipelined(model, plan, ranks, mode, seq_len, batch)
    if batch is not None:
        msg = ("simulate(batch=...) sizes a pipelined plan's microbatches; this plan has no "
               "pipeline section: drop batch (or --batch)")
        raise UsageError(msg)
    shape = plan.mesh_shape
    world = math.prod(shape.values())
    chosen = list(range(world)) if ranks is None else sorted(set(ranks))
    outside = [r for r in chosen if not 0 <= r < world]
    if outside:
        msg = f"simulate(): rank(s) {outside} are outside the mesh of {world} ranks"
        raise UsageError(msg)
    if seq_len is not None and mode != "production":
        msg = (f"simulate(seq_len=...) traces production mode only, not {mode!r}: validate "
               f"mode's DTensor ops do not run on a meta mesh; drop seq_len (or --seq-len) or "
               f"the mode")
        raise UsageError(msg)
    started = time.perf_counter()
    rows = tuple(_simulate_rank(model, plan, shape, rank, world, mode, seq_len)
                 for rank in chosen)
    return Simulation(recipe=plan.recipe, mesh=tuple(shape.items()), mode=mode, ranks=rows,
                      collectives=_step_collectives(plan),
                      grad_bucket_bytes=sum(b.numel * _itemsize(b.dtype) * len(b.ops)
                                            for b in plan.grad_buckets),
                      seconds=time.perf_counter() - started)


def _simulate_pipelined(model: nn.Module, plan: Plan, ranks: Iterable[int] | None, mode: str,
                        seq_len: int | None, batch: int | None) -> Simulation:
    started = time.perf_counter()
    report = simulate_pipeline(model, plan, ranks=None if ranks is None else list(ranks),
                               seq_len=seq_len, batch=batch)
    return Simulation(recipe=plan.recipe, mesh=tuple(plan.mesh_shape.items()), mode=mode,
                      ranks=(), collectives=_step_collectives(plan),
                      grad_bucket_bytes=sum(b.numel * _itemsize(b.dtype) * len(b.ops)
                                            for b in plan.grad_buckets),
                      seconds=time.perf_counter() - started, pipeline=report)


def _simulate_rank(model: nn.Module, plan: Plan, shape: Mapping[str, int], rank: int,
                   world: int, mode: str, seq_len: int | None) -> RankMemory:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.runtime import apply

    copied = copy.deepcopy(model)
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("meta", tuple(shape.values()), mesh_dim_names=tuple(shape))
        installation = apply(copied, plan, mesh, mode=mode)  # type: ignore[arg-type]
        coords = tuple((name, mesh.get_local_rank(name)) for name in shape)
        params = list(copied.parameters())  # each object once: tied parameters count once
        trainable = [p for p in params if p.requires_grad]
        row = RankMemory(rank=rank, coords=coords,
                         parameters=sum(_bytes(p) for p in params),
                         gradients=sum(_bytes(p) for p in trainable),
                         optimizer=sum(_local(p).numel() for p in trainable) * ADAMW_STATE_BYTES,
                         buffers=sum(_bytes(b) for b in copied.buffers()))
        if seq_len is not None:
            row = attrs.evolve(row, step=trace_step(copied, plan, seq_len,
                                                    torch.device("meta")))
        # process-wide installs (an attention hook of an inner wrapper) go with the copy, so
        # the next rank's apply finds the process as this one did
        installation.restore()
    finally:
        dist.destroy_process_group()
    return row


def trace_step(model: nn.Module, plan: Plan, seq_len: int,
               device: torch.device) -> StepTrace:
    """Run one training step of one sequence of ``seq_len`` tokens (all token 0, labels equal
    to the inputs) on the applied ``model`` and measure what the plan lays out: each
    boundary's outputs and each collective issued, with its buffer's bytes.

    On the meta device under the fake process group this is the dry run; on a real model (a
    collective: every rank) it is what the dry run is compared with. Collectives are labelled
    with the records of :func:`~hyperrecipe.runtime.comm.collectives.count_collectives` (kind,
    mesh dim, direction) and sized by a dispatch mode that sees each ``c10d`` op; ops issued
    outside that module (the expert-parallel dispatch kernel's ``all_to_all_single``) count
    toward the op recorded before them. Plans whose shapes depend on values (token dispatch)
    cannot be traced on the meta device.

    Raises:
        UsageError: the model's forward does not take ``input_ids`` and ``labels``, or returns
            no ``loss``.
    """
    import inspect

    from torch.utils._pytree import tree_leaves

    from hyperrecipe.runtime import count_collectives

    accepted = inspect.signature(model.forward).parameters
    if not {"input_ids", "labels"} <= set(accepted):
        msg = (f"simulate(seq_len=...): {type(model).__name__}.forward takes no input_ids and "
               f"labels; the step trace runs a causal LM's own loss")
        raise UsageError(msg)
    outputs: dict[str, int] = {}

    def on_output(fqn: str) -> Any:
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            size = sum(_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            outputs[fqn] = outputs.get(fqn, 0) + size
        return hook

    handles = [model.get_submodule(b.fqn).register_forward_hook(on_output(b.fqn))
               for b in plan.boundaries]
    ids = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    try:
        with count_collectives() as log, _CollectiveSizes(log.records) as sized:
            loss = getattr(model(input_ids=ids, labels=ids), "loss", None)
            if not isinstance(loss, torch.Tensor):
                msg = (f"simulate(seq_len=...): {type(model).__name__} returned no loss for "
                       f"labels=; the step trace runs the model's own loss")
                raise UsageError(msg)
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for handle in handles:
            handle.remove()
    sizes = sized.sizes + [0] * (len(log.records) - len(sized.sizes))
    manifest: Counter[tuple[str, str, str]] = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest
                       if e.op.communicates)
    counts: Counter[tuple[str, str, str]] = Counter()
    total: Counter[tuple[str, str, str]] = Counter()
    for record, size in zip(log.records, sizes, strict=False):
        key = (record.kind, record.mesh_dim, record.direction)
        counts[key] += 1
        total[key] += size
    measured = tuple(MeasuredCollective(kind=k, mesh_dim=d, direction=w, count=n,
                                        bytes=total[(k, d, w)],
                                        in_manifest=min(n, manifest[(k, d, w)]))
                     for (k, d, w), n in sorted(counts.items()))
    activations = tuple(BoundaryActivation(boundary=b.fqn, bytes=outputs.get(b.fqn, 0))
                        for b in plan.boundaries)
    return StepTrace(seq_len=seq_len, activations=activations, collectives=measured)


class _CollectiveSizes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sizes each ``c10d`` op once it went through (a backend's refused attempt, before its
    fallback, is not counted) and files it under the last collective record: ``sizes[i]`` is
    the largest buffer of the ops issued for ``records[i]``."""

    def __init__(self, records: list[Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.records = records
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", "") == "c10d":
            size = max((_bytes(t) for t in tree_leaves((args, kwargs or {}))
                        if isinstance(t, torch.Tensor)), default=0)
            at = max(len(self.records), 1) - 1
            self.sizes.extend([0] * (at + 1 - len(self.sizes)))
            self.sizes[at] = max(self.sizes[at], size)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype.removeprefix("torch.")).itemsize)


def _step_collectives(plan: Plan) -> tuple[StepCollective, ...]:
    counted = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest
                      if e.op.communicates)
    return tuple(StepCollective(kind=k, mesh_dim=d, direction=w, count=n)
                 for (k, d, w), n in sorted(counted.items()))


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")


def render_table(sim: Simulation) -> str:
    """The report as text: a row per group of ranks holding the same bytes, then the
    collectives of one step (and, when a step was traced, what it measured); a pipelined
    plan's report per stage and pipeline rank instead."""
    if sim.pipeline is not None:
        return _render_pipeline_table(sim.pipeline, recipe=sim.recipe, seconds=sim.seconds)
    mesh = ",".join(f"{k}={v}" for k, v in sim.mesh)
    traced = [r.step for r in sim.ranks if r.step is not None]
    seq = f"; one step of {traced[0].seq_len} tokens traced" if traced else ""
    lines = [f"dry run of {sim.recipe} on {mesh} ({sim.mode}, fake process group, meta device; "
             f"{len(sim.ranks)} rank(s) in {sim.seconds:.2f} s{seq})", "",
             f"{'ranks':<16} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
             f"{'buffers':>12} {'total':>12}" + (f" {'act/token':>12}" if traced else "")]
    groups: dict[tuple[int, int, int, int, float | None], list[int]] = {}
    for r in sim.ranks:
        per_token = r.step.activation_bytes_per_token if r.step is not None else None
        groups.setdefault((r.parameters, r.gradients, r.optimizer, r.buffers, per_token),
                          []).append(r.rank)
    for (p, g, o, b, a), members in groups.items():
        act = "" if a is None else f" {_human_float(a):>12}"
        lines.append(f"{_rank_span(members):<16} {_human(p):>12} {_human(g):>12} "
                     f"{_human(o):>12} {_human(b):>12} {_human(p + g + o + b):>12}{act}")
    activations = ("act/token: the boundaries' outputs per token of the sequence, as the plan "
                   "lays them out" if traced else "activations not included (--seq-len)")
    lines += ["", f"optimizer: AdamW, {ADAMW_STATE_BYTES} bytes (two fp32 moments) per trainable "
                  f"element; {activations}", "",
              "collectives per step (from the plan's manifest, every rank):"]
    if not sim.collectives:
        lines.append("  none")
    for c in sim.collectives:
        lines.append(f"  {c.count:>5} x {c.kind} over {c.mesh_dim} ({c.direction})")
    if sim.grad_bucket_bytes:
        lines.append(f"  gradient buckets reduce {_human(sim.grad_bucket_bytes)} per step")
    first = next((r for r in sim.ranks if r.step is not None), None)
    if first is not None and first.step is not None:
        lines += ["", f"collectives of the traced step on rank {first.rank} (bytes: the largest "
                      f"buffer of each, summed):"]
        for m in first.step.collectives:
            inner = m.count - m.in_manifest
            extra = f"; {inner} from an inner wrapper, not in the manifest" if inner else ""
            lines.append(f"  {m.count:>5} x {m.kind} over {m.mesh_dim} ({m.direction}): "
                         f"{_human(m.bytes)}{extra}")
    return "\n".join(lines) + "\n"


def _human_float(n: float) -> str:
    return _human(int(n)) if n == int(n) else f"{n:.1f} B" if n < 1024 else _human(round(n))


def _rank_span(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{len(ranks)} ranks"


def _render_pipeline_table(pipe: PipelineSimulation, *, recipe: str, seconds: float) -> str:
    """The pipelined report as text: a row per stage, a row per pipeline rank, the bubble."""
    seq = (f"; activations of one microbatch of {pipe.microbatch_size} x {pipe.seq_len} tokens "
           f"measured on meta" if pipe.seq_len is not None else "")
    lines = [f"dry run of {recipe} pipelined over {pipe.mesh_dim}={len({s.rank for s in pipe.stages})}: "
             f"{pipe.schedule}, {pipe.microbatches} microbatches, {pipe.stages_per_rank} "
             f"stage(s) per rank (not applied; {seconds:.2f} s{seq})", "",
             f"{'stage':<6} {'rank':>4} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
             f"{'act/microbatch':>15}  layers"]
    for s in pipe.stages:
        act = "-" if s.activations_per_microbatch is None else _human(s.activations_per_microbatch)
        lines.append(f"{s.index:<6} {s.rank:>4} {_human(s.parameters):>12} "
                     f"{_human(s.gradients):>12} {_human(s.optimizer):>12} {act:>15}  {s.layers}")
    lines += ["", f"{'rank':<6} {'stages':>8} {'parameters':>12} {'gradients':>12} "
                  f"{'optimizer':>12} {'in flight':>9} {'activations':>12} {'total':>12} "
                  f"{'bubble':>7}"]
    for r in pipe.ranks:
        act = "-" if r.activations is None else _human(r.activations)
        lines.append(f"{r.rank:<6} {','.join(map(str, r.stages)):>8} {_human(r.parameters):>12} "
                     f"{_human(r.gradients):>12} {_human(r.optimizer):>12} "
                     f"{r.peak_in_flight:>9} {act:>12} {_human(r.total):>12} "
                     f"{r.bubble:>6.1%}")
    activations = ("activations: the rank's peak of microbatch stage chunks in flight, each its "
                   "stage's saved-for-backward bytes" if pipe.seq_len is not None
                   else "activations not included (--seq-len)")
    lines += ["", f"mean bubble {pipe.mean_bubble:.1%} (forward 1, backward 2, no send delay)",
              f"optimizer: AdamW, {ADAMW_STATE_BYTES} bytes (two fp32 moments) per trainable "
              f"element; {activations}"]
    if pipe.activation_note:
        lines.append(pipe.activation_note)
    return "\n".join(lines) + "\n"
