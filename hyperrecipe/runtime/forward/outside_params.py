"""Validate mode's check of replicated parameters outside every boundary.

A module no boundary encloses runs the model's own code on local tensors in both modes, with
plain replicated parameters. When the value it computes on is a shard a boundary handed back
(the sequence-sharded stream of a sequence-parallel recipe), its parameters' gradients cover
only this rank's tokens: partial. Production reduces them only where the plan says so
(``reduce_grads``); validate mode, whose DTensors end at the boundary, computed the same partial
gradients without a word. Gemma 2's sandwich norms (``pre_feedforward_layernorm``,
``post_feedforward_layernorm``) over ``extends: llama-sp`` are the case: the stream between the
attention and MLP boundaries is sequence-sharded there, and no rule names them.

Which values are shards is data flow, which the plan does not hold, so validate mode reads it
off the autograd graph, where it costs nothing until asked: each local tensor a boundary hands
back is tagged (in its autograd node's ``metadata``: the node is unique to that tensor, and
the tag holds only names, so it keeps nothing alive), and a forward hook on every module that
owns such a parameter walks back from the module's outputs, stopping at tagged nodes, to find
where a value derived from the parameter meets a value derived from a shard. Each node's
summary (which shards and which watched parameters lie upstream) is memoised in its
``metadata``, so one forward's walks together visit each node outside the boundaries once.
Nothing runs when autograd records nothing (no gradient, nothing to get wrong).

Where they meet, a parameter with no ``grad_reduce`` on the shard's mesh dim is refused by
name (:class:`~hyperrecipe.errors.PlanMismatchError`: the module, the op, the boundary that
handed the shard back, and the recipe fields that fix it). A parameter whose plan does reduce
it there (``reduce_grads`` on a module outside every boundary) has its gradient all-reduced by a
hook, as production's buckets do, but only over mesh dims its module was seen to compute on a
shard of; a declared reduction over a dim it never met is refused at backward, since
production would count the whole gradient once per rank. A parameter used only outside its own
module's forward is not seen (the walks start from watched modules' outputs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.runtime.comm.collectives import group_for
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

__all__ = ["mark_handed_back", "watch_params_outside_boundaries"]

_TAG = "hyperrecipe.handed_back"
_SUMMARY = "hyperrecipe.upstream"


@attrs.frozen(kw_only=True)
class _Shard:
    """A shard a boundary handed back: which mesh dim splits which tensor dim, and where."""

    mesh_dim: str
    dim: int
    fqn: str
    key: str

    def describe(self) -> str:
        return (f"the local shard {self.fqn} handed back as output {self.key} (dim {self.dim} "
                f"sharded over {self.mesh_dim})")


_Summary = tuple[frozenset[_Shard], frozenset[str]]
_EMPTY: _Summary = (frozenset(), frozenset())


def mark_handed_back(local: Tensor, placements: Sequence[Any], mesh_dims: Sequence[str], *,
                     fqn: str, key: str) -> None:
    """Tag the autograd node of ``local``, which boundary ``fqn`` hands back to the model's own
    code with DTensor ``placements``: the walks stop there and take its shards (none for a
    replicated value) as what lies upstream."""
    node: Any = local.grad_fn
    if node is None:
        return
    node.metadata[_TAG] = frozenset(
        _Shard(mesh_dim=name, dim=p.dim % max(local.ndim, 1), fqn=fqn, key=key)
        for p, name in zip(placements, mesh_dims) if p.is_shard())


@attrs.define
class _Watched:
    """The parameters validate mode watches, by the id of the live object (rebuilt when a
    trainer replaces one: ``to_empty``, ``load_state_dict(assign=True)``)."""

    entries: tuple[tuple[nn.Module, str, ParamPlan], ...]
    by_fqn: dict[str, ParamPlan] = attrs.field(factory=dict)
    by_id: dict[int, tuple[weakref.ref[nn.Parameter], ParamPlan]] = attrs.field(factory=dict)
    met: dict[str, set[str]] = attrs.field(factory=dict)
    """Per parameter FQN, the mesh dims its compute was seen to meet a shard on (sticky)."""

    def refresh(self) -> None:
        self.by_fqn = {p.fqn: p for _, _, p in self.entries}
        self.by_id = {}
        for module, name, p in self.entries:
            param = module._parameters.get(name)
            if param is not None:
                self.by_id[id(param)] = (weakref.ref(param), p)

    def plan_of(self, value: Any) -> ParamPlan | None:
        hit = self.by_id.get(id(value))
        if hit is None or hit[0]() is not value:
            return None
        return hit[1]

    def current(self, module: nn.Module, names: Sequence[str]) -> bool:
        return all(self.plan_of(module._parameters.get(n)) is not None for n in names)


def _watched_entries(model: nn.Module, plan: Plan) -> tuple[tuple[nn.Module, str, ParamPlan], ...]:
    """Replicated parameters no boundary encloses (tied names repeat their owner's plan)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    owners = {p.fqn: p for p in plan.params}
    out = []
    for p in plan.params:
        if p.boundary is not None or not p.placement.is_replicate or p.module not in modules:
            continue
        owner = owners.get(p.tied_to or p.fqn, p)
        if owner.boundary is not None:
            continue
        out.append((modules[p.module], p.name, owner))
    return tuple(out)


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _op(node: Any) -> str:
    name = type(node).__name__
    return name.removesuffix("Backward0").removesuffix("Backward1").lower() or name


def _walk(root: Any, watched: _Watched, on_meet: Callable[[Any, ParamPlan, frozenset[_Shard]],
                                                          None]) -> None:
    """Post-order over the graph upstream of ``root``, memoising each node's summary and calling
    ``on_meet`` where a watched parameter's value and a shard meet (see the module docstring)."""
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        meta = node.metadata
        if _SUMMARY in meta:
            continue
        if _TAG in meta:
            meta[_SUMMARY] = (meta[_TAG], frozenset())
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children
                         if not hasattr(c, "variable") and _SUMMARY not in c.metadata)
            continue
        parts: list[_Summary] = []
        for c in children:
            if hasattr(c, "variable"):  # AccumulateGrad: a leaf
                p = watched.plan_of(c.variable)
                parts.append((frozenset(), frozenset((p.fqn,))) if p is not None else _EMPTY)
            else:
                parts.append(c.metadata.get(_SUMMARY, _EMPTY))
        shards = frozenset().union(*(s for s, _ in parts))
        params = frozenset().union(*(q for _, q in parts))
        if shards and params:
            for i, (_, q) in enumerate(parts):
                others = frozenset().union(*(s for j, (s, _) in enumerate(parts) if j != i))
                for fqn in q if others else ():
                    on_meet(node, watched.by_fqn[fqn], others)
        meta[_SUMMARY] = (shards, params)


def _refuse_partial(module_fqn: str, node: Any, p: ParamPlan, shards: frozenset[_Shard],
                    unreduced: Sequence[str]) -> None:
    """Raises: PlanMismatchError naming the module, the op, the shard and the fixes."""
    shard = sorted((s for s in shards if s.mesh_dim in unreduced),
                   key=lambda s: (s.mesh_dim, s.fqn, s.key))[0]
    dims = ", ".join(unreduced)
    fields = ", ".join(f"{p.name}: {d}" for d in unreduced)
    last = p.provenance[-1] if p.provenance else None
    where = ((f" (no rule claims it: the recipe's `unclaimed: replicate` places it, "
              f"{last.file}:{last.line})" if last.rule_index < 0
              else f" (placed at {last.file}:{last.line})") if last is not None else "")
    msg = (f"{module_fqn}: replicated parameter {p.fqn} lies outside every boundary and computes "
           f"on values sharded over {dims}: {_op(node)} combines it with {shard.describe()}, so "
           f"its gradient comes back partial (this rank's part of the data only), and production "
           f"mode leaves each rank's partial gradient unreduced{where}. Declare {p.module} on "
           f"the sharded stream: `style: sequence_parallel` on a rule matching it (for a norm: "
           f"a boundary that takes and returns the stream sharded and reduces its gradient), "
           f"or `reduce_grads: {{{fields}}}` there")
    raise PlanMismatchError(msg)


def _check_module(watched: _Watched, names: tuple[str, ...], mesh: DeviceMesh
                  ) -> Callable[[nn.Module, Any, Any], None]:
    sizes = {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names or ())}

    def on_meet(node: Any, p: ParamPlan, shards: frozenset[_Shard]) -> None:
        reduced = {op.mesh_dim for op in p.grad_reduce}
        dims = sorted({s.mesh_dim for s in shards if sizes.get(s.mesh_dim, 1) > 1})
        unreduced = [d for d in dims if d not in reduced]
        if unreduced:
            _refuse_partial(p.module, node, p, shards, unreduced)
        watched.met.setdefault(p.fqn, set()).update(dims)

    def check(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if not watched.current(module, names):
            watched.refresh()
        for t in _tensors(output):
            if t.grad_fn is not None:
                _walk(t.grad_fn, watched, on_meet)

    return check


def _reduce_declared(watched: _Watched, p: ParamPlan, mesh: DeviceMesh
                     ) -> Callable[[Tensor], Tensor]:
    """A gradient hook doing production's ``grad_reduce`` of a plain parameter over the mesh dims
    its compute met a shard on; a declared dim it never met is refused."""

    def reduce(grad: Tensor) -> Tensor:
        met = watched.met.get(p.fqn, set())
        for op in p.grad_reduce:
            if op.mesh_dim not in met:
                g = group_for(mesh, op.mesh_dim)
                msg = (f"{p.fqn}: the plan all-reduces this replicated parameter's gradient over "
                       f"{op.mesh_dim} (reduce_grads), but {p.module} lies outside every "
                       f"boundary and computed on no value sharded over {op.mesh_dim}: its "
                       f"gradient is whole on every rank, and production mode would count it "
                       f"{g.size} times. Drop `reduce_grads: {{{p.name}: {op.mesh_dim}}}` from "
                       f"{p.module}'s rule")
                raise PlanMismatchError(msg)
            grad = grad.clone()
            dist.all_reduce(grad, group=group_for(mesh, op.mesh_dim).group)
        return grad

    return reduce


def watch_params_outside_boundaries(model: nn.Module, plan: Plan, mesh: DeviceMesh
                                    ) -> list[RemovableHandle]:
    """Validate mode's hooks for the plan's replicated parameters outside every boundary (see
    the module docstring); none when the plan has no such parameter."""
    entries = _watched_entries(model, plan)
    if not entries:
        return []
    watched = _Watched(entries=entries)
    watched.refresh()
    by_module: dict[int, tuple[nn.Module, list[str]]] = {}
    for module, name, _ in entries:
        by_module.setdefault(id(module), (module, []))[1].append(name)
    handles: list[RemovableHandle] = [
        module.register_forward_hook(_check_module(watched, tuple(names), mesh))
        for module, names in by_module.values()]
    reducing: set[int] = set()
    for module, name, p in entries:
        param = module._parameters.get(name)
        if p.grad_reduce and param is not None and param.requires_grad \
                and id(param) not in reducing:
            reducing.add(id(param))
            handles.append(param.register_hook(_reduce_declared(watched, p, mesh)))  # type: ignore[no-untyped-call]
    return handles


@answers("watch_outside_boundaries", "production")
def _no_watch(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> list[RemovableHandle]:
    return []  # no per-call checks on the hot path


# validate: the data flow the plan does not hold, read off the autograd graph
answers("watch_outside_boundaries", "validate")(watch_params_outside_boundaries)
