"""Stage 5: the expected-collectives manifest: every collective one training step issues in
production mode, boundary transitions in model order then parameter gradients."""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.plan import BoundaryPlan, Direction, ManifestEntry, ParamPlan
from hyperrecipe.resolve.context import ResolveInput

__all__ = ["list_collectives"]


def list_collectives(inp: ResolveInput, boundaries: Sequence[BoundaryPlan],
                     params: Sequence[ParamPlan]) -> tuple[ManifestEntry, ...]:
    """The manifest: each communicating forward and backward op of every transition, then each
    parameter's gradient reductions (attributed to its enclosing boundary, ``""`` for none)."""
    out: list[ManifestEntry] = []
    for b in sorted(boundaries, key=lambda b: inp.order[b.fqn]):
        for t in b.transitions:
            steps: tuple[tuple[Direction, CollectiveOp], ...] = (
                ("forward", t.forward), ("backward", t.backward))
            for direction, op in steps:
                if op.communicates:
                    out.append(ManifestEntry(boundary=b.fqn, stage=t.stage, name=t.name,
                                             mesh_dim=t.mesh_dim, direction=direction, op=op))
    for p in params:
        for op in p.grad_reduce:
            out.append(ManifestEntry(boundary=p.boundary or "", stage="param_grad", name=p.fqn,
                                     mesh_dim=op.mesh_dim, direction="backward", op=op))
    return tuple(out)
