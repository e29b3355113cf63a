"""Validate mode's parameters: this rank's shard as a DTensor with the plan's placement.

The plan records, per parameter, the DTensor placement its shard has (``ParamPlan.dtensor``), or
why it has none (``no_dtensor``). A parameter whose fused parts are unequal has no single DTensor
placement: it stays a plain tensor marked with its parts, and is computed part by part
(:mod:`~hyperrecipe.runtime.comm.strided`). Production never comes here: its parameters are the
plain shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.placement import parse_dtensor
from hyperrecipe.plan import ParamPlan
from hyperrecipe.runtime.comm.strided import FusedParts, mark_parts
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.hooks import RemovableHandle
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["dtensor_parameter", "placed_at", "rearm_after_moves"]


def placed_at(p: ParamPlan) -> str:
    """`` (placed at file:line)``: the recipe line behind a parameter's placement."""
    if not p.provenance:
        return ""
    return f" (placed at {p.provenance[-1].file}:{p.provenance[-1].line})"


def dtensor_parameter(p: ParamPlan, local: Tensor, mesh: DeviceMesh, *,
                      requires_grad: bool) -> nn.Parameter:
    """``local`` (this rank's shard of ``p``) as validate mode's parameter.

    A replicated parameter outside every boundary stays a plain tensor (the model's own code
    uses it on plain values). A DTensor parameter keeps its placement through backward: a
    replicated one used on sharded data gets a partial gradient, which its hook reduces.

    Raises:
        PlanMismatchError: ``p`` is sharded outside every boundary, or its placement has no
            DTensor form (production mode runs both).
    """
    from torch.distributed.tensor import DTensor

    if p.boundary is None:
        if not p.placement.is_replicate:
            msg = (f"{p.fqn} is placed {p.placement} but lies in no boundary; validate mode "
                   f"needs a boundary around sharded parameters{placed_at(p)}")
            raise PlanMismatchError(msg)
        return nn.Parameter(local, requires_grad=requires_grad)
    if p.no_dtensor is not None:
        msg = (f"{p.fqn}: {p.placement} has no DTensor placement ({p.no_dtensor}); validate "
               f"mode cannot run it (production mode can){placed_at(p)}")
        raise PlanMismatchError(msg)
    layout = parse_dtensor(p.dtensor)
    if layout.parts is not None:  # unequal chunks: plain, computed part by part (comm.strided)
        index, dim, sizes = layout.parts
        param = nn.Parameter(local, requires_grad=requires_grad)
        mark_parts(param, FusedParts(mesh=mesh,
                                     placements=layout.torch_placements(parts_as_shard=True),
                                     index=index, dim=dim, sizes=sizes, ways=mesh.size(index)))
        return param
    placements = layout.torch_placements()
    dt = DTensor.from_local(local, mesh, placements, run_check=False)
    param = nn.Parameter(dt, requires_grad=requires_grad)
    unreduced = _unreduced_dims(p, placements, mesh)
    # in the parameter's __dict__, which a module move's swap takes along (a weak reference
    # to the parameter would make torch.utils.swap_tensors refuse the move)
    setattr(param, _PLANNED, (p, unreduced))

    def refuse(grad: Any) -> None:
        if grad.device_mesh == mesh:  # not a mesh another wrapper (FSDP) put it on
            _refuse_partial_left_by_production(p, grad, unreduced)

    _keep_placement(param, placements, refuse if unreduced else None)
    return param


def _keep_placement(param: nn.Parameter, placements: Any,
                    refuse: Callable[[Any], None] | None = None) -> None:
    """Hook ``param`` so its gradient leaves backward with the parameter's placement, and mark
    it hooked (the mark lives in the parameter's ``__dict__``, which a swap takes along with the
    hook: see :func:`rearm_after_moves`). ``refuse`` sees a gradient whose placement differs
    first (:func:`_refuse_partial_left_by_production`)."""
    from torch.distributed.tensor import DTensor

    if not param.requires_grad:
        # no gradient now (a MoE router's bias kept as a parameter, a layer frozen for gradual
        # unfreezing), and no hook can go on it: rearm_after_moves hooks it once unfrozen
        _FROZEN[param] = (placements, refuse)
        return

    def keep_placement(grad: Tensor, placements: Any = placements) -> Tensor:
        # a replicated parameter used on sharded data gets a partial gradient: reduce it; an
        # embedding row-sharded over the vocabulary gets a replicated one: keep its rows
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
            if refuse is not None:
                refuse(grad)
            return grad.redistribute(grad.device_mesh, placements)
        return grad

    param.register_hook(keep_placement)  # type: ignore[no-untyped-call]
    setattr(param, _KEEPS_PLACEMENT, True)


def _unreduced_dims(p: ParamPlan, placements: Any, mesh: DeviceMesh
                    ) -> tuple[tuple[int, str], ...]:
    """(index, name) of the mesh dims on which ``p`` is replicated and production does not
    reduce its gradient (no ``grad_reduce`` op there): a partial gradient on one of them is
    left partial by production."""
    if p.tied_to is not None:
        return ()  # the tied parameter's own plan carries the reductions
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    reduced = {op.mesh_dim for op in p.grad_reduce}
    return tuple((i, name) for i, (name, q) in enumerate(zip(names, placements))
                 if q.is_replicate() and name not in reduced and mesh.size(i) > 1)


def _placed_by(p: ParamPlan) -> str:
    last = p.provenance[-1] if p.provenance else None
    if last is not None and last.rule_index < 0:
        return (f" (no rule claims it: the recipe's `unclaimed: replicate` places it, "
                f"{last.file}:{last.line})")
    return placed_at(p)


def _refuse_partial_left_by_production(p: ParamPlan, grad: Any,
                                       unreduced: tuple[tuple[int, str], ...]) -> None:
    """DTensor computed a partial gradient for replicated ``p`` on a mesh dim where the plan
    has no gradient reduction: DTensor would reduce it here and agree with one process, while
    production mode leaves each rank's partial gradient as it is (a per-head norm under another
    family's recipe, a norm on the sequence-sharded stream not listed as
    ``sequence_parallel``). Validate mode refuses it by name rather than agree.

    Raises:
        PlanMismatchError: naming the parameter, the mesh dim and the recipe fields that fix it.
    """
    partial = [name for i, name in unreduced if grad.placements[i].is_partial()]
    if not partial:
        return
    dims = ", ".join(partial)
    fields = ", ".join(f"{p.name}: {d}" for d in partial)
    msg = (f"{p.fqn}: its gradient comes back partial over {dims} (the module computes on data "
           f"sharded over {dims}: this rank's heads or tokens), but the plan reduces no "
           f"gradient of this replicated parameter there: production mode would leave each "
           f"rank's partial gradient unreduced{_placed_by(p)}. Declare the reduction: "
           f"`reduce_grads: {{{fields}}}` on {p.module}'s rule (or `style: sequence_parallel` "
           f"for a norm on the sequence-sharded stream)")
    raise PlanMismatchError(msg)


def unreduced_after_early_sum(param: Any, mesh_dim: int, op: str) -> str | None:
    """The finding for ``param`` when DTensor summed a partial gradient over ``mesh_dim``
    inside ``op``'s backward before it reached ``param`` (``native_layer_norm_backward`` takes
    its gradient whole): validate's gradient then arrives whole, while production's local
    backward gives each rank its partial share, which the plan must reduce. ``None`` where the
    plan reduces it there.

    Raises:
        KeyError: ``param`` is not a DTensor parameter of an applied plan.
    """
    planned = getattr(param, _PLANNED, None)
    if planned is None:
        raise KeyError(_PLANNED)
    p, unreduced = planned
    names = [name for i, name in unreduced if i == mesh_dim]
    if not names:
        return None
    dim = names[0]
    return (f"{p.fqn}: its gradient is partial over {dim} in production mode (the module "
            f"computes on a gradient that is this rank's partial sum over {dim}; in validate "
            f"mode DTensor sums it inside {op}'s backward, so it arrives whole there), but the "
            f"plan reduces no gradient of this replicated parameter over {dim}: production "
            f"would leave each rank's share unreduced{_placed_by(p)}. Declare the reduction: "
            f"`reduce_grads: {{{p.name}: {dim}}}` on {p.module}'s rule, or move {p.module} "
            f"out of the boundary (a boundary on the projections after it)")


_PLANNED = "_hyperrecipe_planned"
"""The attribute of validate mode's DTensor parameters holding their plan and the mesh dims on
which production leaves their gradient unreduced (:func:`unreduced_after_early_sum`)."""

_KEEPS_PLACEMENT = "_hyperrecipe_keeps_placement"
# Placement hooks owed to parameters frozen at install, by the parameter's Python object (which
# a module move keeps; its ``__dict__`` does not survive the move).
_FROZEN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def rearm_after_moves(model: nn.Module) -> RemovableHandle:
    """A forward pre-hook on ``model`` that puts back the placement hooks a module move took.

    ``model.to(device)``, ``model.float()`` and every other ``Module._apply`` replace a DTensor
    parameter's tensor through ``torch.utils.swap_tensors``: the Python object (and so the
    optimizer's reference) stays, but the autograd hooks of the old tensor and its ``__dict__``
    go. Every trainer moves its model (the Hugging Face Trainer calls ``model.to(args.device)``);
    without the hook a vocab-sharded embedding's gradient came back replicated (the whole table
    on every rank) and a replicated parameter's partial. The check per forward is one dict
    lookup per DTensor parameter, in validate mode only; a parameter swapped in by the user
    (``module.weight = nn.Parameter(...)``) is not the plan's and is not touched.

    A parameter frozen when the plan was applied cannot be hooked then; unfrozen later (gradual
    unfreezing), it gets its hook before the first forward that needs it, so its gradient keeps
    the placement and production's missing reductions are still refused by name.
    """
    hooked = [p for p in model.parameters() if getattr(p, _KEEPS_PLACEMENT, False)]
    frozen = [p for p in model.parameters() if p in _FROZEN]

    def rearm(module: nn.Module, args: Any) -> None:
        for p in hooked:
            if _KEEPS_PLACEMENT not in p.__dict__:
                _rearm(p)
        if frozen and any(p.requires_grad for p in frozen):
            for p in [p for p in frozen if p.requires_grad]:
                frozen.remove(p)
                placements, refuse = _FROZEN[p]
                del _FROZEN[p]
                _keep_placement(p, placements, refuse)
                hooked.append(p)

    return model.register_forward_pre_hook(rearm)


def _rearm(param: nn.Parameter) -> None:
    """Bind ``param``'s hooks to the tensor a swap gave it. torch keeps a tensor's Python
    hooks in a dict on the Python object (which the swap leaves in place) and binds that dict to
    the tensor underneath when it is assigned; the swap left the binding on the old tensor.
    Assigning the dict again re-binds every hook on it, the user's too. A torch without that
    dict gets the placement hook afresh."""
    hooks = getattr(param, "_backward_hooks", None)
    if hooks:
        param._backward_hooks = hooks
        setattr(param, _KEEPS_PLACEMENT, True)
    else:
        _keep_placement(param, tuple(param.placements))  # type: ignore[attr-defined]


@answers("make_parameter", "production")
def _plain_parameter(p: ParamPlan, local: Tensor, mesh: DeviceMesh, *,
                     requires_grad: bool) -> nn.Parameter:
    # gradient reductions (grad_reduce) run in buckets: install_grad_reductions
    return nn.Parameter(local, requires_grad=requires_grad)


answers("make_parameter", "validate")(dtensor_parameter)


@answers("keep_hooks_through_moves", "production")
def _nothing_to_rearm(model: nn.Module) -> list[RemovableHandle]:
    return []  # a move assigns plain parameters' .data: the object and its hooks stay


@answers("keep_hooks_through_moves", "validate")
def _rearm_after_moves(model: nn.Module) -> list[RemovableHandle]:
    return [rearm_after_moves(model)]
