"""torch's ``GradScaler`` over an applied model's shards: every rank skips the same steps.

Why this module patches torch: ``GradScaler`` (fp16 training, and what accelerate, Lightning's
``16-mixed`` and the Hugging Face Trainer's ``fp16=True`` run) looks for infs and NaNs in the
gradients *this rank holds*. On production shards those are this rank's pieces of each sharded
parameter: an overflow in rank 0's rows of ``q_proj`` makes rank 0 skip the step and halve its
scale while rank 1 steps and keeps its own. From then on the replicated weights differ between
ranks and the scales disagree, and nothing says so (torch's ``ShardedGradScaler`` exists for the
same reason, for FSDP1, with a ``process_group`` to agree over). No hook on the model or the
optimizer sees that decision: ``GradScaler.step`` decides from the found-inf flags before it
calls ``optimizer.step()``.

Both of torch's paths to those flags (``unscale_`` and, for fused optimizers,
``_check_inf_per_device``) go through ``GradScaler._unscale_grads_``, which torch 2.13 looks up
on the instance's class at every call. While an installation with sharded parameters is alive,
that method is wrapped: when the optimizer holds any of an installation's parameters, each
per-device flag is all-reduced with ``MAX`` over every dim of the installation's mesh, so every
rank of the model sees an overflow on any rank and all skip together (one tiny all-reduce per
mesh dim per step, only with a scaler). Optimizers over other parameters are untouched. A torch
without ``_unscale_grads_`` is not covered (the docs say so); a subclass that overrides it
(torch's ``ShardedGradScaler``) agrees through its own ``process_group``.

This module only builds the wrapper; the patch is declared in
:data:`hyperrecipe.process_patches.PROCESS_PATCHES` and assigned there, held by each
installation. Another library may patch the same method over ours (wrapping it, as ours wraps
torch's). Each wrapper of ours is a closure over the function it wrapped, so the chain stays
callable however it is stacked; when the last installation goes, torch's method is put back only
if ours is still the one on the class. Otherwise ours stays in the chain below the other patch
and serves as a pass-through (no installation left: the function it wrapped answers), and the
next apply finds it there (through ``__wrapped__``) instead of wrapping again. A patch over ours
that does not say what it wraps hides ours, and ours goes on top of it: the flags are then
all-reduced twice, with the same result (``MAX`` of flags that already agree).

Validate mode's gradients are DTensors inside boundaries and plain outside, and torch's inf
check (one multi-tensor kernel per device and dtype) refuses that mix with DTensor's bare
error; it is refused here by name instead, before anything is unscaled: validate mode checks
placements in fp32 or bf16, which need no scaler.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hyperrecipe.errors import MixedParametersError
from hyperrecipe.process_patches import ProcessHold, hold_process_patches

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["PATCH", "ScalerGuardHandle", "guard_grad_scaler"]

_OWNERS: dict[int, weakref.ref[LiveParams]] = {}
_HOLDS: dict[int, ProcessHold] = {}
_KEYS = itertools.count()
#: The declared patch (``hyperrecipe.process_patches``) this module supplies.
PATCH = "torch.amp.GradScaler:_unscale_grads_"


class ScalerGuardHandle:
    """``remove()`` forgets the installation (torch's method comes back with the last one)."""

    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        _forget(self._key)


def guard_grad_scaler(live: LiveParams) -> ScalerGuardHandle:
    """Make every ``GradScaler`` over ``live``'s parameters agree on overflows across the mesh
    while ``live`` exists (see the module)."""
    key = next(_KEYS)
    _HOLDS[key] = hold_process_patches({PATCH: _agreeing})
    _OWNERS[key] = weakref.ref(live)
    weakref.finalize(live, _forget, key)
    return ScalerGuardHandle(key)


def _forget(key: int) -> None:
    _OWNERS.pop(key, None)
    hold = _HOLDS.pop(key, None)
    if hold is not None:
        hold.release()


def _agreeing(inner: Any) -> Any:
    """``inner`` (torch's ``_unscale_grads_``, or the patch that was on the class) with the
    found-inf flags agreed over the mesh of the installation the optimizer belongs to."""

    @functools.wraps(inner)
    def _agreeing_unscale_grads_(self: Any, optimizer: torch.optim.Optimizer, *args: Any,
                                 **kwargs: Any) -> dict[torch.device, torch.Tensor]:
        live = _owner_of(optimizer)
        if live is not None and live.mode.parameters_are_dtensors:
            raise _refusal(live, optimizer)
        found: dict[torch.device, torch.Tensor] = inner(self, optimizer, *args, **kwargs)
        if live is None or not dist.is_initialized():
            return found
        mesh = live.mesh
        for flag in found.values():
            for dim in range(mesh.ndim):
                if mesh.size(dim) > 1:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        return found

    return _agreeing_unscale_grads_


def _owner_of(optimizer: torch.optim.Optimizer) -> LiveParams | None:
    """The installation whose parameters ``optimizer`` holds, if any."""
    held = {id(q) for g in optimizer.param_groups for q in g["params"]}
    for ref in list(_OWNERS.values()):
        live = ref()
        if live is None:
            continue
        for p in live.own:
            param = live.modules[p.module]._parameters.get(p.name)
            if param is not None and id(param) in held:
                return live
    return None


def _refusal(live: LiveParams, optimizer: torch.optim.Optimizer) -> MixedParametersError:
    from torch.distributed.tensor import DTensor

    names = {id(q): n for n, q in live.model.named_parameters()}
    held = [q for g in optimizer.param_groups for q in g["params"]]
    dtensors = tuple(names.get(id(q), "?") for q in held if isinstance(q, DTensor))
    plain = tuple(names.get(id(q), "?") for q in held if not isinstance(q, DTensor))
    msg = (f"GradScaler over an applied model in validate mode: torch's inf check runs one "
           f"multi-tensor kernel over DTensor gradients ({', '.join(dtensors[:2])}, ...) and "
           f"plain ones ({', '.join(plain[:2]) or 'none'}, ...), which DTensor refuses. "
           f"Validate mode checks placements; run it in fp32 or bf16 (no scaler), and train "
           f"fp16 with a GradScaler in production mode, where every rank skips an overflow "
           f"together (docs/training.md)")
    return MixedParametersError(msg, dtensors=dtensors, plain=plain)

