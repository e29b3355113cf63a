"""The collective vocabulary shared by the resolver (which lowers transitions to it), the plan
(which stores it) and the runtime (which executes it).

A :class:`CollectiveOp` is pure data: what one rank does to one tensor over one mesh dim. Every
lowered transition is a *pair* of them, the forward op and the backward op that carries the
gradient back (its dual), so production mode needs no placement reasoning at run time.
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["CollectiveKind", "CollectiveOp", "IDENTITY"]

CollectiveKind = Literal[
    "identity",  # nothing
    "all_reduce",  # partial -> replicate
    "all_gather",  # shard(gather_dim) -> replicate
    "reduce_scatter",  # partial -> shard(scatter_dim)
    "all_to_all",  # shard(gather_dim) -> shard(scatter_dim)
    "local_slice",  # replicate -> shard(scatter_dim), no communication
]


@attrs.frozen(kw_only=True)
class CollectiveOp:
    """One rank's part of a collective over ``mesh_dim``.

    Tensor dims may be negative (counted from the end), as in the recipe.
    ``gather_dim`` is the dim that becomes whole (``all_gather``, ``all_to_all``);
    ``scatter_dim`` the dim that becomes sharded (``reduce_scatter``, ``all_to_all``,
    ``local_slice``); ``reduce`` applies to ``all_reduce`` and ``reduce_scatter``.
    """

    kind: CollectiveKind
    mesh_dim: str = ""
    gather_dim: int | None = None
    scatter_dim: int | None = None
    reduce: Literal["sum", "avg"] = "sum"

    @property
    def communicates(self) -> bool:
        """Whether this op sends anything between ranks (identity and local slices do not)."""
        return self.kind not in ("identity", "local_slice")

    def __str__(self) -> str:
        if self.kind == "identity":
            return "identity"
        args = []
        if self.gather_dim is not None:
            args.append(f"gather_dim={self.gather_dim}")
        if self.scatter_dim is not None:
            args.append(f"scatter_dim={self.scatter_dim}")
        if self.kind in ("all_reduce", "reduce_scatter"):
            args.append(self.reduce)
        inner = ", ".join(args)
        return f"{self.kind}[{self.mesh_dim}]({inner})"


IDENTITY = CollectiveOp(kind="identity")
