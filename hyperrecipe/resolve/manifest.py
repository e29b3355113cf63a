"""Stage 5: the expected-collectives manifest: every collective one training step issues in
production mode, boundary transitions in model order then the gradient buckets' reductions."""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.plan import BoundaryPlan, Direction, GradBucket, ManifestEntry, ParamPlan
from hyperrecipe.resolve.context import ResolveInput

__all__ = ["list_collectives"]


def list_collectives(inp: ResolveInput, boundaries: Sequence[BoundaryPlan],
                     params: Sequence[ParamPlan],
                     buckets: Sequence[GradBucket]) -> tuple[ManifestEntry, ...]:
    """The manifest: each communicating forward and backward op of every transition, then each
    gradient bucket's ops in launch order (attributed to the boundary enclosing all of its
    parameters, ``""`` when there is none)."""
    out: list[ManifestEntry] = []
    for b in sorted(boundaries, key=lambda b: inp.order[b.fqn]):
        for t in b.transitions:
            steps: tuple[tuple[Direction, CollectiveOp], ...] = (
                ("forward", t.forward), ("backward", t.backward))
            for direction, op in steps:
                if op.communicates:
                    out.append(ManifestEntry(boundary=b.fqn, stage=t.stage, name=t.name,
                                             mesh_dim=t.mesh_dim, direction=direction, op=op))
    boundary_of = {p.fqn: p.boundary or "" for p in params}
    for bucket in buckets:
        enclosing = {boundary_of[fqn] for fqn in bucket.params}
        where = enclosing.pop() if len(enclosing) == 1 else ""
        for op in bucket.ops:
            out.append(ManifestEntry(boundary=where, stage="param_grad", name=bucket.name,
                                     mesh_dim=op.mesh_dim, direction="backward", op=op))
    return tuple(out)
