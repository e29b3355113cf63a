"""Training state in and out of an applied model: DTensor state dicts for DCP, in both modes.

``torch.distributed.checkpoint`` stores each shard once and reshards on load only when every
tensor it is handed says where it lies in the global tensor: a DTensor. Production mode trains
on plain local shards whose names are the same on every rank, and DCP deduplicates those into
one rank's piece without a word. So every state dict handed out here is made of DTensors that
carry the plan's placements, built on the live local shards (no copy where the layout allows),
and loading accepts DTensors of any placement or full tensors and writes each rank's slice.

Layouts DTensor cannot store (a chunked shard: each rank holds one piece of every fused part;
DCP refuses ``_StridedShard`` as overlapping chunks) are handed out *replicated*: gathered, and
stored once, at the cost of one full copy of those tensors while the state dict lives.

Everything that gathers is a collective; the functions that may gather say so.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.placement import Shard, to_torch_placements
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.runtime.sharding import gather_full, local_shard

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "LiveParams",
    "dtensor_placements",
    "load_optimizer_state",
    "optimizer_state",
]


def dtensor_placements(p: ParamPlan, mesh_dims: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The torch placements that store ``p``'s local shard exactly as a DTensor, or ``None``.

    K equal chunks of a dim sharded over one mesh dim is ``_StridedShard(d, split_factor=K)``;
    unequal chunks, or a chunked dim that another mesh dim shards too, have no DTensor placement.
    """
    chunked = [(n, q) for n, q in p.placement.dims if isinstance(q, Shard) and q.is_chunked]
    if not chunked:
        return to_torch_placements(p.placement, mesh_dims)
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    ndim = len(p.shape)
    dims = {n: q.dim % ndim for n, q in p.placement.dims if isinstance(q, Shard)}
    out: list[Any] = []
    for name in mesh_dims:
        q = p.placement.get(name)
        if not isinstance(q, Shard):
            out.append(TReplicate())
            continue
        shared = any(d == dims[name] and n != name for n, d in dims.items())
        if q.is_chunked and (shared or len(set(q.part_sizes(p.shape[dims[name]]))) > 1):
            return None
        out.append(_StridedShard(dims[name], split_factor=q.chunks) if q.is_chunked
                   else TShard(dims[name]))
    return tuple(out)


def _stores_exactly(placements: tuple[Any, ...] | None) -> bool:
    """Whether DCP can store a DTensor of these placements shard by shard."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placements is not None and not any(isinstance(q, _StridedShard) for q in placements)


class LiveParams:
    """The model's *current* parameters for the plan's FQNs, looked up on every use.

    An ``Installation`` must not keep its own references: ``to_empty()``, ``fully_shard`` and
    ``load_state_dict(assign=True)`` replace parameter objects, and a state dict read from stale
    references is a silently stale checkpoint.
    """

    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh, mode: str) -> None:
        self.model, self.plan, self.mesh, self.mode = model, plan, mesh, mode
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.own = tuple(p for p in plan.params if p.tied_to is None)

    def param(self, p: ParamPlan) -> Tensor:
        value: Tensor | None = self.modules[p.module]._parameters.get(p.name)
        if value is None:
            msg = f"{p.fqn}: the parameter is gone from the model; it was removed after apply"
            raise PlanMismatchError(msg)
        return value

    def local(self, p: ParamPlan) -> Tensor:
        """This rank's shard as the plan lays it out (a plain tensor sharing the parameter's
        storage), or a refusal naming what replaced the parameter (a parameter that
        ``fully_shard`` wrapped after apply holds only pieces of the shard: see
        :meth:`full_of`)."""
        from torch.distributed.tensor import DTensor

        value = self.param(p)
        if isinstance(value, DTensor):
            if value.device_mesh != self.mesh:
                msg = (f"{p.fqn} is now a DTensor on another mesh "
                       f"({value.device_mesh.mesh_dim_names}): it was wrapped after apply "
                       f"(fully_shard?), and its DTensor does not say where this rank's tensor "
                       f"parallel shard lies, so a checkpoint of it would be wrong; use "
                       f"Installation.full_state_dict() for full weights")
                raise PlanMismatchError(msg)
            value = value._local_tensor
        if tuple(value.shape) != p.local_shape and not (self.mode == "validate"
                                                        and tuple(value.shape) == p.shape):
            msg = (f"{p.fqn}: the live parameter has shape {list(value.shape)}, this rank's "
                   f"shard is {list(p.local_shape)}; it was replaced after apply")
            raise PlanMismatchError(msg)
        if value.device.type == "meta":
            msg = (f"{p.fqn} is on the meta device; apply allocates shards itself, do not call "
                   f"to_empty() on an applied model")
            raise PlanMismatchError(msg)
        return value

    def items(self) -> Iterator[tuple[ParamPlan, Tensor]]:
        for p in self.own:
            yield p, self.local(p)

    # -- DTensor views -------------------------------------------------------------------

    def as_dtensor(self, p: ParamPlan, local: Tensor) -> Tensor:
        """``local`` (shaped like ``p``'s shard) as a DTensor DCP can store once per shard.
        Gathers (a collective) only for layouts DTensor cannot store."""
        from torch.distributed.tensor import DTensor, Replicate

        placements = dtensor_placements(p, self.plan.mesh_dims)
        if tuple(local.shape) == p.shape and tuple(local.shape) != p.local_shape:
            # validate mode keeps replicated params outside boundaries whole
            placements = tuple(Replicate() for _ in self.plan.mesh_dims)
        if _stores_exactly(placements):
            assert placements is not None
            return DTensor.from_local(local.detach(), self.mesh, placements, run_check=False,
                                      shape=torch.Size(p.shape), stride=contiguous_stride(p.shape))
        full = self.full(p, local)
        return DTensor.from_local(full, self.mesh, tuple(Replicate() for _ in self.plan.mesh_dims),
                                  run_check=False)

    def full_of(self, p: ParamPlan, value: Tensor) -> Tensor:
        """The full tensor of a parameter-shaped ``value`` in any of the layouts a live
        parameter or gradient can have: a plain local shard, a DTensor on this mesh (validate),
        or a DTensor that ``fully_shard`` made of this rank's shard. A collective."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            if value.device_mesh == self.mesh:
                value = value._local_tensor
            elif tuple(value.shape) == p.local_shape:
                value = value.full_tensor()
            else:
                msg = (f"{p.fqn}: a DTensor of shape {list(value.shape)} on mesh "
                       f"{value.device_mesh.mesh_dim_names} is neither this plan's layout nor "
                       f"a wrapper's of this rank's shard {list(p.local_shape)}")
                raise PlanMismatchError(msg)
        return self.full(p, value)

    def full(self, p: ParamPlan, local: Tensor) -> Tensor:
        """The full tensor from every rank's ``local`` (a collective when sharded)."""
        if tuple(local.shape) == p.shape:
            return local.detach().clone()
        return gather_full(local, p.placement, p.shape, self.mesh, self.plan.mesh_dims)

    def shard_of(self, p: ParamPlan, value: Tensor) -> Tensor:
        """This rank's shard of ``value``: a DTensor of any placement (redistributed; may be a
        collective) or a full tensor (sliced)."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            if tuple(value.shape) != p.shape:
                msg = (f"{p.fqn}: the checkpoint holds shape {list(value.shape)}, the model "
                       f"{list(p.shape)}")
                raise PlanMismatchError(msg)
            placements = dtensor_placements(p, self.plan.mesh_dims)
            if (_stores_exactly(placements) and value.device_mesh == self.mesh):
                assert placements is not None
                return value.redistribute(self.mesh, placements).to_local()
            value = value.full_tensor()
        if tuple(value.shape) != p.shape:
            msg = f"{p.fqn}: got shape {list(value.shape)}, the model {list(p.shape)}"
            raise PlanMismatchError(msg)
        return local_shard(value, p.placement, self.mesh, self.plan.mesh_dims)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


# -- optimizer state -----------------------------------------------------------------------


def _param_fqns(live: LiveParams) -> dict[int, ParamPlan]:
    return {id(live.param(p)): p for p in live.own}


def _groups_with_fqns(optimizer: torch.optim.Optimizer,
                      by_id: Mapping[int, ParamPlan]) -> list[list[ParamPlan]]:
    groups: list[list[ParamPlan]] = []
    for group in optimizer.param_groups:
        names: list[ParamPlan] = []
        for param in group["params"]:
            p = by_id.get(id(param))
            if p is None:
                msg = ("the optimizer holds a parameter that is not one of the applied model's "
                       "(create the optimizer after apply, from model.parameters())")
                raise PlanMismatchError(msg)
            names.append(p)
        groups.append(names)
    return groups


def optimizer_state(live: LiveParams, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN, per-parameter tensors as DTensors with the
    parameter's placements (the layout of ``torch.distributed.checkpoint.state_dict``'s
    optimizer state dict). An optimizer that has not stepped yet is given its state first (one
    step with zero gradients and a zero learning rate), so DCP has somewhere to load into."""
    by_id = _param_fqns(live)
    groups = _groups_with_fqns(optimizer, by_id)
    _init_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for group, plans in zip(optimizer.param_groups, groups, strict=True):
        for param, p in zip(group["params"], plans, strict=True):
            entry: dict[str, Any] = {}
            for key, value in optimizer.state.get(param, {}).items():
                entry[key] = _to_state(live, p, value)
            state[p.fqn] = entry
    param_groups = []
    for group, plans in zip(optimizer.param_groups, groups, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        param_groups.append({**hyper, "params": [p.fqn for p in plans]})
    return {"state": state, "param_groups": param_groups}


def _to_state(live: LiveParams, p: ParamPlan, value: Any) -> Any:
    if isinstance(value, Tensor) and value.dim() > 0:
        from torch.distributed.tensor import DTensor

        local = value._local_tensor if isinstance(value, DTensor) else value
        if tuple(local.shape) in (p.local_shape, p.shape):
            return live.as_dtensor(p, local)
    return value


def load_optimizer_state(live: LiveParams, optimizer: torch.optim.Optimizer,
                         state: Mapping[str, Any]) -> None:
    """Put an :func:`optimizer_state` dict (after ``dcp.load``, possibly saved on another mesh)
    back into ``optimizer``: each tensor becomes this rank's shard of the live layout."""
    from torch.distributed.tensor import DTensor

    by_id = _param_fqns(live)
    groups = _groups_with_fqns(optimizer, by_id)
    saved_groups = state.get("param_groups", [])
    if len(saved_groups) != len(groups):
        msg = (f"optimizer state has {len(saved_groups)} param groups, the optimizer "
               f"{len(groups)}; build the optimizer with the same groups as when it was saved")
        raise PlanMismatchError(msg)
    per_fqn = state.get("state", {})
    ids: dict[str, int] = {}
    out_groups = []
    index = 0
    for saved, plans in zip(saved_groups, groups, strict=True):
        if list(saved["params"]) != [p.fqn for p in plans]:
            msg = "optimizer state's param groups hold other parameters than the optimizer's"
            raise PlanMismatchError(msg)
        numbers = []
        for p in plans:
            ids[p.fqn] = index
            numbers.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": numbers})
    out_state: dict[int, dict[str, Any]] = {}
    for fqn, entry in per_fqn.items():
        if fqn not in ids:
            continue
        p = live.plan.param(fqn)
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and (
                    isinstance(value, DTensor) or tuple(value.shape) == p.shape):
                local = live.shard_of(p, value)
                out[key] = local if live.mode == "production" or not isinstance(
                    live.param(p), DTensor) else _like_param(live, p, local)
            else:
                out[key] = value
        out_state[ids[fqn]] = out
    optimizer.load_state_dict({"state": out_state, "param_groups": out_groups})


def _like_param(live: LiveParams, p: ParamPlan, local: Tensor) -> Tensor:
    """In validate mode the optimizer's state tensors are DTensors like the parameter."""
    from torch.distributed.tensor import DTensor

    param = live.param(p)
    assert isinstance(param, DTensor)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    if optimizer.state:
        return
    params = [q for g in optimizer.param_groups for q in g["params"]]
    if any(q.grad is not None for q in params):
        return  # a step is about to give it state; do not overwrite real gradients
    for q in params:
        if q.requires_grad:
            q.grad = torch.zeros_like(q)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], Tensor) else 0.0
    try:
        with torch.no_grad():
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
