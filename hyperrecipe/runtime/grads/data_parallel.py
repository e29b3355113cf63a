"""DDP over a data dim of the mesh, the way a plan's gradient buckets need it.

The body of :func:`hyperrecipe.runtime.installation.data_parallel`, the entry point trainers
call (its docstring says why bucketed parameters are left out of DDP). It lives with the
buckets and the DDP guard because it is about who reduces which gradient; the installation
only hands it the applied model and its bucket reducer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hyperrecipe.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer

__all__ = ["wrap_data_parallel"]


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
