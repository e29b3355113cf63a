"""Lowering placement transitions to the collectives production mode runs.

A boundary converts each declared tensor from one placement to another, per mesh dim. Forward,
the value moves ``src -> dst``; backward, the gradient moves the other way, from the placement
it has *inside* to the one the caller expects. Gradients at a boundary are canonical: a sharded
value's gradient is sharded the same way, a replicated or partial value's gradient is
replicated. The one exception is what makes tensor parallelism work (Megatron's *f*): a
replicated input consumed by sharded parameters gets a *partial* gradient back from the region.

Forward lowering::

    src \\ dst     replicate            shard(b)               partial
    replicate     identity             local_slice(b)         impossible
    shard(a)      all_gather(a)        all_to_all(a -> b)     impossible
    partial       all_reduce           reduce_scatter(b)      identity
"""

from __future__ import annotations

from hyperrecipe.collective import IDENTITY, CollectiveOp
from hyperrecipe.errors import ImpossibleTransition
from hyperrecipe.placement import REPLICATE, Partial, Placement, Replicate, Shard

__all__ = ["ImpossibleTransition", "canonical_grad", "lower_transition"]


def canonical_grad(p: Placement) -> Placement:
    """The placement of a gradient at a boundary, given the value's placement."""
    return p if isinstance(p, Shard) else REPLICATE


def lower_transition(src: Placement, dst: Placement, mesh_dim: str) -> CollectiveOp:
    """The collective that turns a tensor placed ``src`` into one placed ``dst`` on ``mesh_dim``.

    Raises:
        ImpossibleTransition: ``dst`` is partial (nothing creates a pending sum), the reduce
            ops differ, or a chunked shard is used for an activation.
    """
    for p in (src, dst):
        if isinstance(p, Shard) and p.is_chunked:
            raise ImpossibleTransition(f"{p} describes fused parameters, not activations")
    if src == dst:
        return IDENTITY
    if isinstance(dst, Partial):
        raise ImpossibleTransition(
            f"{src} -> {dst} is impossible: no collective turns a tensor into a pending "
            f"reduction (partial is only ever produced by the forward itself)")
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return CollectiveOp(kind="all_reduce", mesh_dim=mesh_dim, reduce=src.reduce)
        assert isinstance(dst, Shard)
        return CollectiveOp(kind="reduce_scatter", mesh_dim=mesh_dim, scatter_dim=dst.dim,
                            reduce=src.reduce)
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return CollectiveOp(kind="all_gather", mesh_dim=mesh_dim, gather_dim=src.dim)
        assert isinstance(dst, Shard)
        return CollectiveOp(kind="all_to_all", mesh_dim=mesh_dim, gather_dim=src.dim,
                            scatter_dim=dst.dim)
    assert isinstance(src, Replicate) and isinstance(dst, Shard)
    return CollectiveOp(kind="local_slice", mesh_dim=mesh_dim, scatter_dim=dst.dim)
