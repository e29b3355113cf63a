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

Nothing is decided here: the resolver records the mesh dim, the kernel (``partial`` or
``dispatch``) and the expert counts in the plan (``BoundaryPlan.expert_parallel``), refusing a
layout no kernel fits at compile time with its recipe line; ``apply`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.models import LIBRARY

__all__ = ["expert_parallel_attributes", "expert_parallel_forward"]

Forward = Callable[..., Any]


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
    out.update(LIBRARY.expert_kernel_flags(module))
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
