"""A pipelined plan as one pipeline rank applies it: the stage view.

With pipeline parallelism beside tensor parallelism, each rank holds only its stages; the
rest of the model is placeholders (:mod:`hyperrecipe.runtime.pipeline`). ``apply`` then runs on
that stage model, over the mesh without the pipeline dim, with :func:`stage_view`: the plan
restricted to what the stages own. The view decides nothing new: every entry is the plan's own,
filtered; gradient buckets keep their order and lose the members another stage owns.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from hyperrecipe.plan import (
    GradBucket,
    ManifestEntry,
    ParamPlan,
    Plan,
    compute_fingerprint,
)

__all__ = ["stage_units", "stage_view"]


def stage_units(plan: Plan, stages: Iterable[int]) -> tuple[str, ...]:
    """The module FQNs (layers and outer units) the given stages own."""
    pipe = plan.pipeline
    assert pipe is not None
    out: list[str] = []
    for st in pipe.stages:
        if st.index in set(stages):
            out += [f"{pipe.layers}.{i}" for i in range(st.start, st.stop)]
            out += list(st.modules)
    return tuple(out)


def _inside(fqn: str, units: tuple[str, ...]) -> bool:
    return any(fqn == u or fqn.startswith(u + ".") for u in units)


def stage_view(plan: Plan, stages: Iterable[int], *, model_digest: str) -> Plan:
    """``plan`` restricted to ``stages``, on the mesh without the pipeline dim.

    Args:
        plan: a plan with a ``pipeline``.
        stages: global stage indices one model object holds (one stage: each stage of an
            interleaved rank is its own model object).
        model_digest: the digest of the stage model's structure (placeholders in place of
            what other stages own), which ``apply`` checks the view against.

    Returns:
        A sealed plan without ``pipeline``: the stages' parameters, the boundaries and head
        counts inside their modules, their gradient buckets and collectives, the loss on vocab
        shards if its boundary is theirs, and the mesh less the pipeline dim.
    """
    pipe = plan.pipeline
    assert pipe is not None
    stages = tuple(stages)
    units = stage_units(plan, stages)
    owned = {f for st in pipe.stages if st.index in stages for f in st.params}
    # a tie to a parameter another stage owns is that stage's copy (the pipeline sums their
    # gradients): here the parameter stands alone
    # and a parameter's DTensor placements, one per mesh dim, lose the pipeline dim's entry
    at = plan.mesh_dims.index(pipe.mesh_dim)

    def own(p: ParamPlan) -> ParamPlan:
        dtensor = p.dtensor[:at] + p.dtensor[at + 1:] if len(p.dtensor) == len(plan.mesh) \
            else p.dtensor
        tied_to = p.tied_to if p.tied_to is None or p.tied_to in owned else None
        return attrs.evolve(p, dtensor=dtensor, tied_to=tied_to)

    params = tuple(own(p) for p in plan.params if p.fqn in owned)
    boundaries = tuple(b for b in plan.boundaries if _inside(b.fqn, units))
    kept = {b.fqn for b in boundaries}
    sizes = {p.fqn: _numel(p.local_shape) for p in params}
    buckets: list[GradBucket] = []
    renamed: dict[str, str] = {}
    for bucket in plan.grad_buckets:
        members = tuple(f for f in bucket.params if f in owned)
        if members:
            new = attrs.evolve(bucket, index=len(buckets), params=members,
                               numel=sum(sizes[f] for f in members))
            renamed[bucket.name] = new.name
            buckets.append(new)
    manifest: list[ManifestEntry] = []
    for entry in plan.manifest:
        if entry.stage == "param_grad":
            if entry.name in renamed:
                manifest.append(attrs.evolve(entry, name=renamed[entry.name]))
        elif entry.boundary in kept:
            manifest.append(entry)
    loss = plan.loss_parallel
    if loss is not None and loss.boundary not in kept:
        loss = None
    mesh = tuple(d for d in plan.mesh if d.name != pipe.mesh_dim)
    return attrs.evolve(
        plan, mesh=mesh, params=params, boundaries=boundaries,
        head_counts=tuple(h for h in plan.head_counts if _inside(h.module, units)),
        grad_buckets=tuple(buckets), manifest=tuple(manifest), loss_parallel=loss,
        pipeline=None, model_digest=model_digest,
        fingerprint=compute_fingerprint(plan.recipe_digest, model_digest, mesh),
    ).sealed()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
