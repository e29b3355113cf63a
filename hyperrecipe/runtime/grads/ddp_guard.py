"""Refuse ``DistributedDataParallel`` over ranks that hold different shards of the plan.

Trainers we do not write wrap the model in DDP whenever the world has more than one rank
(``Trainer``/``accelerate`` under ``torchrun`` do). DDP assumes every rank of its process group
holds the same parameters: at construction it broadcasts rank 0's values to the group, and every
step it averages the group's gradients. Over ranks that hold *different shards* of a tensor-
(or expert-) parallel plan, both are silently wrong: production mode's shards have the same
names and shapes on every rank, so DDP's own checks pass, every rank trains rank 0's shard of
each tensor, and gradients of different rows are averaged. (Validate mode fails later, inside a
forward, with an error that does not say why.)

DDP with a group whose ranks agree on every mesh dim the plan shards over (the ``dp`` dim of a
``dp x tp`` mesh, or ranks outside the plan's mesh) is correct and left alone. Anything else is
refused at the first forward under DDP, before an optimizer step can train on it: DDP's
construction has already overwritten the shards by then, so the message says to rebuild.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from hyperrecipe.errors import PlanMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.plan import Plan

__all__ = ["install_ddp_guard"]


def install_ddp_guard(model: nn.Module, plan: Plan, mesh: DeviceMesh, *,
                      bucketed: tuple[str, ...] = ()) -> Any:
    """A forward pre-hook on ``model`` that refuses a DDP wrapper across shards, and one
    over the data dim that was not made by ``hyperrecipe.runtime.data_parallel`` when ``bucketed``
    (the parameters whose gradients production reduces in buckets) is not empty: DDP would
    average those before the buckets reduced them, and write that back over the reduction
    (one class attribute read per forward; each DDP object is checked once). Returns the
    handle."""
    from torch.nn.parallel import DistributedDataParallel

    sharded = sorted({d for p in plan.params for d in p.placement.mesh_dims})
    names = tuple(mesh.mesh_dim_names or ())
    checked: dict[int, str | None] = {}

    def refuse_ddp_across_shards(module: nn.Module, args: Any) -> None:
        # A private class attribute (torch >= 2.1); a torch without it leaves the guard off
        # rather than breaking every forward.
        ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
        if ddp is None or getattr(ddp, "module", None) is not model:
            return
        why = checked.get(id(ddp), "")
        if why == "":
            why = checked[id(ddp)] = (_crossing(ddp, mesh, names, sharded)
                                      or _bypassing_buckets(ddp, bucketed))
        if why is not None:
            raise PlanMismatchError(why)

    return model.register_forward_pre_hook(refuse_ddp_across_shards)


def _bypassing_buckets(ddp: Any, bucketed: tuple[str, ...]) -> str | None:
    """Why ``ddp`` (over ranks holding the same shards) would undo the plan's bucketed
    gradient reductions, or ``None``."""
    if not bucketed or getattr(ddp, "_hyperrecipe_data_parallel", False):
        return None
    group = getattr(ddp, "process_group", None)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) == 1:
        return None
    shown = ", ".join(bucketed[:3]) + (f" and {len(bucketed) - 3} more" if len(bucketed) > 3
                                       else "")
    return (f"DistributedDataParallel over this plan's data dim: the plan reduces the gradients "
            f"of {shown} over its model-parallel dims in buckets as they accumulate, and DDP "
            f"copies each gradient before that reduction and writes its average back over it, "
            f"so the reduction would be lost (silently wrong gradients). Wrap with "
            f"hyperrecipe.runtime.data_parallel(installation, group) (HyperrecipeTrainer and "
            f"HyperrecipeAccelerator do), which leaves those parameters to the buckets and "
            f"averages them there")


def _crossing(ddp: Any, mesh: DeviceMesh, names: tuple[str, ...],
              sharded: list[str]) -> str | None:
    """Why ``ddp``'s process group spans ranks with different shards, or ``None``."""
    if not sharded or not dist.is_initialized():
        return None
    group = getattr(ddp, "process_group", None)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))
    me = dist.get_rank()
    shape = tuple(mesh.mesh.shape)
    coords = {int(rank): _unravel(index, shape)
              for index, rank in enumerate(mesh.mesh.flatten().tolist())}
    if me not in coords:
        return None
    dims = [names.index(d) for d in sharded if d in names]
    other = [r for r in ranks if r in coords and any(coords[r][i] != coords[me][i] for i in dims)]
    if not other:
        return None
    return (f"DistributedDataParallel over ranks {sorted(ranks)}, which hold different shards of "
            f"this plan (mesh dim(s) {[names[i] for i in dims]}: rank {me} and rank(s) "
            f"{sorted(other)}): DDP broadcast rank {min(ranks)}'s shards to the group when it was "
            f"built and would average gradients of different shards, training silently wrong. "
            f"Wrap with DDP only over a dim the plan does not shard "
            f"(DDP(model, process_group=mesh['dp'].get_group())) or use fully_shard on it; "
            f"the shards were overwritten, so rebuild and reload the model. Under the Hugging "
            f"Face Trainer use hyperrecipe.trainers.hf_trainer.HyperrecipeTrainer (TRL: "
            f"hyperrecipe.trainers.trl.HyperrecipeSFTTrainer), under accelerate "
            f"hyperrecipe.trainers.accelerate.HyperrecipeAccelerator, which wrap over the "
            f"data dim only (docs/training.md)")


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))
