"""The mode a plan is applied in: one object, chosen once by ``apply``, asked by everything else.

``production`` runs on plain local shards with the collectives the resolver lowered;
``validate`` runs on DTensors end to end and checks every declared placement. The two share
every wrapper body (:mod:`~hyperrecipe.runtime.forward.boundary`); where they differ, the code asks the
:class:`Mode` it was given what to do, never which mode it is:

- ``redistributor``: the converters a boundary's body calls (:mod:`~hyperrecipe.runtime.forward.layouts`).
- ``dtensor_parameters``: parameters become DTensors with the plan's ``dtensor`` placement
  (validate), or this rank's local shards with their gradient collectives (production).
- ``local_kernels``: modules compute on local shards, so head counts are divided and a
  vocab-parallel table is looked up with the masked local kernel (production); DTensor does
  both itself on global shapes (validate).
- ``wrapper_edge``: how an inner wrapper, which always computes on local tensors, meets the
  boundary's values (a pass-through in production; DTensors unwrapped and rewrapped with the
  plan's ``inner_out_src`` in validate).

This module is the only code that knows which mode runs. A :class:`Mode` compares equal to its
name (``PRODUCTION == "production"``), so callers that hold the string keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from hyperrecipe.errors import ModeError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.plan import BoundaryPlan
    from hyperrecipe.runtime.forward.layouts import Redistributor

__all__ = ["MODES", "PRODUCTION", "VALIDATE", "Mode", "ModeName", "as_mode"]

ModeName = Literal["production", "validate"]


class Mode:
    """How a plan runs; see the module docstring. Use :data:`PRODUCTION` or :data:`VALIDATE`."""

    name: ClassVar[ModeName]
    dtensor_parameters: ClassVar[bool]
    local_kernels: ClassVar[bool]

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False) -> Redistributor:
        """The converter factory every boundary of one ``apply`` is built with. ``local_code``:
        the plan runs code on local tensors inside boundaries (marshal adapters, local regions,
        inner wrappers)."""
        raise NotImplementedError

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        """``fn`` (an inner wrapper's callable, ``fn(original, *args, **kwargs)``) as the
        boundary calls it: on local tensors in both modes. ``declared``: ``args`` are the
        module's forward arguments, whose declared inputs unwrap with production's gradient
        placement (the forward hook)."""
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
    name: ClassVar[ModeName] = "production"
    dtensor_parameters: ClassVar[bool] = False
    local_kernels: ClassVar[bool] = True

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False) -> Redistributor:
        from hyperrecipe.runtime.forward.layouts import ProductionRedistributor

        return ProductionRedistributor(mesh)

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        return fn  # the arguments are local already


class _Validate(Mode):
    name: ClassVar[ModeName] = "validate"
    dtensor_parameters: ClassVar[bool] = True
    local_kernels: ClassVar[bool] = False

    def redistributor(self, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                      local_code: bool = False) -> Redistributor:
        from hyperrecipe.runtime.forward.layouts import ValidateRedistributor

        return ValidateRedistributor(mesh, mesh_dims, check_input_grads=not local_code)

    def wrapper_edge(self, fn: Callable[..., Any], boundary: BoundaryPlan, mesh: DeviceMesh,
                     mesh_dims: tuple[str, ...], *, declared: bool = False) -> Callable[..., Any]:
        from hyperrecipe.runtime.features.inner import dtensor_edge

        return dtensor_edge(fn, boundary, mesh, mesh_dims, declared=declared)


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
