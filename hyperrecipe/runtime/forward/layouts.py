"""Per-mode conversion of a boundary's declared tensors.

A :class:`Redistributor` is built once per ``apply`` by the
:class:`~hyperrecipe.runtime.mode.Mode` it chose; at install time it builds, for each boundary
and from plan data, the converters the boundary body calls, one for inputs and one for outputs.
The body (:mod:`hyperrecipe.runtime.forward.boundary`) never asks which mode it is in.

- :class:`ProductionRedistributor`: plain local tensors; each declared tensor goes through the
  transitions the resolver lowered (forward op, and the backward op its gradient needs).
- :class:`ValidateRedistributor`: DTensor. Inputs become DTensors placed ``src`` and are
  redistributed to ``dst``; undeclared tensor arguments become replicated DTensors (DTensor
  refuses to mix them with plain tensors); outputs are checked against ``out_src`` and raise
  :class:`~hyperrecipe.errors.PlacementMismatchError` when DTensor propagated something else, then
  are redistributed to ``out_dst``; the outermost boundary, and a boundary called from local
  code (:mod:`~hyperrecipe.runtime.forward.validate_scope`), hands local tensors back to the
  caller. The compute runs under
  :func:`~hyperrecipe.runtime.forward.validate_scope.validate_compute`, and its backward names
  the boundary when DTensor refuses an op there
  (:mod:`~hyperrecipe.runtime.forward.backward_scope`).

  A declared replicated input whose gradient production reduces (Megatron's *f*) gets a
  gradient hook that raises :class:`~hyperrecipe.errors.PlanMismatchError` when DTensor
  computes that gradient whole (a residual that bypasses the sharded parameters), and so does
  each use of it in the boundary's compute whose share comes back whole
  (:mod:`~hyperrecipe.runtime.forward.input_grads`), unless the plan runs code on local tensors
  inside boundaries, whose re-wrapping reduces a partial gradient early. Every declared input
  and output replicated on the side its gradient arrives at is checked against the plan's
  backward collective (``in_grad`` / ``out_grad`` or the resolver's default), and a declared
  partial output gradient is reduced where production reduces it
  (:mod:`~hyperrecipe.runtime.forward.grad_layouts`). A sharded local tensor
  handed back to the model's code is remembered, and one that the model's code refolded before
  a boundary takes it as sharded is refused (:mod:`~hyperrecipe.runtime.forward.handed_back`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor, is_grad_enabled

from hyperrecipe.errors import PlacementMismatchError, PlanMismatchError
from hyperrecipe.placement import NamedPlacement, Partial, Replicate, Shard, to_torch_placements
from hyperrecipe.plan import ArgLayout, BoundaryPlan, Transition
from hyperrecipe.runtime.comm.collectives import (
    MeshDimGroup,
    bind_transition,
    group_for,
    unchanged_tensor,
)
from hyperrecipe.runtime.forward.backward_scope import naming_backward_ops
from hyperrecipe.runtime.forward.grad_layouts import arriving_grad_check
from hyperrecipe.runtime.forward.handed_back import refuse_refolded_shard, remember_handed_back
from hyperrecipe.runtime.forward.outside_params import mark_handed_back
from hyperrecipe.runtime.forward.input_grads import (
    checking_input_uses,
    note_reduced_input,
    reduce_grad_here,
)
from hyperrecipe.runtime.forward.validate_scope import caller_is_local, validate_compute
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Converter", "ProductionRedistributor", "Redistributor", "ValidateRedistributor",
           "unchanged"]

Converter = Callable[[Any, str], Any]
"""(value, name) → converted value; ``name`` is the declared argument or output."""


def unchanged(value: Any, name: str) -> Any:
    """The converter of a declared tensor whose layout the plan leaves as it is (no
    transition, no bias): a redistributor returns this very function so that the boundary body
    can leave the tensor out of its per-call work."""
    return value

Forward = Callable[..., Any]


class Redistributor(Protocol):
    """Builds, at install time, the converters one boundary's body calls per forward."""

    def input_converter(self, boundary: BoundaryPlan, layout: ArgLayout) -> Converter: ...

    def output_converter(self, boundary: BoundaryPlan, layout: ArgLayout,
                         bias: Tensor | None = None) -> Converter: ...

    def undeclared_converter(self, boundary: BoundaryPlan) -> Converter | None: ...

    def finish_outputs(self, boundary: BoundaryPlan) -> Converter | None: ...

    def wrap_compute(self, boundary: BoundaryPlan, compute: Forward) -> Forward: ...


# ------------------------------------------------------------------------------ production


class ProductionRedistributor:
    """Local tensors and precompiled collectives; nothing is decided per call."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        # One converter per distinct chain of transitions, shared by the boundaries that have
        # it (every layer's attention input), while one of them lives: shared slots are one
        # entry of the boundary body's table, guarded once under torch.compile (boundary.py).
        self._shared: weakref.WeakValueDictionary[tuple[Any, ...], Converter] = (
            weakref.WeakValueDictionary())

    def _chain(self, steps: Sequence[Transition], bias: Tensor | None = None) -> Converter:
        """The transitions of one declared tensor, bound now (op kinds, groups, sizes), so a
        call runs them and nothing else; none and no bias is :func:`unchanged`, which the
        boundary body leaves out of its call path altogether."""
        groups = [group_for(self.mesh, t.mesh_dim) for t in steps]
        if bias is not None:
            return self._bind_chain(steps, groups, bias)
        key = tuple((t.forward, t.backward, g.group, g.size, g.rank)
                    for t, g in zip(steps, groups))
        convert = self._shared.get(key)
        if convert is None:
            convert = self._bind_chain(steps, groups, None)
            if convert is not unchanged:
                self._shared[key] = convert
        return convert

    @staticmethod
    def _bind_chain(steps: Sequence[Transition], groups: Sequence[MeshDimGroup],
                    bias: Tensor | None) -> Converter:
        bound = []
        for t, g in zip(steps, groups):
            fn = bind_transition(t.forward, t.backward, g.group, group_size=g.size,
                                 group_rank=g.rank)
            if fn is not unchanged_tensor:
                bound.append(fn)
        if not bound and bias is None:
            return unchanged
        if len(bound) == 1 and bias is None:
            (only,) = bound

            def convert_one(value: Any, name: str) -> Any:
                return only(value) if isinstance(value, Tensor) else value

            return convert_one

        def convert(value: Any, name: str) -> Any:
            if not isinstance(value, Tensor):
                return value
            for fn in bound:
                value = fn(value)
            return value if bias is None else value + bias

        return convert

    def input_converter(self, boundary: BoundaryPlan, layout: ArgLayout) -> Converter:
        return self._chain([t for t in boundary.transitions
                            if t.stage == "input" and t.name == layout.name])

    def output_converter(self, boundary: BoundaryPlan, layout: ArgLayout,
                         bias: Tensor | None = None) -> Converter:
        return self._chain([t for t in boundary.transitions
                            if t.stage == "output" and t.name == layout.name], bias)

    def undeclared_converter(self, boundary: BoundaryPlan) -> Converter | None:
        return None

    def finish_outputs(self, boundary: BoundaryPlan) -> Converter | None:
        return None

    def wrap_compute(self, boundary: BoundaryPlan, compute: Forward) -> Forward:
        return compute


# ------------------------------------------------------------------------------ validate


def describe_placements(placements: Sequence[Any], mesh_dims: Sequence[str], ndim: int) -> str:
    """Torch placements as our named-placement text, for messages."""
    entries: dict[str, Any] = {}
    for name, p in zip(mesh_dims, placements):
        if p.is_shard():
            entries[name] = Shard(dim=p.dim)
        elif p.is_partial():
            entries[name] = Partial()
    return str(NamedPlacement.of(entries))


def _same(actual: Sequence[Any], expected: NamedPlacement, mesh_dims: Sequence[str],
          ndim: int) -> bool:
    for name, p in zip(mesh_dims, actual):
        q = expected.get(name)
        if isinstance(q, Shard):
            if not p.is_shard() or (p.dim % ndim) != (q.dim % ndim):
                return False
        elif isinstance(q, Partial):
            if not p.is_partial():  # a mask-partial from a vocab-parallel lookup is partial too
                return False
        elif isinstance(q, Replicate) and not p.is_replicate():
            return False
    return True


def _normalized(placements: Sequence[Any], ndim: int) -> tuple[Any, ...]:
    """Torch placements with negative shard dims counted from the front: DTensor's backward
    builds a spec from ``grad_placements`` and refuses ``Shard(-1)``."""
    from torch.distributed.tensor import Shard as TShard

    return tuple(TShard(p.dim % ndim) if p.is_shard() and p.dim < 0 else p for p in placements)


def _handed_back(local: Tensor) -> Tensor:
    """A local tensor handed back to the model's own code, which may modify it in place
    (Falcon's parallel block: ``mlp_output += attention_output``). ``DTensor.to_local`` returns
    its local tensor as-is from a custom autograd Function, and autograd forbids an in-place op on
    such a view ("Output 0 of _ToTorchTensor is a view and is being modified inplace"), so
    validate mode hands back a copy (production's tensors are the collectives' own outputs)."""
    return local.clone() if local.requires_grad else local


class ValidateRedistributor:
    """DTensor end to end; declared output placements are checked against propagated ones."""

    def __init__(self, mesh: DeviceMesh, mesh_dims: Sequence[str], *,
                 check_input_grads: bool = True,
                 sharded_regions: Mapping[str, frozenset[str]] | None = None) -> None:
        self.mesh = mesh
        self.sharded_regions = dict(sharded_regions or {})
        self.mesh_dims = tuple(mesh_dims)
        # Off when the plan runs code on local tensors inside boundaries (marshal adapters, local
        # regions, inner wrappers): re-wrapping their outputs reduces a partial gradient early,
        # so a whole gradient at the entry no longer shows that production reduces one too many.
        self.check_input_grads = check_input_grads
        from torch.distributed.tensor import DTensor, Replicate as TReplicate

        self._dtensor = DTensor
        self._replicated = tuple(TReplicate() for _ in self.mesh_dims)

    def _torch(self, p: NamedPlacement) -> tuple[Any, ...]:
        return to_torch_placements(p, self.mesh_dims)

    def input_converter(self, boundary: BoundaryPlan, layout: ArgLayout) -> Converter:
        DTensor, mesh = self._dtensor, self.mesh
        src, dst = self._torch(layout.src), self._torch(layout.dst)
        same = src == dst
        # dims the redistribution splits: DTensor would split them unevenly, production refuses
        splits = [(q.dim, mesh.size(i), self.mesh_dims[i]) for i, q in enumerate(dst)
                  if q.is_shard() and q != src[i]]

        def check_even(d: Any, name: str) -> None:
            for dim, n, mesh_dim in splits:
                if d.shape[dim] % n:
                    msg = (f"{boundary.fqn}: input {name!r} of shape {tuple(d.shape)} is "
                           f"redistributed to {layout.dst}, but dim {dim} (size "
                           f"{d.shape[dim]}) does not divide evenly into {mesh_dim}={n} shards; "
                           f"production mode refuses it too (its shards are equal)")
                    raise PlanMismatchError(msg)

        reduced_here = self._reduced_input_grads(boundary, layout)
        reduced = reduced_here if self.check_input_grads else ()
        sharded_src = any(p.is_shard() for p in src)
        # the gradient DTensor computes for it against the plan's backward (grad_layouts);
        # declared partial arriving whole is input_grads' check, use by use
        arriving = arriving_grad_check(boundary, layout, "input", self.mesh_dims,
                                       self._sizes(), check_whole=False,
                                       sharded=self.sharded_regions.get(boundary.fqn,
                                                                        frozenset()))

        def convert(value: Any, name: str) -> Any:
            if not isinstance(value, Tensor):
                return value
            d: Any
            if isinstance(value, DTensor):
                if not _same(value.placements, layout.src, self.mesh_dims, value.ndim):
                    actual = describe_placements(value.placements, self.mesh_dims, value.ndim)
                    raise PlacementMismatchError(boundary.fqn, name, str(layout.src), actual,
                                                 stage="input")
                d, fresh = value, False
                if same and reduced_here and d.requires_grad and is_grad_enabled():
                    d = reduce_grad_here(d, src)
            else:
                if sharded_src:
                    refuse_refolded_shard(value, fqn=boundary.fqn, name=name,
                                          declared=str(layout.src))
                d, fresh = DTensor.from_local(value, mesh, src, run_check=False), True
            if not same:
                check_even(d, name)
                d, fresh = d.redistribute(mesh, dst), True
            if reduced and fresh and d.requires_grad and is_grad_enabled():
                # only a tensor this boundary made: its gradient is this boundary's alone;
                # each use of it is checked too (input_grads), before the sum is
                noted = note_reduced_input(name, d, reduced)
                # the set alone: the record holds d's own node, and a hook on d reaching it
                # is a cycle through C++ the collector cannot see (the model never freed)
                summed = noted.summed_inside if noted is not None else None
                d.register_hook(self._grad_check(boundary, name, reduced, summed))
            if arriving is not None and fresh and d.requires_grad and is_grad_enabled():
                d.register_hook(arriving)
            return d

        return convert

    def _reduced_input_grads(self, boundary: BoundaryPlan, layout: ArgLayout
                             ) -> tuple[tuple[int, Transition], ...]:
        """The mesh dims (index, transition) on which production reduces this input's
        gradient because the plan assumes it comes back partial from the boundary's sharded
        parameters (Megatron's *f*: the input is replicated inside, its backward an all-reduce
        or a reduce-scatter)."""
        out = []
        for t in boundary.transitions:
            if (t.stage == "input" and t.name == layout.name and isinstance(t.dst, Replicate)
                    and t.backward.kind in ("all_reduce", "reduce_scatter")
                    and t.mesh_dim in self.mesh_dims):
                out.append((self.mesh_dims.index(t.mesh_dim), t))
        return tuple(out)

    def _grad_check(self, boundary: BoundaryPlan, name: str,
                    reduced: tuple[tuple[int, Transition], ...],
                    summed_inside: set[int] | None) -> Callable[[Any], None]:
        """A gradient hook: the gradient DTensor computed for a declared input must be partial
        wherever production reduces it. Replicated there means every rank already holds the
        whole gradient (the input bypasses the sharded parameters, e.g. a residual added after
        the reduction), and production's reduction would count it once per rank; unless a use
        received a partial gradient that DTensor summed inside its backward (the mesh dims in
        ``summed_inside``, filled by the checks of each use,
        :attr:`~hyperrecipe.runtime.forward.input_grads.ReducedInput.summed_inside`), which
        production's local backward leaves partial."""
        mesh = self.mesh

        def check(grad: Any) -> None:
            placements = getattr(grad, "placements", None)
            if placements is None:
                return
            for i, t in reduced:
                if placements[i].is_replicate() and (summed_inside is None
                                                     or i not in summed_inside):
                    n = mesh.size(i)
                    msg = (f"{boundary.fqn}: the gradient of input {name!r} comes back "
                           f"whole (replicate on {t.mesh_dim}), but production mode "
                           f"{t.backward.kind}s it over {t.mesh_dim}: the plan takes a "
                           f"replicated input of a boundary holding parameters sharded on "
                           f"{t.mesh_dim} to reach them, so that its gradient is partial "
                           f"(Megatron's f). {name!r} does not (a residual added after the "
                           f"reduction), and production would count its gradient {n} times: "
                           f"leave {name!r} out of the boundary's in_src / in_dst")
                    raise PlanMismatchError(msg)

        return check

    def output_converter(self, boundary: BoundaryPlan, layout: ArgLayout,
                         bias: Tensor | None = None) -> Converter:
        DTensor, mesh = self._dtensor, self.mesh
        src, dst = self._torch(layout.src), self._torch(layout.dst)
        outermost = boundary.parent is None
        sharded_dst, mesh_dims = any(p.is_shard() for p in dst), self.mesh_dims
        key = str(layout.position) if layout.position is not None else layout.name
        # a declared partial gradient: what the caller's local code hands back is partial,
        # and DTensor reduces it here, where production does (Megatron's f on an output)
        grad_dst = self._grad_placements(layout)
        reduce_here = grad_dst != dst
        arriving = arriving_grad_check(boundary, layout, "output", mesh_dims, self._sizes(),
                                       check_whole=self.check_input_grads,
                                       sharded=self.sharded_regions.get(boundary.fqn,
                                                                        frozenset()))

        def convert(value: Any, name: str) -> Any:
            if not isinstance(value, Tensor):
                return value
            if not isinstance(value, DTensor):
                if not boundary.local_region:
                    raise PlacementMismatchError(boundary.fqn, name, str(layout.src),
                                                 "a plain torch.Tensor (not a DTensor)")
                value = DTensor.from_local(value, mesh, src, run_check=False)
            if not _same(value.placements, layout.src, self.mesh_dims, value.ndim):
                actual = describe_placements(value.placements, self.mesh_dims, value.ndim)
                raise PlacementMismatchError(boundary.fqn, name, str(layout.src), actual)
            if tuple(value.placements) != dst:
                value = value.redistribute(mesh, dst)
            if bias is not None:
                value = value + bias
            if outermost or caller_is_local():
                local = _handed_back(value.to_local(
                    grad_placements=_normalized(grad_dst, value.ndim)))
                mark_handed_back(local, dst, mesh_dims, fqn=boundary.fqn, key=key)
                if sharded_dst:
                    remember_handed_back(local, dst, mesh_dims, fqn=boundary.fqn, key=key)
                return local
            if value.requires_grad and is_grad_enabled():
                if reduce_here:
                    value = reduce_grad_here(value, dst)
                if arriving is not None:
                    value.register_hook(arriving)
            return value

        return convert

    def _sizes(self) -> tuple[int, ...]:
        return tuple(self.mesh.size(i) for i in range(len(self.mesh_dims)))

    def _grad_placements(self, layout: ArgLayout) -> tuple[Any, ...]:
        """The torch placements of the gradient the caller hands back to an output: its
        ``dst``, partial where ``out_grad`` declares it partial."""
        from torch.distributed.tensor import Partial as TPartial

        dst = self._torch(layout.dst)
        grad = layout.grad
        if grad is None:
            return dst
        return tuple(TPartial() if isinstance(grad.get(d), Partial) and p.is_replicate() else p
                     for d, p in zip(self.mesh_dims, dst))

    def undeclared_converter(self, boundary: BoundaryPlan) -> Converter | None:
        DTensor, mesh, rep = self._dtensor, self.mesh, self._replicated

        def convert(value: Any, name: str) -> Any:
            if isinstance(value, Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, mesh, rep, run_check=False)
            if isinstance(value, tuple):
                return tuple(convert(v, name) for v in value)
            if isinstance(value, list):
                return [convert(v, name) for v in value]
            return value

        return convert

    def wrap_compute(self, boundary: BoundaryPlan, compute: Forward) -> Forward:
        if self.check_input_grads:
            sizes = tuple(self.mesh.size(i) for i in range(len(self.mesh_dims)))
            compute = checking_input_uses(compute, boundary, sizes)
        return validate_compute(naming_backward_ops(compute, boundary.fqn), boundary.fqn)

    def finish_outputs(self, boundary: BoundaryPlan) -> Converter | None:
        """At the outermost boundary, and at one called from local code, undeclared DTensor
        outputs go back to local tensors."""
        DTensor, outermost = self._dtensor, boundary.parent is None

        def convert(value: Any, name: str) -> Any:
            if isinstance(value, DTensor) and (outermost or caller_is_local()):
                if not all(p.is_replicate() for p in value.placements):
                    actual = describe_placements(value.placements, self.mesh_dims, value.ndim)
                    raise PlacementMismatchError(boundary.fqn, name, "replicate (undeclared "
                                                 "outputs leave replicated)", actual)
                local = _handed_back(value.to_local())
                mark_handed_back(local, value.placements, self.mesh_dims, fqn=boundary.fqn,
                                 key=name)
                return local
            return value

        return convert


@answers("redistributor", "production")
def _production_redistributor(mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                              local_code: bool = False,
                              sharded_regions: Mapping[str, frozenset[str]] | None = None
                              ) -> Redistributor:
    return ProductionRedistributor(mesh)


@answers("redistributor", "validate")
def _validate_redistributor(mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                            local_code: bool = False,
                            sharded_regions: Mapping[str, frozenset[str]] | None = None
                            ) -> Redistributor:
    return ValidateRedistributor(mesh, mesh_dims, check_input_grads=not local_code,
                                 sharded_regions=sharded_regions)
