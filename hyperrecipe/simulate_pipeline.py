"""The dry run of a pipelined plan: what each stage and each pipeline rank holds, and its bubble.

A plan with a ``pipeline`` section is not applied (the stages are separate programs, not
shardings of one): :func:`simulate_pipeline` reads each stage's parameters off the plan
(gradients alike; AdamW's state at :data:`ADAMW_STATE_BYTES` per element), measures one
microbatch's activations per stage by running one forward of the whole model on the meta device (:func:`measure_stage_activations`: every tensor autograd saves for
backward, attributed to the stage whose layer or outer module was running), and multiplies
them by what the schedule keeps in flight on each rank (:mod:`hyperrecipe.pipeline.schedule`'s
timeline, which also gives each rank's idle share, its bubble).

What lives here: the pipelined dry run's measurements and report. What does not: the per-rank
apply of other plans and the rendered table (:mod:`hyperrecipe.simulate`, which calls this module
and sits above it), the schedules themselves (:mod:`hyperrecipe.pipeline`).
"""

from __future__ import annotations

import math

import functools
from typing import Any

import attrs
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hyperrecipe.errors import UsageError
from hyperrecipe.pipeline.schedule import Action, schedule_actions, simulate_timeline
from hyperrecipe.plan import PipelinePlan, Plan

__all__ = ["ADAMW_STATE_BYTES", "PipelineRankMemory", "PipelineSimulation", "StageMemory",
           "measure_stage_activations", "simulate_pipeline"]

ADAMW_STATE_BYTES = 8
"""Optimizer bytes per trainable element: AdamW's two moments (``exp_avg``, ``exp_avg_sq``)
kept in fp32, as mixed-precision training keeps them whatever the parameters' dtype.
(:mod:`hyperrecipe.simulate`, which imports this module, exports it too.)"""


@attrs.frozen(kw_only=True)
class StageMemory:
    """One stage's bytes: its parameters (from the plan; a tied parameter counts on each stage
    holding a copy), one gradient each, AdamW's state, and the activations one microbatch
    leaves saved for backward (``None`` when no sequence length was given)."""

    index: int
    rank: int
    layers: str
    """``model.layers[0:10]`` plus the outer modules the stage owns."""
    parameters: int
    gradients: int
    optimizer: int
    activations_per_microbatch: int | None


@attrs.frozen(kw_only=True)
class PipelineRankMemory:
    """One pipeline rank: the sum over its stages, the activations it holds at its peak (each
    stage chunk in flight counts its own stage's per-microbatch bytes), and its bubble."""

    rank: int
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer: int
    peak_in_flight: int
    """The most microbatch stage chunks whose forward ran and whose backward has not."""
    activations: int | None
    bubble: float
    """The share of the step this rank waits (forward 1, backward 2, no send delay)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + (self.activations or 0)


@attrs.frozen(kw_only=True)
class PipelineSimulation:
    """The pipelined dry run: per stage, per pipeline rank, and the mean bubble."""

    mesh_dim: str
    schedule: str
    microbatches: int
    stages_per_rank: int
    seq_len: int | None
    microbatch_size: int | None
    """Sequences per microbatch (the global batch over the microbatches)."""
    stages: tuple[StageMemory, ...]
    ranks: tuple[PipelineRankMemory, ...]
    mean_bubble: float
    activation_note: str = ""
    """Set beside another model-parallel dim: the activations were measured on the whole
    model, so they bound a rank's from above instead of measuring them."""

    def to_json(self) -> dict[str, Any]:
        return {"mesh_dim": self.mesh_dim, "schedule": self.schedule,
                "microbatches": self.microbatches, "stages_per_rank": self.stages_per_rank,
                "seq_len": self.seq_len, "microbatch_size": self.microbatch_size,
                "stages": [attrs.asdict(s) for s in self.stages],
                "ranks": [{**attrs.asdict(r), "stages": list(r.stages), "total_bytes": r.total}
                          for r in self.ranks],
                "mean_bubble": self.mean_bubble, "activation_note": self.activation_note}


def simulate_pipeline(model: nn.Module, plan: Plan, *, ranks: list[int] | None = None,
                      seq_len: int | None = None, batch: int | None = None) -> PipelineSimulation:
    """Report a pipelined plan per stage and per pipeline rank, without applying it.

    Args:
        model: the model built on the meta device; left as it is.
        plan: a compiled plan with a ``pipeline``.
        ranks: the pipeline ranks to report (default every one).
        seq_len: measure activations with sequences of this many tokens.
        batch: the global batch in sequences (default one sequence per microbatch); it must
            divide into the plan's microbatches.

    Returns:
        The :class:`PipelineSimulation`.

    Raises:
        UsageError: the plan has no pipeline, ``batch`` does not divide into its microbatches,
            or a rank is outside the pipeline.
    """
    pipe = plan.pipeline
    if pipe is None:
        msg = "simulate_pipeline() needs a plan with a pipeline section"
        raise UsageError(msg)
    pp = plan.mesh_shape[pipe.mesh_dim]
    chosen = list(range(pp)) if ranks is None else sorted(set(ranks))
    outside = [r for r in chosen if not 0 <= r < pp]
    if outside:
        msg = f"simulate(): rank(s) {outside} are outside the pipeline of {pp} ranks"
        raise UsageError(msg)
    global_batch = pipe.microbatches if batch is None else batch
    if global_batch <= 0 or global_batch % pipe.microbatches:
        msg = (f"simulate(): the global batch must split into the plan's microbatches. "
               f"Declared: batch={global_batch}; required: a positive multiple of "
               f"{pipe.microbatches}.")
        raise UsageError(msg)
    micro = global_batch // pipe.microbatches
    per_micro = (measure_stage_activations(model, pipe, batch=micro, seq_len=seq_len)
                 if seq_len is not None else None)
    stages = tuple(_stage_memory(model, plan, s.index, per_micro) for s in pipe.stages)
    actions = schedule_actions(pipe.schedule, pp, pipe.microbatches, pipe.stages_per_rank)
    timeline = simulate_timeline(actions)
    rows = []
    for rank in chosen:
        mine = [s for s in stages if s.rank == rank]
        held = None if per_micro is None else _peak_bytes(actions[rank], per_micro)
        rows.append(PipelineRankMemory(
            rank=rank, stages=tuple(s.index for s in mine),
            parameters=sum(s.parameters for s in mine), gradients=sum(s.gradients for s in mine),
            optimizer=sum(s.optimizer for s in mine),
            peak_in_flight=timeline.peak_activations[rank], activations=held,
            bubble=timeline.bubble[rank]))
    return PipelineSimulation(mesh_dim=pipe.mesh_dim, schedule=pipe.schedule,
                              microbatches=pipe.microbatches,
                              stages_per_rank=pipe.stages_per_rank, seq_len=seq_len,
                              microbatch_size=micro if seq_len is not None else None,
                              stages=stages, ranks=tuple(rows), mean_bubble=timeline.mean_bubble,
                              activation_note=_activation_note(plan, seq_len))


def _activation_note(plan: Plan, seq_len: int | None) -> str:
    pipe = plan.pipeline
    assert pipe is not None
    others = [f"{d.name}={d.size}" for d in plan.mesh
              if d.name != pipe.mesh_dim and d.size > 1 and d.name in plan.model_parallel_dims]
    if seq_len is None or not others:
        return ""
    return (f"activations measured on the whole model, without the sharding over "
            f"{', '.join(others)}: an upper bound per rank")


def _stage_memory(model: nn.Module, plan: Plan, index: int,
                  per_micro: tuple[int, ...] | None) -> StageMemory:
    """A stage's bytes on one of its ranks: the plan's local shards (beside tensor parallel a
    rank holds its share of each of the stage's parameters)."""
    pipe = plan.pipeline
    assert pipe is not None
    stage = pipe.stages[index]
    local = {p.fqn: math.prod(p.local_shape) for p in plan.params}
    trainable = [fqn for fqn in stage.params if model.get_parameter(fqn).requires_grad]
    outer = f" + {', '.join(stage.modules)}" if stage.modules else ""

    def size(fqn: str) -> int:
        return local[fqn] * model.get_parameter(fqn).element_size()

    return StageMemory(
        index=stage.index, rank=stage.rank,
        layers=f"{pipe.layers}[{stage.start}:{stage.stop}]{outer}",
        parameters=sum(size(f) for f in stage.params),
        gradients=sum(size(f) for f in trainable),
        optimizer=sum(local[f] for f in trainable) * ADAMW_STATE_BYTES,
        activations_per_microbatch=None if per_micro is None else per_micro[stage.index])


def _peak_bytes(actions: tuple[Action, ...], per_micro: tuple[int, ...]) -> int:
    """The most activation bytes a rank holds: each forward adds its stage's microbatch
    activations until that stage's input gradient (``B`` or ``I``) for it runs, as the
    timeline counts chunks."""
    held = peak = 0
    for action in actions:
        if action.kind == "F":
            held += per_micro[action.stage]
        elif action.kind in ("B", "I"):
            held -= per_micro[action.stage]
        peak = max(peak, held)
    return peak


def measure_stage_activations(model: nn.Module, pipe: PipelinePlan, *, batch: int,
                              seq_len: int) -> tuple[int, ...]:
    """The bytes one microbatch leaves saved for backward on each stage.

    Runs one forward of ``model`` (``input_ids`` and ``labels`` of ``batch`` x ``seq_len``
    token 0s, on the device of its parameters: meta for the dry run, a real device for the
    reference) under :func:`torch.autograd.graph.saved_tensors_hooks`. Each saved tensor's
    storage is attributed to the unit running when autograd saved it (layer ``i`` of the split
    list, or an outer module; what runs before the first layer counts on stage 0, and the loss
    after the last module on the last stage), found by module pre-hooks. A stage holds each
    storage once however many of its ops save it (a view saved by two layers counts once), and
    never the parameters' own storages (the weights are counted as parameters).

    On the meta device torch's attention picks its math kernel, which saves the
    ``heads x seq x seq`` probabilities; a real device picks a fused kernel that saves its
    inputs, output and log-sum-exp. The measurement runs the fused kernel on meta
    (:class:`_FusedAttentionOnMeta`), so it saves what a real run saves.

    Returns:
        Per stage index, the bytes.

    Raises:
        UsageError: the model's forward takes no ``input_ids`` and ``labels`` or returns no loss.
    """
    import inspect

    if not {"input_ids", "labels"} <= set(inspect.signature(model.forward).parameters):
        msg = (f"simulate(seq_len=...): {type(model).__name__}.forward takes no input_ids and "
               f"labels; the activation measurement runs a causal LM's own loss")
        raise UsageError(msg)
    stage_of_layer = {i: s.index for s in pipe.stages for i in range(s.start, s.stop)}
    stage_of_module = {m: s.index for s in pipe.stages for m in s.modules}
    current = [0]
    saved: list[dict[int, int]] = [{} for _ in pipe.stages]
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    kept: list[torch.Tensor] = []  # storages stay alive, so their keys stay unique

    def enter(stage: int, _module: nn.Module, _args: Any) -> None:
        current[0] = stage

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in weights:
            saved[current[0]].setdefault(storage._cdata, storage.nbytes())
            kept.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    layers = model.get_submodule(pipe.layers)
    handles = [layers.get_submodule(str(i)).register_forward_pre_hook(
                   functools.partial(enter, stage)) for i, stage in stage_of_layer.items()]
    handles += [model.get_submodule(m).register_forward_pre_hook(functools.partial(enter, s))
                for m, s in stage_of_module.items()]
    device = next(model.parameters()).device
    ids = torch.zeros((batch, seq_len), dtype=torch.long, device=device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _FusedAttentionOnMeta():
            loss = getattr(model(input_ids=ids, labels=ids), "loss", None)
        if not isinstance(loss, torch.Tensor):
            msg = (f"simulate(seq_len=...): {type(model).__name__} returned no loss for "
                   f"labels=; the activation measurement runs the model's own loss")
            raise UsageError(msg)
    finally:
        for handle in handles:
            handle.remove()
    del kept, loss
    return tuple(sum(s.values()) for s in saved)


class _FusedAttentionOnMeta(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` of meta tensors as the fused kernel CPUs run
    (``_scaled_dot_product_flash_attention_for_cpu``: it saves the query, key, value, output
    and log-sum-exp, as GPUs' flash kernel does) instead of the math kernel torch picks on meta.
    Other calls pass through."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            query = args[0] if args else kwargs.get("query")
            if isinstance(query, torch.Tensor) and query.device.type == "meta":
                return _fused_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    del enable_gqa  # the fused kernel takes fewer key/value heads as they come
    out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return out
