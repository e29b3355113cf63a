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
:func:`~hyperrecipe.runtime.preflight.agreement.every_rank_entered` is how a collective state
path learns, within a bound, that a rank
called it alone (``if rank == 0: dcp.save(inst.state.state_dict())``) instead of waiting in the
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
from hyperrecipe.runtime.state.live_params import LiveParams

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "differing_ties",
    "init_optimizer_state",
    "load_optimizer_state",
    "load_training_state",
    "optimizer_state",
    "optimizer_state_to_load",
    "state_value_to_load",
    "stored_state_value",
]


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




# -- optimizer state -----------------------------------------------------------------------


def _param_fqns(live: LiveParams) -> dict[int, ParamPlan]:
    live.reshard_wrappers()  # an eval forward under FSDP2 leaves the root's params gathered
    return {id(live.param(p)): p for p in live.own}


def _groups_with_fqns(optimizer: torch.optim.Optimizer, by_id: Mapping[int, ParamPlan],
                      live: LiveParams) -> list[list[ParamPlan]]:
    groups: list[list[ParamPlan]] = []
    for group in optimizer.param_groups:
        names: list[ParamPlan] = []
        for param in group["params"]:
            p = by_id.get(id(param))
            if p is None:
                raise PlanMismatchError(_foreign_param(live, param))
            names.append(p)
        groups.append(names)
    return groups


def _foreign_param(live: LiveParams, param: Tensor) -> str:
    """Why the optimizer's ``param`` is none of the model's current parameters, as far as
    the model tells: the optimizer was built before apply, or before a data-parallel wrapper
    (``fully_shard``) replaced the parameters, or over another model."""
    from torch.distributed.tensor import DTensor

    kind = (f"DTensor on mesh {param.device_mesh.mesh_dim_names}"
            if isinstance(param, DTensor) else "plain tensor")
    found = f"a {kind} of shape {list(param.shape)}"
    wrapped = [p.fqn for p in live.own if _on_wrapper_mesh(live.param(p), live)]
    if wrapped and not isinstance(param, DTensor):
        cause = (f"the model's parameters are now a data-parallel wrapper's DTensor pieces "
                 f"({wrapped[0]}, ...: fully_shard?) and this optimizer still holds the "
                 f"objects they replaced; create the optimizer after fully_shard, from "
                 f"model.parameters()")
    else:
        cause = ("create the optimizer after apply (and after fully_shard, where the model "
                 "uses it), from this model's model.parameters()")
    return (f"the optimizer holds a parameter ({found}) that is not one of the applied "
            f"model's current parameters; {cause}")


def _on_wrapper_mesh(value: Tensor, live: LiveParams) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and value.device_mesh != live.mesh


def optimizer_state(live: LiveParams, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN, per-parameter tensors as DTensors with the
    parameter's placements (the layout of ``torch.distributed.checkpoint.state_dict``'s
    optimizer state dict). An optimizer that has not stepped yet is given its state first (one
    step with zero gradients and a zero learning rate), so DCP has somewhere to load into."""
    by_id = _param_fqns(live)
    groups = _groups_with_fqns(optimizer, by_id, live)
    init_optimizer_state(optimizer)
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
    by_id = _param_fqns(live)
    groups = _groups_with_fqns(optimizer, by_id, live)
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups", []), list) \
            or not isinstance(state.get("state", {}), Mapping):
        msg = (f"the optimizer entry is a {type(state).__name__} without 'state' (a mapping) and "
               f"'param_groups' (a list); pass what TrainingState.state_dict(optimizer) returned")
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
        out_state[ids[fqn]] = {key: state_value_to_load(live, p, value)
                               for key, value in entry.items()}
    return {"state": out_state, "param_groups": out_groups}


def stored_state_value(live: LiveParams, p: ParamPlan, value: Any) -> Any:
    """One optimizer state value of parameter ``p`` as :func:`optimizer_state` hands it to
    DCP: a parameter-shaped tensor (a production-mode local shard included) becomes a
    DTensor with the parameter's placements; anything else is kept."""
    return _to_state(live, p, value)


def state_value_to_load(live: LiveParams, p: ParamPlan, value: Any) -> Any:
    """One loaded optimizer state value of parameter ``p`` (a DTensor of any placement or a
    full tensor) as this rank's optimizer holds it: its shard, a DTensor like the parameter
    where parameters are DTensors; anything else is kept. May be a collective (resharding)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, Tensor) and value.dim() > 0 and (
            isinstance(value, DTensor) or tuple(value.shape) == p.shape):
        param = live.param(p)
        if live.wrapper_layout(p, param) is not None:
            return live.piece_like(p, value, param)
        local = live.shard_of(p, value)
        return local if not live.mode.parameters_are_dtensors or not isinstance(
            param, DTensor) else live.like_param(p, local)
    return value


def load_training_state(live: LiveParams, state: Mapping[str, Any],
                        optimizer: torch.optim.Optimizer | None, unloaded: set[str]) -> None:
    """``TrainingState.load_state_dict``: every parameter's shard, every buffer and the
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
                                "TrainingState.state_dict() returned (after dcp.load)")
    plan = live.plan
    missing = [p.fqn for p in live.own
               if p.fqn not in model and not any(q.tied_to == p.fqn and q.fqn in model
                                                 for q in plan.params)]
    if missing:
        raise PlanMismatchError(f"load_state_dict: missing {missing}")
    if optimizer is not None and "optimizer" not in state:
        raise PlanMismatchError("load_state_dict: an optimizer was given but the state holds "
                                "none; save with TrainingState.state_dict(optimizer)")
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


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state (one step with zero gradients and a
    zero learning rate), so DCP has somewhere to load into."""
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
