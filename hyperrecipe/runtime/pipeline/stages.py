"""A rank's pipeline stages, built from the plan: which modules each stage owns, the placeholders
for the rest, the entry and exit on its first and last layer.

A rank's first stage is the live model itself; a second stage on the same rank (interleaved and
V-shaped schedules) is a skeleton copy made before anything changes, sharing the live model's
parameters it owns and buffers and holding meta tensors for the rest (which placeholders then
replace). Every change goes through one :class:`~hyperrecipe.rewriter.Rewrite` the caller holds,
so a failure anywhere leaves the model as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch
from torch import nn

from hyperrecipe.errors import PipelineError, StageDone, did_you_mean
from hyperrecipe.plan import PipelinePlan, PipelineStagePlan
from hyperrecipe.rewriter import Rewrite
from hyperrecipe.runtime.pipeline.boundary import edge_forward
from hyperrecipe.runtime.pipeline.placeholder import Side, StagePlaceholder, StageRun
from hyperrecipe.runtime.state.materialize import materialize_buffers

__all__ = ["LOSS_KEYS", "TARGET_KEY", "LossFn", "StageModule", "build_stage_modules"]

LossFn = Callable[[Any, Any], torch.Tensor]

TARGET_KEY: Final = "_hr_pipeline_target"
"""The step keyword that carries a ``loss_fn`` target to the last stage (chunked like inputs)."""
LOSS_KEYS: Final = ("labels", "num_items_in_batch", TARGET_KEY)
"""Step keywords only the last stage's forward takes; earlier stages drop them."""


class StageModule(nn.Module):
    """One stage as :class:`torch.distributed.pipelining.PipelineStage` runs it.

    The forward runs the model's own forward: the hidden states received from the previous
    stage come in positionally, the model's inputs as keywords (every stage gets them, so masks
    and positions are recomputed locally instead of sent). A stage that is not the last returns
    the hidden states after its last layer; the last stage returns the microbatch's loss, either
    the model's own (``labels`` given) or ``loss_fn(output, target) / microbatches``.
    """

    def __init__(self, model: nn.Module, plan: PipelineStagePlan, run: StageRun, *,
                 is_last: bool, last_layer: str, loss_fn: LossFn | None,
                 microbatches: int) -> None:
        super().__init__()
        self.model = model
        self.index = plan.index
        self.is_last = is_last
        self.last_layer = last_layer
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        object.__setattr__(self, "_hr_run", run)

    def probe(self, **inputs: Any) -> torch.Tensor:
        """The hidden states this stage's first layer gets for ``inputs`` (one microbatch),
        without running any owned layer: their shape and dtype are what crosses the stage's
        boundaries."""
        run: StageRun = self.__dict__["_hr_run"]
        run.probing = True
        try:
            with torch.no_grad():
                hidden: torch.Tensor = self(**{k: v for k, v in inputs.items()
                                               if k not in LOSS_KEYS})
            return hidden
        finally:
            run.probing = False

    def forward(self, *received: torch.Tensor, **inputs: Any) -> torch.Tensor:
        run: StageRun = self.__dict__["_hr_run"]
        target = inputs.pop(TARGET_KEY, None)
        if not self.is_last or run.probing:
            for key in LOSS_KEYS:
                inputs.pop(key, None)
        run.begin(received[0] if received else None)
        try:
            with run.tracking():
                out = self.model(**inputs)
        except StageDone as done:
            hidden: torch.Tensor = done.output
            return hidden
        finally:
            run.end()
        if not self.is_last or run.probing:
            msg = (f"pipeline stage {self.index}: the model's forward returned without calling "
                   f"its last layer {self.last_layer}; the plan's split does not match the "
                   f"model's forward")
            raise PipelineError(msg)
        if self.loss_fn is not None:
            return self.loss_fn(out, target) / self.microbatches
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if not isinstance(loss, torch.Tensor):
            msg = (f"pipeline stage {self.index}: the model returned no loss for the labels it "
                   f"was given; pass loss_fn to build_pipeline for a model without labels")
            raise PipelineError(msg)
        return loss


def _meta_param(p: torch.Tensor) -> torch.Tensor:
    if isinstance(p, nn.Parameter):
        return nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return torch.empty_like(p, device="meta")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on meta, made without moving the live
    model: ``.to("meta")`` on a live module would also strip a weight it ties to an owned one."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        memo[id(t)] = _meta_param(t)
    return copy.deepcopy(model, memo)


def _skeleton(model: nn.Module, owned: set[int]) -> nn.Module:
    """A copy of ``model`` sharing the parameters in ``owned`` (and every buffer) and holding
    meta tensors for the rest, which become placeholders."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = p if id(p) in owned else _meta_param(p)
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo)


def _submodule(model: nn.Module, fqn: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        names = [n for n, _ in model.named_modules()]
        msg = f"the plan's pipeline {what} {fqn!r} is not a module of the model{did_you_mean(fqn, names)}"
        raise PipelineError(msg) from None


def _layer_list(model: nn.Module, pipeline: PipelinePlan) -> nn.ModuleList:
    layers = _submodule(model, pipeline.layers, "layers")
    if not isinstance(layers, nn.ModuleList) or len(layers) != pipeline.num_layers:
        size = len(layers) if isinstance(layers, nn.ModuleList) else type(layers).__name__
        msg = (f"the plan splits {pipeline.layers!r} as an nn.ModuleList of "
               f"{pipeline.num_layers} layers; the model has {size}")
        raise PipelineError(msg)
    return layers


def _elsewhere(pipeline: PipelinePlan,
               stage: PipelineStagePlan) -> list[tuple[str, Side, str, bool]]:
    """(FQN, side, owning stage in words, is a layer) of every module this stage does not own."""
    last = len(pipeline.stages) - 1
    owner_of = {i: s.index for s in pipeline.stages for i in range(s.start, s.stop)}
    out: list[tuple[str, Side, str, bool]] = []
    if stage.index != 0:
        out += [(fqn, "before", "stage 0 (pipeline.first)", False) for fqn in pipeline.first]
    out += [(f"{pipeline.layers}.{i}", "before" if i < stage.start else "after",
             f"stage {owner_of.get(i, '?')}", True)
            for i in range(pipeline.num_layers) if not stage.start <= i < stage.stop]
    if stage.index != last:
        out += [(fqn, "after", f"stage {last} (pipeline.last)", False) for fqn in pipeline.last]
    return out


def _owned_param_ids(model: nn.Module, pipeline: PipelinePlan,
                     stage: PipelineStagePlan) -> set[int]:
    named = dict(model.named_parameters(remove_duplicate=False))
    missing = [fqn for fqn in stage.params if fqn not in named]
    if missing:
        msg = (f"pipeline stage {stage.index} owns parameters the model does not have: "
               f"{missing[:5]}{did_you_mean(missing[0], list(named))}")
        raise PipelineError(msg)
    return {id(named[fqn]) for fqn in stage.params}


def _check_coverage(model: nn.Module, pipeline: PipelinePlan) -> None:
    """Every parameter lives in the split list or in a ``first``/``last`` module: one outside
    them would run on every stage with a copy per rank, and train as several weights."""
    owners = (f"{pipeline.layers}.", *(f"{m}." for m in (*pipeline.first, *pipeline.last)))
    loose = [n for n, _ in model.named_parameters(remove_duplicate=False)
             if not n.startswith(owners)]
    if loose:
        msg = (f"parameters {loose[:5]} are outside the pipeline's split list "
               f"{pipeline.layers!r} and in no module of pipeline.first "
               f"{list(pipeline.first)} or pipeline.last {list(pipeline.last)}: declare their "
               f"module in one of them")
        raise PipelineError(msg)


def _check_ownership(module: nn.Module, stage: PipelineStagePlan) -> None:
    """After placeholders went in, the stage holds exactly the parameters the plan gives it."""
    held = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    extra, missing = sorted(held - set(stage.params)), sorted(set(stage.params) - held)
    if extra or missing:
        msg = (f"pipeline stage {stage.index} holds parameters the plan does not give it "
               f"({extra[:5]}) or lacks ones it does ({missing[:5]}): a parameter-holding "
               f"module outside the split list is missing from pipeline.first/last")
        raise PipelineError(msg)


def _materialize(tx: Rewrite, model: nn.Module, device: torch.device, label: str) -> None:
    """Give a meta model's owned parameters and kept buffers storage on ``device``, keeping
    ties within the stage: parameters and persistent buffers unset (the caller initialises or
    loads them: ``pipe.state.load_weights``), non-persistent buffers (rotary tables)
    recomputed by the model's own initializer, as ``apply`` does on a meta model."""
    done: dict[int, nn.Parameter] = {}
    for mod_fqn, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, StagePlaceholder):
            continue
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                           requires_grad=p.requires_grad)
            tx.replace_parameter(mod, name, done[id(p)], fqn=f"{label}{mod_fqn}")
    materialize_buffers(model, tx, device)


StageApply = Callable[[nn.Module, PipelineStagePlan], None]
"""Called on each stage model once its placeholders are in and before its entry and exit are:
where a pipeline beside tensor parallel applies the stage's share of the plan."""


def build_stage_modules(tx: Rewrite, model: nn.Module, pipeline: PipelinePlan, pp_rank: int,
                        device: torch.device, *, loss_fn: LossFn | None,
                        apply_stage: StageApply | None = None) -> list[StageModule]:
    """This rank's stages (``pipeline.stages`` whose ``rank`` is ``pp_rank``), in stage order.

    Args:
        tx: the open transaction every change to the live model goes through.
        model: the whole model, materialized or on meta.
        pipeline: the plan's pipeline section.
        pp_rank: this rank's coordinate on the pipeline mesh dim.
        device: where owned parameters of a meta model are given storage.
        loss_fn: the last stage's loss, or ``None`` for the model's own (``labels``).
        apply_stage: see :data:`StageApply`; it also gives a meta model's owned parameters
            their storage (``apply`` allocates only the rank's shards).

    Raises:
        PipelineError: the plan names modules the model lacks, gives this rank no stage, or a
            stage's parameters differ from the plan's.
    """
    local = pipeline.stages_of_rank(pp_rank)
    if not local:
        msg = (f"pipeline rank {pp_rank} runs no stage of the plan (stage ranks: "
               f"{[s.rank for s in pipeline.stages]})")
        raise PipelineError(msg)
    _layer_list(model, pipeline)
    for fqn in (*pipeline.first, *pipeline.last):
        _submodule(model, fqn, "module")
    _check_coverage(model, pipeline)
    meta = meta_copy(model)
    owned = [_owned_param_ids(model, pipeline, s) for s in local]
    # Copies first, while the live model is whole; the first stage keeps the live model.
    targets = [model, *(_skeleton(model, ids) for ids in owned[1:])]
    return [_install_stage(tx, target, meta, pipeline, stage, device, loss_fn, apply_stage)
            for target, stage in zip(targets, local, strict=True)]


def _install_stage(tx: Rewrite, target: nn.Module, meta: nn.Module, pipeline: PipelinePlan,
                   stage: PipelineStagePlan, device: torch.device,
                   loss_fn: LossFn | None, apply_stage: StageApply | None) -> StageModule:
    label = f"stage {stage.index}: "
    run = StageRun(stage.index)
    for fqn, side, owner, is_layer in _elsewhere(pipeline, stage):
        parent_fqn, _, name = fqn.rpartition(".")
        parent = target.get_submodule(parent_fqn)
        holder = StagePlaceholder(fqn, meta.get_submodule(fqn), side, owner, run,
                                  like_input=is_layer)
        tx.set_item(parent._modules, name, holder, fqn=f"{label}{fqn}")
    _check_ownership(target, stage)
    if apply_stage is not None:
        apply_stage(target, stage)
    is_last = stage.index == len(pipeline.stages) - 1
    layers = _layer_list(target, pipeline)
    for i in sorted({stage.start, stage.stop - 1}):
        first, exit_ = i == stage.start, i == stage.stop - 1 and not is_last
        if first or exit_:
            fqn = f"{pipeline.layers}.{i}"
            replacement = edge_forward(layers[i], fqn, run, swap=first and stage.index != 0,
                                       exit_=exit_)
            tx.install_forward(layers[i], replacement, fqn=f"{label}{fqn}")
    if apply_stage is None and any(t.is_meta for t in _tensors(target)):
        _materialize(tx, target, device, label)
    return StageModule(target, stage, run, is_last=is_last,
                       last_layer=f"{pipeline.layers}.{stage.stop - 1}", loss_fn=loss_fn,
                       microbatches=pipeline.microbatches)


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()
