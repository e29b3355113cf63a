"""Gradients that span stages: weights tied across stages, and the global gradient norm.

A tied weight (GPT-2's ``wte``/``lm_head``) is one tensor in the model but is used on two
stages, each holding a copy; the full gradient is the sum of both stages' contributions. Only
the contribution of the current step is summed, so gradient accumulation over several steps
stays exact. The norm counts a tied weight once, on the rank of its first holding stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist

from hyperrecipe.plan import PipelinePlan

__all__ = ["TiedGrads", "grad_norm", "local_grad", "scale_grads", "stash_tied", "sum_tied",
           "tie_groups", "tied_grads"]


@attrs.frozen(kw_only=True)
class TiedGrads:
    """This rank's copy of one tied weight and the group of the ranks holding a copy.

    ``group`` is ``None`` when this rank holds every copy (nothing to sum across ranks) or
    holds none (``param`` is ``None`` then). ``counted`` says whether this rank counts the
    weight in the gradient norm.
    """

    fqns: tuple[str, ...]
    param: torch.nn.Parameter | None
    group: dist.ProcessGroup | None
    counted: bool


def tie_groups(pipeline: PipelinePlan, columns: Sequence[Sequence[int]],
               pp_group: dist.ProcessGroup) -> tuple[dist.ProcessGroup | None, ...]:
    """One process group per tie of the plan, over exactly the ranks of this rank's pipeline
    column holding a copy (``None`` when one rank holds them all).

    ``columns`` lists the global ranks of every pipeline column of the mesh (one column without
    another model-parallel dim; one per tensor-parallel coordinate beside it), each in pipeline
    order. ``new_group`` is a collective over the default group, so every rank creates every
    column's group, in plan order, before anything that could fail on one rank only; a tie
    held by every rank of the column reuses ``pp_group``."""
    rank_of = {s.index: s.rank for s in pipeline.stages}
    mine = dist.get_rank()
    pp = len(columns[0])
    groups: list[dist.ProcessGroup | None] = []
    for tie in pipeline.tied:
        holders = sorted({rank_of[s] for s in tie.stages})
        chosen: dist.ProcessGroup | None = None
        if len(holders) == pp and pp > 1:
            chosen = pp_group
        elif len(holders) > 1:
            for column in columns:
                group = dist.new_group([column[r] for r in holders])
                if mine in column:
                    chosen = group
        groups.append(chosen)
    return tuple(groups)


def tied_grads(pipeline: PipelinePlan, pp_rank: int, named: dict[str, torch.nn.Parameter],
               groups: Sequence[dist.ProcessGroup | None]) -> tuple[TiedGrads, ...]:
    """This rank's :class:`TiedGrads`, one per tie of the plan (groups from :func:`tie_groups`)."""
    rank_of = {s.index: s.rank for s in pipeline.stages}
    out = []
    for tie, group in zip(pipeline.tied, groups, strict=True):
        holders = {rank_of[s] for s in tie.stages}
        mine = pp_rank in holders
        param = next((named[f] for f in tie.params if f in named), None) if mine else None
        out.append(TiedGrads(fqns=tie.params, param=param, group=group if mine else None,
                             counted=mine and rank_of[min(tie.stages)] == pp_rank))
    return tuple(out)


def stash_tied(ties: Sequence[TiedGrads]) -> list[torch.Tensor | None]:
    """Take the gradients of earlier steps off the tied copies, so the sum after the schedule
    adds only this step's contributions."""
    stashed: list[torch.Tensor | None] = []
    for tie in ties:
        grad = tie.param.grad if tie.param is not None and tie.group is not None else None
        stashed.append(grad)
        if grad is not None and tie.param is not None:
            tie.param.grad = None
    return stashed


def sum_tied(ties: Sequence[TiedGrads], stashed: Sequence[torch.Tensor | None]) -> None:
    """Sum this step's gradient of every tied copy over its holders, then add back the stash."""
    for tie, old in zip(ties, stashed, strict=True):
        if tie.param is None or tie.group is None:
            continue
        if tie.param.grad is None:
            tie.param.grad = torch.zeros_like(tie.param)
        dist.all_reduce(local_grad(tie.param.grad), group=tie.group)
        if old is not None:
            tie.param.grad.add_(old)


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The tensor a collective works on: a DTensor gradient's (validate mode beside tensor
    parallel) local shard, in place; a plain gradient itself. The copies of a tied weight on
    two stages have the same placement, so their shards sum shard by shard."""
    from torch.distributed.tensor import DTensor

    return grad._local_tensor if isinstance(grad, DTensor) else grad


def grad_norm(params: Sequence[torch.nn.Parameter], uncounted: set[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """The 2-norm of the whole model's gradient from this rank's whole (unsharded) gradients:
    squares summed over the pipeline ranks, a tied weight only on the rank that counts it
    (``uncounted`` holds the ids of the others). The same float32 scalar on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None and id(p) not in uncounted:
            total += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(total, group=group)
    return total.sqrt().float()


def scale_grads(params: Sequence[torch.nn.Parameter], norm: torch.Tensor,
                max_norm: float) -> None:
    """Scale every gradient as :func:`torch.nn.utils.clip_grad_norm_` scales the full model's
    for ``norm``: by ``max_norm / (norm + 1e-6)`` when that is below 1 (shards and DTensors
    alike: the coefficient is one number on every rank)."""
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef)
