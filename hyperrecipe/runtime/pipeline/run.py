"""The trainer's handle on a pipelined model: :func:`build_pipeline` and :class:`Pipeline`.

A training step is ``loss = pipe.step(**inputs, labels=labels)``, then the optimizer over
``pipe.parameters()``; ``pipe.clip_grad_norm_`` clips by the whole model's norm. torch's stages
are made on the first step (and again when the inputs' shapes change), from a probe of the
hidden states' shape, so no shape inference traffic runs between ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from hyperrecipe.errors import (
    HyperrecipeError,
    PipelineError,
    PipelineUnsupportedError,
    UsageError,
)
from hyperrecipe.plan import PipelineStagePlan, Plan
from hyperrecipe.model_tree import snapshot
from hyperrecipe.models import LIBRARY
from hyperrecipe.rewriter import Rewrite, Rewritten
from hyperrecipe.runtime.mode import ModeName
from hyperrecipe.runtime.pipeline.beside import (
    ApplyFn,
    StageApplier,
    pp_columns,
    stage_grad_norm,
)
from hyperrecipe.runtime.pipeline.grads import (
    TiedGrads,
    grad_norm,
    scale_grads,
    stash_tied,
    sum_tied,
    tie_groups,
    tied_grads,
)
from hyperrecipe.runtime.pipeline.schedule import build_schedule
from hyperrecipe.runtime.pipeline.state import PipelineState
from hyperrecipe.runtime.preflight.agreement import agree_before_apply
from hyperrecipe.runtime.preflight.plan_fit import check_mesh_fits, check_model_fits
from hyperrecipe.runtime.pipeline.stages import (
    TARGET_KEY,
    LossFn,
    StageModule,
    build_stage_modules,
)

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.installation import Installation

__all__ = ["Pipeline", "build_pipeline"]


def _rank_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    backend = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, backend.current_device())


def _our_cause(exc: BaseException) -> HyperrecipeError | None:
    """Our error under torch's wrapping (a stage forward's failure arrives as a RuntimeError
    ``from`` it), so the caller catches the class and reads the message it was raised with."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, HyperrecipeError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


class Pipeline:
    """This rank's share of a pipelined model and the schedule that runs it.

    Build it with :func:`build_pipeline`. Gradients accumulate across :meth:`step` calls, like
    ``loss.backward()`` on one process; the optimizer's ``zero_grad`` clears them.
    """

    def __init__(self, *, plan: Plan, modules: list[StageModule], rewritten: Rewritten,
                 group: dist.ProcessGroup, pp_rank: int, device: torch.device,
                 ties: tuple[TiedGrads, ...], loss_fn: LossFn | None,
                 installations: tuple[Installation, ...] = ()) -> None:
        assert plan.pipeline is not None
        self._pipeline = plan.pipeline
        self._plan = plan
        self._modules = modules
        self._rewritten = rewritten
        self._group = group
        self._pp_rank = pp_rank
        self._device = device
        self._ties = ties
        self._loss_fn = loss_fn
        self._installations = installations
        self._schedule: Any = None
        self._shapes: object = None
        last = self._pipeline.stages[-1]
        self._loss_src = dist.get_global_rank(group, last.rank)

    @property
    def stages(self) -> tuple[PipelineStagePlan, ...]:
        """The plan stages this rank holds, in stage order."""
        return tuple(s for s in self._pipeline.stages if s.rank == self._pp_rank)

    @property
    def stage_modules(self) -> tuple[StageModule, ...]:
        """The modules torch's ``PipelineStage`` runs, one per local stage in stage order. Each
        call is one microbatch's forward: a forward pre-hook sees the hidden states received
        (the first positional argument; none on stage 0), a forward hook the hidden states the
        stage sends (its output; the microbatch's loss on the last stage). The shape probe
        before the first step calls them too, under ``torch.no_grad``. For observers such as
        ``hyperrecipe check``; the stages' forwards are not to be changed."""
        return tuple(self._modules)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The stage modules (the live model first; skeleton copies for further stages)."""
        return tuple(m.model for m in self._modules)

    @property
    def state(self) -> PipelineState:
        """This rank's state front (:mod:`hyperrecipe.runtime.pipeline.state`), made once."""
        return PipelineState.of(self, plan=self._plan, modules=self._modules,
                                group=self._group, device=self._device, rewritten=self._rewritten,
                                installations=self._installations)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their FQNs in the original model; a weight shared by
        two local stages (a tie) is listed once."""
        seen: set[int] = set()
        for module in self._modules:
            for fqn, p in module.model.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield fqn, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def step(self, *, labels: torch.Tensor | None = None, target: Any = None,
             **model_inputs: Any) -> torch.Tensor:
        """Run forward and backward of one batch over all microbatches; every rank calls it
        with the same inputs.

        With the model's own loss (``labels``), each microbatch's loss is the model's sum over
        its label tokens divided by the batch's count of label tokens (``labels != -100``
        after the causal shift), so the microbatch losses add up to the full-batch mean. With
        a ``loss_fn`` (``target``), see :func:`build_pipeline` for the contract.

        Returns:
            The full-batch loss on every rank (detached; broadcast from the last stage).
        """
        kwargs = dict(model_inputs)
        if self._loss_fn is None:
            if labels is None:
                msg = "Pipeline.step: pass labels= (the model computes the loss) or build with loss_fn"
                raise UsageError(msg)
            kwargs["labels"] = labels
            kwargs["num_items_in_batch"] = int((labels[..., 1:] != -100).sum())
            target = labels
        else:
            if target is None:
                msg = "Pipeline.step: a pipeline built with loss_fn takes target="
                raise UsageError(msg)
            kwargs[TARGET_KEY] = target
        schedule = self._schedule_for(kwargs)
        stashed = stash_tied(self._ties)
        losses: list[torch.Tensor] = []
        try:
            schedule.step(target=target, losses=losses, return_outputs=False, **kwargs)
        except RuntimeError as exc:
            ours = _our_cause(exc)
            if ours is None:
                raise
            raise ours from exc
        sum_tied(self._ties, stashed)
        loss = (torch.stack([x.detach().float() for x in losses]).sum() if losses
                else torch.zeros((), dtype=torch.float32, device=self._device))
        dist.broadcast(loss, src=self._loss_src, group=self._group)
        return loss

    @property
    def installations(self) -> tuple[Installation, ...]:
        """Beside tensor parallel, each stage model's :class:`Installation` (in stage order);
        empty for pipeline parallelism alone."""
        return self._installations

    def full_grads(self) -> dict[str, torch.Tensor]:
        """FQN -> full (unsharded) gradient of every parameter this rank's stages hold; a tied
        weight's gradient is already summed over the stages holding it."""
        if not self._installations:
            return {fqn: p.grad.detach().clone() for fqn, p in self.named_parameters()
                    if p.grad is not None}
        grads: dict[str, torch.Tensor] = {}
        for inst in self._installations:
            grads.update(inst.full_grads())
        return grads

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, as one process computes it (a tied weight
        counted once), on every rank. A collective over every rank of the mesh."""
        uncounted = {id(t.param) for t in self._ties if t.param is not None and not t.counted}
        if not self._installations:
            return grad_norm(list(self.parameters()), uncounted, self._group)
        return stage_grad_norm(self._installations, self._ties, self._group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (:meth:`grad_norm`), as
        ``torch.nn.utils.clip_grad_norm_`` on one process. A collective: every rank calls it.
        Returns the total norm."""
        norm = self.grad_norm()
        scale_grads(list(self.parameters()), norm, max_norm)
        return norm

    def restore(self) -> None:
        """Put the live model back as it was before :func:`build_pipeline` (beside tensor
        parallel a collective over each stage's tensor-parallel ranks, as ``restore`` of an
        installation is)."""
        for inst in reversed(self._installations):
            inst.restore()
        self._rewritten.restore()

    def _schedule_for(self, kwargs: dict[str, Any]) -> Any:
        shapes = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in kwargs.items()
                              if isinstance(v, torch.Tensor)))
        if self._schedule is None or shapes != self._shapes:
            _, chunks = split_args_kwargs_into_chunks((), kwargs, self._pipeline.microbatches)
            self._schedule = build_schedule(self._pipeline, [self._stage(m, chunks[0])
                                                             for m in self._modules])
            self._shapes = shapes
        return self._schedule

    def _stage(self, module: StageModule, first_chunk: dict[str, Any]) -> PipelineStage:
        example = module.probe(**first_chunk)
        n = len(self._pipeline.stages)
        loss_example = torch.zeros((), dtype=torch.float32, device=self._device)
        return PipelineStage(
            module, module.index, n, self._device,
            # The first stage takes the model's inputs as keywords only: no positional example.
            input_args=None if module.index == 0 else _dense(example),
            output_args=loss_example if module.is_last else _dense(example),
            group=self._group,
        )


def _refuse_unknown_loss(model: nn.Module, loss_fn: LossFn | None) -> None:
    """The model's own loss is weighted across microbatches by the batch's label tokens, counted
    with the causal shift (``labels[..., 1:]``): right only for the causal-LM cross entropy its
    library names; another own loss would be scaled wrong without a word."""
    if loss_fn is not None or LIBRARY.loss_seat(model) is not None:
        return
    known = LIBRARY.causal_lm_loss_name() or "a causal-LM cross entropy"
    msg = (f"build_pipeline: {type(model).__name__}'s own loss is not {known}, whose label "
           f"tokens the pipeline counts (with the causal shift) to weigh its microbatches; pass "
           f"loss_fn= (docs/pipeline.md#running-a-pipeline) for this model")
    raise PipelineUnsupportedError(msg)


def _dense(example: torch.Tensor) -> torch.Tensor:
    """The example buffer of what crosses a stage boundary: contiguous, as the stage exit sends
    it (a layer may return a transposed view)."""
    return torch.empty(example.shape, dtype=example.dtype, device=example.device)


def build_pipeline(model: nn.Module, plan: Plan, mesh: DeviceMesh, *,
                   mode: ModeName = "production", loss_fn: LossFn | None = None,
                   apply_fn: ApplyFn | None = None) -> Pipeline:
    """Make ``model`` this rank's share of the plan's pipeline.

    Every other stage's parameter-holding module is replaced by a placeholder that never holds
    its weights; the model's own forward still runs on every stage. A model on the meta device
    is accepted: the owned parameters and buffers get uninitialised storage on the rank's
    device, and the caller initialises or loads them afterwards (non-persistent buffers, such
    as rotary tables, included).

    Args:
        model: the whole model, built the same way on every rank.
        plan: a plan with a ``pipeline`` section.
        mesh: a device mesh with the plan's dims, ``plan.pipeline.mesh_dim`` among them.
        mode: beside tensor parallel, the mode each stage model's share of the plan is applied
            in (``"production"`` or ``"validate"``; :func:`hyperrecipe.runtime.apply`).
            Pipeline parallelism alone runs the same code in both.
        loss_fn: for a model whose forward takes no labels: ``loss_fn(output, target)`` on one
            microbatch's output and target (``target`` split like the inputs, along dim 0). It
            must return that microbatch's mean loss; the pipeline divides it by the number of
            microbatches and sums, so the step's loss (and gradient) is the full-batch mean
            when every microbatch weighs the same (equal sizes, no ignored elements). For
            per-token weights (ignored labels), fold the full batch's count into ``loss_fn``
            yourself (a sum divided by it, times the microbatch count), or use ``labels``.

    Returns:
        The :class:`Pipeline`. On failure the model is left untouched.

    Raises:
        PipelineError: no pipeline in the plan, or the plan does not fit the model.
        PlanMismatchError: the plan or mesh differs between ranks, the mesh is not the plan's,
            or the plan was compiled for another model (raised on every rank).
        PipelineUnsupportedError: no ``loss_fn`` and the model's own loss is not the causal-LM
            cross entropy.
        PlanMismatchError, and anything ``apply`` raises: beside tensor parallel, applying a
            stage's share of the plan failed (every stage model is left as it was).
    """
    pipeline = plan.pipeline
    if pipeline is None:
        msg = "build_pipeline: the plan has no pipeline section (compile a recipe with one)"
        raise PipelineError(msg)
    if pipeline.mesh_dim not in (mesh.mesh_dim_names or ()):
        msg = (f"the plan pipelines over mesh dim {pipeline.mesh_dim!r}; the mesh has "
               f"{list(mesh.mesh_dim_names or ())}")
        raise PipelineError(msg)
    # every rank agrees on plan and mesh, and that the plan fits the model, before the first
    # group is made: a rank with another plan would otherwise wait in a schedule forever
    agree_before_apply(plan, mesh, lambda: check_mesh_fits(plan, mesh),
                       lambda: check_model_fits(plan, snapshot(model)),
                       lambda: _refuse_unknown_loss(model, loss_fn))
    group = mesh.get_group(pipeline.mesh_dim)
    pp_rank = mesh.get_local_rank(pipeline.mesh_dim)
    device = _rank_device(mesh)
    groups = tie_groups(pipeline, pp_columns(mesh, pipeline.mesh_dim), group)
    beside = StageApplier.for_plan(plan, mesh, mode, apply_fn)
    try:
        with Rewrite(label="pipeline") as tx:
            modules = build_stage_modules(tx, model, pipeline, pp_rank, device, loss_fn=loss_fn,
                                          apply_stage=None if beside is None else beside.apply)
    except BaseException:
        if beside is not None:
            beside.restore()
        raise
    named: dict[str, nn.Parameter] = {}
    for module in modules:
        named.update(module.model.named_parameters(remove_duplicate=False))
    ties = tied_grads(pipeline, pp_rank, named, groups)
    return Pipeline(plan=plan, modules=modules, rewritten=tx.result, group=group, pp_rank=pp_rank,
                    device=device, ties=ties, loss_fn=loss_fn,
                    installations=() if beside is None else tuple(beside.installations))
