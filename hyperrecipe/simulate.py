"""A dry run at real scale on one machine: what each rank will hold and send, before renting it.

:func:`simulate` applies a compiled plan to a model built on the meta device, once per rank,
under torch's fake process group (``init_process_group("fake")``: collectives return without
communicating) and a ``DeviceMesh`` on the meta device, so the real ``apply`` runs (the same
sharding code, preflight and installs as on the cluster) and allocates nothing. It then reads
each rank's parameters, gradients and optimizer state off the applied model, and the
collectives of one training step off the plan's manifest. A 70B model at world size 8 takes
seconds and no memory.

What lives here: the dry run and its report (table and JSON). What does not: the sharding itself
(:mod:`hyperrecipe.runtime`), and any estimate of activations (they depend on the batch; not
reported yet).
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from hyperrecipe.errors import UsageError
from hyperrecipe.plan import Plan

__all__ = ["ADAMW_STATE_BYTES", "RankMemory", "Simulation", "StepCollective", "render_table",
           "simulate"]

ADAMW_STATE_BYTES = 8
"""Optimizer bytes per trainable element: AdamW's two moments (``exp_avg``, ``exp_avg_sq``)
kept in fp32, as mixed-precision training keeps them whatever the parameters' dtype."""


@attrs.frozen(kw_only=True)
class RankMemory:
    """What one rank holds once the plan is applied (bytes; tied parameters counted once).

    ``gradient`` is one gradient per trainable parameter, in its dtype; ``optimizer`` is
    :data:`ADAMW_STATE_BYTES` per trainable element; ``buffers`` are the model's buffers
    (replicated, not in the plan)."""

    rank: int
    coords: tuple[tuple[str, int], ...]
    parameters: int
    gradients: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers


@attrs.frozen(kw_only=True)
class StepCollective:
    """How many times one step issues a collective kind over a mesh dim, per the manifest."""

    kind: str
    mesh_dim: str
    direction: str
    count: int


@attrs.frozen(kw_only=True)
class Simulation:
    """The dry run's report: per-rank memory and the collectives of one step."""

    recipe: str
    mesh: tuple[tuple[str, int], ...]
    mode: str
    ranks: tuple[RankMemory, ...]
    collectives: tuple[StepCollective, ...]
    grad_bucket_bytes: int
    """Bytes each rank reduces in gradient buckets per step (the plan's buckets' elements)."""
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "mesh": dict(self.mesh), "mode": self.mode,
            "ranks": [{"rank": r.rank, "coords": dict(r.coords), "parameter_bytes": r.parameters,
                       "gradient_bytes": r.gradients, "optimizer_bytes": r.optimizer,
                       "buffer_bytes": r.buffers, "total_bytes": r.total} for r in self.ranks],
            "collectives_per_step": [attrs.asdict(c) for c in self.collectives],
            "grad_bucket_bytes_per_step": self.grad_bucket_bytes,
            "seconds": round(self.seconds, 3),
        }


def simulate(model: nn.Module, plan: Plan, *, ranks: Iterable[int] | None = None,
             mode: str = "production") -> Simulation:
    """Apply ``plan`` to a copy of the meta-built ``model`` as each rank would, under a fake
    process group of the plan's world size, and report what each rank holds.

    Args:
        model: the model built on the meta device (``hyperrecipe.model_tree.build_model``);
            it is copied for each rank and left as it is.
        plan: the compiled plan (its mesh gives the world size and the mesh's shape).
        ranks: the ranks to simulate (default every rank of the mesh).
        mode: ``"production"`` (default) or ``"validate"``.

    Returns:
        The :class:`Simulation`.

    Raises:
        UsageError: a process group is already initialized in this process (the dry run needs
            the default group for the fake one), a parameter of ``model`` is not on the meta
            device, or a rank is outside the mesh.
        Anything ``apply`` raises for this plan and model.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        msg = ("simulate() runs its own fake process group and this process already has one; "
               "run the dry run in a process of its own (`hyperrecipe simulate`)")
        raise UsageError(msg)
    real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if real:
        msg = (f"simulate() needs the model built on the meta device; {real[0]!r} is on "
               f"{model.get_parameter(real[0]).device}: build it with "
               f"hyperrecipe.model_tree.build_model(...) or under `with torch.device('meta')`")
        raise UsageError(msg)
    shape = plan.mesh_shape
    world = math.prod(shape.values())
    chosen = list(range(world)) if ranks is None else sorted(set(ranks))
    outside = [r for r in chosen if not 0 <= r < world]
    if outside:
        msg = f"simulate(): rank(s) {outside} are outside the mesh of {world} ranks"
        raise UsageError(msg)
    started = time.perf_counter()
    rows = tuple(_simulate_rank(model, plan, shape, rank, world, mode) for rank in chosen)
    return Simulation(recipe=plan.recipe, mesh=tuple(shape.items()), mode=mode, ranks=rows,
                      collectives=_step_collectives(plan),
                      grad_bucket_bytes=sum(b.numel * _itemsize(b.dtype) * len(b.ops)
                                            for b in plan.grad_buckets),
                      seconds=time.perf_counter() - started)


def _simulate_rank(model: nn.Module, plan: Plan, shape: Mapping[str, int], rank: int,
                   world: int, mode: str) -> RankMemory:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.runtime.install import apply

    copied = copy.deepcopy(model)
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("meta", tuple(shape.values()), mesh_dim_names=tuple(shape))
        installation = apply(copied, plan, mesh, mode=mode)  # type: ignore[arg-type]
        coords = tuple((name, mesh.get_local_rank(name)) for name in shape)
        params = list(copied.parameters())  # each object once: tied parameters count once
        trainable = [p for p in params if p.requires_grad]
        row = RankMemory(rank=rank, coords=coords,
                         parameters=sum(_bytes(p) for p in params),
                         gradients=sum(_bytes(p) for p in trainable),
                         optimizer=sum(_local(p).numel() for p in trainable) * ADAMW_STATE_BYTES,
                         buffers=sum(_bytes(b) for b in copied.buffers()))
        # process-wide installs (an attention hook of an inner wrapper) go with the copy, so
        # the next rank's apply finds the process as this one did
        installation.restore()
    finally:
        dist.destroy_process_group()
    return row


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype.removeprefix("torch.")).itemsize)


def _step_collectives(plan: Plan) -> tuple[StepCollective, ...]:
    counted = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest
                      if e.op.communicates)
    return tuple(StepCollective(kind=k, mesh_dim=d, direction=w, count=n)
                 for (k, d, w), n in sorted(counted.items()))


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")


def render_table(sim: Simulation) -> str:
    """The report as text: a row per group of ranks holding the same bytes, then the
    collectives of one step."""
    mesh = ",".join(f"{k}={v}" for k, v in sim.mesh)
    lines = [f"dry run of {sim.recipe} on {mesh} ({sim.mode}, fake process group, meta device; "
             f"{len(sim.ranks)} rank(s) in {sim.seconds:.2f} s)", "",
             f"{'ranks':<16} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
             f"{'buffers':>12} {'total':>12}"]
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for r in sim.ranks:
        groups.setdefault((r.parameters, r.gradients, r.optimizer, r.buffers), []).append(r.rank)
    for (p, g, o, b), members in groups.items():
        lines.append(f"{_rank_span(members):<16} {_human(p):>12} {_human(g):>12} "
                     f"{_human(o):>12} {_human(b):>12} {_human(p + g + o + b):>12}")
    lines += ["", f"optimizer: AdamW, {ADAMW_STATE_BYTES} bytes (two fp32 moments) per trainable "
                  "element; activations not included", "",
              "collectives per step (from the plan's manifest, every rank):"]
    if not sim.collectives:
        lines.append("  none")
    for c in sim.collectives:
        lines.append(f"  {c.count:>5} x {c.kind} over {c.mesh_dim} ({c.direction})")
    if sim.grad_bucket_bytes:
        lines.append(f"  gradient buckets reduce {_human(sim.grad_bucket_bytes)} per step")
    return "\n".join(lines) + "\n"


def _rank_span(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{len(ranks)} ranks"
