"""The mode a plan is applied in: one object, chosen once by ``apply``, asked by everything else.

``production`` runs on plain local shards with the collectives the resolver lowered;
``validate`` runs on DTensors end to end and checks every declared placement. The two share
every wrapper body (:mod:`~hyperrecipe.runtime.forward.boundary`); where they differ, the code asks the
:class:`Mode` it was given what to do, never which mode it is:

- ``redistributor``: the converters a boundary's body calls (:mod:`~hyperrecipe.runtime.forward.layouts`).
- ``make_parameter``: this rank's shard as the module's parameter: a plain tensor (production)
  or a DTensor with the plan's ``dtensor`` placement (validate).
- ``install_grad_reductions`` / ``hook_reduced_gradients``: the plan's gradient buckets run as
  hooks on the shards (production); DTensor's own backward reduces them (validate).
- ``keep_hooks_through_moves``: validate mode puts back, before a forward, the gradient hooks
  that a module move (``model.to(...)``, which swaps DTensor parameters' tensors) took away.
- ``watch_outside_boundaries``: validate mode refuses a replicated parameter outside every
  boundary that computes on a shard a boundary handed back, unless the plan reduces its
  gradient (then it reduces it as production does).
- ``install_optimizer_checks``: validate mode refuses torch's multi-tensor kernels over its
  mixed DTensor / plain parameters at ``optimizer.step()``.
- ``prepare``: validate mode registers DTensor rules for the ops torch ships without one (CPU
  SDPA) and refuses a kernel that cannot run on DTensors before anything is installed.
- ``divided_head_counts``: the head counts modules read, divided where modules compute on local
  shards (production; in validate mode only inside local regions, whose code runs on local
  tensors in both modes).
- ``embedding_compute``: a vocab-parallel table's lookup, the masked local kernel
  (production) or the module's own on DTensor (validate).
- ``vocab_shard``: how the loss on vocab shards computes (local kernels or DTensor ops).
- ``wrapper_edge``: how an inner wrapper, which always computes on local tensors, meets the
  boundary's values (a pass-through in production; DTensors unwrapped and rewrapped with the
  plan's ``inner_out_src`` in validate).
- ``counts_whole_gradients_per_rank``: whether a gradient that is whole on every rank (the
  router load-balancing loss's) is summed by the plan's reductions as if it were partial:
  production's collectives cannot tell; DTensor can (:mod:`~hyperrecipe.runtime.features.router_loss`).
- ``parameters_are_dtensors``: what the state code (``LiveParams``) finds in the model after
  apply; the one fact of the mode that is data rather than behaviour.

This module is the only code that knows which mode runs: the rest of the runtime asks the
:class:`Mode` it was given to do something. A :class:`Mode` compares equal to its name
(``PRODUCTION == "production"``), so callers that hold the string keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from hyperrecipe.errors import ModeError

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor, nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

    from hyperrecipe.plan import BoundaryPlan, HeadCount, LossParallel, ParamPlan, Plan
    from hyperrecipe.rewriter import Rewrite
    from hyperrecipe.runtime.features.vocab_loss import VocabShard
    from hyperrecipe.runtime.forward.layouts import Redistributor
    from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["MODES", "PRODUCTION", "VALIDATE", "Mode", "ModeName", "as_mode"]

ModeName = Literal["production", "validate"]


class Mode:
    """How a plan runs; see the module docstring. Use :data:`PRODUCTION` or :data:`VALIDATE`."""

    name: ClassVar[ModeName]
    parameters_are_dtensors: ClassVar[bool]
    counts_whole_gradients_per_rank: ClassVar[bool]

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False,
                      sharded_regions: Mapping[str, frozenset[str]] | None = None
                      ) -> Redistributor:
        """The converter factory every boundary of one ``apply`` is built with. ``local_code``:
        the plan runs code on local tensors inside boundaries (marshal adapters, local regions,
        inner wrappers). ``sharded_regions``: per boundary, the mesh dims on which its own
        region holds sharded parameters (validate mode's gradient-layout check)."""
        raise NotImplementedError

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        """``fn`` (an inner wrapper's callable, ``fn(original, *args, **kwargs)``) as the
        boundary calls it: on local tensors in both modes. ``declared``: ``args`` are the
        module's forward arguments, whose declared inputs unwrap with production's gradient
        placement (the forward hook)."""
        raise NotImplementedError

    def prepare(self, model: nn.Module, plan: Plan) -> None:
        """What this mode needs before anything is installed, or its refusal of the model.

        Raises:
            ValidateUnsupportedError: (validate) a kernel the model runs cannot run on DTensors.
        """
        raise NotImplementedError

    def make_parameter(self, p: ParamPlan, local: Tensor, mesh: DeviceMesh, *,
                       requires_grad: bool) -> nn.Parameter:
        """The parameter ``p`` becomes on this rank, from its local shard ``local``.

        Raises:
            PlanMismatchError: the mode cannot run this parameter as the plan places it.
        """
        raise NotImplementedError

    def install_grad_reductions(self, plan: Plan, params: dict[str, nn.Parameter],
                                mesh: DeviceMesh) -> GradBucketReducer | None:
        """Whatever reduces the plan's gradient buckets over ``params`` (the new shards): the
        reducer, or ``None`` where nothing needs one."""
        raise NotImplementedError

    def hook_reduced_gradients(self, plan: Plan) -> tuple[str, ...]:
        """The parameters whose gradients hooks on the objects apply installed reduce (a
        wrapper that replaced those objects would leave the gradients partial)."""
        raise NotImplementedError

    def install_optimizer_checks(self, live: LiveParams) -> list[RemovableHandle]:
        """Hooks that refuse an optimizer step this mode cannot run right."""
        raise NotImplementedError

    def watch_outside_boundaries(self, model: nn.Module, plan: Plan,
                                 mesh: DeviceMesh) -> list[RemovableHandle]:
        """Hooks on the replicated parameters no boundary encloses (validate: their gradients
        checked against the data they compute on)."""
        raise NotImplementedError

    def keep_hooks_through_moves(self, model: nn.Module) -> list[RemovableHandle]:
        """Hooks that keep the parameters' own hooks in place when the trainer moves the
        model after apply (``model.to(device)``)."""
        raise NotImplementedError

    def divided_head_counts(self, plan: Plan) -> tuple[HeadCount, ...]:
        """The head counts to set on modules for the length of the installation."""
        raise NotImplementedError

    def embedding_compute(self, tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                          compute: Callable[..., Any], mesh: DeviceMesh) -> Callable[..., Any]:
        """The compute of a vocab-parallel embedding boundary (``boundary.vocab_parallel``)."""
        raise NotImplementedError

    def vocab_shard(self, loss: LossParallel, mesh: DeviceMesh,
                    mesh_dims: tuple[str, ...]) -> VocabShard:
        """The marked vocab-slice logits of the plan's loss on vocab shards."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Mode({self.name!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mode):
            return other.name == self.name
        if isinstance(other, str):
            return other == self.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


class _Production(Mode):
    """Local shards, the collectives the resolver lowered, local kernels."""

    name: ClassVar[ModeName] = "production"
    parameters_are_dtensors: ClassVar[bool] = False
    counts_whole_gradients_per_rank: ClassVar[bool] = True

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False,
                      sharded_regions: Mapping[str, frozenset[str]] | None = None
                      ) -> Redistributor:
        from hyperrecipe.runtime.forward.layouts import ProductionRedistributor

        return ProductionRedistributor(mesh)

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        return fn  # the arguments are local already

    def prepare(self, model: nn.Module, plan: Plan) -> None:
        return None  # local kernels run whatever the model runs

    def make_parameter(self, p: ParamPlan, local: Tensor, mesh: DeviceMesh, *,
                       requires_grad: bool) -> nn.Parameter:
        from torch import nn

        # gradient reductions (grad_reduce) run in buckets: install_grad_reductions
        return nn.Parameter(local, requires_grad=requires_grad)

    def install_grad_reductions(self, plan: Plan, params: dict[str, nn.Parameter],
                                mesh: DeviceMesh) -> GradBucketReducer | None:
        from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer

        if not plan.grad_buckets:
            return None
        reducer = GradBucketReducer(plan.grad_buckets, params, mesh)
        reducer.install()
        return reducer

    def hook_reduced_gradients(self, plan: Plan) -> tuple[str, ...]:
        return tuple(fqn for b in plan.grad_buckets for fqn in b.params)

    def install_optimizer_checks(self, live: LiveParams) -> list[RemovableHandle]:
        return []

    def watch_outside_boundaries(self, model: nn.Module, plan: Plan,
                                 mesh: DeviceMesh) -> list[RemovableHandle]:
        return []  # no per-call checks on the hot path

    def keep_hooks_through_moves(self, model: nn.Module) -> list[RemovableHandle]:
        return []  # a move assigns plain parameters' .data: the object and its hooks stay

    def divided_head_counts(self, plan: Plan) -> tuple[HeadCount, ...]:
        return plan.head_counts

    def embedding_compute(self, tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                          compute: Callable[..., Any], mesh: DeviceMesh) -> Callable[..., Any]:
        from torch import nn

        from hyperrecipe.runtime.comm.collectives import group_for
        from hyperrecipe.runtime.forward.compute import local_padding_idx, vocab_parallel_embedding

        assert boundary.vocab_parallel is not None
        g = group_for(mesh, boundary.vocab_parallel)
        local = vocab_parallel_embedding(module, compute, rank=g.rank, fqn=boundary.fqn)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            tx.set_attribute(module, "padding_idx", local_padding_idx(module, rank=g.rank),
                             fqn=boundary.fqn)
        return local

    def vocab_shard(self, loss: LossParallel, mesh: DeviceMesh,
                    mesh_dims: tuple[str, ...]) -> VocabShard:
        from hyperrecipe.runtime.features.vocab_loss import make_vocab_shard

        return make_vocab_shard(loss, mesh, mesh_dims, dtensor=False)


class _Validate(Mode):
    """DTensors end to end, every declared placement checked, DTensor's own kernels."""

    name: ClassVar[ModeName] = "validate"
    parameters_are_dtensors: ClassVar[bool] = True
    counts_whole_gradients_per_rank: ClassVar[bool] = False

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False,
                      sharded_regions: Mapping[str, frozenset[str]] | None = None
                      ) -> Redistributor:
        from hyperrecipe.runtime.forward.layouts import ValidateRedistributor

        return ValidateRedistributor(mesh, mesh_dims, check_input_grads=not local_code,
                                     sharded_regions=sharded_regions)

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        from hyperrecipe.runtime.features.inner import dtensor_edge

        return dtensor_edge(fn, boundary, mesh, mesh_dims, declared=declared)

    def prepare(self, model: nn.Module, plan: Plan) -> None:
        from hyperrecipe.errors import ValidateUnsupportedError
        from hyperrecipe.models.hf_kernels import validate_experts_refusal
        from hyperrecipe.runtime.comm.dtensor_rules import register_validate_rules

        register_validate_rules()  # the ops torch ships without a DTensor rule (CPU SDPA)
        refusal = validate_experts_refusal(model, plan)
        if refusal is not None:
            raise ValidateUnsupportedError(refusal, fqn=refusal.split(":", 1)[0],
                                           op="aten._grouped_mm.default")

    def make_parameter(self, p: ParamPlan, local: Tensor, mesh: DeviceMesh, *,
                       requires_grad: bool) -> nn.Parameter:
        from hyperrecipe.runtime.comm.dtensor_parameters import dtensor_parameter

        return dtensor_parameter(p, local, mesh, requires_grad=requires_grad)

    def install_grad_reductions(self, plan: Plan, params: dict[str, nn.Parameter],
                                mesh: DeviceMesh) -> GradBucketReducer | None:
        return None  # DTensor's backward reduces: a parameter's hook keeps its placement

    def hook_reduced_gradients(self, plan: Plan) -> tuple[str, ...]:
        return ()  # DTensor's backward reduces them

    def install_optimizer_checks(self, live: LiveParams) -> list[RemovableHandle]:
        # torch's multi-tensor kernels over mixed DTensor / plain parameters: refused by name
        from hyperrecipe.runtime.grads.optimizer_kernels import install_mixed_kernel_check

        return list(install_mixed_kernel_check(live))

    def watch_outside_boundaries(self, model: nn.Module, plan: Plan,
                                 mesh: DeviceMesh) -> list[RemovableHandle]:
        # the data flow the plan does not hold, read off the autograd graph
        from hyperrecipe.runtime.forward.outside_params import watch_params_outside_boundaries

        return watch_params_outside_boundaries(model, plan, mesh)

    def keep_hooks_through_moves(self, model: nn.Module) -> list[RemovableHandle]:
        from hyperrecipe.runtime.comm.dtensor_parameters import rearm_after_moves

        return [rearm_after_moves(model)]

    def divided_head_counts(self, plan: Plan) -> tuple[HeadCount, ...]:
        # DTensor computes with global shapes, so the attributes stay global, except in modules
        # whose code runs on local tensors (a local region) in both modes
        from hyperrecipe.runtime.features.local_region import runs_on_local_tensors

        return tuple(h for h in plan.head_counts
                     if runs_on_local_tensors(h.module, plan.boundaries))

    def embedding_compute(self, tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                          compute: Callable[..., Any], mesh: DeviceMesh) -> Callable[..., Any]:
        return compute  # DTensor looks a row-sharded table up itself

    def vocab_shard(self, loss: LossParallel, mesh: DeviceMesh,
                    mesh_dims: tuple[str, ...]) -> VocabShard:
        from hyperrecipe.runtime.features.vocab_loss import make_vocab_shard

        return make_vocab_shard(loss, mesh, mesh_dims, dtensor=True)


PRODUCTION: Mode = _Production()
VALIDATE: Mode = _Validate()
MODES: dict[str, Mode] = {m.name: m for m in (PRODUCTION, VALIDATE)}


def as_mode(value: Mode | str) -> Mode:
    """The :class:`Mode` for ``"production"`` / ``"validate"`` (a Mode is returned as is).

    Raises:
        ModeError: any other value.
    """
    if isinstance(value, Mode):
        return value
    mode = MODES.get(value) if isinstance(value, str) else None
    if mode is None:
        msg = f"mode must be 'production' or 'validate', not {value!r}"
        raise ModeError(msg)
    return mode
