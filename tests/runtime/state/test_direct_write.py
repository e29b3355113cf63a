"""Ranks on one host write their own blocks of an export into the writer's file (issue 29).

Real gloo ranks (forked on this host), a real tiny Llama and real files: every sharded tensor's
blocks reach the file without a byte sent to the writer, and the file is what one process's
model holds; a rank that does not see the writer's kernel makes every rank send its blocks as
before (same bytes); a rank that cannot write its blocks makes every rank raise and leaves
the previous export exactly as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import ExportError
from hyperrecipe.runtime.state.folder_switch import leftovers
from tests.support.runtime_harness import ROOT, llama, mesh_1d

LLAMA = str(ROOT / "recipes/llama.yaml")


def _applied(world: int) -> tuple[nn.Module, Any]:
    model = llama("cpu")
    plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
    return model, apply(model, plan, mesh_1d(world), mode="production")


def _worker(rank: int, world: int, folder: str, case: str) -> dict[str, Any]:
    import hyperrecipe.runtime.state.direct_write as direct_write
    import hyperrecipe.runtime.state.export as export

    model, inst = _applied(world)
    counts = {"sent": 0, "written": 0}
    real_gather, real_write = export.gather_to_writer, export.write_runs

    def gather_to_writer(*args: Any) -> torch.Tensor | None:
        counts["sent"] += 1
        return real_gather(*args)

    def write_runs(*args: Any) -> int:
        counts["written"] += 1
        if case == "peer-cannot-write" and rank == 1:
            raise OSError(28, "No space left on device")
        return real_write(*args)

    export.gather_to_writer = gather_to_writer  # type: ignore[assignment]
    export.write_runs = write_runs  # type: ignore[assignment]
    if case == "peer-on-another-kernel" and rank == 1:
        direct_write.host_identity = lambda: "another-kernel"  # type: ignore[assignment]
    if case == "peer-cannot-write":
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)  # other weights: they must not reach the folder
    try:
        inst.state.save_pretrained(folder)
    except ExportError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", **counts}
    return {"error": None, **counts}


def _check_files(folder: Path) -> None:
    from safetensors.torch import load_file

    from hyperrecipe.runtime.state.weights import verify_manifest

    written = load_file(str(folder / "model.safetensors"))
    model = llama("cpu")
    expected = model.state_dict()
    assert {n for n, _ in model.named_parameters()} <= set(written) <= set(expected)
    for name, value in written.items():
        assert torch.equal(value, expected[name]), name
    verify_manifest(folder)  # the writer's digest covers the bytes its peer wrote


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_ranks_on_one_host_write_their_own_blocks_and_send_none(tmp_path: Path) -> None:
    folder = tmp_path / "export"
    results = run_ranks(_worker, 2, str(folder), "direct")
    assert [r["error"] for r in results] == [None, None]
    assert [r["sent"] for r in results] == [0, 0], "a block travelled to the writer"
    assert results[0]["written"] > 0 and results[1]["written"] == results[0]["written"]
    _check_files(folder)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_peer_on_another_kernel_makes_every_rank_send_its_blocks(tmp_path: Path) -> None:
    folder = tmp_path / "export"
    results = run_ranks(_worker, 2, str(folder), "peer-on-another-kernel")
    assert [r["error"] for r in results] == [None, None]
    assert [r["written"] for r in results] == [0, 0]
    assert results[1]["sent"] > 0
    _check_files(folder)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("world", [2])
def test_a_peer_that_cannot_write_its_blocks_makes_every_rank_raise(world: int,
                                                                   tmp_path: Path) -> None:
    folder = tmp_path / "export"
    assert [r["error"] for r in run_ranks(_worker, world, str(folder), "direct")] == [None, None]
    before = _snapshot(folder)
    results = run_ranks(_worker, world, str(folder), "peer-cannot-write", timeout_s=120)
    for res in results:
        assert res["error"] is not None and res["error"].startswith(
            f"ExportError: save_pretrained into {folder} failed, so nothing was replaced"), \
            res["error"]
        assert "rank 1: writing its blocks of 'model.embed_tokens.weight' into" in res["error"]
        assert "No space left on device" in res["error"]
        assert "rank 0:" not in res["error"], res["error"]
    assert _snapshot(folder) == before
    assert not [f for f in folder.iterdir() if ".tmp-" in f.name]
    assert leftovers(folder) == []


def test_hashing_a_range_from_the_pages_or_by_reading_gives_the_bytes_digest(
        tmp_path: Path) -> None:
    """The writer hashes its peers' tensors from the file: through a mapping, or by reading
    where the file system cannot map; both equal the digest of the bytes themselves."""
    import os

    from hyperrecipe.runtime.state.direct_write import hash_range, map_for_hashing
    from hyperrecipe.runtime.state.integrity import new_hasher

    data = os.urandom((9 << 20) + 4097)
    path = tmp_path / "f"
    path.write_bytes(data)
    expected = new_hasher("xxh3_128")
    expected.update(data[5:-3])
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = map_for_hashing(fd)
        assert mapping is not None
        for source in (mapping, None):
            hasher = new_hasher("xxh3_128")
            hash_range(hasher, fd, source, 5, len(data) - 3)
            assert hasher.hexdigest() == expected.hexdigest()
        mapping.close()
    finally:
        os.close(fd)
