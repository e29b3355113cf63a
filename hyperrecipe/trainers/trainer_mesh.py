"""Which ranks of an applied plan hold the same shards and see different batches.

A trainer that does data parallel itself (the Hugging Face Trainer's DDP wrap and its sampler
split, Lightning's strategy) assumes every rank holds the whole model. On an applied plan only
the ranks that differ on a *data* dim (a mesh dim the plan never splits anything over: no
parameter, no boundary layout, no transition, no expert or vocab split) hold the same shards;
ranks that differ on any other dim must see the same batch and must never average gradients.
This module reads that from the plan, so both trainer integrations agree on it.

Metrics gathered for a dataset (the Trainer's ``evaluate``, accelerate's ``gather_for_metrics``)
are gathered over the data dim only here too: the model-parallel ranks hold copies of a batch.

Where training ends, the ranks leave together (``hyperrecipe.runtime.leave_together``): without it a
rank was seen to abort at interpreter exit in torch's teardown (``terminate called without an
active exception``; the method says why).

A plan with a ``pipeline`` section is refused by every trainer route here
(:func:`refuse_pipeline`): those trainers run one program per rank over one model, not a pipeline
schedule, so the route to use is named instead (our own loop with ``build_pipeline``, or
``tools/train.py --pp N``).

What does not live here: wrapping (each integration wraps through its trainer's seam).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import attrs

from hyperrecipe.errors import TrainerSetupError

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.plan import Plan
    from hyperrecipe.runtime import Installation

__all__ = ["DataParallel", "data_parallel_of", "gather_over_data_dim", "model_parallel_dims",
           "refuse_pipeline"]

PIPELINE_ROUTE = ("train it with hyperrecipe.runtime.build_pipeline in your own loop "
                  "(docs/training.md#pipeline-parallel) or with tools/train.py --pp N")
"""Where a pipelined plan trains; every trainer route's refusal names it."""


def refuse_pipeline(given: Any, *, trainer: str) -> None:
    """Refuse a pipelined plan (a :class:`~hyperrecipe.plan.Plan` or an installation with a
    ``pipeline`` section, or a :class:`~hyperrecipe.runtime.pipeline.Pipeline`) by name, before
    the trainer changes anything.

    Raises:
        TrainerSetupError: ``given`` is pipelined; the message names the route to use.
    """
    from hyperrecipe.runtime import Pipeline

    if isinstance(given, Pipeline):
        what = "a Pipeline (build_pipeline's handle)"
    else:
        plan = getattr(given, "plan", given)
        pipeline = getattr(plan, "pipeline", None)
        if pipeline is None:
            return
        what = (f"a pipelined plan ({pipeline.schedule} over mesh dim {pipeline.mesh_dim!r}, "
                f"{len(pipeline.stages)} stages)")
    msg = (f"{trainer}: got {what}; {trainer} runs the whole model's forward and backward on "
           f"every rank, not a pipeline schedule, so it would train every rank's copy of the "
           f"model unpipelined. Pipeline parallelism is not supported through {trainer}: "
           f"{PIPELINE_ROUTE}")
    raise TrainerSetupError(msg)


def model_parallel_dims(plan: Plan) -> tuple[str, ...]:
    """The mesh dims the plan splits something over, in mesh order
    (:attr:`~hyperrecipe.plan.Plan.model_parallel_dims`)."""
    return plan.model_parallel_dims


@attrs.frozen(kw_only=True)
class DataParallel:
    """The data-parallel side of an applied plan, seen from this rank.

    Attributes:
        dim: the mesh dim batches are split over (``None``: every rank sees the same batch).
        size: how many different batches one step sees (1 without ``dim``).
        rank: this rank's index among them.
        model_parallel: how many ranks share each batch (the product of the other dims).
        group: the process group of the ranks that hold this rank's shards (``None`` when
            ``size`` is 1): the only group a DDP wrapper may average over.
    """

    dim: str | None
    size: int
    rank: int
    model_parallel: int
    group: Any


def data_parallel_of(inst: Installation, *, trainer: str) -> DataParallel:
    """The data dim of ``inst``'s mesh and this rank's place on it.

    Raises:
        TrainerSetupError: the mesh has more than one data dim (flatten them into one), or the
            mesh does not span the world (the trainer would split batches over ranks outside it).
    """
    import torch.distributed as dist

    names = tuple(inst.mesh.mesh_dim_names or ())
    sizes = dict(zip(names, inst.mesh.mesh.shape, strict=True))
    used = set(model_parallel_dims(inst.plan))
    data = [d for d in names if d not in used]
    if len(data) > 1:
        msg = (f"{trainer}: the mesh has {len(data)} dims the plan splits nothing over "
               f"({data}); batches can be split over one. Declared mesh: {names}; flatten "
               f"the data dims into one (mesh[{tuple(data)}]._flatten('dp')) or size all but one 1")
        raise TrainerSetupError(msg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if inst.mesh.mesh.numel() != world:
        msg = (f"{trainer}: the mesh {dict(sizes)} has {inst.mesh.mesh.numel()} ranks, the world "
               f"{world}; the trainer splits batches over the world, so the mesh must span it")
        raise TrainerSetupError(msg)
    dim = data[0] if data and int(sizes[data[0]]) > 1 else None
    size = int(sizes[dim]) if dim is not None else 1
    return DataParallel(
        dim=dim, size=size, rank=inst.mesh.get_local_rank(dim) if dim is not None else 0,
        model_parallel=world // size,
        group=inst.mesh.get_group(dim) if dim is not None else None)


def gather_over_data_dim(data: Any, dp: DataParallel, gradient_state: Any) -> Any:
    """``accelerate``'s ``gather_for_metrics`` over the ranks that see different batches:
    tensors in (nested) lists, tuples and dicts concatenated over the data dim, and at the end
    of a loader whose last batch was padded (accelerate's ``gradient_state.remainder``), the
    padding samples dropped."""
    gathered = _gather_tensors(data, dp.group)
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        return _truncate(gathered, gradient_state.remainder)
    return gathered


def _gather_tensors(data: Any, group: Any) -> Any:
    if isinstance(data, (list, tuple)):
        return type(data)(_gather_tensors(d, group) for d in data)
    if isinstance(data, dict):
        return {k: _gather_tensors(v, group) for k, v in data.items()}
    if group is None or not isinstance(data, torch.Tensor):
        return data
    import torch.distributed as dist

    value = data.contiguous() if data.dim() else data.reshape(1)
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value, group=group)
    return torch.cat(parts)


def _truncate(data: Any, count: int) -> Any:
    if isinstance(data, (list, tuple)):
        return type(data)(_truncate(d, count) for d in data)
    if isinstance(data, dict):
        return {k: _truncate(v, count) for k, v in data.items()}
    return data[:count] if isinstance(data, torch.Tensor) and data.dim() else data
