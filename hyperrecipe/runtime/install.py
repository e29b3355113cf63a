"""``apply``: put a compiled plan onto a live model, atomically, on every rank.

Order inside one rewriter transaction: parameters (local shards, or DTensors in validate mode;
tied parameters stay one object; in production, the hooks of the plan's gradient buckets),
head counts (production), method adapters, then boundary
forwards, innermost first. Before anything changes, the plan is checked against the model's structure, the
``DeviceMesh`` and the other ranks' plans (:mod:`~hyperrecipe.runtime.preflight.agreement`: bounded
waits); after everything is installed, every rank votes, so a failure on one rank rolls back
all of them instead of leaving ranks out of step.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import HyperrecipeError, PlanMismatchError, RewriteError, UsageError
from hyperrecipe.model_tree import snapshot
from hyperrecipe.placement import Shard
from hyperrecipe.plan import BoundaryPlan, LossParallel, ParamPlan, Plan
from hyperrecipe.refs import trusting
from hyperrecipe.rewriter import Rewrite, installed_forward_owner
from hyperrecipe.runtime.features.adapters import install_adapters
from hyperrecipe.runtime.preflight.agreement import agree_before_apply, vote
from hyperrecipe.runtime.forward.boundary import make_boundary_forward
from hyperrecipe.runtime.comm.collectives import group_for
from hyperrecipe.runtime.forward.compute import bias_free_forward, class_forward
from hyperrecipe.runtime.forward.unwrapped_params import remember_sharded_param
from hyperrecipe.runtime.state.export import model_save_pretrained
from hyperrecipe.runtime.features.inner import InnerWrapperInstaller
from hyperrecipe.runtime.features.router_loss import install_router_loss_scale
from hyperrecipe.runtime.features.local_region import (
    local_grad_placements,
    mark_local_grad,
    region_partial_dims,
)
from hyperrecipe.runtime.installation import Installation, attach
from hyperrecipe.runtime.state.materialize import (
    allocate_unloaded,
    is_meta,
    materialize_buffers,
    mesh_device,
)
from hyperrecipe.runtime.mode import Mode, ModeName, as_mode
from hyperrecipe.runtime.preflight.plan_fit import check_mesh_fits, check_model_fits
from hyperrecipe.runtime.comm.sharding import gather_full, local_shard
from hyperrecipe.runtime.preflight.torch_support import require_supported_torch
from hyperrecipe.runtime.features.vocab_loss import (
    VocabShard,
    install_loss_parallel,
    vocab_shard_output,
)

# The modules that answer the Mode's questions (mode.py's QUESTIONS) register their answers when
# imported: these are the ones nothing above imports already (tests/test_layering.py checks that
# importing the runtime answers every question for every mode).
from hyperrecipe.runtime.comm import dtensor_parameters, dtensor_rules  # noqa: F401
from hyperrecipe.runtime.forward import layouts, outside_params  # noqa: F401
from hyperrecipe.runtime.grads import grad_buckets, optimizer_kernels  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mode", "apply"]


def _check_arguments(model: object, plan: object, mesh: object) -> None:
    """Wrong argument types, caught before any rank starts exchanging digests."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(model, nn.Module):
        raise UsageError(f"apply: model must be an nn.Module, not {type(model).__name__}")
    if not isinstance(plan, Plan):
        how = (f"; load it first: hyperrecipe.apply(model, hyperrecipe.load_plan({plan!r}), mesh)"
               if isinstance(plan, (str, os.PathLike)) else "")
        raise UsageError(f"apply: plan must be a Plan, not {type(plan).__name__}{how}")
    if not isinstance(mesh, DeviceMesh):
        raise UsageError(f"apply: mesh must be a DeviceMesh (init_device_mesh(..., "
                         f"mesh_dim_names=...)), not {type(mesh).__name__}")
    if plan.pipeline is not None:
        pipe = plan.pipeline
        raise UsageError(
            f"apply: plan {plan.recipe!r} pipelines the model over {pipe.mesh_dim} "
            f"({len(pipe.stages)} stages, {pipe.schedule}); apply would run the whole model on "
            f"every rank instead: build the pipeline with hyperrecipe.runtime.build_pipeline("
            f"model, plan, mesh) (docs/pipeline.md#running-a-pipeline)")


def _check_model(plan: Plan, model: nn.Module) -> None:
    for fqn, module in model.named_modules():
        owner = installed_forward_owner(module)
        if owner is not None:
            msg = (f"{fqn or '<root>'} already has a forward installed by {owner!r}: restore the "
                   f"earlier installation before applying a plan again")
            raise RewriteError(msg)
    check_model_fits(plan, snapshot(model))


class _Applier:
    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh,
                 mode: Mode | ModeName) -> None:
        self.model, self.plan, self.mesh, self.mode = model, plan, mesh, as_mode(mode)
        self.mesh_dims = plan.mesh_dims
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.new_params: dict[str, nn.Parameter] = {}
        self.grad_reducer: GradBucketReducer | None = None
        self.restored: dict[str, nn.Parameter] = {}
        self.released: dict[str, nn.Parameter] = {}
        """Originals whose storage was dropped once their shard existed (by owner FQN)."""
        self.peers_lost = False
        """Set when a rank did not vote in time: a rollback then gathers nothing."""
        self.inner = InnerWrapperInstaller(mesh=mesh, mesh_dims=self.mesh_dims, mode=self.mode)
        self.device = mesh_device(mesh)
        self.boundaries = {b.fqn: b for b in plan.boundaries}
        self.partial_dims: dict[str, frozenset[str]] = {}
        """Per local region: the mesh dims its code computes on parts of the data along."""
        self.unloaded: list[str] = []
        """Parameters and persistent buffers allocated on the meta device's behalf: no value yet."""

    def shard_parameters(self, tx: Rewrite) -> None:
        """Replace every parameter by this rank's shard, dropping each original as soon as its
        shard exists (a materialized model is never held twice).

        A rollback then rebuilds originals by gathering shards, a collective, so every rank
        must hold one parameter memento per plan parameter whatever happens: once making a
        shard fails on this rank, the remaining originals are re-registered as they are, with a
        restorer that takes part in the same gathers as its peers' (and keeps the original).
        The error is raised after the loop; the vote then rolls every rank back in step.
        """
        failure: Exception | None = None
        for p in self.plan.params:
            module = self.modules[p.module]
            original = module._parameters[p.name]
            assert original is not None
            new: nn.Parameter | None = None
            if p.tied_to is not None:
                new = self.new_params.get(p.tied_to)  # None when its owner was not sharded
            elif failure is None:
                try:
                    new = self._make_param(p, module)
                    self.new_params[p.fqn] = new
                except Exception as exc:  # noqa: BLE001 - raised after the loop
                    if not isinstance(exc, HyperrecipeError):  # ours name the parameter already
                        exc.add_note(f"(while placing the parameter {p.fqn})")
                    failure = exc
            if new is None:
                tx.replace_parameter(module, p.name, original, fqn=p.module,
                                     on_restore=self._keeper(p, original), keep_original=False)
                continue
            # A meta original costs nothing and needs no gather to put back: keep it. A real
            # one keeps its identity but gives up its storage now; a rollback or restore
            # gathers its value back into the same object.
            tx.replace_parameter(module, p.name, new, fqn=p.module,
                                 on_restore=self._restorer(p), keep_original=is_meta(original))
            if p.tied_to is None and not is_meta(original):
                self.released[p.fqn] = original
                original.data = torch.empty(0, dtype=original.dtype, device=original.device)
        if failure is not None:
            raise failure

    def _keeper(self, p: ParamPlan, original: nn.Parameter) -> Callable[[], nn.Parameter]:
        """The restorer of a parameter this rank never sharded: joins its peers' gather (see
        :meth:`_restorer`) with its own slice of the original, then puts the original back."""

        def restore() -> nn.Parameter:
            if p.tied_to is None and not is_meta(original) and not self.peers_lost:
                # peers gather only real shards, and only while they are all here
                self._gather_local(p, local_shard(original.detach(), p.placement, self.mesh,
                                                  self.mesh_dims))
            return original

        return restore

    def _gather_local(self, p: ParamPlan, local: Tensor) -> Tensor:
        """The full tensor from every rank's plain local shard: the same collectives in both
        modes and for every way a rank came to hold its shard, so restores and rollbacks on
        different ranks always meet in the same gathers."""
        return gather_full(local.detach(), p.placement, p.shape, self.mesh, self.mesh_dims)

    def _make_param(self, p: ParamPlan, module: nn.Module) -> nn.Parameter:
        full = module._parameters[p.name]
        assert full is not None
        param = self.mode.make_parameter(p, self._local(p, full), self.mesh,
                                         requires_grad=full.requires_grad)
        self._mark_local_region_grad(p, param)
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):  # validate mode: refuse a forward that unwraps it
            remember_sharded_param(param, p.fqn, str(p.placement))
        return param

    def _mark_local_region_grad(self, p: ParamPlan, param: nn.Parameter) -> None:
        """A DTensor parameter that a local region's code computes with on this rank's part of
        the data hands back a partial sum where the plan reduces its gradient: declare it so,
        and its placement hook all-reduces it (production's buckets do the same)."""
        from torch.distributed.tensor import DTensor

        region = self.boundaries.get(p.boundary or "")
        if region is None or not region.local_region or not p.grad_reduce \
                or not isinstance(param, DTensor):
            return
        if region.fqn not in self.partial_dims:
            self.partial_dims[region.fqn] = region_partial_dims(region, self.plan.params)
        ops = tuple(op for op in p.grad_reduce if op.mesh_dim in self.partial_dims[region.fqn])
        mark_local_grad(param, local_grad_placements(tuple(param.placements), ops,
                                                     self.mesh_dims))

    def _local(self, p: ParamPlan, full: Tensor) -> Tensor:
        """This rank's shard of ``full``: sliced once from a real tensor, or allocated (unset)
        on the mesh's device when the model was built on the meta device."""
        if is_meta(full):
            self.unloaded.append(p.fqn)
            return allocate_unloaded(p.local_shape, full.dtype, self.device)
        return local_shard(full.detach(), p.placement, self.mesh, self.mesh_dims)

    def install_grad_reductions(self) -> None:
        """What reduces the plan's gradient buckets (production: hooks, one flat collective per
        bucket and op, :mod:`~hyperrecipe.runtime.grads.grad_buckets`). They live on the shards
        made here, so a rollback or ``restore()`` drops them with the shards."""
        self.grad_reducer = self.mode.install_grad_reductions(self.plan, self.new_params,
                                                              self.mesh)

    def materialize_buffers(self, tx: Rewrite) -> None:
        self.unloaded.extend(materialize_buffers(self.model, tx, self.device))

    def _restorer(self, p: ParamPlan) -> Callable[[], nn.Parameter]:
        """Gathers the full parameter back at restore time (once per tied group)."""
        fqn = p.tied_to or p.fqn

        def restore() -> nn.Parameter:
            if fqn not in self.restored:
                from torch.distributed.tensor import DTensor

                current = self.new_params[fqn]
                local = current._local_tensor if isinstance(current, DTensor) else current
                p_owner = self.plan.param(fqn)
                if self.peers_lost and local.shape != torch.Size(p_owner.shape):
                    # no gather without the peers: the value is gone, say so with meta
                    local = torch.empty(p_owner.shape, dtype=local.dtype, device="meta")
                full = (local if local.is_meta
                        else self._gather_local(p_owner, local))
                if full is local or full.data_ptr() == local.data_ptr():
                    full = full.clone()
                original = self.released.get(fqn)
                if original is not None and not full.is_meta:  # the model's own object, back
                    original.data = full
                    self.restored[fqn] = original
                else:
                    self.restored[fqn] = nn.Parameter(full, requires_grad=current.requires_grad)
            return self.restored[fqn]

        return restore

    def set_head_counts(self, tx: Rewrite) -> None:
        """Divided head counts: every one in production; in validate mode those of modules
        whose code runs in a local region (it computes on local shards there too), while
        DTensor computes everywhere else with global shapes and the counts stay global. A
        ``config.`` count is set on a copy of the module's
        config (one per module, with every divided field), which the module then holds: the
        config object is shared with the rest of the model, whose counts stay global."""
        configs: dict[str, Any] = {}
        for h in self.mode.divided_head_counts(self.plan):
            module = self.modules[h.module]
            field = h.attr.removeprefix("config.")
            if field == h.attr:
                tx.set_attribute(module, h.attr, h.local_value, fqn=h.module)
                continue
            if h.module not in configs:
                configs[h.module] = copy.copy(module.config)
            setattr(configs[h.module], field, h.local_value)
        for fqn, config in configs.items():
            tx.set_attribute(self.modules[fqn], "config", config, fqn=fqn)

    def install_save_pretrained(self, tx: Rewrite,
                                installation: Callable[[], Installation]) -> None:
        """A transformers model's ``save_pretrained`` becomes the installation's
        ``state.save_pretrained`` (export.py), for as long as the plan is applied."""
        if callable(getattr(self.model, "save_pretrained", None)):
            tx.set_attribute(self.model, "save_pretrained", model_save_pretrained(installation),
                             fqn="<model>")

    def install_adapters(self, tx: Rewrite) -> None:
        """The plan's method adapters. Before the boundaries: a boundary binds its module's
        class forward when it is installed, and that forward may be an adapted method."""
        install_adapters(tx, self.plan.adapters, self.mesh_dims, self.modules)

    def install_boundaries(self, tx: Rewrite) -> None:
        local_code = (any(a.mode == "marshal" for a in self.plan.adapters)
                      or any(b.local_region or b.inner_wrapper for b in self.plan.boundaries))
        sharded: dict[str, set[str]] = {}
        for p in self.plan.params:
            if p.boundary is not None:
                sharded.setdefault(p.boundary, set()).update(
                    d for d, q in p.placement.dims if isinstance(q, Shard)
                    and self.plan.mesh_shape.get(d, 1) > 1)
        redist = self.mode.redistributor(
            self.mesh, self.mesh_dims, local_code=local_code,
            sharded_regions={k: frozenset(v) for k, v in sharded.items()})
        for b in sorted(self.plan.boundaries, key=lambda b: -b.depth):
            module = self.modules[b.fqn]
            compute, bias = self._compute(b, module, tx)
            if b.inner_wrapper:
                compute = self.inner.install(tx, b, module, compute)
            forward = make_boundary_forward(b, compute, redist, deferred_bias=bias)
            loss = self.plan.loss_parallel
            if loss is not None and loss.boundary == b.fqn:
                forward = vocab_shard_output(forward, self._vocab_shard(loss))
            tx.install_forward(module, forward, fqn=b.fqn, companions={"_hyperrecipe_boundary": b})

    def _vocab_shard(self, loss: LossParallel) -> VocabShard:
        return self.mode.vocab_shard(loss, self.mesh, self.mesh_dims)

    def install_loss(self, tx: Rewrite) -> None:
        """The loss on vocab shards of a ``"model"`` loss (the lm_head's marking is part of its
        boundary forward): the owner's loss function and its gathering forward."""
        loss = self.plan.loss_parallel
        if loss is None or loss.kind != "model":
            return
        owner = self.modules[loss.owner]
        install_loss_parallel(tx, owner, loss, self._vocab_shard(loss), class_forward(owner))

    def install_router_loss(self, tx: Rewrite) -> None:
        """An MoE model's router load-balancing loss counted once by the plan's sums of the
        routers' gradients (:mod:`~hyperrecipe.runtime.features.router_loss`)."""
        install_router_loss_scale(tx, self.model, self.plan, self.plan.mesh_shape,
                                  dtensors=not self.mode.counts_whole_gradients_per_rank)

    def _compute(self, b: BoundaryPlan, module: nn.Module,
                 tx: Rewrite) -> tuple[Callable[..., Any], Any]:
        compute = class_forward(module)
        if b.vocab_parallel is not None:
            compute = self.mode.embedding_compute(tx, b, module, compute, self.mesh)
        bias = None
        if "bias" in b.defer_bias:
            bias = module._parameters["bias"]
            compute = bias_free_forward(module, compute)
        if b.local_region:
            compute = self._local_region(b, module, compute, tx)
        return compute, bias

    def _local_region(self, b: BoundaryPlan, module: nn.Module, compute: Callable[..., Any],
                      tx: Rewrite) -> Callable[..., Any]:
        """A local-region boundary's compute: the expert-parallel kernel where the plan shards
        the module's experts, run on local tensors in both modes; the module's own compute
        always reaches its inputs and parameters in backward (:mod:`~hyperrecipe.runtime.features.reach`)."""
        from hyperrecipe.runtime.features.experts import expert_parallel_attributes, expert_parallel_forward
        from hyperrecipe.runtime.features.local_region import local_region_forward
        from hyperrecipe.runtime.features.reach import reaching_forward
        from hyperrecipe.runtime.features.token_dispatch import dispatch_forward

        compute = reaching_forward(compute, module)
        ep = b.expert_parallel
        if ep is not None:
            g = group_for(self.mesh, ep.mesh_dim)
            count = ep.local_experts
            for attr, value in expert_parallel_attributes(module, count, fqn=b.fqn).items():
                tx.set_attribute(module, attr, value, fqn=b.fqn)
            if ep.kernel == "dispatch":
                compute = dispatch_forward(compute, count=count, group=g.group, size=g.size)
            else:
                compute = expert_parallel_forward(compute, first=g.rank * count, count=count)
        return local_region_forward(module, compute, b, self.mesh_dims)


def apply(model: nn.Module, plan: Plan, mesh: DeviceMesh, *,
          mode: Mode | ModeName = "production",
          trust_code: bool | Sequence[str] = False) -> Installation:
    """Apply a compiled plan to ``model`` on this rank (call on every rank of ``mesh``).

    Args:
        model: the full, unsharded model, on this rank's device (same weights on every rank), or
            the model built on the meta device: then only this rank's shards are allocated, on
            the mesh's device, unset (NaN) until ``inst.state.load_weights``;
            non-persistent buffers (rotary ``inv_freq``) are recomputed.
        plan: from :func:`hyperrecipe.compile_recipe` or :func:`hyperrecipe.load_plan`.
        mesh: a ``DeviceMesh`` whose dim names and sizes are the plan's.
        mode: ``"production"`` (local shards, precompiled collectives) or ``"validate"``
            (DTensor end to end, declared placements checked at every boundary), or the
            :class:`~hyperrecipe.runtime.mode.Mode` object itself; chosen once, here.
        trust_code: also import the inner wrappers and adapter targets the plan names from
            any module (``True``) or from these module prefixes (docs/security.md); without
            it only built-in, already imported and entry-point-declared code is imported.

    Returns:
        The :class:`Installation`: full gradients, the training state (``inst.state``:
        status, state dicts, weights, checkpoints, export) and ``restore()``.

    Raises:
        PlanMismatchError: the plan does not fit the model or the mesh, or ranks hold different
            plans (raised on every rank), or an install failed on another rank.
        RewriteError: the model already has a plan applied.
        ModeError: ``mode`` is neither ``"production"`` nor ``"validate"``.
        UnsupportedTorchError: the installed torch is older than the runtime supports
            (:data:`~hyperrecipe.runtime.preflight.torch_support.MIN_TORCH`).
        UsageError: ``model``, ``plan`` or ``mesh`` is not an ``nn.Module``, a :class:`Plan`
            (a path is not: load it with :func:`hyperrecipe.load_plan`) or a ``DeviceMesh``.
        Anything an install raised on this rank, after rolling every rank back.

    Example::

        mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))
        inst = hyperrecipe.apply(model, hyperrecipe.load_plan("plan.json"), mesh)
        loss = model(batch).loss; loss.backward(); opt.step()
        inst.restore()
    """
    require_supported_torch()
    chosen = as_mode(mode)
    _check_arguments(model, plan, mesh)
    agree_before_apply(plan, mesh, lambda: check_mesh_fits(plan, mesh),
                       lambda: _check_model(plan, model))
    chosen.prepare(model, plan)  # the same model on every rank: all raise together
    applier = _Applier(model, plan, mesh, chosen)
    tx = Rewrite(label=f"hyperrecipe {chosen} {plan.recipe}")
    with tx, trusting(trust_code):
        error: BaseException | None = None
        try:
            applier.shard_parameters(tx)
            applier.install_grad_reductions()
            applier.materialize_buffers(tx)
            applier.set_head_counts(tx)
            applier.install_adapters(tx)
            applier.install_boundaries(tx)
            applier.install_loss(tx)
            applier.install_router_loss(tx)
            applier.install_save_pretrained(tx, lambda: installation)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the vote
            error = exc
        try:
            failed = vote(error is None)
        except PlanMismatchError as exc:
            # A rank did not vote in time: it may still be installing, so this rank's
            # rollback must not start collectives it would meet half-way.
            applier.peers_lost = True
            if applier.released:
                exc.add_note(
                    f"hyperrecipe: {len(applier.released)} parameters had released their full "
                    f"storage once sharded and cannot be gathered back without the missing "
                    f"rank(s); they are left on the meta device: rebuild or reload the model")
            raise
        if error is not None:
            raise error
        if failed:
            msg = (f"applying plan {plan.recipe!r} failed on rank(s) {failed}; this rank rolled "
                   f"back too (see the failing rank's error)")
            raise PlanMismatchError(msg)
    installation = attach(model=model, plan=plan, mode=chosen, rewritten=tx.result, mesh=mesh,
                          wrapper_choices=applier.inner.choices, unloaded=applier.unloaded,
                          grad_reducer=applier.grad_reducer)
    return installation

