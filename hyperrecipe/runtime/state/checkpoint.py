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

A data-parallel wrapper applied after apply (FSDP2's ``fully_shard`` on a dim the plan
replicates) turns each parameter into its piece of the rank's shard, a DTensor over the wrapper's
mesh only. Those pieces are handed out over the whole mesh (:meth:`LiveParams.wrapper_layout`:
the plan's placements plus the wrapper's split, strided where both split one tensor dim), so a
dp × tp checkpoint is stored piece by piece and reshards like any other.

Everything that gathers is a collective; the functions that may gather say so.
:func:`every_rank_entered` is how a collective state path learns, within a bound, that a rank
called it alone (``if rank == 0: dcp.save(inst.state_dict())``) instead of waiting in the
gather or in DCP's own exchanges for the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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

__all__ = [
    "every_rank_entered",
    "LiveParams",
    "differing_ties",
    "dtensor_placements",
    "load_optimizer_state",
    "load_training_state",
    "optimizer_state",
    "optimizer_state_to_load",
]


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


def differing_ties(plan: Plan, state: Mapping[str, Any], prefix: str = "") -> str | None:
    """Why ``state`` cannot load into the plan's tied parameters, or ``None``: it holds two of
    a tied parameter's names as different tensors with different values (a one-process
    *untied* model's state dict). ``load_state_dict`` would copy both into the one shared
    tensor, the last silently winning, where ``from_pretrained`` unties them. The same object
    under both names (what ``state_dict()`` of the applied model hands out) is not compared.
    Comparing DTensors is a collective (every rank loads)."""
    from torch.distributed.tensor import DTensor

    problems = []
    for q in plan.params:
        if q.tied_to is None:
            continue
        a, b = state.get(prefix + q.tied_to), state.get(prefix + q.fqn)
        if not isinstance(a, Tensor) or not isinstance(b, Tensor):
            continue
        la = a._local_tensor if isinstance(a, DTensor) else a
        lb = b._local_tensor if isinstance(b, DTensor) else b
        if la.data_ptr() == lb.data_ptr() and la.shape == lb.shape:
            continue  # one tensor under both names (the applied model's own state dicts)
        fa = a.full_tensor() if isinstance(a, DTensor) else a
        fb = b.full_tensor() if isinstance(b, DTensor) else b
        if fa.shape != fb.shape or not bool((fa == fb).all()):
            problems.append(f"{prefix + q.tied_to!r} and {prefix + q.fqn!r}")
    if not problems:
        return None
    return (f"the state dict holds different values for {', '.join(problems)}, which the model "
            f"ties into one parameter (from_pretrained would untie them); build the model "
            f"untied (tie_word_embeddings=False) and compile the plan for it, or keep one name")


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
                    f"checkpoint with Installation.state_dict() / load_state_dict(), which "
                    f"store and restore the pieces")
        return (f"{p.fqn} is now a DTensor on another mesh ({mesh}) that is not a "
                f"data-parallel wrapper's piece of this rank's shard on a replicated dim of "
                f"the plan's mesh {tuple(self.plan.mesh_dims)}, so where its values lie in the "
                f"full tensor is unknown and a checkpoint of it would be wrong; use "
                f"Installation.full_state_dict() for full weights")

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
        """This rank's shard ``local`` as a DTensor like the live (validate-mode) parameter."""
        return _like_param(self, p, local)

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

        if live.wrapper_layout(p, value) is not None:
            return live.stored(p, value)
        if isinstance(value, DTensor) and value.device_mesh != live.mesh:
            raise PlanMismatchError(live._wrapped_refusal(p, value))
        local = value._local_tensor if isinstance(value, DTensor) else value
        if tuple(local.shape) in (p.local_shape, p.shape):
            return live.as_dtensor(p, local)
    return value


def load_optimizer_state(live: LiveParams, optimizer: torch.optim.Optimizer,
                         state: Mapping[str, Any]) -> None:
    """Put an :func:`optimizer_state` dict (after ``dcp.load``, possibly saved on another mesh)
    back into ``optimizer``: each tensor becomes this rank's shard of the live layout."""
    optimizer.load_state_dict(optimizer_state_to_load(live, optimizer, state))


def optimizer_state_to_load(live: LiveParams, optimizer: torch.optim.Optimizer,
                            state: Any) -> dict[str, Any]:
    """What ``optimizer.load_state_dict`` takes for an :func:`optimizer_state` dict, checked
    whole and built without touching the optimizer (so a caller can check everything before
    writing anything).

    Raises:
        PlanMismatchError: the entry is not an optimizer state of this optimizer's groups and
            parameters, or a tensor has another global shape.
    """
    from torch.distributed.tensor import DTensor

    by_id = _param_fqns(live)
    groups = _groups_with_fqns(optimizer, by_id)
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups", []), list) \
            or not isinstance(state.get("state", {}), Mapping):
        msg = (f"the optimizer entry is a {type(state).__name__} without 'state' (a mapping) and "
               f"'param_groups' (a list); pass what Installation.state_dict(optimizer) returned")
        raise PlanMismatchError(msg)
    saved_groups = state.get("param_groups", [])
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
               for g in saved_groups):
        raise PlanMismatchError("optimizer state's param_groups must be mappings with 'params'")
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
        if not isinstance(entry, Mapping):
            raise PlanMismatchError(f"optimizer state of {fqn!r} is a {type(entry).__name__}, "
                                    f"not a mapping of its state tensors")
        p = live.plan.param(fqn)
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and (
                    isinstance(value, DTensor) or tuple(value.shape) == p.shape):
                param = live.param(p)
                if live.wrapper_layout(p, param) is not None:
                    out[key] = live.piece_like(p, value, param)
                    continue
                local = live.shard_of(p, value)
                out[key] = local if not live.mode.parameters_are_dtensors or not isinstance(
                    param, DTensor) else _like_param(live, p, local)
            else:
                out[key] = value
        out_state[ids[fqn]] = out
    return {"state": out_state, "param_groups": out_groups}


def load_training_state(live: LiveParams, state: Mapping[str, Any],
                        optimizer: torch.optim.Optimizer | None, unloaded: set[str]) -> None:
    """``Installation.load_state_dict``: every parameter's shard, every buffer and the
    optimizer's state are computed and checked first; only then is anything written, so a
    missing or malformed entry leaves the model and the optimizer as they were. A collective
    (resharding may gather).

    Raises:
        PlanMismatchError: a parameter or buffer is missing or has another shape; tied names
            hold different values; an optimizer was given and the state has no valid entry.
    """
    model = state.get("model") if isinstance(state, Mapping) else None
    if not isinstance(model, Mapping):
        raise PlanMismatchError("load_state_dict: the state has no 'model' entry; pass what "
                                "Installation.state_dict() returned (after dcp.load)")
    plan = live.plan
    missing = [p.fqn for p in live.own
               if p.fqn not in model and not any(q.tied_to == p.fqn and q.fqn in model
                                                 for q in plan.params)]
    if missing:
        raise PlanMismatchError(f"load_state_dict: missing {missing}")
    if optimizer is not None and "optimizer" not in state:
        raise PlanMismatchError("load_state_dict: an optimizer was given but the state holds "
                                "none; save with Installation.state_dict(optimizer)")
    why = differing_ties(plan, model)
    if why is not None:
        raise PlanMismatchError(f"load_state_dict: {why}")
    writes: list[tuple[str, Tensor, Tensor]] = []
    for p in live.own:
        value = model[p.fqn] if p.fqn in model else next(
            model[q.fqn] for q in plan.params if q.tied_to == p.fqn and q.fqn in model)
        if not isinstance(value, Tensor):
            raise PlanMismatchError(f"load_state_dict: {p.fqn!r} is a {type(value).__name__}, "
                                    f"not a tensor")
        param = live.param(p)
        if live.wrapper_layout(p, param) is not None:  # fully_shard's piece
            piece = live.piece_like(p, value, param)
            writes.append((p.fqn, param._local_tensor,  # type: ignore[attr-defined]
                           piece._local_tensor))  # type: ignore[attr-defined]
        else:
            writes.append((p.fqn, live.local(p), live.shard_of(p, value)))
    from hyperrecipe.runtime.state.weights import persistent_buffers

    buffers: list[tuple[str, Tensor, Any]] = []
    for name, buf in persistent_buffers(live.model):
        value = model.get(name)
        if value is not None and value is not buf:
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(buf.shape):
                shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise PlanMismatchError(f"load_state_dict: buffer {name!r} is {shape}, the "
                                        f"model's is {list(buf.shape)}")
        buffers.append((name, buf, value))
    to_load = (optimizer_state_to_load(live, optimizer, state["optimizer"])
               if optimizer is not None else None)
    with torch.no_grad():
        for fqn, target, shard in writes:
            if target.data_ptr() != shard.data_ptr():
                target.copy_(shard)
            unloaded.discard(fqn)
        for name, buf, value in buffers:
            if value is not None and value is not buf:
                buf.copy_(value)
            unloaded.discard(name)
    if optimizer is not None:
        assert to_load is not None
        optimizer.load_state_dict(to_load)


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


class _Entered:
    """How many collective state calls this process got through (the same on every rank
    while the ranks call them in the same order, which they must for the gathers anyway)."""

    calls = 0


def every_rank_entered(store: Any, label: str, rank: int, world: int,
                       timeout_s: float) -> str | None:
    """Wait up to ``timeout_s`` for every rank to enter this collective call; None when all
    did and all entered ``label``, otherwise why not (the missing ranks, or what others called).

    Through the process group's store, not a collective: a monitored barrier bounds the wait
    only on rank 0 (other ranks wait for rank 0 with the process group's timeout), and a timed
    out collective leaves the group unusable. The store is polled (``check``): a timed-out
    blocking ``wait`` would leave a reply pending on the store's socket. A rank that gives up
    removes its own entry and does not count the call, so a later call finds no stale arrival;
    after a call every rank got through, the last rank to leave removes its keys.
    """
    import time

    key = f"hyperrecipe/collective/{_Entered.calls + 1}"
    mine = f"{key}/{rank}"
    keys = [f"{key}/{r}" for r in range(world)]
    store.set(mine, label)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            store.delete_key(mine)
            return f"rank(s) {missing} did not enter it within {timeout_s:g} s"
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    called = {r: bytes(store.get(k)).decode() for r, k in enumerate(keys)}
    _Entered.calls += 1
    if store.add(f"{key}/left", 1) == world:  # every rank has read every entry
        for k in (*keys, f"{key}/left"):
            store.delete_key(k)
    others = {r: c for r, c in called.items() if c != label}
    if others:
        listed = ", ".join(f"rank {r} {c}()" for r, c in sorted(others.items()))
        return f"other ranks entered another collective at this point: {listed}"
    return None
