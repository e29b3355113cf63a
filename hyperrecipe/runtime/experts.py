"""Expert parallelism: the local kernel that runs this rank's share of a fused experts module.

A fused experts module (transformers 5 ``MixtralExperts``: ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, ``forward(hidden_states, top_k_index, top_k_weights)``) is expert
parallel when a local-region boundary shards its 3-D expert tensors on dim 0 over one mesh dim
``X``: rank ``r`` of ``X`` holds experts ``[r * E_local, (r + 1) * E_local)``.

The kernel (:func:`expert_parallel_forward`) maps the router's global expert ids to this rank's
local range and every other id to the sentinel ``E_local``, zeroes the routing weights of those
slots, and runs the module's own class forward. transformers' experts implementations all skip
the sentinel: ``eager`` one-hots with ``num_classes=num_experts + 1`` and skips index
``num_experts``; ``batched_mm`` and ``grouped_mm`` mask ids ``>= num_experts`` when the module's
``_is_expert_parallel`` flag is set (without it ``grouped_mm`` would leave the sentinel rows
uninitialised and ``batched_mm`` would index out of range). Each rank's output is then the sum
over its own experts only: partial over ``X``, reduced by the boundary.

The module must see the *local* expert count in both modes (in validate mode head counts stay
global, but the region computes on local tensors): :func:`expert_parallel_attributes` names the
attributes ``apply`` sets for as long as the plan is applied (``num_experts``, and
``_is_expert_parallel`` where the module has it), through the rewriter, restored with everything
else. Nothing is changed per call.

Everything is decided once at install time from plan data (:func:`expert_parallel_dim`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.placement import Partial, Shard
from hyperrecipe.plan import BoundaryPlan, Plan

__all__ = ["expert_parallel_attributes", "expert_parallel_dim", "expert_parallel_forward",
           "expert_parallel_kernel"]

Forward = Callable[..., Any]


def expert_parallel_dim(boundary: BoundaryPlan, plan: Plan) -> str | None:
    """The mesh dim an expert-parallel kernel runs on for this boundary, or ``None``.

    A local-region boundary whose module's own 3-D parameters are sharded on dim 0 (the expert
    axis, plain ``shard(0)``) over one mesh dim.

    Raises:
        PlanMismatchError: some 3-D parameters are expert-sharded and others are not, or on
            different mesh dims (rank r would pair expert e of one tensor with another expert
            of the next).
    """
    if not boundary.local_region:
        return None
    experts = [p for p in plan.params if p.module == boundary.fqn and len(p.shape) == 3]
    on: dict[str, set[str]] = {}
    for p in experts:
        on[p.name] = {d for d, q in p.placement.dims if isinstance(q, Shard)
                      and not q.is_chunked and q.dim in (0, -3)}
    dims = set().union(*on.values()) if on else set()
    if not dims:
        return None
    if len(dims) > 1 or any(s != dims for s in on.values()):
        layout = ", ".join(f"{p.name}: {p.placement}" for p in experts)
        msg = (f"{boundary.fqn}: an expert-parallel region shards every 3-D expert tensor on "
               f"dim 0 over one mesh dim; found {layout}")
        raise PlanMismatchError(msg)
    return dims.pop()


def expert_parallel_kernel(boundary: BoundaryPlan, ep_dim: str) -> Literal["partial", "dispatch"]:
    """Which kernel the region's declared layouts on ``ep_dim`` call for.

    ``"partial"``: every declared input is whole on ``ep_dim`` (replicated tokens); each rank
    runs its experts on every token and the output is partial (``out_src {ep: partial}``).
    ``"dispatch"``: every declared input is sharded on dim 0 (each rank holds its own tokens);
    tokens travel to their experts' ranks and back (:mod:`~hyperrecipe.runtime.token_dispatch`)
    and the output is this rank's tokens, complete (``out_src {ep: shard(0)}``).

    Raises:
        PlanMismatchError: inputs disagree, or the first output's declared layout is not the
            one the kernel produces (the region would hand back values the plan misdescribes).
    """
    sharded = {a.name: isinstance(a.dst.get(ep_dim), Shard) for a in boundary.inputs}
    if not sharded:
        kind: Literal["partial", "dispatch"] = "partial"
    elif all(sharded.values()) and all(a.dst.get(ep_dim) == Shard(dim=0) for a in boundary.inputs):
        kind = "dispatch"
    elif not any(sharded.values()):
        kind = "partial"
    else:
        layout = ", ".join(f"{a.name}: {a.dst}" for a in boundary.inputs)
        msg = (f"{boundary.fqn}: an expert-parallel region takes its inputs either whole on "
               f"{ep_dim} (each rank runs its experts on every token) or all sharded on dim 0 "
               f"(tokens dispatched to their experts' ranks); found {layout}")
        raise PlanMismatchError(msg)
    out = boundary.outputs[0].src.get(ep_dim) if boundary.outputs else None
    want = Partial() if kind == "partial" else Shard(dim=0)
    if out != want:
        msg = (f"{boundary.fqn}: with inputs {'sharded' if kind == 'dispatch' else 'whole'} on "
               f"{ep_dim} the expert-parallel region produces {{{ep_dim}: {want}}} outputs; the "
               f"plan declares out_src {{{ep_dim}: {out}}}")
        raise PlanMismatchError(msg)
    return kind


def expert_parallel_attributes(module: nn.Module, num_local: int, *, fqn: str
                               ) -> dict[str, object]:
    """Attributes to set while the plan is applied, so the class forward sees local experts.

    Raises:
        PlanMismatchError: the module has no integer ``num_experts``.
    """
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int):
        msg = (f"{fqn}: an expert-parallel region needs the experts module's integer "
               f"'num_experts' attribute; {type(module).__name__} has none")
        raise PlanMismatchError(msg)
    out: dict[str, object] = {}
    if count != num_local:
        out["num_experts"] = num_local
    if hasattr(module, "_is_expert_parallel"):
        out["_is_expert_parallel"] = True
    return out


def expert_parallel_forward(inner: Forward, *, first: int, count: int) -> Forward:
    """``inner`` (the experts' class forward) on this rank's experts ``[first, first + count)``.

    Global ids outside the range become the sentinel ``count`` and their routing weights 0, so
    they add nothing to the output and get no gradient; ids inside are shifted by ``first``.
    """

    def experts_forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                        *args: Any, **kwargs: Any) -> Any:
        local = top_k_index - first
        foreign = (local < 0) | (local >= count)
        local = local.masked_fill(foreign, count)
        weights = top_k_weights.masked_fill(foreign, 0.0)
        return inner(hidden_states, local, weights, *args, **kwargs)

    return experts_forward
