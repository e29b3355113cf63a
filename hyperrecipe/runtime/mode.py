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

Each answer lives with the feature it concerns and is registered there with :func:`answers`
(``@answers("vocab_shard", "production")`` in :mod:`~hyperrecipe.runtime.features.vocab_loss`),
so this module imports nothing from the rooms that import it: the rest of the runtime asks the
:class:`Mode` it was given to do something, and the feature that knows answers. Importing
:mod:`hyperrecipe.runtime` imports every answering module (``install`` does);
tests/test_layering.py checks that each question has an answer for each mode. A :class:`Mode`
compares equal to its name (``PRODUCTION == "production"``), so callers that hold the string
keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

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

__all__ = ["MODES", "PRODUCTION", "QUESTIONS", "VALIDATE", "Mode", "ModeName", "answers",
           "as_mode"]

ModeName = Literal["production", "validate"]

QUESTIONS = ("redistributor", "wrapper_edge", "prepare", "make_parameter",
             "install_grad_reductions", "hook_reduced_gradients", "install_optimizer_checks",
             "watch_outside_boundaries", "keep_hooks_through_moves", "divided_head_counts",
             "embedding_compute", "vocab_shard")
"""What code asks a :class:`Mode` (one method each, module docstring); every mode answers each."""

_ANSWERS: dict[tuple[str, str], Callable[..., Any]] = {}
_F = TypeVar("_F", bound=Callable[..., Any])


def answers(question: str, *modes: ModeName) -> Callable[[_F], _F]:
    """Register the decorated function as ``modes``' answer to ``question`` (one of
    :data:`QUESTIONS`; it takes the method's arguments, without ``self``)."""
    if question not in QUESTIONS or not modes or not set(modes) <= {"production", "validate"}:
        msg = f"answers({question!r}, {', '.join(map(repr, modes))}): no such question or mode"
        raise ModeError(msg)

    def register(fn: _F) -> _F:
        for mode in modes:
            _ANSWERS[mode, question] = fn
        return fn

    return register


class Mode:
    """How a plan runs; see the module docstring. Use :data:`PRODUCTION` or :data:`VALIDATE`.

    Attributes:
        name: ``"production"`` or ``"validate"``.
        parameters_are_dtensors: what the state code (``LiveParams``) finds in the model after
            apply; the one fact of the mode that is data rather than behaviour.
        counts_whole_gradients_per_rank: whether the plan's reductions sum a gradient that is
            whole on every rank as if it were partial (production's collectives cannot tell;
            DTensor can).
    """

    def __init__(self, name: ModeName, *, parameters_are_dtensors: bool,
                 counts_whole_gradients_per_rank: bool) -> None:
        self.name: ModeName = name
        self.parameters_are_dtensors = parameters_are_dtensors
        self.counts_whole_gradients_per_rank = counts_whole_gradients_per_rank

    def _ask(self, question: str) -> Callable[..., Any]:
        try:
            return _ANSWERS[self.name, question]
        except KeyError:
            msg = (f"no runtime module answers {question!r} for the {self.name} mode: "
                   f"import hyperrecipe.runtime (which imports every answer) first")
            raise ModeError(msg) from None

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False,
                      sharded_regions: Mapping[str, frozenset[str]] | None = None
                      ) -> Redistributor:
        """The converter factory every boundary of one ``apply`` is built with. ``local_code``:
        the plan runs code on local tensors inside boundaries (marshal adapters, local regions,
        inner wrappers). ``sharded_regions``: per boundary, the mesh dims on which its own
        region holds sharded parameters (validate mode's gradient-layout check)."""
        result: Redistributor = self._ask("redistributor")(
            mesh, mesh_dims, local_code=local_code, sharded_regions=sharded_regions)
        return result

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        """``fn`` (an inner wrapper's callable, ``fn(original, *args, **kwargs)``) as the
        boundary calls it: on local tensors in both modes. ``declared``: ``args`` are the
        module's forward arguments, whose declared inputs unwrap with production's gradient
        placement (the forward hook)."""
        result: Callable[..., Any] = self._ask("wrapper_edge")(fn, boundary, mesh, mesh_dims,
                                                              declared=declared)
        return result

    def prepare(self, model: nn.Module, plan: Plan) -> None:
        """What this mode needs before anything is installed, or its refusal of the model.

        Raises:
            ValidateUnsupportedError: (validate) a kernel the model runs cannot run on DTensors.
        """
        self._ask("prepare")(model, plan)

    def make_parameter(self, p: ParamPlan, local: Tensor, mesh: DeviceMesh, *,
                       requires_grad: bool) -> nn.Parameter:
        """The parameter ``p`` becomes on this rank, from its local shard ``local``.

        Raises:
            PlanMismatchError: the mode cannot run this parameter as the plan places it.
        """
        result: nn.Parameter = self._ask("make_parameter")(p, local, mesh,
                                                           requires_grad=requires_grad)
        return result

    def install_grad_reductions(self, plan: Plan, params: dict[str, nn.Parameter],
                                mesh: DeviceMesh) -> GradBucketReducer | None:
        """Whatever reduces the plan's gradient buckets over ``params`` (the new shards): the
        reducer, or ``None`` where nothing needs one."""
        result: GradBucketReducer | None = self._ask("install_grad_reductions")(plan, params,
                                                                                mesh)
        return result

    def hook_reduced_gradients(self, plan: Plan) -> tuple[str, ...]:
        """The parameters whose gradients hooks on the objects apply installed reduce (a
        wrapper that replaced those objects would leave the gradients partial)."""
        result: tuple[str, ...] = self._ask("hook_reduced_gradients")(plan)
        return result

    def install_optimizer_checks(self, live: LiveParams) -> list[RemovableHandle]:
        """Hooks that refuse an optimizer step this mode cannot run right."""
        result: list[RemovableHandle] = self._ask("install_optimizer_checks")(live)
        return result

    def watch_outside_boundaries(self, model: nn.Module, plan: Plan,
                                 mesh: DeviceMesh) -> list[RemovableHandle]:
        """Hooks on the replicated parameters no boundary encloses (validate: their gradients
        checked against the data they compute on)."""
        result: list[RemovableHandle] = self._ask("watch_outside_boundaries")(model, plan, mesh)
        return result

    def keep_hooks_through_moves(self, model: nn.Module) -> list[RemovableHandle]:
        """Hooks that keep the parameters' own hooks in place when the trainer moves the
        model after apply (``model.to(device)``)."""
        result: list[RemovableHandle] = self._ask("keep_hooks_through_moves")(model)
        return result

    def divided_head_counts(self, plan: Plan) -> tuple[HeadCount, ...]:
        """The head counts to set on modules for the length of the installation."""
        result: tuple[HeadCount, ...] = self._ask("divided_head_counts")(plan)
        return result

    def embedding_compute(self, tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                          compute: Callable[..., Any], mesh: DeviceMesh) -> Callable[..., Any]:
        """The compute of a vocab-parallel embedding boundary (``boundary.vocab_parallel``)."""
        result: Callable[..., Any] = self._ask("embedding_compute")(tx, boundary, module,
                                                                   compute, mesh)
        return result

    def vocab_shard(self, loss: LossParallel, mesh: DeviceMesh,
                    mesh_dims: tuple[str, ...]) -> VocabShard:
        """The marked vocab-slice logits of the plan's loss on vocab shards."""
        result: VocabShard = self._ask("vocab_shard")(loss, mesh, mesh_dims)
        return result

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


#: Local shards, the collectives the resolver lowered, local kernels.
PRODUCTION = Mode("production", parameters_are_dtensors=False,
                  counts_whole_gradients_per_rank=True)
#: DTensors end to end, every declared placement checked, DTensor's own kernels.
VALIDATE = Mode("validate", parameters_are_dtensors=True, counts_whole_gradients_per_rank=False)
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
