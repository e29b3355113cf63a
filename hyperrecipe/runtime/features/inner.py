"""Installing a boundary's inner wrapper: the fallback chain, the hooks, the local-tensor edge.

For each candidate of a boundary's ``inner_wrapper`` chain, in order: its requirements are
checked (an unmet one makes it *ineligible*, and the reason is kept); an eligible candidate is
built and hooked in inside a rewriter savepoint, so a candidate that raises half way through is
rolled back before the next is tried. The first that installs is used; when none does,
:class:`~hyperrecipe.errors.PlanMismatchError` lists every candidate and why it was passed over.
Every decision shows in ``TrainingState.status()``.

Hooks (:data:`~hyperrecipe.wrappers.Hook`):

- ``attention``: an attention module whose model library dispatches its attention function
  through a registry (transformers' attention modules: the library's answers are in
  :mod:`hyperrecipe.models`). A dispatcher is set (through the rewriter) as that registry's
  local entry for the module's implementation;
  it calls the module's wrapper when the module has one (a companion attribute) and the
  original function for every other module, so other models in the process are unaffected.
  ``eager`` is not in the registry (models call their own function directly) and cannot be
  hooked: such a module is refused with the fix (build it with ``attn_implementation="sdpa"``).
- ``forward``: the wrapper receives the boundary's compute (the module's forward, run with the
  module's parameters as local tensors) and replaces it inside the boundary.

The edge: wrappers compute on local tensors in both modes. In validate mode the DTensor
arguments are unwrapped once (refusing ``partial`` ones, whose local values are summands; a
forward hook's declared inputs with the gradient placement production reduces from, as a local
region's are) and the results wrapped with the boundary's ``inner_out_src`` (outputs it does
not name: replicated). The wrapper runs as local code: a boundary nested in a forward hook's
module takes local tensors and hands local tensors back
(:mod:`~hyperrecipe.runtime.forward.validate_scope`). In production the arguments are local already and
the edge is a pass-through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
from torch import nn

from hyperrecipe.errors import PlacementMismatchError, PlanMismatchError
from hyperrecipe.models import LIBRARY
from hyperrecipe.placement import REPLICATED, to_torch_placements
from hyperrecipe.plan import BoundaryPlan
from hyperrecipe.rewriter import Rewrite
from hyperrecipe.runtime.forward.arguments import Slot, map_declared
from hyperrecipe.runtime.features.local_region import (
    input_grad_placements,
    unwrap_declared,
    with_local_parameters,
)
from hyperrecipe.runtime.forward.marshal import map_tensors, to_local_tree, wrap_local_tree
from hyperrecipe.runtime.comm.collectives import group_for
from hyperrecipe.runtime.forward.validate_scope import running_local_code
from hyperrecipe.wrappers import WrapperContext, WrapperSpec, load_wrapper
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.runtime.mode import Mode

__all__ = ["InnerWrapperInstaller", "WrapperChoice", "dtensor_edge"]

ATTENTION_COMPANION = "_hyperrecipe_attention"
_DISPATCHER_MARK = "__hyperrecipe_dispatcher__"


@attrs.frozen(kw_only=True)
class WrapperChoice:
    """One candidate of one boundary's chain and what became of it."""

    fqn: str
    wrapper: str
    state: str  # "installed", "ineligible", "failed" (rolled back), "not tried"
    reason: str | None = None


def _note_mesh(t: Any, meshes: list[Any]) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        meshes.append(t.device_mesh)
    return t


class InnerWrapperInstaller:
    """Installs the inner wrappers of one ``apply`` (one per applier: it owns the dispatchers
    it set, and refuses a registry entry another live installation set)."""

    def __init__(self, *, mesh: DeviceMesh, mesh_dims: tuple[str, ...], mode: Mode) -> None:
        self.mesh, self.mesh_dims, self.mode = mesh, mesh_dims, mode
        self.choices: list[WrapperChoice] = []
        self._dispatchers: dict[str, Callable[..., Any]] = {}

    def install(self, tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                compute: Callable[..., Any]) -> Callable[..., Any]:
        """Install the first eligible candidate of ``boundary.inner_wrapper``; return the
        compute the boundary runs (``compute`` itself for the attention hook).

        Raises:
            PlanMismatchError: no candidate is eligible and installs (every reason listed).
        """
        fqn = boundary.fqn
        tried: list[WrapperChoice] = []
        for i, ref in enumerate(boundary.inner_wrapper):
            spec = load_wrapper(ref)
            ctx = WrapperContext(fqn=fqn, module=module, mode=self.mode.name, mesh=self.mesh,
                                 mesh_dims=spec.mesh_dims,
                                 set_attribute=lambda o, n, v: tx.set_attribute(o, n, v, fqn=fqn),
                                 groups=lambda dim: group_for(self.mesh, dim))
            unmet = self._unmet(spec, ctx)
            if unmet is not None:
                tried.append(WrapperChoice(fqn=fqn, wrapper=ref, state="ineligible", reason=unmet))
                continue
            try:
                with tx.attempt(fqn):
                    result = self._install_one(tx, spec, ctx, boundary, module, compute)
            except Exception as exc:  # noqa: BLE001 - the next candidate is tried; all reported
                tried.append(WrapperChoice(fqn=fqn, wrapper=ref, state="failed",
                                           reason=f"{type(exc).__name__}: {exc}"))
                continue
            tried.append(WrapperChoice(fqn=fqn, wrapper=ref, state="installed"))
            tried.extend(WrapperChoice(fqn=fqn, wrapper=rest, state="not tried")
                         for rest in boundary.inner_wrapper[i + 1:])
            self.choices.extend(tried)
            return result
        self.choices.extend(tried)
        reasons = "; ".join(f"{c.wrapper}: {c.state} ({c.reason})" for c in tried)
        msg = f"{fqn}: no inner wrapper of the chain could be installed: {reasons}"
        raise PlanMismatchError(msg)

    @staticmethod
    def _unmet(spec: WrapperSpec, ctx: WrapperContext) -> str | None:
        for need in spec.requires:
            try:
                reason = need.check(ctx)
            except Exception as exc:  # noqa: BLE001 - a check that cannot run is not met
                reason = f"check raised {type(exc).__name__}: {exc}"
            if reason is not None:
                return f"requires {need.what}: {reason}"
        return None

    def _install_one(self, tx: Rewrite, spec: WrapperSpec, ctx: WrapperContext,
                     boundary: BoundaryPlan, module: nn.Module,
                     compute: Callable[..., Any]) -> Callable[..., Any]:
        built: object = spec.factory(ctx)  # user code: the annotation is not a guarantee
        if not callable(built):
            msg = f"inner wrapper {spec.name!r} returned {type(built).__name__}, not a callable"
            raise PlanMismatchError(msg)
        edged = self.mode.wrapper_edge(built, boundary, self.mesh, self.mesh_dims,
                                       declared=spec.hook == "forward")
        if spec.hook == "forward":
            # the wrapper computes on local tensors, so the compute it calls must too
            local_compute = with_local_parameters(module, compute)

            def wrapped_compute(*args: Any, **kwargs: Any) -> Any:
                return edged(local_compute, *args, **kwargs)

            return wrapped_compute
        self._hook_attention(tx, boundary.fqn, module)
        tx.set_attribute(module, ATTENTION_COMPANION, edged, fqn=boundary.fqn)
        return compute

    def _hook_attention(self, tx: Rewrite, fqn: str, module: nn.Module) -> None:
        impl = LIBRARY.attention_implementation(module)
        if impl is None:
            msg = (f"{fqn}: the attention hook needs an attention module whose model library "
                   f"dispatches its attention function (a transformers attention module); "
                   f"{type(module).__name__} has none — declare the wrapper with "
                   f"hook='forward'")
            raise PlanMismatchError(msg)
        registries = LIBRARY.attention_registry()
        registry, target = registries if registries is not None else ({}, {})
        if impl == "eager" or impl not in registry:
            msg = (f"{fqn}: attention implementation {impl!r} is not looked up through "
                   f"its model library's attention registry (eager attention is called "
                   f"directly), so "
                   f"it cannot be wrapped; build the model with attn_implementation='sdpa'")
            raise PlanMismatchError(msg)
        if impl in self._dispatchers:
            return
        current = registry[impl]
        if getattr(current, _DISPATCHER_MARK, False):
            msg = (f"{fqn}: attention {impl!r} is already hooked by another hyperrecipe "
                   f"installation; restore it before applying a second plan with inner wrappers")
            raise PlanMismatchError(msg)
        original = current

        def dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            wrapper = module.__dict__.get(ATTENTION_COMPANION)
            if wrapper is None:
                return original(module, *args, **kwargs)
            return wrapper(original, module, *args, **kwargs)

        setattr(dispatch, _DISPATCHER_MARK, True)
        tx.set_item(target, impl, dispatch, fqn=f"attention registry[{impl!r}]")
        self._dispatchers[impl] = dispatch


def dtensor_edge(fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                 mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
    """``fn`` (called as ``fn(original, *args, **kwargs)``) on local tensors, as local code,
    between DTensor values: validate mode's edge (:meth:`~hyperrecipe.runtime.mode.Mode.wrapper_edge`).

    With ``declared`` (the forward hook: ``args`` are the module's forward arguments), each
    declared input is unwrapped with the gradient placement production's backward reduces
    from (:func:`~hyperrecipe.runtime.features.local_region.input_grad_placements`): a replicated
    input consumed by parameters the wrapper's compute holds sharded gets a *partial*
    gradient from each rank, which DTensor then reduces, as production's lowered backward
    does. Other DTensors keep their placement for the gradient."""
    fqn = boundary.fqn
    slots: tuple[Slot, ...] = ()
    if declared:
        slots = tuple((a.position, a.name, functools.partial(
            unwrap_declared, grad_placements=input_grad_placements(boundary, a, mesh_dims)))
                      for a in boundary.inputs)
    placements = {a.position if a.position is not None else 0:
                  to_torch_placements(a.dst, mesh_dims) for a in boundary.inner_out_src}
    replicated = to_torch_placements(REPLICATED, mesh_dims)
    names = {a.position if a.position is not None else 0: a.name
             for a in boundary.inner_out_src}

    def refuse_partial(t: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
            raise PlacementMismatchError(fqn, "inner wrapper input", "not partial",
                                         "partial", stage="input")
        return t

    def edged(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        map_tensors((args, kwargs), refuse_partial)
        meshes: list[Any] = []
        args_l, kwargs_d = list(args), dict(kwargs)
        map_tensors((args_l, kwargs_d), lambda t: _note_mesh(t, meshes))
        map_declared(args_l, kwargs_d, slots)
        local_args = to_local_tree(args_l)
        local_kwargs = to_local_tree(kwargs_d)
        with running_local_code():
            out = fn(original, *local_args, **local_kwargs)
        if not meshes:
            return out
        where = f"{fqn} inner wrapper"
        if not isinstance(out, (tuple, list)):
            return wrap_local_tree(out, mesh, placements.get(0, replicated), where=where)
        items = [wrap_local_tree(v, mesh, placements.get(i, replicated),
                                 where=f"{where} output {names.get(i, i)}")
                 for i, v in enumerate(out)]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)

    return edged


@answers("wrapper_edge", "production")
def _local_edge(fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
    return fn  # the arguments are local already


answers("wrapper_edge", "validate")(dtensor_edge)
