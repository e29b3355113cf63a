"""Full tensors gathered straight into their place (:mod:`hyperrecipe.runtime.comm.gather_into`).

On real gloo ranks (2 on a 1-D mesh, 4 on a dp x tp mesh), each layout's shards, cut from one
full tensor by ``local_shard``, must gather back to that tensor exactly (data movement: bit for
bit), through the direct path where the placement is one mesh dim and through the general path
(mesh dim by mesh dim) for the others; the all-gathers are counted as the plan counts them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.placement import parse_named_text
from hyperrecipe.runtime.comm.collectives import count_collectives
from hyperrecipe.runtime.comm.gather_into import gather_full_in_place
from hyperrecipe.runtime.comm.sharding import gather_full, local_shard

SHAPE = (12, 8, 6)
ONE_DIM = ["{tp: shard(0)}", "{tp: shard(1)}", "{tp: shard(-1)}", "{tp: shard(0, chunks=3)}",
           "{tp: shard(1, chunks=[4, 2, 2])}", "{tp: shard(2, chunks=3)}"]
TWO_DIMS = ["{dp: shard(0), tp: shard(1)}", "{dp: shard(0), tp: shard(0)}"]


def _gathers(rank: int, world: int) -> dict[str, Any]:
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    out: dict[str, Any] = {}
    if world == 2:
        mesh, dims, cases = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), ("tp",), ONE_DIM
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dims, cases = ("dp", "tp"), ONE_DIM + TWO_DIMS
    for text in cases:
        p = parse_named_text(text)
        local = local_shard(full, p, mesh, dims)
        direct = gather_full_in_place(local, p, SHAPE, mesh, dims)
        with count_collectives() as log:
            whole = gather_full(local, p, SHAPE, mesh, dims)
        out[text] = (direct is not None and torch.equal(direct, full), torch.equal(whole, full),
                     len(log))
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_one_mesh_dim_shards_gather_straight_into_the_full_tensor_bit_for_bit() -> None:
    for world in (2, 4):
        for res in run_ranks(_gathers, world, timeout_s=300):
            for text in ONE_DIM:
                direct_equal, equal, gathers = res[text]
                assert direct_equal and equal, text
                parts = 3 if "chunks" in text else 1
                assert gathers == parts, f"{text}: one all_gather per fused part"


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_two_mesh_dim_shards_take_the_general_path_and_still_gather_exactly() -> None:
    for res in run_ranks(_gathers, 4, timeout_s=300):
        for text in TWO_DIMS:
            direct_equal, equal, _ = res[text]
            assert not direct_equal and equal, text


def _to_writer(rank: int, world: int, writer: int) -> dict[str, Any]:
    from hyperrecipe.runtime.comm import gather_into
    from hyperrecipe.runtime.comm.gather_into import gather_to_writer

    gather_into.CHUNK_BYTES = 40  # several pieces per block: the chunking is exercised too
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    if world == 2:
        mesh, dims, cases = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), ("tp",), ONE_DIM
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dims, cases = ("dp", "tp"), ONE_DIM + TWO_DIMS
    out: dict[str, Any] = {}
    for text in cases:
        p = parse_named_text(text)
        local = local_shard(full, p, mesh, dims)
        with count_collectives() as log:
            got = gather_to_writer(local, p, SHAPE, mesh, dims, writer)
        out[text] = (None if got is None else
                     "full" if torch.equal(got, full) else list(got.shape), len(log))
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_one_mesh_dim_shards_reach_the_writer_alone_bit_for_bit() -> None:
    """The writer gets the full tensor; every other rank an empty one (it sent, or on a dp x tp
    mesh, another replica had nothing to send); two-dim layouts are left to the general path
    on every rank alike. No collective is counted: it is point to point."""
    for world, writer in ((2, 1), (4, 0)):
        results = run_ranks(_to_writer, world, writer, timeout_s=300)
        for rank, res in enumerate(results):
            for text in ONE_DIM:
                assert res[text] == ("full" if rank == writer else [0], 0), (rank, text)
            for text in TWO_DIMS if world == 4 else ():
                assert res[text] == (None, 0), (rank, text)
