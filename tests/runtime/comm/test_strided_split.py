"""A fused projection's output split into its parts inside a validate-mode compute, on 2 gloo ranks.

The weight is ``shard(1, chunks=3)`` (GPT-2's Conv1D ``c_attn``: q, k and v of width 4 each),
held as DTensor's ``_StridedShard(1, split_factor=3)``. Splitting its output on chunk boundaries
gives ``Shard(-1)`` parts (``m`` consecutive chunks: ``_StridedShard(-1, m)``) whose values, and
the weight's gradient through them, equal one process exactly; a split across a chunk boundary
is DTensor's own (replicate, exact). Outside a validate compute DTensor gathers every split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

WIDTH = 4  # one chunk
SPLITS: dict[str, Callable[[torch.Tensor], Any]] = {
    "split": lambda y: y.split(WIDTH, dim=2),
    "split_keyword": lambda y: y.split(split_size=WIDTH, dim=-1),
    "torch.split": lambda y: torch.split(y, [WIDTH, 2 * WIDTH], dim=2),
    "chunk": lambda y: y.chunk(3, dim=-1),
    "torch.chunk": lambda y: torch.chunk(y, 3, -1),
    "slices": lambda y: (y[..., :WIDTH], y[:, :, WIDTH:2 * WIDTH], y[..., 2 * WIDTH:]),
    "narrow": lambda y: (y.narrow(2, 0, WIDTH), torch.narrow(y, -1, WIDTH, 2 * WIDTH)),
    "across_chunks": lambda y: y.split(6, dim=2),
}


def _full() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 3, generator=g), torch.randn(3, 3 * WIDTH, generator=g)


def _loss(parts: Any) -> torch.Tensor:
    # weigh each part differently, so a part's gradient landing in another's place shows
    return sum(((i + 1) * p.pow(2)).sum() for i, p in enumerate(parts))  # type: ignore[return-value]


def _worker(rank: int, world: int, cases: list[str], scoped: bool) -> dict[str, Any]:
    return {case: _split_once(rank, world, case, scoped) for case in cases}


def _split_once(rank: int, world: int, case: str, scoped: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    x_full, w_full = _full()
    local = torch.cat([c.chunk(world, dim=1)[rank] for c in w_full.chunk(3, dim=1)], dim=1)
    w = torch.nn.Parameter(DTensor.from_local(local, mesh, (_StridedShard(1, split_factor=3),),
                                              run_check=False))
    x = DTensor.from_local(x_full, mesh, (Replicate(),))

    def compute() -> tuple[Any, torch.Tensor]:
        parts = SPLITS[case](x @ w)
        return parts, _loss(parts)

    parts, loss = (validate_compute(compute) if scoped else compute)()
    loss.backward()  # type: ignore[no-untyped-call]
    assert isinstance(w.grad, DTensor)
    return {"placements": [str(p.placements) for p in parts],
            "values": [p.full_tensor() for p in parts],
            "grad": w.grad.full_tensor()}


def _reference(case: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    x, w = _full()
    w.requires_grad_()
    parts = SPLITS[case](x @ w)
    _loss(parts).backward()  # type: ignore[no-untyped-call]
    assert w.grad is not None
    return [p.detach() for p in parts], w.grad


SHARD = "(Shard(dim=2),)"
EXPECTED = {
    "split": [SHARD] * 3,
    "split_keyword": [SHARD] * 3,
    "torch.split": [SHARD, "(_StridedShard(dim=2, sf=2),)"],
    "chunk": [SHARD] * 3,
    "torch.chunk": [SHARD] * 3,
    "slices": [SHARD] * 3,
    "narrow": [SHARD, "(_StridedShard(dim=2, sf=2),)"],
    "across_chunks": ["(Replicate(),)"] * 2,
}


def test_fused_output_splits_into_sharded_parts_on_chunk_boundaries() -> None:
    results = run_ranks(_worker, 2, list(EXPECTED), True, timeout_s=120)
    for case, placements in EXPECTED.items():
        values, grad = _reference(case)
        for rank, res in enumerate(r[case] for r in results):
            assert res["placements"] == placements, f"{case}, rank {rank}"
            for i, (got, want) in enumerate(zip(res["values"], values, strict=True)):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6,
                                           msg=f"{case}: part {i}, rank {rank}")
            torch.testing.assert_close(res["grad"], grad, atol=1e-6, rtol=1e-6,
                                       msg=f"{case}: weight gradient, rank {rank}")


def test_outside_a_validate_compute_dtensor_gathers_the_parts() -> None:
    (res, _) = run_ranks(_worker, 2, ["split"], False, timeout_s=120)
    assert res["split"]["placements"] == ["(Replicate(),)"] * 3


SIZES = (4, 2, 2)  # q, k and v of a GQA projection, output features of a linear layer


def _parts_worker(rank: int, world: int, in_place: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyperrecipe.runtime.comm.strided import FusedParts, mark_parts
    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    x_full, w_full = _full()
    w_full = w_full.T[:sum(SIZES)].contiguous()  # [8, 3]: nn.Linear's [out, in]
    local = torch.cat([p.chunk(world)[rank] for p in w_full.split(SIZES)])
    w = torch.nn.Parameter(local)
    mark_parts(w, FusedParts(mesh=mesh, placements=(Shard(0),), index=0, dim=0, sizes=SIZES,
                             ways=world))
    x = DTensor.from_local(x_full, mesh, (Replicate(),))

    def compute() -> tuple[Any, torch.Tensor]:
        y = torch.nn.functional.linear(x, w)
        if in_place:
            y.mul_(2)
        parts = (y[..., :4], y[..., 4:6], y[..., 6:])
        return parts, _loss(parts)

    parts, loss = validate_compute(compute)()
    loss.backward()  # type: ignore[no-untyped-call]
    assert w.grad is not None
    return {"placements": [str(p.placements) for p in parts],
            "values": [p.full_tensor() for p in parts], "grad": w.grad.clone(), "local": local}


def test_a_linear_held_in_unequal_parts_runs_part_by_part_and_slices_into_its_parts() -> None:
    """Each output part ``Shard(-1)``; the local gradient is this rank's parts of the full one.
    Changed in place after the linear, the fused output is sliced by DTensor instead (gathered:
    replicate, and the values still exact)."""
    for in_place, placement in ((False, SHARD), (True, "(Replicate(),)")):
        x, w = _full()
        w = w.T[:sum(SIZES)].contiguous().requires_grad_()
        y = torch.nn.functional.linear(x, w) * (2 if in_place else 1)
        want = (y[..., :4], y[..., 4:6], y[..., 6:])
        _loss(want).backward()  # type: ignore[no-untyped-call]
        assert w.grad is not None
        for rank, res in enumerate(run_ranks(_parts_worker, 2, in_place, timeout_s=120)):
            assert res["placements"] == [placement] * 3, f"in place {in_place}, rank {rank}"
            for got, part in zip(res["values"], want, strict=True):
                torch.testing.assert_close(got, part.detach(), atol=1e-6, rtol=1e-6)
            local_grad = torch.cat([p.chunk(2)[rank] for p in w.grad.split(SIZES)])
            torch.testing.assert_close(res["grad"], local_grad, atol=1e-6, rtol=1e-6)
