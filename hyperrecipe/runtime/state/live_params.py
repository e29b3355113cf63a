"""The model's *current* parameters for the plan's FQNs: the view every state path reads.

``LiveParams`` looks each parameter up on every use instead of keeping a reference, because
``to_empty()``, ``fully_shard`` and ``load_state_dict(assign=True)`` replace parameter objects
after apply. It also knows how each shard lies in the global tensor (the plan's DTensor
placements, plus a data-parallel wrapper's split when one holds the parameter) and gathers or
slices full tensors. Its own module because every room that touches parameters after apply
(``grads``, ``state``, the mode) reads it, and none of them needs the DCP state dicts that live
beside it in :mod:`~hyperrecipe.runtime.state.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.placement import parse_dtensor
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.runtime.mode import Mode, as_mode
from hyperrecipe.runtime.comm.sharding import gather_full, local_shard

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["LiveParams", "contiguous_stride", "dtensor_placements"]


def dtensor_placements(p: ParamPlan, mesh_dims: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The torch placements that store ``p``'s local shard exactly as a DTensor, or ``None``:
    read from the plan (``ParamPlan.dtensor``, decided at compile time), in the plan's mesh
    order (``mesh_dims`` is the plan's). K equal chunks of a dim sharded over one mesh dim are
    ``_StridedShard(d, split_factor=K)``; unequal chunks, or a chunked dim that another mesh dim
    shards too, have none (``ParamPlan.no_dtensor`` says why)."""
    del mesh_dims  # the plan records the placement in its own mesh order
    if p.no_dtensor is not None:
        return None
    layout = parse_dtensor(p.dtensor)
    if layout.parts is not None:
        return None  # one DTensor per part (unequal chunks): stored whole
    return layout.torch_placements()



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

    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh, mode: Mode | str) -> None:
        self.model, self.plan, self.mesh, self.mode = model, plan, mesh, as_mode(mode)
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.own = tuple(p for p in plan.params if p.tied_to is None)

    def reshard_wrappers(self) -> None:
        """Put FSDP2's shards back in the modules where a forward left them gathered.

        ``fully_shard`` registers each module's *unsharded* parameters in place of its sharded
        ones while it computes, and reshards them after backward; after a forward without
        backward (an evaluation under ``torch.no_grad()``) the modules it does not reshard
        after forward (the root, by default) keep the gathered, plain ones. Those are not the
        objects the optimizer holds, nor FSDP's pieces. torch's own ``get_state_dict`` gets
        past this through FSDP's state-dict pre-hooks, which reshard; every state path here
        reads the parameters itself, so it calls this first. Resharding is local (it frees
        the gathered copy and registers the shards again: no collective) and leaves nothing
        to redo: the next forward gathers again, as it would after a backward.
        """
        from torch.distributed.fsdp import FSDPModule

        for module in self.modules.values():
            if isinstance(module, FSDPModule):
                module.reshard()

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
                raise PlanMismatchError(self._wrapped_refusal(p, value))
            value = value._local_tensor
        if tuple(value.shape) != p.local_shape and not (self.mode.parameters_are_dtensors
                                                        and tuple(value.shape) == p.shape):
            msg = (f"{p.fqn}: the live parameter has shape {list(value.shape)}, this rank's "
                   f"shard is {list(p.local_shape)}; it was replaced after apply")
            raise PlanMismatchError(msg)
        if value.device.type == "meta":
            msg = (f"{p.fqn} is on the meta device; apply allocates shards itself, do not call "
                   f"to_empty() on an applied model")
            raise PlanMismatchError(msg)
        return value

    def _wrapped_refusal(self, p: ParamPlan, value: Tensor) -> str:
        from torch.distributed.tensor import DTensor

        assert isinstance(value, DTensor)
        mesh = value.device_mesh.mesh_dim_names
        if self.wrapper_layout(p, value) is not None:
            return (f"{p.fqn} is now a piece of this rank's shard, made by a data-parallel "
                    f"wrapper on mesh {mesh} (fully_shard?): load weights before wrapping; "
                    f"checkpoint with inst.state.state_dict() / load_state_dict(), which "
                    f"store and restore the pieces")
        return (f"{p.fqn} is now a DTensor on another mesh ({mesh}) that is not a "
                f"data-parallel wrapper's piece of this rank's shard on a replicated dim of "
                f"the plan's mesh {tuple(self.plan.mesh_dims)}, so where its values lie in the "
                f"full tensor is unknown and a checkpoint of it would be wrong; use "
                f"inst.state.full_state_dict() for full weights")

    # -- data-parallel wrappers over the shards (fully_shard after apply) ------------------

    def wrapper_layout(self, p: ParamPlan, value: Tensor) -> tuple[Any, ...] | None:
        """The placements over this mesh of ``value``, when it is what a data-parallel
        wrapper (FSDP2's ``fully_shard`` on a dim the plan replicates) made of this rank's
        shard: a DTensor on a sub-mesh of this mesh whose global shape is the shard's. The
        wrapper splits the *shard*, so on a tensor dim the plan also shards over a later mesh
        dim its placement is ``_StridedShard`` (the layout FSDP2 itself uses with tensor
        parallel), which DCP stores shard by shard. ``None`` for anything else, including a
        chunked (fused) shard under a wrapper, whose pieces no placement expresses."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import _StridedShard

        if (not isinstance(value, DTensor) or value.device_mesh == self.mesh
                or tuple(value.shape) != p.local_shape or self.mode.parameters_are_dtensors):
            return None
        names = tuple(self.mesh.mesh_dim_names or ())
        wrapper = value.device_mesh
        wnames = tuple(wrapper.mesh_dim_names or ())
        if not wnames or any(n not in names for n in wnames) or list(wnames) != sorted(
                wnames, key=names.index):
            return None
        coordinate = self.mesh.get_coordinate()
        if coordinate is None:
            return None
        index = tuple(slice(None) if n in wnames else coordinate[i] for i, n in enumerate(names))
        if not torch.equal(self.mesh.mesh[index], wrapper.mesh):
            return None  # not this mesh's sub-mesh through this rank
        base = dtensor_placements(p, self.plan.mesh_dims)
        if base is None or any(isinstance(q, _StridedShard) for q in base):
            return None
        placements = list(base)
        sharded_dims: set[int] = set()
        for wdim, q in zip(wnames, value.placements, strict=True):
            if isinstance(q, Replicate):
                continue
            i = names.index(wdim)
            if type(q) is not Shard or not isinstance(placements[i], Replicate) or (
                    q.dim in sharded_dims):  # a plain shard only (not a strided subclass)
                return None
            sharded_dims.add(q.dim)
            later = [self.mesh.size(t) for t in range(i + 1, len(names))
                     if isinstance(placements[t], Shard) and placements[t].dim == q.dim]
            factor = 1
            for n in later:
                factor *= n
            placements[i] = (_StridedShard(q.dim, split_factor=factor) if factor > 1
                             else Shard(q.dim))
        layout = tuple(placements)
        shape, _ = compute_local_shape_and_global_offset(p.shape, self.mesh, layout)
        if tuple(shape) != tuple(value._local_tensor.shape):
            return None  # the wrapper split differently than DTensor would: do not guess
        return layout

    def stored(self, p: ParamPlan, value: Tensor | None = None) -> Tensor:
        """``value`` (default: the live parameter), a parameter-shaped tensor of any live
        layout, as the DTensor a checkpoint stores: over this mesh with the plan's placements
        (:meth:`as_dtensor`), or, for a data-parallel wrapper's piece, with
        :meth:`wrapper_layout` (sharing the piece's storage)."""
        from torch.distributed.tensor import DTensor

        value = self.param(p) if value is None else value
        layout = self.wrapper_layout(p, value)
        if layout is not None:
            assert isinstance(value, DTensor)
            return DTensor.from_local(value._local_tensor.detach(), self.mesh, layout,
                                      run_check=False, shape=torch.Size(p.shape),
                                      stride=contiguous_stride(p.shape))
        if value is self.param(p):
            return self.as_dtensor(p, self.local(p))  # local() refuses stale or foreign values
        if isinstance(value, DTensor) and value.device_mesh != self.mesh:
            raise PlanMismatchError(self._wrapped_refusal(p, value))
        local = value._local_tensor if isinstance(value, DTensor) else value
        return self.as_dtensor(p, local)

    def piece_like(self, p: ParamPlan, value: Tensor, like: Tensor) -> Tensor:
        """This rank's part of a checkpoint ``value`` (a DTensor of any layout, or a full
        tensor) in the layout of the live tensor ``like``: a wrapper's piece (as a DTensor
        like ``like``), or a plain shard. May be a collective."""
        from torch.distributed.tensor import DTensor, Replicate

        layout = self.wrapper_layout(p, like)
        if layout is None:
            return self.shard_of(p, value)
        assert isinstance(like, DTensor)
        if isinstance(value, DTensor) and value.device_mesh == like.device_mesh and (
                value.placements == like.placements and value.shape == like.shape):
            return value  # already a piece in the live layout (idempotent for load hooks)
        if isinstance(value, DTensor) and value.device_mesh == self.mesh and tuple(
                value.placements) == layout:
            piece = value._local_tensor
        else:
            shard = self.shard_of(p, value)
            whole = DTensor.from_local(shard, like.device_mesh,
                                       tuple(Replicate() for _ in like.placements),
                                       run_check=False)
            piece = whole.redistribute(like.device_mesh, like.placements).to_local()
        return DTensor.from_local(piece, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())

    def gathers(self, p: ParamPlan) -> bool:
        """Whether :meth:`as_dtensor` of ``p``'s shard gathers (a collective): a layout DCP
        cannot store shard by shard (fused ``chunks=K``, or none DTensor expresses)."""
        return tuple(p.shape) != p.local_shape and not _stores_exactly(
            dtensor_placements(p, self.plan.mesh_dims))

    def like_param(self, p: ParamPlan, local: Tensor) -> Tensor:
        """This rank's shard ``local`` as a DTensor like the live (validate-mode) parameter:
        in validate mode the optimizer's state tensors are DTensors like the parameter."""
        from torch.distributed.tensor import DTensor

        param = self.param(p)
        assert isinstance(param, DTensor)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

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
