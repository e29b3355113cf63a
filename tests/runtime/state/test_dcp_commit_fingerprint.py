"""A committed DCP folder is checked by content: the commit record holds each storage file's
sampled fingerprint, so a folder that a later ``dcp.save`` wrote into (same sizes, other bytes)
is refused instead of loading a mix of two saves, while a copy of the folder (new inodes and
mtimes) still loads.

Real gloo ranks, real ``dcp.save`` / ``save_checkpoint`` of a tiny Llama at tp=2.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import WeightLoadError
from hyperrecipe.runtime.state.dcp_reader import read_dcp_metadata
from hyperrecipe.runtime.state.integrity import COMMIT, FINGERPRINT_SCHEME, sampled_fingerprint
from tests.support.checkpoint_harness import applied, resume_worker


def _save_twice(rank: int, world: int, committed: str, later: str) -> dict[str, torch.Tensor]:
    """``save_checkpoint`` into ``committed`` (state A), one AdamW step, then a plain
    ``dcp.save`` of state B into ``later``: the files a ``dcp.save`` into ``committed`` writes
    before it dies. Returns state A in full."""
    import torch.distributed.checkpoint as dcp

    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inst.state.save_checkpoint(committed, opt)
    state_a: dict[str, torch.Tensor] = inst.state.full_state_dict()
    ids = torch.arange(8).view(1, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    dcp.save(inst.state.state_dict(opt), checkpoint_id=later)
    return state_a


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fingerprint")
    committed, later = root / "committed", root / "later"
    state_a = run_ranks(_save_twice, 2, str(committed), str(later))[0]
    return committed, later, state_a


def _load_weights_error(rank: int, world: int, source: str) -> str | None:
    _, inst = applied(world, "meta")
    try:
        inst.state.load_weights(source)
    except WeightLoadError as exc:
        return str(exc)
    return None


def _assert_is(full: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert full.keys() == state.keys()
    for name, value in full.items():
        torch.testing.assert_close(value, state[name], atol=0, rtol=0)  # bit for bit


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_committed_folder_with_a_same_size_file_of_a_later_save_is_refused(
        saved: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    committed, later, _ = saved
    folder = tmp_path / "mixed"
    shutil.copytree(committed, folder)
    # a plain dcp.save into the folder, killed after rank 0 wrote its data file and before
    # .metadata: one storage file of state B, of exactly the committed size
    name = "__0_0.distcp"
    assert (later / name).stat().st_size == (folder / name).stat().st_size
    shutil.copyfile(later / name, folder / name)
    record = json.loads((folder / COMMIT).read_text())
    size = (folder / name).stat().st_size
    expected = (f"{folder}: written again after it was committed: {name} has the size {COMMIT} "
                f"records ({size} bytes) but other bytes (sampled fingerprint "
                f"{sampled_fingerprint(folder / name)[:16]}, committed "
                f"{record['fingerprints'][name][:16]}): a dcp.save into the same folder that "
                f"did not finish, or a file of another checkpoint, so its files may mix two "
                f"saves. Save the checkpoint again (or resume from an earlier one)")
    for res in run_ranks(resume_worker, 2, str(folder)):
        assert res["error"] == expected
        assert res["unchanged"], "the model changed although the load was refused"
    # load_weights names the strategy that refused it (reading DCP folders)
    assert run_ranks(_load_weights_error, 2, str(folder)) == [f"dcp: {expected}"] * 2


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_copied_committed_folder_loads_the_committed_state(
        saved: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    committed, _, state_a = saved
    copy = tmp_path / "copy"
    shutil.copytree(committed, copy, copy_function=shutil.copyfile)  # new inodes and mtimes
    for f in copy.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
        assert f.stat().st_ino != (committed / f.name).stat().st_ino
    two = run_ranks(resume_worker, 2, str(copy))
    assert [r["error"] for r in two] == [None, None]
    _assert_is(two[0]["full"], state_a)
    assert run_ranks(_load_weights_error, 1, str(copy)) == [None]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_commit_record_from_before_fingerprints_still_loads(
        saved: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    committed, _, state_a = saved
    folder = tmp_path / "old"
    shutil.copytree(committed, folder)
    record = json.loads((folder / COMMIT).read_text())
    assert record["fingerprint"] == FINGERPRINT_SCHEME
    assert sorted(record["fingerprints"]) == sorted(record["files"])
    del record["fingerprint"], record["fingerprints"]
    (folder / COMMIT).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    res = run_ranks(resume_worker, 1, str(folder))[0]
    assert res["error"] is None and res["opt"] > 0
    _assert_is(res["full"], state_a)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_commit_record_of_an_unknown_fingerprint_scheme_is_refused(
        saved: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    committed, _, _ = saved
    folder = tmp_path / "newer"
    shutil.copytree(committed, folder)
    record = json.loads((folder / COMMIT).read_text())
    record["fingerprint"] = "sampled-sha256/9"
    (folder / COMMIT).write_text(json.dumps(record))
    with pytest.raises(WeightLoadError) as info:
        read_dcp_metadata(folder)
    assert str(info.value) == (f"{folder / COMMIT}: fingerprint 'sampled-sha256/9' is not "
                               f"'{FINGERPRINT_SCHEME}': written by a newer hyperrecipe? Load "
                               f"it with that version")


def test_the_sampled_fingerprint_sees_size_and_sampled_bytes_not_bytes_between(
        tmp_path: Path) -> None:
    """What the docstring promises, on a file past the whole-file limit (4 MiB): a changed
    size or a changed byte in a sampled block differs; a byte between the blocks does not
    (that is the export manifest's full digest's job)."""
    path = tmp_path / "__0_0.distcp"
    data = bytearray(torch.randint(0, 256, (40 << 20,), dtype=torch.uint8).numpy().tobytes())
    path.write_bytes(data)
    base = sampled_fingerprint(path)
    step = ((40 << 20) - (2 << 20) - (64 << 10)) // 31  # the blocks' spacing
    changed = {
        "first MiB": 100, "last MiB": len(data) - 100,
        "a middle block": (1 << 20) + 7 * step + 10,
    }
    for where, offset in changed.items():
        edited = bytearray(data)
        edited[offset] ^= 0xFF
        path.write_bytes(edited)
        assert sampled_fingerprint(path) != base, where
    edited = bytearray(data)
    edited[(1 << 20) + 7 * step + (64 << 10) + 10] ^= 0xFF  # just past block 7
    path.write_bytes(edited)
    assert sampled_fingerprint(path) == base
    for resized in (data[:-1], data + b"\0"):
        path.write_bytes(resized)
        assert sampled_fingerprint(path) != base
