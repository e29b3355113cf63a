"""transformers' compute kernels that validate mode cannot run on DTensors, found before apply.

transformers 5 picks a fused experts kernel from ``config._experts_implementation``; its default,
``grouped_mm``, calls ``aten._grouped_mm``, whose DTensor rule on torch 2.13 accepts bfloat16
only (its meta kernel says "Expected inputs of BF16 type"). Experts that validate mode runs on
DTensors (outside a local region) in another dtype would fail at the first forward, deep inside
transformers; :func:`validate_experts_refusal` names them before anything is applied, with the
two ways out. ``batched_mm`` and ``eager``-in-a-local-region run; ``check`` switches to
``batched_mm`` by itself and says so in a note.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hyperrecipe.plan import Plan

__all__ = ["validate_experts_refusal"]

_GROUPED_MM = "grouped_mm"


def validate_experts_refusal(model: nn.Module, plan: Plan) -> str | None:
    """Why validate mode cannot run ``model``'s experts as built, or ``None``.

    The model's experts implementation is ``grouped_mm`` and an experts module (one with
    transformers' ``_is_expert_parallel`` flag) whose parameters lie in a boundary but in no
    local region holds a 3-D weight that is not bfloat16.
    """
    import torch

    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != _GROUPED_MM:
        return None
    regions = {b.fqn for b in plan.boundaries if b.local_region}
    in_boundary = {p.module: p for p in plan.params if p.boundary is not None}
    for fqn, module in model.named_modules():
        if "_is_expert_parallel" not in vars(module):
            continue
        owner = in_boundary.get(fqn)
        if owner is None or regions.intersection(plan.boundary_chain(owner.boundary)):
            continue
        dtypes = {p.dtype for p in module.parameters(recurse=False) if p.ndim == 3}
        odd = sorted(str(d).removeprefix("torch.") for d in dtypes if d != torch.bfloat16)
        if odd:
            return (f"{fqn}: transformers' default experts kernel (experts_implementation="
                    f"'{_GROUPED_MM}') calls aten._grouped_mm, which DTensor (torch "
                    f"{torch.__version__}) runs in bfloat16 only, and these experts are "
                    f"{', '.join(odd)}. For validate mode build the model with "
                    f"experts_implementation='batched_mm' (or call "
                    f"model.set_experts_implementation('batched_mm')), or make the experts a "
                    f"local region (`local_region: true`); production mode runs it as it is")
    return None
