"""The plan's schedule name as a :mod:`torch.distributed.pipelining` schedule over this rank's
stages.

The plan already placed every stage on a rank (V-shaped schedules put stages ``r`` and
``2 * pp - 1 - r`` on rank ``r``); torch's schedules place them by their own convention, so the
two are compared after construction and any difference is an error rather than a hang.
Gradients are never scaled by the schedule (``scale_grads=False``): each microbatch's loss is
already its share of the full-batch loss, and torch's scaling would also divide gradients
accumulated by earlier steps.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from hyperrecipe.errors import PipelineError, PipelineUnsupportedError
from hyperrecipe.plan import PipelinePlan

__all__ = ["SCHEDULES", "build_schedule"]

SCHEDULES: Final[dict[str, str]] = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
"""Plan schedule name -> torch class name (looked up in the installed torch)."""
_SINGLE: Final = frozenset({"GPipe", "1F1B"})


def _loss_is_output(output: torch.Tensor, _target: Any) -> torch.Tensor:
    """The last stage's module already returns the microbatch loss."""
    return output


def build_schedule(pipeline: PipelinePlan, stages: list[PipelineStage]) -> Any:
    """The torch schedule for ``pipeline.schedule`` over this rank's ``stages``.

    Raises:
        PipelineUnsupportedError: the name is not one of :data:`SCHEDULES` or the installed
            torch lacks it.
        PipelineError: torch places a stage on another rank than the plan does.
    """
    cls_name = SCHEDULES.get(pipeline.schedule)
    cls = getattr(torch_schedules, cls_name, None) if cls_name else None
    if cls is None:
        msg = (f"pipeline schedule {pipeline.schedule!r} is not one this runtime runs with "
               f"torch {torch.__version__}; known: {sorted(SCHEDULES)}")
        raise PipelineUnsupportedError(msg)
    if pipeline.schedule in _SINGLE:
        if len(stages) != 1:
            msg = (f"schedule {pipeline.schedule} runs one stage per rank; the plan gives this "
                   f"rank {len(stages)}")
            raise PipelineError(msg)
        schedule = cls(stages[0], pipeline.microbatches, loss_fn=_loss_is_output,
                       scale_grads=False)
    else:
        schedule = cls(stages, pipeline.microbatches, loss_fn=_loss_is_output,
                       scale_grads=False)
    planned = {s.index: s.rank for s in pipeline.stages}
    for stage in stages:
        placed = dict(getattr(stage, "stage_index_to_group_rank", None) or
                      {i: i for i in range(stage.num_stages)})
        if placed != planned:
            msg = (f"schedule {pipeline.schedule} places stages on ranks {placed}; the plan "
                   f"places them on {planned}: the plan and torch disagree on the layout")
            raise PipelineError(msg)
    return schedule
