"""A checkpoint spread over node-local folders is refused at save, on every rank.

Two nodes that each give ``save_checkpoint`` a folder on their own local disk see two different
folders under one name: each rank writes its storage files into the folder it sees, the rank
that writes ``.metadata`` commits, and no single folder holds a loadable checkpoint (measured
with two torchrun launches on one host: the node holding rank 0 committed a folder listing 2 of
the 4 storage files ``.metadata`` needs). Here each rank runs from its own working directory and
saves into the same relative path, which is exactly that: one name, one folder per "node".

Real gloo ranks, a tiny Llama at tp=2, real ``dcp.save``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import ExportError
from hyperrecipe.runtime.state import folder_switch
from hyperrecipe.runtime.state.integrity import COMMIT
from tests.support.checkpoint_harness import applied


def _save_from_own_folder(rank: int, world: int, roots: list[str]) -> str | None:
    os.chdir(roots[rank])  # this rank's "node": the relative folder below lands on its disk
    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        inst.state.save_checkpoint("ckpt", opt)
    except ExportError as exc:
        return str(exc)
    return None


def _save_shared(rank: int, world: int, folder: str) -> str | None:
    model, inst = applied(world)
    try:
        inst.state.save_checkpoint(folder, torch.optim.AdamW(model.parameters(), lr=1e-2))
    except ExportError as exc:
        return str(exc)
    return None


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_node_local_folders_are_refused_on_every_rank_naming_what_each_misses(
        tmp_path: Path) -> None:
    roots = [tmp_path / "node0", tmp_path / "node1"]
    for root in roots:
        root.mkdir()
    errors = run_ranks(_save_from_own_folder, 2, [str(r) for r in roots])
    assert all(e is not None for e in errors), errors
    assert errors[0] == errors[1]  # the same refusal on every rank
    message = errors[0]
    assert message is not None
    assert message.startswith("save_checkpoint into ckpt failed; the folder holds what it held "
                               "before (the new checkpoint was never switched in)"), message
    # each rank wrote into the staging folder beside the "ckpt" it sees; rank 0's has
    # .metadata, which names rank 1's file it does not hold
    staged = [r / f".ckpt{folder_switch.STAGING_SUFFIX}" for r in roots]
    assert (f"rank 0 does not see the checkpoint whole: {staged[0]}/__1_0.distcp: named by "
            f".metadata but cannot be read") in message, message
    # rank 1's has no .metadata at all
    assert (f"rank 1 does not see the checkpoint whole: cannot read {staged[1]}/.metadata"
            in message), message
    assert "needs a file system every rank shares" in message
    # neither folder holds a checkpoint, nor a staging folder: rank 0 removed the one it made,
    # rank 1 the one DCP made on its "node"
    assert list((roots[0] / "ckpt").iterdir()) == []
    assert not (roots[1] / "ckpt").exists()
    assert not staged[0].exists() and not staged[1].exists()


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_shared_folder_still_commits(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    assert run_ranks(_save_shared, 2, str(folder)) == [None, None]
    record = json.loads((folder / COMMIT).read_text())
    assert record["state"] == "committed"
    assert sorted(record["fingerprints"]) == ["__0_0.distcp", "__1_0.distcp"]
