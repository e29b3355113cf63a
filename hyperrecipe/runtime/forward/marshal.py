"""Moving values between DTensor and plain local tensors at the edge of code that runs locally.

Inner wrappers, local compute regions and ``marshal`` adapters run the same local code in both
modes. In production their arguments are already local tensors and these helpers change nothing;
in validate mode DTensor arguments are unwrapped here once on the way in (``to_local``, which
keeps autograd: the gradient comes back as a DTensor with the same placements) and local results
are wrapped again on the way out with the placements the recipe declared.

Values are walked through tuples, lists and dicts (a rotary ``(cos, sin)`` pair, a ``ModelOutput``
is a dict); anything else passes through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from hyperrecipe.errors import PlanMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["grad_roots", "map_tensors", "to_local_tree", "wrap_local_tree"]


def map_tensors(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``fn`` applied to every tensor in ``value`` (nested tuples, lists and dicts rebuilt)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        out = value.copy()  # keeps a ModelOutput's class
        for k, v in value.items():
            out[k] = map_tensors(v, fn)
        return out
    return value


def grad_roots(value: Any) -> list[Any]:
    """The autograd nodes that made the tensors in ``value`` (walked as :func:`map_tensors`
    walks it, in that order; a tensor without a ``grad_fn`` adds none): where a walk of the
    graph a call built starts."""
    roots: list[Any] = []

    def collect(t: Tensor) -> Tensor:
        if t.grad_fn is not None:
            roots.append(t.grad_fn)
        return t

    map_tensors(value, collect)
    return roots


def to_local_tree(value: Any, meshes: list[DeviceMesh] | None = None) -> Any:
    """Every DTensor in ``value`` as its local tensor (differentiably).

    Args:
        value: anything; DTensors inside tuples, lists and dicts are found too.
        meshes: when given, the mesh of each DTensor met is appended (callers check that one
            region sees one mesh, and re-wrap on it).
    """
    from torch.distributed.tensor import DTensor

    def unwrap(t: Tensor) -> Tensor:
        if isinstance(t, DTensor):
            if meshes is not None:
                meshes.append(t.device_mesh)
            return t.to_local()
        return t

    return map_tensors(value, unwrap)


def wrap_local_tree(value: Any, mesh: DeviceMesh, placements: Sequence[Any], *,
                    where: str) -> Any:
    """Every plain tensor in ``value`` as a DTensor on ``mesh`` with ``placements``.

    ``from_local`` without a check: the placements are the recipe's declaration of what the
    local code produced, and the boundary's output check compares them with what the rest of
    the model expects.

    Raises:
        PlanMismatchError: a DTensor came out of code that was supposed to run locally.
    """
    from torch.distributed.tensor import DTensor

    def wrap(t: Tensor) -> Tensor:
        if isinstance(t, DTensor):
            msg = (f"{where}: local code returned a DTensor; it must compute on the local tensors "
                   f"it was given")
            raise PlanMismatchError(msg)
        return DTensor.from_local(t, mesh, tuple(placements), run_check=False)

    return map_tensors(value, wrap)
