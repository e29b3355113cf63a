"""``model.state_dict()`` and ``model.load_state_dict()`` of an applied model, made right.

Production mode trains on plain local shards registered under the original names, so the
model's own state dict has the same keys on every rank with different contents. Handed to
``torch.distributed.checkpoint`` (directly or through ``get_state_dict``), that is silently
deduplicated into one rank's pieces. While a plan is applied in production mode the root
module therefore carries two hooks, removed by ``restore()``:

- a state-dict post-hook that hands out each sharded parameter as a DTensor with the plan's
  placements over the mesh (no copy, no collective), so DCP stores every shard once. A fused
  (chunked) shard would be a ``_StridedShard`` DTensor, which DCP refuses ("overlapping
  chunks"), and a layout no DTensor expresses cannot be stored shard by shard at all: those
  are handed out as ``TrainingState.state_dict()`` stores them, gathered and replicated (a
  collective, so ``model.state_dict()`` of such a plan must be called on every rank).
- a load pre-hook that turns DTensors (any placement, any mesh layout of the same global
  shape) and full tensors into this rank's shard before ``load_state_dict`` copies them.

Optimizers over those shards have the same problem with their moments;
:func:`install_optimizer_hooks` gives them the same pair of hooks.

Validate mode's parameters (and so its optimizer state) are DTensors already and are handed
out as they are, except ``_StridedShard`` (fused) ones and their optimizer state, which are
handed out replicated for the same reason (the optimizer hooks are installed in both modes);
its load pre-hooks turn full tensors and such replicated DTensors back into DTensors like the
parameter.
In both modes the load pre-hook refuses ``assign=True``, and a load post-hook tells the
installation which tensors now have values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ParamPlan
from hyperrecipe.runtime.state.checkpoint import differing_ties
from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["install_optimizer_hooks", "install_state_hooks", "replaced_bucket_params"]


GATHER_WHY = (" on a plan with fused (chunked) parameters: it gathers them to hand them out "
              "replicated, the form DCP stores")


def install_state_hooks(model: nn.Module, live: LiveParams,
                        on_loaded: Callable[[set[str]], None],
                        enter_collective: Callable[[str, str], None] | None = None
                        ) -> list[Any]:
    """Register the hooks on ``model``; returns their handles (``.remove()`` each).

    Both modes: ``load_state_dict(..., assign=True)`` is refused (it would put new parameter
    objects in place of the installed shards: ties split, the deferred biases and gradient
    hooks stay on the old objects, and training goes on silently wrong), and the FQNs a
    ``load_state_dict`` wrote are reported to ``on_loaded`` (the installation's "weights unset"
    status). Production mode: DTensors out of ``state_dict()``, DTensors or full tensors back
    in as this rank's shard. Validate mode: full tensors in become DTensors like the parameter,
    so ``load_state_dict`` of a one-process state dict works in both modes.
    ``enter_collective(what, why)`` is called once before a ``state_dict()`` that gathers
    (fused parameters), so a call on one rank only is refused by name instead of hanging.
    """
    names: dict[str, Any] = {}
    for p in live.plan.params:
        names[p.fqn] = live.plan.param(p.tied_to) if p.tied_to else p
    handles: list[Any] = []
    pending: set[str] = set()

    def to_dtensors(module: nn.Module, state: dict[str, Any], prefix: str,
                    local_metadata: Any) -> None:
        if enter_collective is not None and any(
                prefix + fqn in state and _gathers(live, p) for fqn, p in names.items()):
            enter_collective("model.state_dict", GATHER_WHY)
        for fqn, p in names.items():
            key = prefix + fqn
            if key not in state or tuple(p.shape) == tuple(p.local_shape):
                continue
            if live.mode.parameters_are_dtensors:
                # validate: the live DTensors as they are, but a fused (chunked) one, which
                # DCP refuses as _StridedShard, replicated like production's
                param = live.param(p)
                if _strided(param) and _on(param, live):
                    state[key] = live.as_dtensor(p, live.local(p))
                continue
            if live.wrapper_layout(p, live.param(p)) is not None:  # fully_shard's piece
                state[key] = live.stored(p)
                continue
            # TrainingState.state_dict()'s form: the plan's placements where DCP stores them
            # shard by shard; a fused (chunked) shard, which DCP refuses as _StridedShard
            # ("overlapping chunks"), gathered and handed out replicated (a collective).
            state[key] = live.as_dtensor(p, live.local(p))

    def from_dtensors(module: nn.Module, state: dict[str, Any], prefix: str,
                      local_metadata: Any, *args: Any) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(local_metadata, Mapping) and local_metadata.get("assign_to_params_buffers"):
            msg = ("load_state_dict(..., assign=True) on a model with an applied plan would "
                   "replace the installed shards with new parameter objects (ties split, "
                   "deferred biases and gradient hooks left on the old ones); call "
                   "load_state_dict without assign=True (the values are copied into the "
                   "shards), or TrainingState.load_weights / load_full_state_dict")
            raise PlanMismatchError(msg)
        why = differing_ties(live.plan, state, prefix)
        if why is not None:
            raise PlanMismatchError(f"load_state_dict: {why}")
        pending.clear()
        pending.update(k[len(prefix):] for k in state if k.startswith(prefix))
        for fqn, p in names.items():
            key = prefix + fqn
            value = state.get(key)
            if not isinstance(value, Tensor):
                continue
            param = live.param(p)
            if live.mode.parameters_are_dtensors:
                if value is param and _strided(param):
                    raise PlanMismatchError(_broadcast_refusal(fqn))
                if isinstance(value, DTensor) and isinstance(param, DTensor) and _strided(
                        param) and _on(param, live) and (
                        tuple(value.placements) != tuple(param.placements)
                        or value.device_mesh != param.device_mesh):
                    # a replicated (or resharded) checkpoint of a fused parameter
                    state[key] = live.like_param(p, live.shard_of(p, value))
                    continue
                if isinstance(param, DTensor) and not isinstance(value, DTensor) and tuple(
                        value.shape) == tuple(p.shape):
                    local = (value if tuple(param._local_tensor.shape) == tuple(p.shape)
                             else live.shard_of(p, value))
                    state[key] = DTensor.from_local(
                        local.to(param.device), param.device_mesh, param.placements,
                        run_check=False, shape=param.shape, stride=param.stride())
                continue
            if tuple(p.shape) == tuple(p.local_shape):
                continue
            if isinstance(value, DTensor) or tuple(value.shape) == tuple(p.shape):
                state[key] = (live.piece_like(p, value, param)
                              if live.wrapper_layout(p, param) is not None
                              else live.shard_of(p, value))

    def report_loaded(module: nn.Module, incompatible: Any) -> None:
        missing = set(getattr(incompatible, "missing_keys", ()))
        loaded = {k for k in pending if k not in missing}
        pending.clear()
        on_loaded(loaded)

    register: Any = model  # torch leaves these three untyped
    handles.append(register.register_state_dict_post_hook(to_dtensors))
    handles.append(register.register_load_state_dict_pre_hook(from_dtensors))
    handles.append(register.register_load_state_dict_post_hook(report_loaded))
    return handles


def _gathers(live: LiveParams, p: ParamPlan) -> bool:
    """Whether the state-dict hooks gather ``p`` (and its optimizer state): production, a
    layout DCP cannot store shard by shard; validate, a ``_StridedShard`` parameter."""
    if live.mode.parameters_are_dtensors:
        param = live.param(p)
        return _strided(param) and _on(param, live)
    return live.gathers(p) and live.wrapper_layout(p, live.param(p)) is None


def _on(value: Tensor, live: LiveParams) -> bool:
    """Whether ``value`` is a DTensor over the plan's own mesh (not a wrapper's)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and value.device_mesh == live.mesh


def _strided(param: Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(param, DTensor) and any(isinstance(q, _StridedShard)
                                              for q in param.placements)


def _broadcast_refusal(fqn: str) -> str:
    """torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` hands a validate-mode
    model's own DTensor parameters back to ``load_state_dict`` after copying into each one
    the slice ``compute_local_shape_and_global_offset`` names; for a ``_StridedShard`` (fused,
    chunked) parameter that is one contiguous range, not the rank's piece of every chunk."""
    return (f"load_state_dict: {fqn} is a fused (chunked) parameter, a _StridedShard DTensor in "
            f"validate mode, and it was handed back as the parameter itself, as "
            f"set_model_state_dict(..., broadcast_from_rank0=True) does after copying one "
            f"contiguous slice of the full tensor into it (not this rank's piece of every "
            f"chunk): its values are wrong. Load full tensors with "
            f"TrainingState.load_full_state_dict(), model.load_state_dict(full_state_dict), or "
            f"set_model_state_dict with full_state_dict=True and no broadcast_from_rank0 (or "
            f"in production mode)")


def replaced_bucket_params(live: LiveParams,
                           watched: Mapping[str, tuple[ParamPlan, Tensor]],
                           averaged: Callable[[], bool] | None = None) -> str | None:
    """Why a step would train on wrong gradients of the bucketed parameters, or ``None``:
    a parameter whose gradient the plan reduces in a bucket (``grad_buckets``) that is no
    longer the object apply installed (``fully_shard`` replaces parameters; the bucket hooks
    stay on the old one), or, the bucketed parameters left out of a ``fully_shard`` on a
    data dim, buckets that do not average them over it (``averaged()`` false: each data rank
    would train its own copy)."""
    gone = [fqn for fqn, (p, param) in watched.items() if live.param(p) is not param]
    route = ("hyperrecipe.runtime.fully_shard_data_parallel(inst, mesh['dp'], "
             "model.model.layers) in place of fully_shard (it leaves these parameters to the "
             "plan's buckets, which also average them over dp), or DDP through "
             "hyperrecipe.runtime.data_parallel(inst, mesh['dp'].get_group()) "
             "(docs/training.md#fsdp2-on-a-dp-dim)")
    if not gone:
        if not watched or averaged is None or averaged() or not _under_fully_shard(live):
            return None
        shown = ", ".join(list(watched)[:3]) + (", ..." if len(watched) > 3 else "")
        return (f"the model is under fully_shard with the parameters whose gradients the plan "
                f"reduces in buckets ({shown}) left out of it, and nothing averages their "
                f"gradients over the data dim: each data-parallel rank would train its own "
                f"copy of them. Use {route}")
    shown = ", ".join(gone[:3]) + (", ..." if len(gone) > 3 else "")
    return (f"{len(gone)} parameter(s) whose gradients the plan reduces over the mesh "
            f"(grad_buckets: {shown}) were replaced after apply (fully_shard?); the reduction "
            f"hooks stay on the objects apply installed, so these gradients are partial and a "
            f"step would train on them. Use {route}. Do not drop the buckets to get past "
            f"this: a plan compiled for this model needs them (sequence_parallel norms, "
            f"reduce_grads such as the per-head q/k norms of Qwen3, OLMo-2, Gemma-3), and "
            f"another model's recipe would train it wrong")


def _under_fully_shard(live: LiveParams) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in live.modules.values())


def install_optimizer_hooks(live: LiveParams,
                            watched: Mapping[str, tuple[ParamPlan, Tensor]] | None = None,
                            enter_collective: Callable[[str, str], None] | None = None,
                            averaged: Callable[[], bool] | None = None) -> list[Any]:
    """Make the state dict of every optimizer over this model's local shards DTensors too
    (production), and its fused parameters' state replicated (both modes; see the module).

    Optimizers are created after apply, so they are found where they first act: a global
    step pre-hook (one set lookup per step; it lives as long as the model,
    :mod:`~hyperrecipe.runtime.state.scoped_hooks`) registers, once per optimizer that holds one of
    the plan's parameters, a state-dict post-hook (moments and other parameter-shaped state as
    DTensors with the parameter's placements) and a load pre-hook (back to this rank's shard).
    ``get_state_dict``/``set_state_dict`` step an optimizer that has no state yet before
    reading it, so they always meet the hooks. Returns handles (``.remove()`` each).
    """
    import weakref

    import torch

    seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
    handles: list[Any] = []

    def by_key(optimizer: torch.optim.Optimizer,
               state: dict[str, Any]) -> Iterator[tuple[ParamPlan, dict[str, Any]]]:
        """(plan, state entry) of each of the plan's parameters in an optimizer state dict,
        matched through the param groups' order (keys are indices or, from torch's
        ``set_state_dict``, FQNs). Each entry is a copy put in the state dict's place:
        ``Optimizer.state_dict()`` shares its per-parameter dicts with the live optimizer, and
        writing DTensors into those would change the state the next step trains with."""
        live.reshard_wrappers()  # after an eval forward FSDP2's root holds gathered params
        plans = {id(live.param(p)): p for p in live.own}
        for saved, group in zip(state.get("param_groups", ()), optimizer.param_groups,
                                strict=False):
            for key, param in zip(saved["params"], group["params"], strict=False):
                p = plans.get(id(param))
                entry = state["state"].get(key)
                if p is not None and entry is not None and tuple(p.shape) != p.local_shape:
                    state["state"][key] = entry = dict(entry)
                    yield p, entry

    def to_dtensors(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        entries = list(by_key(optimizer, state))
        if enter_collective is not None and any(_gathers(live, p) for p, _ in entries):
            enter_collective("optimizer.state_dict", GATHER_WHY)
        for p, entry in entries:
            for key, value in entry.items():
                if live.mode.parameters_are_dtensors:  # validate: only fused moments, replicated
                    if _strided(value) and _on(value, live):
                        assert isinstance(value, DTensor)
                        entry[key] = live.as_dtensor(p, value._local_tensor)
                    continue
                if live.wrapper_layout(p, value) is not None:  # fully_shard's piece
                    entry[key] = live.stored(p, value)
                    continue
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and tuple(
                        value.shape) == tuple(p.local_shape):
                    # as the parameter: a fused (chunked) shard's moments replicated
                    entry[key] = live.as_dtensor(p, value)

    def from_dtensors(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        for p, entry in by_key(optimizer, state):
            param = live.param(p)
            wrapped = live.wrapper_layout(p, param) is not None
            for key, value in entry.items():
                if not isinstance(value, DTensor):
                    continue
                if not live.mode.parameters_are_dtensors:
                    entry[key] = (live.piece_like(p, value, param) if wrapped
                                  else live.shard_of(p, value))
                elif isinstance(param, DTensor) and _strided(param) and _on(param, live) and (
                        tuple(value.placements) != tuple(param.placements)
                        or value.device_mesh != param.device_mesh):
                    entry[key] = live.like_param(p, live.shard_of(p, value))

    def holds_plan_params(optimizer: torch.optim.Optimizer) -> bool:
        ids = {id(live.param(p)) for p in live.own}
        return any(id(q) in ids for g in optimizer.param_groups for q in g["params"])

    def on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if watched:
            why = replaced_bucket_params(live, watched, averaged)
            if why is not None and holds_plan_params(optimizer):
                raise PlanMismatchError(f"optimizer.step(): {why}")
        if optimizer in seen:
            return
        seen.add(optimizer)
        if holds_plan_params(optimizer):
            handles.append(optimizer.register_state_dict_post_hook(to_dtensors))
            handles.append(optimizer.register_load_state_dict_pre_hook(from_dtensors))

    from hyperrecipe.runtime.state.scoped_hooks import model_scoped_step_pre_hook

    handles.append(model_scoped_step_pre_hook(live.model, on_step))
    return handles
