"""Bucketed gradient reductions in production mode: one flat collective per bucket and op.

The plan lists the buckets (:class:`~hyperrecipe.plan.GradBucket`, decided by
:mod:`hyperrecipe.resolve.grad_buckets`); this module executes them. Each bucketed parameter
gets two hooks:

- a tensor hook, which runs just before autograd accumulates this backward's gradient into
  ``param.grad``: it sets aside the gradient accumulated so far (earlier micro-batches) and
  clears ``param.grad``, so that after accumulation ``param.grad`` holds exactly this
  backward's (partial) contribution;
- a post-accumulate-grad hook, which marks the parameter ready. When every parameter of a
  bucket is ready, the bucket's contributions are flattened into one tensor, each op of the
  bucket runs once on it (:func:`~hyperrecipe.runtime.comm.collectives.execute`, so the collective
  is counted against the manifest), and each parameter's gradient becomes what it had set
  aside plus its reduced slice. Gradient accumulation over several backward calls therefore
  reduces each contribution exactly once, as the per-parameter hook it replaces did.

Buckets are launched strictly in ``index`` order: a ready bucket waits for the buckets before
it, so every rank issues the same collectives in the same order whatever order its hooks
fire in. At the end of each backward that reached any bucketed parameter (an autograd engine
callback), the buckets not launched yet are launched in order, with zeros in the slots of
parameters that got no gradient in this backward (unused, frozen): every rank still issues
one collective per bucket and op, and those parameters keep the gradient they had (``None``
as in one process). A rank whose backward reaches no bucketed parameter at all while its peers'
does would fall out of step: local regions tie their outputs to every parameter for exactly
that reason (:mod:`~hyperrecipe.runtime.features.reach`).

Refused, at the end of the backward: a gradient taken with ``torch.autograd.grad`` (autograd
ran the tensor hook but never accumulated, so the value returned was not reduced), and the
gradient of a bucketed parameter without the hooks. A parameter frozen at apply carries them
(registered while ``requires_grad`` is briefly on), so unfreezing it later is fine.
``fully_shard`` after apply replaces the parameters it manages with new objects that carry
none of these hooks, which would leave these gradients unreduced over ``tp``:
:func:`~hyperrecipe.runtime.installation.fully_shard_data_parallel` leaves the bucketed
parameters out of FSDP (``ignored_params``) and has the buckets average them over ``dp``
(:meth:`GradBucketReducer.average_over`), and a plain ``fully_shard`` over them is refused at
the first step (docs/training.md).
Reentrant activation checkpointing runs a nested backward whose end launches the buckets
early; the gradients stay right but the step issues the bucket collectives more than once.

Validate mode does not bucket: DTensor reduces each partial gradient itself, and that
independent path is what validate checks production against.

``DistributedDataParallel`` over a data dim cannot take these parameters: its own hook copies
each gradient into its bucket as it accumulates, before this module has reduced it over the
model-parallel dims, and writes its average back over the reduced value at the end, so the
reduction was lost (a sequence-parallel norm's gradient 27-89 % off at dp=2 x tp=2).
:meth:`GradBucketReducer.average_over` makes the buckets also average over the data dim, and
:func:`~hyperrecipe.runtime.installation.data_parallel` wraps DDP with these
parameters left out of it; the DDP guard refuses any other DDP over such a plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import GradBucket, Plan
from hyperrecipe.runtime.comm.collectives import MeshDimGroup, execute, group_for
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GradBucketReducer"]


class _Slot:
    """One parameter of a bucket and its state in the current backward."""

    __slots__ = ("fqn", "param", "numel", "ready", "set_aside", "hooked", "installed")

    def __init__(self, fqn: str, param: nn.Parameter) -> None:
        self.fqn = fqn
        self.param = param
        self.numel = param.numel()
        self.ready = False
        self.set_aside: Tensor | None = None
        self.hooked = False
        """Whether the tensor hook ran in this backward (the gradient is on its way)."""
        self.installed = False
        """Whether the hooks are on the parameter (a gradient accumulated on one without them
        was never reduced: refused)."""


class _Bucket:
    def __init__(self, spec: GradBucket, slots: list[_Slot],
                 groups: list[MeshDimGroup]) -> None:
        self.spec = spec
        self.slots = slots
        self.groups = groups
        self.dtype = slots[0].param.dtype if slots else torch.float32
        self.waiting = len(slots)


class GradBucketReducer:
    """The hooks of every bucket of a plan, on this rank's parameters (module docstring).

    Args:
        buckets: the plan's ``grad_buckets``.
        params: this rank's parameter objects, by FQN (the shards ``apply`` made).
        mesh: the device mesh whose dims the buckets' ops name.

    Raises:
        PlanMismatchError: a bucket names a parameter that is not there, or parameters of
            different dtypes (a plan that does not fit the model).
    """

    def __init__(self, buckets: Sequence[GradBucket], params: Mapping[str, nn.Parameter],
                 mesh: DeviceMesh) -> None:
        self.buckets: list[_Bucket] = []
        for spec in buckets:
            slots = []
            for fqn in spec.params:
                if fqn not in params:
                    msg = (f"gradient bucket {spec.name} names parameter {fqn!r}, which the "
                           f"model does not have; recompile the recipe against this model")
                    raise PlanMismatchError(msg)
                slots.append(_Slot(fqn, params[fqn]))
            dtypes = {s.param.dtype for s in slots}
            if len(dtypes) > 1:
                msg = (f"gradient bucket {spec.name} holds parameters of dtypes "
                       f"{sorted(map(str, dtypes))}; the plan lists it as {spec.dtype}: "
                       f"recompile the recipe against this model")
                raise PlanMismatchError(msg)
            groups = [group_for(mesh, op.mesh_dim) for op in spec.ops]
            self.buckets.append(_Bucket(spec, slots, groups))
        self.next_launch = 0
        self.armed = False
        self.data_parallel: tuple[Any, int] | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        """Every bucketed parameter, in bucket order."""
        return [slot.param for bucket in self.buckets for slot in bucket.slots]

    def average_over(self, group: Any) -> None:
        """After its plan's ops, each bucket is averaged over ``group`` (a data-parallel group
        whose DDP leaves these parameters to this reducer): each backward's contribution, so
        accumulation under DDP's ``no_sync`` stays exact (the average is linear), at one more
        collective per bucket and backward."""
        import torch.distributed as dist

        self.data_parallel = (group, dist.get_world_size(group))

    def install(self) -> None:
        """Register both hooks on every bucketed parameter. A frozen one is hooked too (torch
        takes hooks only while a tensor requires a gradient, and keeps them when it stops):
        while frozen its slot is zeros when the bucket launches; unfrozen later (gradual
        unfreezing), its gradient is reduced like the others'."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                frozen = not slot.param.requires_grad
                if frozen:
                    slot.param.requires_grad_(True)
                try:
                    slot.param.register_hook(  # type: ignore[no-untyped-call]
                        self._before_accumulate(slot))
                    slot.param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._after_accumulate(bucket, slot))
                finally:
                    if frozen:
                        slot.param.requires_grad_(False)
                slot.installed = True

    def _before_accumulate(self, slot: _Slot) -> Callable[[Tensor], Tensor]:
        def hook(grad: Tensor) -> Tensor:
            self._arm()
            if not slot.hooked:
                slot.hooked = True
                slot.set_aside = slot.param.grad
                slot.param.grad = None
            return grad

        return hook

    def _after_accumulate(self, bucket: _Bucket, slot: _Slot) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            if slot.ready:
                return
            slot.ready = True
            bucket.waiting -= 1
            self._launch_ready()

        return hook

    def _arm(self) -> None:
        """Once per backward: launch what is left when the backward ends."""
        if not self.armed:
            self.armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and \
                self.buckets[self.next_launch].waiting == 0:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _finish_backward(self) -> None:
        try:
            taken = [s.fqn for b in self.buckets for s in b.slots if s.hooked and not s.ready]
            unhooked = [s.fqn for b in self.buckets for s in b.slots
                        if not s.installed and s.param.grad is not None]
            while self.next_launch < len(self.buckets):
                self._launch(self.buckets[self.next_launch])
                self.next_launch += 1
        finally:
            self.next_launch = 0
            self.armed = False
            for bucket in self.buckets:
                bucket.waiting = len(bucket.slots)
                for slot in bucket.slots:
                    if slot.hooked and not slot.ready:
                        slot.param.grad = slot.set_aside  # put back what was set aside
                    slot.ready, slot.hooked, slot.set_aside = False, False, None
        if unhooked:
            msg = (f"{', '.join(unhooked[:3])}: requires_grad was switched on after apply, so "
                   f"this partial gradient was not reduced over the plan's mesh dims; set "
                   f"requires_grad before applying the plan")
            raise PlanMismatchError(msg)
        if taken:
            shown = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
            msg = (f"the gradients of {shown} were computed but never accumulated into .grad "
                   f"(torch.autograd.grad?): production mode reduces these parameters' partial "
                   f"gradients in buckets as they accumulate, so the values returned were not "
                   f"reduced; call backward() instead")
            raise PlanMismatchError(msg)

    def _launch(self, bucket: _Bucket) -> None:
        parts = []
        for slot in bucket.slots:
            grad = slot.param.grad if slot.ready else None
            if grad is None:
                parts.append(torch.zeros(slot.numel, dtype=bucket.dtype,
                                         device=slot.param.device))
            else:
                parts.append(grad.reshape(-1))
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        for op, g in zip(bucket.spec.ops, bucket.groups):
            flat = execute(flat, op, g.group, group_size=g.size, group_rank=g.rank,
                           direction="backward")
        if self.data_parallel is not None and self.data_parallel[1] > 1:
            import torch.distributed as dist

            group, size = self.data_parallel
            flat = flat.clone()  # never a view of a gradient
            dist.all_reduce(flat, group=group)
            flat.div_(size)
        offset = 0
        for slot in bucket.slots:
            part = flat[offset:offset + slot.numel]
            offset += slot.numel
            if not slot.ready:
                continue
            param = slot.param
            reduced = (part.view(param.shape) if param.is_contiguous()
                       else torch.empty_like(param).copy_(part.view(param.shape)))
            if slot.set_aside is None:
                param.grad = reduced
            else:
                slot.set_aside.add_(reduced)
                param.grad = slot.set_aside
            slot.set_aside = None


@answers("install_grad_reductions", "production")
def _install_bucket_reducer(plan: Plan, params: dict[str, nn.Parameter],
                            mesh: DeviceMesh) -> GradBucketReducer | None:
    if not plan.grad_buckets:
        return None
    reducer = GradBucketReducer(plan.grad_buckets, params, mesh)
    reducer.install()
    return reducer


@answers("install_grad_reductions", "validate")
def _dtensor_reduces(plan: Plan, params: dict[str, nn.Parameter],
                     mesh: DeviceMesh) -> GradBucketReducer | None:
    return None  # DTensor's backward reduces: a parameter's hook keeps its placement


@answers("hook_reduced_gradients", "production")
def _bucketed_params(plan: Plan) -> tuple[str, ...]:
    return tuple(fqn for b in plan.grad_buckets for fqn in b.params)


@answers("hook_reduced_gradients", "validate")
def _no_hooked_params(plan: Plan) -> tuple[str, ...]:
    return ()  # DTensor's backward reduces them
