"""Validate mode's check of a declared replicated input's gradient, use by use.

Production mode reduces the gradient of a replicated input that a boundary hands to parameters
sharded on a mesh dim (Megatron's *f*: all-reduce, or reduce-scatter): it assumes that every
rank holds a partial sum. That holds for each use of the input that reaches the sharded
parameters, and not for a use that bypasses them: a residual added after the row-wise
reduction holds the whole gradient on every rank, and production counts it once per rank.

Checking the input's accumulated gradient finds only the case where every use bypasses them
(BLOOM's MLP with its ``residual`` declared). Where one input feeds both (BERT's
``BertAttention`` hands ``hidden_states`` to query/key/value and, as the residual, to
``output``), DTensor adds the whole part to the partial parts correctly and the sum comes back
partial: validate mode agreed while production diverged. So the check is made on each use:
after the boundary's compute, the autograd graph it built is walked from its outputs back to
the inputs this boundary made (nodes older than those inputs are never visited, so the walk is
the boundary's own graph), and each node that consumes such an input gets a hook that looks at
the gradient it hands back to it. One that comes back whole (``Replicate``) on a mesh dim where
production reduces, from a gradient that did not arrive partial there, raises :class:`~hyperrecipe.errors.PlanMismatchError` naming the boundary,
the input, the op of that use, and the recipe line that declared the boundary.

Inputs are noted by the boundary's input converter (:func:`note_reduced_input`) and taken by
its compute (:func:`checking_input_uses`) in the same call; a nested boundary's compute takes
its own, since the outer compute took the outer's before running.

A use whose gradient arrived partial and that DTensor summed inside its backward (a norm
before the projections, as vit-pytorch and x-transformers put it inside their attention and
feed-forward blocks) is no bypass: production's local backward keeps it a partial sum, which
the input's reduction completes. The norm's own parameters then get partial gradients in
production, which validate mode's early sum hides: each must be reduced by the plan
(``reduce_grads``), or the plan is refused naming it (:func:`_summed_inside`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import BoundaryPlan, Transition
from hyperrecipe.runtime.forward.marshal import grad_roots

__all__ = ["ReducedInput", "checking_input_uses", "note_reduced_input", "reduce_grad_here"]

Forward = Callable[..., Any]


@attrs.frozen(kw_only=True)
class ReducedInput:
    """A declared input this boundary made, whose gradient production reduces on ``reduced``
    (mesh-dim index, transition) pairs."""

    name: str
    node: Any  # the autograd node that made it (from_local or redistribute)
    reduced: tuple[tuple[int, Transition], ...]
    summed_inside: set[int] = attrs.field(factory=set)
    """Mesh dims on which a use's whole gradient is DTensor's doing, not a bypass: a partial
    gradient it summed inside the use's backward (:func:`_summed_inside`), or a product with a
    sharded parameter it gathered (:func:`_sharded_operands`). The input's whole gradient
    there is no finding either."""


_PENDING: contextvars.ContextVar[list[ReducedInput] | None] = contextvars.ContextVar(
    "hyperrecipe_reduced_inputs", default=None)


def note_reduced_input(name: str, value: Tensor,
                       reduced: tuple[tuple[int, Transition], ...]) -> ReducedInput | None:
    """Remember ``value`` (a DTensor the input converter just made) for the compute that
    runs next in this call; the record its uses' checks fill in."""
    node = value.grad_fn
    if node is None:
        return None
    pending = _PENDING.get()
    if pending is None:
        pending = []
        _PENDING.set(pending)
    noted = ReducedInput(name=name, node=node, reduced=reduced)
    pending.append(noted)
    return noted


def _declared_at(boundary: BoundaryPlan, name: str) -> str:
    """Where the recipe declared input ``name`` of ``boundary`` (the rule that set its
    ``in_src`` / ``in_dst`` last), else where it made the boundary."""
    marks = (f"in_src[{name}]", f"in_dst[{name}]")
    found = [p for p in boundary.provenance
             if any(m in p.reason for m in marks) and "overridden" not in p.reason]
    found = found or [p for p in boundary.provenance if "boundary" in p.reason]
    if not found:
        return ""
    p = found[-1]
    return f" ({name!r} is declared at {p.file}:{p.line}:{p.column})"


@attrs.frozen(kw_only=True)
class _Use:
    """One use of a noted input: the autograd node consuming it at edge ``index``, and the
    mesh dims of the sharded parameters that use multiplies it by (:func:`_sharded_operands`)."""

    node: Any
    index: int
    noted: ReducedInput
    through: frozenset[int]


def _consumers(outputs: Any, inputs: list[ReducedInput]) -> list[_Use]:
    """Each edge of the graph built since the inputs were made that leads straight to one of
    them, as a :class:`_Use`."""
    by_node = {id(i.node): i for i in inputs}
    oldest = min(i.node._sequence_nr() for i in inputs)
    roots = grad_roots(outputs)
    seen: set[int] = set()
    parents: dict[int, list[Any]] = {}
    found: list[tuple[Any, int, ReducedInput]] = []
    stack = [n for n in roots if id(n) not in by_node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for index, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            hit = by_node.get(id(nxt))
            if hit is not None:
                found.append((node, index, hit))
            elif nxt._sequence_nr() > oldest:
                parents.setdefault(id(nxt), []).append(node)
                if id(nxt) not in seen:
                    stack.append(nxt)
    return [_Use(node=node, index=index, noted=hit,
                 through=_sharded_operands(node, index, parents))
            for node, index, hit in found]


_RESHAPES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0",
    "TransposeBackward0", "PermuteBackward0", "ExpandBackward0", "ToCopyBackward0",
    "CloneBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "UnsqueezeBackward0", "AliasBackward0"})
"""Autograd nodes that move a value's elements without combining them (a view, a transpose, a
cast): looked through, on either side of a product."""

_PRODUCTS = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0",
                       "MatmulBackward0", "LinearBackward0"})
"""Autograd nodes of a matrix product: a use that multiplies the input by a sharded weight."""


def _sharded_operands(node: Any, index: int, parents: dict[int, list[Any]]) -> frozenset[int]:
    """The mesh dims on which the use of an input at ``node``'s edge ``index`` multiplies it,
    after views and transposes only, by a parameter sharded there (through views and casts).

    Such a use reaches the sharded parameters, whatever DTensor does with them: where its
    sharding rules have no strategy for the weight's layout (a fused projection stored in
    ``chunks``, a ``_StridedShard``), it gathers the weight and computes the product whole,
    so the input's gradient comes back whole although every rank in production computes a
    partial sum with its shard, which the plan's reduction completes. A residual's use adds
    the input to something and is never a product with a parameter: still a finding."""
    came_from, current = index, node
    while current.name() in _RESHAPES:
        above = parents.get(id(current), [])
        if len(above) != 1:
            return frozenset()
        parent = above[0]
        edges = [i for i, (n, _) in enumerate(parent.next_functions) if n is current]
        if len(edges) != 1:
            return frozenset()
        came_from, current = edges[0], parent
    if current.name() not in _PRODUCTS:
        return frozenset()
    dims: set[int] = set()
    for i, (operand, _) in enumerate(current.next_functions):
        while operand is not None and i != came_from and operand.name() in _RESHAPES:
            inner = [n for n, _ in operand.next_functions if n is not None]
            operand = inner[0] if len(inner) == 1 else None
        placements = getattr(getattr(operand, "variable", None), "placements", None)
        if i == came_from or placements is None:
            continue
        # a _StridedShard (a chunked weight) is neither a Shard nor replicated nor partial
        dims.update(d for d, p in enumerate(placements)
                    if not (p.is_replicate() or p.is_partial()))
    return frozenset(dims)


def _use_check(boundary: BoundaryPlan, mesh_sizes: tuple[int, ...], use: _Use
               ) -> Callable[[Any, Any], None]:
    # the node's name, not the node: a hook that refers to the node it is registered on is a
    # cycle through C++ that Python's collector cannot see, which kept every graph's nodes (and
    # through their AccumulateGrad, the parameters) alive after the model was dropped
    user, index, noted, through = use.node.name(), use.index, use.noted, use.through
    params = _params_of(use.node, index)

    def check(grad_inputs: Any, grad_outputs: Any) -> None:
        grad = grad_inputs[index] if index < len(grad_inputs) else None
        placements = getattr(grad, "placements", None)
        if placements is None:
            return
        for i, t in noted.reduced:
            if placements[i].is_replicate() and (
                    i in through or _summed_inside(grad_outputs, i, params, user)):
                noted.summed_inside.add(i)
            elif placements[i].is_replicate():
                name, n = noted.name, mesh_sizes[i]
                msg = (f"{boundary.fqn}: input {name!r} is used by {user} whose share of "
                       f"its gradient comes back whole (replicate on {t.mesh_dim}), but "
                       f"production mode {t.backward.kind}s the gradient of {name!r} over "
                       f"{t.mesh_dim}, assuming every use reaches parameters sharded on "
                       f"{t.mesh_dim} (Megatron's f). This use bypasses them (a residual added "
                       f"after the reduction), so production would count its share {n} times"
                       f"{_declared_at(boundary, name)}. Put the boundary on the submodule(s) that "
                       f"alone consume {name!r} through the sharded parameters (the attention's "
                       f"projections, not the block that also adds the residual), or leave "
                       f"{name!r} out of the boundary's in_src / in_dst")
                raise PlanMismatchError(msg)

    return check


def _params_of(node: Any, index: int) -> list[Any] | None:
    """The parameters whose gradients ``node`` computes itself, besides the input's at edge
    ``index`` (its ``AccumulateGrad`` edges, a cast between allowed); ``None`` where another
    edge leads elsewhere: what DTensor's early sum hides there is not known. Held strongly,
    as the graph's own ``AccumulateGrad`` nodes hold them, and dropped with the graph (a weak
    reference would make ``torch.utils.swap_tensors`` refuse a later module move)."""
    found: list[Any] = []
    for j, (nxt, _) in enumerate(node.next_functions):
        if j == index or nxt is None:
            continue
        if nxt.name() == "ToCopyBackward0":
            inner = [n for n, _ in nxt.next_functions if n is not None]
            nxt = inner[0] if len(inner) == 1 else nxt
        if not hasattr(nxt, "variable"):  # only AccumulateGrad holds its leaf
            return None
        found.append(nxt.variable)
    return found


def _summed_inside(grad_outputs: Any, mesh_dim: int, params: list[Any] | None,
                   user: str) -> bool:
    """Whether the use's whole gradient comes from DTensor summing, inside its backward, a
    gradient that arrived partial on ``mesh_dim`` (a norm before a column-wise projection:
    ``native_layer_norm_backward`` takes its gradient whole): the use lies on the path
    through the sharded parameters. A backward is linear in the gradient it is given, so
    production's local backward of this rank's share, summed where production reduces the
    input's gradient, is the same sum: no finding about the input. The op's own parameters
    get that partial share too in production: each must be reduced by the plan, else it is
    refused by name (:func:`~hyperrecipe.runtime.comm.dtensor_parameters.unreduced_after_early_sum`).
    A residual's use receives the whole gradient, never a partial one."""
    from hyperrecipe.runtime.comm.dtensor_parameters import unreduced_after_early_sum

    placed = [getattr(g, "placements", None) for g in grad_outputs if g is not None]
    if (params is None or not placed
            or not all(p is not None and p[mesh_dim].is_partial() for p in placed)):
        return False
    for param in params:
        try:
            finding = unreduced_after_early_sum(param, mesh_dim, user)
        except KeyError:
            return False  # not a parameter the plan placed: judged as before
        if finding is not None:
            raise PlanMismatchError(finding)
    return True


def checking_input_uses(compute: Forward, boundary: BoundaryPlan,
                        mesh_sizes: tuple[int, ...]) -> Forward:
    """``compute`` that, when the input converter noted inputs in this call, hooks each of
    their uses in the graph it built (see the module docstring)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        noted = _PENDING.get()
        if not noted:
            return compute(*args, **kwargs)
        inputs = list(noted)
        noted.clear()
        token = _PENDING.set(None)  # a nested boundary notes and takes its own
        try:
            out = compute(*args, **kwargs)
        finally:
            _PENDING.reset(token)
        for use in _consumers(out, inputs):
            use.node.register_hook(_use_check(boundary, mesh_sizes, use))
        return out

    return run


class _ReduceGradHere(torch.autograd.Function):
    """Identity forward; backward redistributes the gradient to the input's placements."""

    @staticmethod
    def forward(ctx: Any, x: Any, placements: Any) -> Any:
        ctx.placements = placements
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        placements = getattr(grad, "placements", None)
        if placements is not None and tuple(placements) != tuple(ctx.placements):
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        return grad, None


def reduce_grad_here(value: Any, placements: Any) -> Any:
    """``value`` (a DTensor a nested boundary takes as it is, replicated where production
    reduces its gradient: Megatron's *f*) whose gradient is reduced to ``placements`` when it
    leaves the boundary, as production reduces it there. DTensor alone would keep the gradient
    partial and reduce it later, at whatever needs it whole: a replicated parameter of the
    enclosing boundary that computes on it (a norm before a nested attention) would then get a
    partial gradient that production never gives it, and the check of partial parameter
    gradients (:mod:`~hyperrecipe.runtime.comm.dtensor_parameters`) would blame the recipe. The
    values are the same either way: only where the sum happens moves."""
    return _ReduceGradHere.apply(value, tuple(placements))  # type: ignore[no-untyped-call]
