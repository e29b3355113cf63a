"""What ``apply`` returns: the model, plan, mode and mesh, full gradients, the training state's
front (``inst.state``) and ``restore()``; and the trainer glue that needs an installation.

Everything here that produces full tensors gathers shards, so it is a collective: call it on
every rank. State in and out (state dicts, weights, checkpoints, export, status) lives on
:class:`~hyperrecipe.runtime.state.front.TrainingState`, reached as ``inst.state``, so that
this handle stays small.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError, UsageError
from hyperrecipe.plan import Plan
from hyperrecipe.rewriter import Rewritten
from hyperrecipe.runtime.features.inner import WrapperChoice
from hyperrecipe.runtime.grads.data_parallel import shard_data_parallel, wrap_data_parallel
from hyperrecipe.runtime.grads.ddp_guard import install_ddp_guard
from hyperrecipe.runtime.grads.grad_norm import (
    clip_grads_by_norm,
    per_parameter_grad_norms,
    total_grad_norm,
)
from hyperrecipe.runtime.grads.scaler_guard import guard_grad_scaler
from hyperrecipe.runtime.grads.torch_clip_guard import guard_torch_clipping
from hyperrecipe.runtime.mode import Mode, as_mode
from hyperrecipe.runtime.preflight import agreement
from hyperrecipe.runtime.preflight.first_forward import install_first_forward_checks
from hyperrecipe.runtime.state.front import TrainingState
from hyperrecipe.runtime.state.live_params import LiveParams
from hyperrecipe.runtime.state.materialize import keep_non_persistent_buffers
from hyperrecipe.runtime.state.state_hooks import (
    install_optimizer_hooks,
    install_state_hooks,
    replaced_bucket_params,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer

__all__ = ["Installation", "attach", "data_parallel", "fully_shard_data_parallel", "leave_together"]


class Installation:
    """A plan applied to a model on this rank.

    Everything that produces or consumes full tensors gathers or slices shards, so it is a
    collective: call it on every rank (a rank that does not would leave the others waiting).

    Attributes:
        model: the applied model.
        plan: the plan that was applied.
        mode: the :class:`~hyperrecipe.runtime.mode.Mode` it runs in (equal to its name,
            ``"production"`` or ``"validate"``).
        mesh: the device mesh it was applied on.
        state: the :class:`~hyperrecipe.runtime.state.front.TrainingState`: state dicts,
            ``load_weights``, ``save_checkpoint`` / ``load_checkpoint``, ``save_pretrained``
            and ``status()``.
    """

    def __init__(self, *, model: nn.Module, plan: Plan, mode: Mode | str, rewritten: Rewritten,
                 mesh: DeviceMesh, wrapper_choices: Sequence[WrapperChoice] = (),
                 unloaded: Sequence[str] = (),
                 grad_reducer: GradBucketReducer | None = None,
                 checked_entry: bool = False) -> None:
        self.model = model
        self._grad_reducer = grad_reducer
        self.plan = plan
        self.mode = as_mode(mode)
        self.mesh = mesh
        self._rewritten = rewritten
        # Parameters are looked up live (LiveParams), never kept: to_empty(), fully_shard and
        # load_state_dict(assign=True) replace them after apply.
        self._live = LiveParams(model, plan, mesh, self.mode)
        # Production reduces these parameters' gradients with hooks on the objects apply
        # installed; a wrapper that replaces them would leave the gradients partial.
        by_fqn = {p.fqn: p for p in plan.params}
        self._bucketed = {fqn: (by_fqn[fqn], self._live.param(by_fqn[fqn]))
                          for fqn in self.mode.hook_reduced_gradients(plan)}
        # The group whose ranks must all enter a collective state call: checked only once
        # attached (:func:`attach`), and only where there are peers to wait for.
        def timeout() -> float:  # read at each call: it may be changed after apply
            return self.collective_timeout_s

        self._enter = (agreement.EntryCheck.for_world(timeout) if checked_entry
                       else agreement.EntryCheck(active=False, timeout_s=timeout))
        self.state = TrainingState(model=model, plan=plan, mesh=mesh, live=self._live,
                                   rewritten=rewritten, wrapper_choices=wrapper_choices,
                                   unloaded=unloaded, enter=self._enter, timeout_s=timeout)
        self._hooks: list[Any] = []

    collective_timeout_s: float = 60.0
    """How long a gathering call waits for every rank to enter it before refusing, and how long
    ``state.save_pretrained`` waits for a peer in any one gather (or the final agreement)
    before raising ``ExportAbortedError``."""

    def full_grads(self) -> dict[str, Tensor]:
        """FQN → full gradient, for parameters that have one (tied names included)."""
        self._check_grads("full_grads")
        grads: dict[str, Tensor] = {}
        for p in self._live.own:
            g = self._live.param(p).grad
            if g is not None:
                grads[p.fqn] = self._live.full_of(p, g)
        for p in self.plan.params:
            if p.tied_to is not None and p.tied_to in grads:
                grads[p.fqn] = grads[p.tied_to]
        return grads

    def grad_norm(self, norm_type: float = 2.0, *, foreach: bool | None = None) -> Tensor:
        """The norm of the model's full gradients, the same on every rank and equal to what
        ``torch.nn.utils.get_total_norm`` returns for the unsharded model in one process, in
        both modes (a collective: call on every rank).

        Each parameter's layout is read from the plan (and from ``fully_shard``'s split when a
        data-parallel wrapper holds it): each rank sums ``|g|^p`` of its pieces, the sums are
        all-reduced over the mesh dims that split them (max for ``inf``), and a replicated
        parameter counts once. Parameters without a gradient are skipped, tied ones counted
        once. torch's own ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` sees
        only this rank's shards in production mode; while this installation lives it is handed
        this norm instead (``runtime/grads/torch_clip_guard.py``; docs/training.md, "torch's
        own clip_grad_norm_ on shards").

        Args:
            norm_type: ``p`` of the p-norm (positive), or ``float("inf")`` / ``-inf``.
            foreach: use the ``torch._foreach_norm`` kernels (default: on CUDA).

        Returns:
            A float32 scalar tensor on the gradients' device.

        Raises:
            PlanMismatchError: a parameter with a gradient is not in the plan (added after
                apply), a gradient is partial, or its layout is neither the plan's nor a
                data-parallel wrapper's; a plan's gradient buckets lost to ``fully_shard``.
            ValueError: ``norm_type`` is not positive or ±inf.
        """
        self._check_grads("grad_norm")
        return total_grad_norm(self._live, norm_type, foreach)

    def grad_norms(self, norm_type: float = 2.0, *,
                   foreach: bool | None = None) -> dict[str, Tensor]:
        """Each parameter's full gradient norm, FQN → float32 scalar: what
        ``param.grad.norm(norm_type)`` gives on the unsharded model in one process, on every
        rank, in both modes (a collective: call on every rank). On production shards
        ``param.grad.norm()`` is this rank's shard's norm; Lightning's
        ``lightning.pytorch.utilities.grad_norm`` reads exactly that
        (``hyperrecipe.trainers.lightning.grad_norm`` reads this instead).

        Parameters without a gradient are left out; tied ones appear once, under the owner's
        FQN.

        Raises:
            PlanMismatchError, ValueError: as :meth:`grad_norm`.
        """
        self._check_grads("grad_norms")
        return per_parameter_grad_norms(self._live, norm_type, foreach)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the applied model, right in both modes: every
        gradient is scaled in place by ``max_norm / (norm + 1e-6)`` (when below 1), with the
        norm of :meth:`grad_norm`, so every rank clips by the same coefficient as one process
        would (a collective: call on every rank, where torch's call would be).

        Returns:
            The total norm before clipping (float32), the same on every rank.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
            PlanMismatchError, ValueError: as :meth:`grad_norm`.

        Example::

            loss.backward()
            norm = inst.clip_grad_norm_(1.0)   # not torch.nn.utils.clip_grad_norm_
            opt.step(); opt.zero_grad()
        """
        self._check_grads("clip_grad_norm_")
        return clip_grads_by_norm(self._live, max_norm, norm_type, error_if_nonfinite, foreach)

    def _check_grads(self, what: str) -> None:
        self._check_live()
        why = replaced_bucket_params(self._live, self._bucketed, self._buckets_average)
        if why is not None:
            raise PlanMismatchError(f"{what}(): {why}")

    def restore(self) -> None:
        """Put the original forwards back and full parameters in place of the shards
        (gathered: call on every rank), and restore rewritten attributes."""
        self._rewritten.restore()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def restored(self) -> bool:
        """Whether :meth:`restore` ran (the shards are gone)."""
        return self._rewritten.restored

    def _buckets_average(self) -> bool:
        """Whether the gradient buckets also average over a data dim (the parameters they
        reduce were left out of DDP or FSDP by ``data_parallel`` /
        ``fully_shard_data_parallel``)."""
        return self._grad_reducer is not None and self._grad_reducer.data_parallel is not None

    def _check_live(self) -> None:
        if self._rewritten.restored:
            raise PlanMismatchError("this installation was restored; its shards are gone")


def attach(*, model: nn.Module, plan: Plan, mode: Mode | str, rewritten: Rewritten,
           mesh: DeviceMesh, wrapper_choices: Sequence[WrapperChoice] = (),
           unloaded: Sequence[str] = (),
           grad_reducer: GradBucketReducer | None = None) -> Installation:
    """The handle ``apply`` returns once every rank committed, with what it documents
    beside the rewritten model: the group whose barrier refuses a collective entered on
    one rank only, and the hooks through which a trainer's own calls reach the plan
    (production: state dicts of local shards as DTensors; both: the optimizer's hooks,
    fused parameters' state replicated for DCP; validate: a step of torch's multi-tensor
    kernels over mixed DTensor / plain parameters refused by name; both:
    ``model.load_state_dict``'s checks, the DDP guard, the check that a model-parallel
    group's ranks were handed the same batch and draw the same dropout (once, at the first
    training forward, :mod:`~hyperrecipe.runtime.preflight.first_forward`) and, for a
    plan that shards, torch's ``clip_grad_norm_`` routed to
    :meth:`Installation.grad_norm`).
    ``restore()`` removes them. Constructing an :class:`Installation` itself changes nothing.
    """
    inst = Installation(model=model, plan=plan, mode=mode, rewritten=rewritten, mesh=mesh,
                        wrapper_choices=wrapper_choices, unloaded=unloaded,
                        grad_reducer=grad_reducer, checked_entry=True)
    state = inst.state
    inst._hooks = [*install_state_hooks(model, inst._live, state._mark_loaded, inst._enter),
                   *install_optimizer_hooks(inst._live, inst._bucketed, inst._enter,
                                            inst._buckets_average),
                   *inst.mode.install_optimizer_checks(inst._live),
                   *inst.mode.keep_hooks_through_moves(model),
                   *inst.mode.watch_outside_boundaries(model, plan, mesh),
                   install_ddp_guard(model, plan, mesh, bucketed=tuple(inst._bucketed)),
                   *filter(None, [install_first_forward_checks(
                       model, mesh, plan.model_parallel_dims,
                       lambda: inst.collective_timeout_s)]),
                   keep_non_persistent_buffers(model)]  # to_empty() keeps rotary values
    if any(p.placement.mesh_dims for p in plan.params):  # torch's clip_grad_norm_ on shards
        inst._hooks.append(guard_torch_clipping(inst._live, inst._check_grads))
        inst._hooks.append(guard_grad_scaler(inst._live))  # and GradScaler's inf check
    return inst


def data_parallel(installation: Installation, group: Any, module: nn.Module | None = None,
                  **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel`` over ``group``, a data dim of the mesh (ranks that hold
    the same shards), the way this plan's gradients need it. Use it instead of wrapping
    DDP yourself; the trainer integrations do.

    A plan that reduces some gradients over its model-parallel dims in buckets (production
    mode: sequence-parallel norms, ``reduce_grads``) cannot let DDP average those: DDP
    copies each gradient as it accumulates, before the bucket's reduction, and writes its
    average back over the reduced value (a sequence-parallel norm's gradient came out
    27-89 % off). So those parameters are left out of DDP (torch's
    ``_set_params_and_buffers_to_ignore_for_model``), the buckets average them over
    ``group`` after their own reduction, and their values are broadcast from ``group``'s
    first rank, as DDP broadcasts the others. Any other DDP over such a plan is refused at
    its first forward.

    Args:
        group: the data-parallel process group (``mesh.get_group("dp")``).
        module: what DDP wraps, when it is not the applied model itself (accelerate's
            prepared model); the applied model must be it or inside it.
        ddp_kwargs: passed to ``DistributedDataParallel``.

    Returns:
        The ``DistributedDataParallel`` module.

    Raises:
        UsageError: ``module`` does not hold the applied model.
    """
    return wrap_data_parallel(installation.model, installation._grad_reducer, group, module,
                              **ddp_kwargs)


def fully_shard_data_parallel(installation: Installation, mesh: DeviceMesh,
                              blocks: Iterable[nn.Module] = (), **fsdp_kwargs: Any) -> nn.Module:
    """FSDP2 (``fully_shard``) over ``mesh``, the data dim's one-dim mesh (``mesh["dp"]``),
    on each of ``blocks`` (the decoder layers, usually) and on the applied model, the way
    this plan's gradients need it. Use it instead of calling ``fully_shard`` yourself when
    the plan has gradient buckets (production mode: sequence-parallel norms, ``reduce_grads``
    such as Qwen3's per-head q/k norms); for any other plan it is ``fully_shard`` per block
    and on the root, as before.

    ``fully_shard`` replaces each parameter it manages with a new object, and the bucket
    hooks that reduce those gradients over the plan's model-parallel dims stay on the old
    one (the gradients would stay partial: refused at ``optimizer.step()``). So the bucketed
    parameters are left out of FSDP (``ignored_params``; they are small: norm weights,
    replicated over dp), the buckets average them over dp after their own reduction, and
    their values are broadcast from dp's first rank. Every other gradient is reduced over
    dp by FSDP's reduce-scatter: each gradient over each dim exactly once.

    Args:
        mesh: the data-parallel one-dim mesh (``mesh["dp"]``).
        blocks: modules of the model to shard one by one before the root.
        fsdp_kwargs: passed to each ``fully_shard`` (``ignored_params`` is added to).

    Returns:
        The applied model, now an ``FSDPModule``.

    Raises:
        UsageError: a block is not in the applied model, or ``mesh`` is not the one-dim mesh
            of a data dim of the plan's mesh (buckets averaging over ``tp`` would be wrong).

    Example::

        inst = hyperrecipe.apply(model, plan, mesh)           # plan's mesh: [dp, tp]
        inst.state.load_weights(folder)                       # before sharding
        fully_shard_data_parallel(inst, mesh["dp"], model.model.layers)
        opt = torch.optim.AdamW(model.parameters())           # after sharding
    """
    names = tuple(mesh.mesh_dim_names or ())
    plan = installation.plan
    if len(names) != 1 or names[0] not in plan.mesh_dims or (
            names[0] in plan.model_parallel_dims):
        data = [d for d in plan.mesh_dims if d not in plan.model_parallel_dims]
        msg = (f"fully_shard_data_parallel: the mesh has dims {list(names)}; pass the one-dim "
               f"mesh of a data dim of the plan's mesh (data dims: {data}; "
               f"model-parallel: {list(plan.model_parallel_dims)}), e.g. mesh['dp']")
        raise UsageError(msg)
    return shard_data_parallel(installation.model, installation._grad_reducer, mesh, blocks,
                               **fsdp_kwargs)


def leave_together(installation: Installation, what: str) -> None:
    """Return once every rank reached the end of ``what`` (a training loop's end), waiting
    at most ``collective_timeout_s``; a rank that does not arrive is warned about, not
    raised on (this rank's work is done). Call it on every rank before
    ``dist.destroy_process_group()``; the trainer integrations do.

    Why (torch's, found with a core dump): a group that outlives ``destroy_process_group``
    (a ``DeviceMesh``, an installation or a trainer still refers to it) keeps its gloo
    worker threads into interpreter teardown. A worker drops its last reference to a
    finished collective a moment after the caller's ``wait()`` returned; when the work's
    tensors belong to Python objects the caller already dropped, that drop takes the GIL,
    and once the interpreter is finalizing CPython ends such a thread with
    ``pthread_exit``, whose forced unwind through a C++ destructor is ``std::terminate``.
    The rank that leaves first is the one that aborts. Waiting here, through the store
    with the GIL released, gives the workers the moment they need. Not a barrier: with a
    ``dist.barrier()`` before ``destroy_process_group`` the early rank still aborted in 2
    of 22 runs of the reproduction, with this meeting in none of 20.
    """
    agreement.leave_together(what, installation.collective_timeout_s)
