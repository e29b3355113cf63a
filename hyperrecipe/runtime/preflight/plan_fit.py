"""Does a plan's every reference land on the model it is applied to? Checked before apply.

A plan's checksum and fingerprint are integrity checks, not signatures (docs/security.md):
anyone can edit a plan, recompute both and keep the model digest, so the digest matching the
model says nothing about the rest of the file. ``apply`` reads module and parameter names,
shapes and placements from the plan and indexes the live model with them; one that does not
exist there would surface as a ``KeyError`` or a torch error half-way through installing.
:func:`check_plan_fits` walks the plan once, before anything is installed, and names the first
field that does not fit, as a :class:`PlanMismatchError`. It costs one pass over the plan and
the model tree; a plan written by ``compile`` for this model always passes.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from hyperrecipe.errors import PlacementError, PlanMismatchError
from hyperrecipe.model_tree import ModelTree
from hyperrecipe.placement import NamedPlacement, Shard, parse_dtensor
from hyperrecipe.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_mesh_fits", "check_model_fits", "check_plan_fits"]


def check_mesh_fits(plan: Plan, mesh: DeviceMesh) -> None:
    """The mesh has the plan's dim names and sizes.

    Raises:
        PlanMismatchError: unnamed dims, or names or sizes other than the plan's.
    """
    names = tuple(mesh.mesh_dim_names or ())
    want = plan.mesh_shape
    if not names:
        exp = ",".join(f"{k}={v}" for k, v in want.items())
        dims = ", ".join(repr(k) for k in want)
        msg = (f"plan {plan.recipe!r} was compiled for mesh {exp}, but the DeviceMesh has no dim "
               f"names; build it with mesh_dim_names=({dims},)")
        raise PlanMismatchError(msg)
    have = {n: mesh.size(i) for i, n in enumerate(names)}
    if have != want:
        got = ",".join(f"{k}={v}" for k, v in have.items()) or "(unnamed)"
        exp = ",".join(f"{k}={v}" for k, v in want.items())
        msg = (f"plan {plan.recipe!r} was compiled for mesh {exp}, but the DeviceMesh is {got}; "
               f"recompile with --mesh {got} or build the mesh the plan names")
        raise PlanMismatchError(msg)


def check_model_fits(plan: Plan, tree: ModelTree) -> None:
    """The plan was compiled for this model: its structure digest matches (then every reference
    of the plan is checked, :func:`check_plan_fits`), or the first parameter that differs is
    named.

    Raises:
        PlanMismatchError: a parameter missing, extra or of another shape or dtype, or the
            module structure (names or classes) differing; recompile the recipe.
    """
    if tree.digest() == plan.model_digest:
        check_plan_fits(plan, tree)  # the digest can be copied into an edited plan
        return
    want = {p.fqn: (p.shape, p.dtype) for p in plan.params}
    have = {p.fqn: (p.shape, p.dtype) for p in tree.params()}
    for fqn in list(want) + [f for f in have if f not in want]:
        if want.get(fqn) != have.get(fqn):
            w, h = want.get(fqn), have.get(fqn)
            detail = (f"the plan has {list(w[0])} {w[1]}" if w else "the plan has no such "
                      "parameter") + ", the model " + (f"{list(h[0])} {h[1]}" if h else "has none")
            msg = (f"plan {plan.recipe!r} does not fit this model: parameter {fqn!r}: {detail}; "
                   f"recompile the recipe against this model")
            raise PlanMismatchError(msg)
    msg = (f"plan {plan.recipe!r} does not fit this model: its module structure (names or "
           f"classes) differs; recompile the recipe against this model")
    raise PlanMismatchError(msg)



def check_plan_fits(plan: Plan, tree: ModelTree) -> None:
    """Check the plan's references against the model's structure.

    Raises:
        PlanMismatchError: a module, parameter, boundary or bucket the plan names that the model
            (or the plan itself) lacks, a shape that differs, or a placement on a tensor dim the
            parameter does not have; the message names the plan field.
    """
    modules = {m.fqn for m in tree.modules}
    shapes = {p.fqn: p.shape for p in tree.params()}
    sizes = plan.mesh_shape
    boundaries = {b.fqn for b in plan.boundaries}
    params = {p.fqn for p in plan.params}

    def fail(where: str, problem: str) -> PlanMismatchError:
        msg = (f"plan {plan.recipe!r} does not fit this model: {where}: {problem}; the plan was "
               f"edited or compiled for another model: recompile the recipe against this model")
        return PlanMismatchError(msg)

    for what, names in (("params", [p.fqn for p in plan.params]),
                        ("boundaries", [b.fqn for b in plan.boundaries])):
        twice = [n for n, count in Counter(names).items() if count > 1]
        if twice:  # a second entry would shard a shard
            raise fail(what, f"{twice[0]!r} is listed twice")
    for i, b in enumerate(plan.boundaries):
        if b.fqn not in modules:
            raise fail(f"boundaries[{i}]", f"{b.fqn!r} is not a module of the model")
        if b.parent is not None and b.parent not in boundaries:
            raise fail(f"boundaries[{i}] ({b.fqn!r})",
                       f"parent {b.parent!r} is not a boundary of the plan")
    for i, p in enumerate(plan.params):
        where = f"params[{i}] ({p.fqn!r})"
        if p.module not in modules:
            raise fail(where, f"module {p.module!r} is not a module of the model")
        if p.fqn != (f"{p.module}.{p.name}" if p.module else p.name):
            raise fail(where, f"module {p.module!r} and name {p.name!r} do not make this FQN")
        if shapes.get(p.fqn) != p.shape:
            have = shapes.get(p.fqn)
            raise fail(where, f"the plan has shape {list(p.shape)}, the model "
                              f"{list(have) if have is not None else 'no such parameter'}")
        if p.tied_to is not None and p.tied_to not in params:
            raise fail(where, f"tied_to {p.tied_to!r} is not a parameter of the plan")
        if p.boundary is not None and p.boundary not in boundaries:
            raise fail(where, f"boundary {p.boundary!r} is not a boundary of the plan")
        _check_placement(p.shape, p.placement, p.local_shape, sizes,
                         functools.partial(fail, where))
        ndim = len(p.shape)
        try:
            layout = parse_dtensor(p.dtensor)
        except PlacementError as exc:
            raise fail(where, str(exc)) from None
        for text, entry in zip(p.dtensor, layout.entries):
            if entry.kind != "replicate" and not -ndim <= entry.dim < ndim:
                raise fail(where, f"dtensor placement {text!r} is on a dim a {ndim}-d "
                                  f"parameter does not have")
    for i, h in enumerate(plan.head_counts):
        if h.module not in modules:
            raise fail(f"head_counts[{i}]", f"{h.module!r} is not a module of the model")
    for i, bucket in enumerate(plan.grad_buckets):
        for name in bucket.params:
            if name not in params:
                raise fail(f"grad_buckets[{i}]", f"{name!r} is not a parameter of the plan")
    loss = plan.loss_parallel
    if loss is not None and loss.boundary not in boundaries:
        raise fail("loss_parallel", f"boundary {loss.boundary!r} is not a boundary of the plan")


def _check_placement(shape: tuple[int, ...], placement: NamedPlacement,
                     local_shape: tuple[int, ...], sizes: dict[str, int],
                     fail: Callable[[str], PlanMismatchError]) -> None:
    """Each shard is on a dim the parameter has, and ``local_shape`` is what it implies."""
    local = list(shape)
    for mesh_dim, q in placement.dims:
        if mesh_dim not in sizes:
            continue  # a recipe dim the mesh does not give: size 1
        if isinstance(q, Shard):
            if not -len(shape) <= q.dim < len(shape):
                raise fail(f"placement {mesh_dim}: {q} is on a dim a {len(shape)}-d parameter "
                           f"does not have")
            d = q.dim % len(shape)
            local[d] //= sizes[mesh_dim]
    if tuple(local) != tuple(local_shape):
        raise fail(f"local_shape {list(local_shape)} is not {list(local)}, what its placement "
                   f"gives on this mesh")
