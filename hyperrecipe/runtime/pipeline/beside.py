"""Pipeline parallelism beside tensor parallel: each stage model gets its share of the plan.

Once a stage model holds placeholders for what other stages own, it is applied like any model
(:func:`hyperrecipe.runtime.apply`), with the plan's stage view
(:func:`hyperrecipe.pipeline.view.stage_view`: the stage's parameters, boundaries and
collectives) over the mesh without the pipeline dim. Every rank of a stage's tensor-parallel
group holds the same stage, so they agree on the view as apply's preflight requires; each
stage model keeps its own :class:`~hyperrecipe.runtime.installation.Installation`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyperrecipe.errors import PipelineUnsupportedError
from hyperrecipe.model_tree import snapshot
from hyperrecipe.pipeline.view import stage_view
from hyperrecipe.plan import PipelineStagePlan, Plan
from hyperrecipe.runtime.mode import ModeName
from hyperrecipe.runtime.pipeline.grads import TiedGrads
from hyperrecipe.runtime.preflight.agreement import agreement_scope

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.installation import Installation

__all__ = ["ApplyFn", "StageApplier", "pp_columns", "stage_grad_norm"]

ApplyFn = Callable[..., "Installation"]
""":func:`hyperrecipe.runtime.apply`, handed in by the runtime's front
(``hyperrecipe.runtime.build_pipeline``): this room sits below the runtime's top, so it is given
apply instead of importing it."""


class StageApplier:
    """Applies each stage model's view of the plan; remembers the installations, in order."""

    def __init__(self, plan: Plan, mesh: DeviceMesh, mode: ModeName,
                 slab: dist.ProcessGroup, apply_fn: ApplyFn) -> None:
        self.apply_fn = apply_fn
        self.plan = plan
        self.mesh = mesh
        self.mode = mode
        self.slab = slab
        self.installations: list[Installation] = []

    @classmethod
    def for_plan(cls, plan: Plan, mesh: DeviceMesh, mode: ModeName,
                 apply_fn: ApplyFn | None) -> StageApplier | None:
        """The applier beside tensor parallel; ``None`` when every other dim has size 1 (the
        stage models then run as they are).

        Raises:
            PipelineUnsupportedError: a tie across two stages of one rank; no ``apply_fn``
                (this room's ``build_pipeline`` called directly beside tensor parallel).
        """
        pipe = plan.pipeline
        assert pipe is not None
        dims = tuple(d.name for d in plan.mesh if d.name != pipe.mesh_dim)
        if not any(plan.mesh_shape[d] > 1 for d in dims):
            return None
        _refuse_local_ties(plan)
        if apply_fn is None:
            msg = ("a pipeline beside tensor parallel applies each stage's share of the plan: "
                   "build it with hyperrecipe.runtime.build_pipeline")
            raise PipelineUnsupportedError(msg)
        sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
        return cls(plan, sub, mode, _slab_group(mesh, pipe.mesh_dim), apply_fn)

    def apply(self, model: nn.Module, stage: PipelineStagePlan) -> None:
        view = stage_view(self.plan, (stage.index,), model_digest=snapshot(model).digest())
        with agreement_scope(self.slab):
            self.installations.append(self.apply_fn(model, view, self.mesh, mode=self.mode))

    def restore(self) -> None:
        """Undo every installation made so far (a collective over each stage's group)."""
        while self.installations:
            self.installations.pop().restore()


def _slab_group(mesh: DeviceMesh, pp_dim: str) -> dist.ProcessGroup:
    """The group of the ranks sharing this rank's pipeline coordinate (they hold the same
    stages): apply's agreement and vote run among them. Every rank creates every slab's group,
    in pipeline order (``new_group`` is a collective over the default group)."""
    names = list(mesh.mesh_dim_names or ())
    ranks = mesh.mesh.movedim(names.index(pp_dim), 0)
    mine = dist.get_rank()
    chosen: dist.ProcessGroup | None = None
    for k in range(ranks.shape[0]):
        members = ranks[k].flatten().tolist()
        group = dist.new_group(members)
        if mine in members:
            chosen = group
    assert chosen is not None
    return chosen


def _refuse_local_ties(plan: Plan) -> None:
    pipe = plan.pipeline
    assert pipe is not None
    rank_of = {s.index: s.rank for s in pipe.stages}
    for tie in pipe.tied:
        ranks = [rank_of[s] for s in tie.stages]
        if len(set(ranks)) < len(ranks):
            msg = (f"pipeline {pipe.schedule} puts stages {list(tie.stages)}, which share the "
                   f"tied weight {tie.params[0]}, on one rank; beside tensor parallel each stage "
                   f"holds its own shard of it, which is not supported yet: use a loop-placed "
                   f"schedule (1F1B, Interleaved1F1B) for this model, or untie the weights")
            raise PipelineUnsupportedError(msg)


def pp_columns(mesh: DeviceMesh, pp_dim: str) -> list[list[int]]:
    """The global ranks of every pipeline column of ``mesh`` (ranks that differ only in their
    pipeline coordinate), each in pipeline order."""
    names = list(mesh.mesh_dim_names or ())
    ranks = mesh.mesh.movedim(names.index(pp_dim), -1)
    return [row.tolist() for row in ranks.reshape(-1, ranks.shape[-1])]


def stage_grad_norm(installations: Sequence[Installation], ties: Sequence[TiedGrads],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """The whole model's gradient 2-norm beside tensor parallel: each stage's full norm (its
    installation's, a collective over its tensor-parallel group), squared and summed over the
    pipeline ranks, less the copies of tied weights that another rank counts."""
    total = torch.zeros((), dtype=torch.float64)
    for inst in installations:
        total += inst.grad_norm().double().cpu() ** 2
    for tie in ties:
        if tie.param is None or tie.counted:
            continue
        for inst in installations:
            norms = inst.grad_norms()
            held = [f for f in tie.fqns if f in norms]
            if held:
                total -= norms[held[0]].double().cpu() ** 2
    device = next((p.device for inst in installations for p in inst.model.parameters()),
                  torch.device("cpu"))
    total = total.to(device)
    dist.all_reduce(total, group=group)
    return total.sqrt().float()
