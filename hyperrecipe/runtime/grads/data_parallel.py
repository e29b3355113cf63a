"""DDP or FSDP2 over a data dim of the mesh, the way a plan's gradient buckets need it.

The bodies of :func:`hyperrecipe.runtime.installation.data_parallel` and
:func:`~hyperrecipe.runtime.installation.fully_shard_data_parallel`, the entry points trainers
call (their docstrings say why bucketed parameters are left out of the wrapper). It lives with the
buckets and the DDP guard because it is about who reduces which gradient; the installation
only hands it the applied model and its bucket reducer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hyperrecipe.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer

__all__ = ["shard_data_parallel", "wrap_data_parallel"]


def wrap_data_parallel(model: nn.Module, reducer: GradBucketReducer | None, group: Any,
                       module: nn.Module | None = None, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel`` over ``group`` of ``module`` (default ``model``, the
    applied model, which must be inside it), with the parameters ``reducer``'s buckets reduce
    left to the buckets, which then also average them over ``group``.

    Raises:
        UsageError: ``module`` does not hold ``model``.
    """
    wrapped = model if module is None else module
    prefix = next((f"{name}." if name else "" for name, m in wrapped.named_modules()
                   if m is model), None)
    if prefix is None:
        msg = (f"data_parallel: module ({type(wrapped).__name__}) does not hold "
               f"the applied model ({type(model).__name__}); pass the module DDP "
               f"wraps, with the applied model inside it")
        raise UsageError(msg)
    if reducer is not None and reducer.buckets and dist.get_world_size(group) > 1:
        mine = {id(p) for p in reducer.params}
        names = [prefix + fqn for fqn, p in model.named_parameters()
                 if id(p) in mine]
        ignored = set(getattr(wrapped, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
            wrapped, sorted(ignored | set(names)))
        first = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for param in reducer.params:
                dist.broadcast(param.data, src=first, group=group)
        reducer.average_over(group)
    ddp = DistributedDataParallel(wrapped, process_group=group, **ddp_kwargs)
    ddp._hyperrecipe_data_parallel = True  # type: ignore[assignment]
    return ddp


def shard_data_parallel(model: nn.Module, reducer: GradBucketReducer | None, mesh: Any,
                        blocks: Iterable[nn.Module] = (), **fsdp_kwargs: Any) -> nn.Module:
    """FSDP2's ``fully_shard`` over ``mesh`` (a one-dim data mesh) on each of ``blocks`` and
    on ``model``, with the parameters ``reducer``'s buckets reduce left out of FSDP
    (``ignored_params``): they stay the objects that carry the bucket hooks, replicated over
    ``mesh``, and the buckets average them over its group after their own reduction (their
    values broadcast from the group's first rank first). Returns ``model``.

    Raises:
        UsageError: a block is not inside ``model``, or ``mesh`` is not one-dimensional.
    """
    from torch.distributed.fsdp import fully_shard

    if mesh.ndim != 1:
        msg = (f"fully_shard_data_parallel: the mesh has dims {mesh.mesh_dim_names}; pass the "
               f"data dim's one-dim mesh (mesh['dp'])")
        raise UsageError(msg)
    inside = {id(m) for m in model.modules()}
    blocks = list(blocks)
    for block in blocks:
        if id(block) not in inside:
            msg = (f"fully_shard_data_parallel: a block ({type(block).__name__}) is not a "
                   f"module of the applied model")
            raise UsageError(msg)
    ignored: set[nn.Parameter] = set(fsdp_kwargs.pop("ignored_params", None) or ())
    if reducer is not None and reducer.buckets:
        ignored |= set(reducer.params)
        group = mesh.get_group()
        if mesh.size() > 1:
            first = dist.get_global_rank(group, 0)
            with torch.no_grad():
                for param in reducer.params:
                    dist.broadcast(param.data, src=first, group=group)
        reducer.average_over(group)  # a no-op at size 1, but says the dim is taken care of
    for block in blocks:
        mine = {p for p in block.parameters() if p in ignored}
        fully_shard(block, mesh=mesh, ignored_params=mine or None, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None, **fsdp_kwargs)
    return model
