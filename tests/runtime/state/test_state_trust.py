"""Training state you can trust (issue 28): no checkpoint runs code, no format is tried behind
the user's back, files are regular and confined to their folder, a resume writes nothing until
everything checked, and an export replaces the previous one whole or not at all.

Real files throughout: ``save_pretrained`` of a tiny Llama, ``dcp.save`` from real gloo ranks,
hostile pickles that would write a marker file if they ran (each test asserts it was not
written, and that torch's own reader *does* run them, so the hostile file is real).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import PlanMismatchError, WeightLoadError
from hyperrecipe.runtime.state.folder_switch import leftovers
from tests.support.checkpoint_harness import (Hostile, applied, resume_worker,
                                              save_dcp_worker)
from tests.support.runtime_harness import llama

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save(inst.state.state_dict(opt))`` at tp=2 after one AdamW step."""
    ckpt = tmp_path_factory.mktemp("dcp") / "step-1"
    run_ranks(save_dcp_worker, 2, str(ckpt))
    return ckpt


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    llama().save_pretrained(folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _plain_metadata_runs(folder: Path) -> None:
    """torch's own reader: a plain ``pickle.load`` of ``.metadata``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        FileSystemReader(str(folder)).read_metadata()
    except Exception:  # noqa: BLE001 - os.system's int is not Metadata; the code has run
        pass


# -- 1. no checkpoint runs code ------------------------------------------------------------


def _load_weights_worker(rank: int, world: int, source: str) -> dict[str, Any]:
    model, inst = applied(world, "meta")
    try:
        inst.state.load_weights(source)
    except WeightLoadError as exc:
        rows = {r.what: r.state for r in inst.state.status() if r.what.startswith("weights")}
        return {"error": str(exc), "rows": rows}
    return {"error": None}


def test_a_hostile_dcp_metadata_is_refused_by_load_weights_without_running(
        dcp_folder: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    bad = _copy(dcp_folder, tmp_path / "bad")
    (bad / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    results = run_ranks(_load_weights_worker, 2, str(bad))
    assert not marker.exists(), "loading a checkpoint ran code"
    for res in results:
        assert res["error"] is not None
        assert f"{bad / '.metadata'}: refused: the pickle names posix.system" in res["error"]
    _plain_metadata_runs(bad)
    assert marker.exists(), "the hostile file is real: torch's plain reader runs it"


def test_load_checkpoint_resumes_what_dcp_save_wrote(dcp_folder: Path) -> None:
    two = run_ranks(resume_worker, 2, str(dcp_folder))
    one = run_ranks(resume_worker, 1, str(dcp_folder))[0]
    assert two[0]["error"] is None and one["error"] is None
    assert one["opt"] > 0, "the optimizer's state came back"
    for name, value in two[0]["full"].items():
        torch.testing.assert_close(one["full"][name], value, atol=0, rtol=0)


def test_a_hostile_dcp_metadata_is_refused_on_the_resume_path(dcp_folder: Path,
                                                              tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    bad = _copy(dcp_folder, tmp_path / "bad")
    (bad / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    for res in run_ranks(resume_worker, 2, str(bad)):
        assert "refused: the pickle names posix.system" in res["error"]
        assert res["unchanged"]
    assert not marker.exists()


def _hostile_bytes_entry(folder: Path, marker: Path) -> str:
    """Point one non-tensor entry of ``folder`` (an optimizer hyperparameter, read by torch
    with ``torch.load(weights_only=False)``) at a hostile ``torch.save`` pickle appended to a
    storage file; returns the entry's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from hyperrecipe.runtime.state.dcp_reader import read_dcp_metadata

    metadata = read_dcp_metadata(folder)
    name = next(k for k, v in metadata.state_dict_metadata.items()
                if isinstance(v, BytesStorageMetadata))
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == name)
    buf = io.BytesIO()
    torch.save(Hostile(marker), buf)
    data = folder / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return name


def test_a_hostile_non_tensor_entry_is_refused_on_the_resume_path(dcp_folder: Path,
                                                                  tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    bad = _copy(dcp_folder, tmp_path / "bad")
    name = _hostile_bytes_entry(bad, marker)
    for res in run_ranks(resume_worker, 2, str(bad)):
        assert f"refused the non-tensor entry {name!r}: it is not plain data" in res["error"]
        assert res["unchanged"]
    assert not marker.exists()
    try:  # torch's own reader and planner run it
        dcp.load({name: 0.0}, checkpoint_id=str(bad), no_dist=True)  # type: ignore[call-arg]
    except BaseException:  # noqa: BLE001 - the value is not a float; the code has run
        pass
    assert marker.exists(), "the hostile entry is real: torch's plain dcp.load runs it"


# -- 2. no silent fall-through -------------------------------------------------------------


def test_a_safetensors_folder_that_does_not_fit_is_not_read_as_dcp(
        hf_folder: Path, dcp_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    marker = tmp_path / "ran"
    folder = _copy(hf_folder, tmp_path / "hf")
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, "extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    res = run_ranks(_load_weights_worker, 1, str(folder))[0]
    assert not marker.exists()
    assert res["error"].startswith("safetensors: the checkpoint does not fit the model")
    assert "unexpected 'extra.weight' in model.safetensors" in res["error"]
    assert f"(not tried: torch, dcp; {folder} holds safetensors files" in res["error"]
    assert res["rows"].get("weights *") == "failed"


# -- 3. regular files, bounded, confined, wrapped ------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin", "__0_0.distcp",
                                  "file-as-source"])
def test_a_fifo_is_refused_not_opened(name: str, dcp_folder: Path, tmp_path: Path) -> None:
    if name == "__0_0.distcp":
        folder = _copy(dcp_folder, tmp_path / "ckpt")
        (folder / name).unlink()
        os.mkfifo(folder / name)
        source, where = folder, folder / name
    elif name == "file-as-source":
        os.mkfifo(tmp_path / "weights.safetensors")
        source = where = tmp_path / "weights.safetensors"
    else:
        os.mkfifo(tmp_path / name)
        source, where = tmp_path, tmp_path / name
    res = run_ranks(_load_weights_worker, 1, str(source), timeout_s=60)[0]
    assert f"{where}: not a regular file (a FIFO)" in res["error"]


def _index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_size_is_bounded_and_its_paths_are_confined(hf_folder: Path,
                                                          tmp_path: Path) -> None:
    from safetensors import safe_open

    from hyperrecipe.runtime.state.weights import MAX_INDEX_BYTES

    keys = list(safe_open(str(hf_folder / "model.safetensors"), framework="pt").keys())
    outside = tmp_path / "outside.safetensors"
    shutil.copy(hf_folder / "model.safetensors", outside)
    cases: dict[str, str] = {}
    for case, target in [("dotdot", "../outside.safetensors"), ("absolute", str(outside))]:
        folder = tmp_path / case
        folder.mkdir()
        _index(folder, {k: target for k in keys})
        cases[str(folder)] = f"names {target!r}, which is not a file name inside {folder}"
    link = tmp_path / "symlink"
    link.mkdir()
    (link / "model.safetensors").symlink_to(outside)
    cases[str(link)] = f"leads to {outside}, outside the checkpoint folder {link}"
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors.index.json", "wb") as f:
        f.truncate(MAX_INDEX_BYTES + 1)  # sparse: the size alone refuses it
    cases[str(big)] = f"the file is {MAX_INDEX_BYTES + 1} bytes; the limit is {MAX_INDEX_BYTES}"
    for source, expected in cases.items():
        res = run_ranks(_load_weights_worker, 1, source)[0]
        assert expected in res["error"], (source, res["error"])


def test_a_hugging_face_cache_snapshot_is_read_through_its_blob_symlinks(
        hf_folder: Path, tmp_path: Path) -> None:
    blobs = tmp_path / "models--tiny" / "blobs"
    snapshot = tmp_path / "models--tiny" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    shutil.copy(hf_folder / "model.safetensors", blobs / "0123abcd")
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    assert run_ranks(_load_weights_worker, 1, str(snapshot))[0]["error"] is None


def test_truncated_and_corrupt_dcp_storage_is_a_project_error(dcp_folder: Path,
                                                              tmp_path: Path) -> None:
    short = _copy(dcp_folder, tmp_path / "short")
    data = short / "__0_0.distcp"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    res = run_ranks(_load_weights_worker, 2, str(short))[0]
    assert f"{data}: {size // 2} bytes, but .metadata places data up to byte" in res["error"]
    corrupt = _copy(dcp_folder, tmp_path / "corrupt")
    data = corrupt / "__0_0.distcp"
    data.write_bytes(b"\0" * size)  # same length, no tensor in it: torch.load fails inside DCP
    for res in run_ranks(_load_weights_worker, 2, str(corrupt)):
        assert f"{corrupt}: dcp.load failed" in res["error"], res["error"]


# -- 4. load_state_dict checks everything before writing -----------------------------------


def _load_state_worker(rank: int, world: int) -> dict[str, Any]:
    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = inst.state.full_state_dict()
    doubled = {k: v * 2 for k, v in before.items()}
    errors = []
    for state in ({"model": doubled},
                  {"model": doubled, "optimizer": {"state": 3, "param_groups": []}},
                  {"model": doubled, "optimizer": {"state": {}, "param_groups": [{"lr": 1}]}}):
        try:
            inst.state.load_state_dict(state, opt)
        except PlanMismatchError as exc:
            errors.append(str(exc))
    after = inst.state.full_state_dict()
    return {"errors": errors, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "opt_state": len(opt.state)}


def test_load_state_dict_with_a_bad_optimizer_entry_leaves_the_model_unchanged() -> None:
    for res in run_ranks(_load_state_worker, 2):
        assert len(res["errors"]) == 3, res["errors"]
        assert "an optimizer was given but the state holds none" in res["errors"][0]
        assert "the optimizer entry is a dict without 'state' (a mapping)" in res["errors"][1]
        assert "param_groups must be mappings with 'params'" in res["errors"][2]
        assert res["unchanged"], "a refused load_state_dict wrote into the model"
        assert res["opt_state"] == 0


# -- 5. exports replace the previous one whole, or not at all ------------------------------


def _export_worker(rank: int, world: int, folder: str, shard_bytes: list[int],
                   limit: int | None) -> dict[str, Any]:
    """Export once per entry of ``shard_bytes``, doubling the weights before each export after
    the first; with ``limit``, the writer's file size limit (``ulimit -f``) for the last."""
    import resource

    model, inst = applied(world)
    fulls = []
    for i, max_shard_bytes in enumerate(shard_bytes):
        if i:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(2)
        fulls.append(inst.state.full_state_dict())
        if limit is not None and i == len(shard_bytes) - 1 and rank == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            inst.state.save_pretrained(folder, max_shard_bytes=max_shard_bytes)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            return {"error": f"{type(exc).__name__}: {exc}", "fulls": fulls}
    return {"error": None, "fulls": fulls}


def _load_full_worker(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    model, inst = applied(world, "meta")
    inst.state.load_weights(folder)
    return inst.state.full_state_dict()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("order", ["sharded-then-single", "single-then-sharded"])
def test_exporting_twice_into_one_folder_leaves_only_the_new_weights(order: str,
                                                                     tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sizes = [40_000, 1 << 40] if order == "sharded-then-single" else [1 << 40, 40_000]
    folder = tmp_path / "export"
    res = run_ranks(_export_worker, 2, str(folder), sizes, None)[0]
    assert res["error"] is None
    new = res["fulls"][-1]
    names = sorted(f.name for f in folder.iterdir() if "safetensors" in f.name)
    if order == "sharded-then-single":
        assert names == ["model.safetensors"]
    else:
        assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert not [f for f in folder.iterdir() if ".tmp-" in f.name]
    assert leftovers(folder) == []  # the staging folder is gone with the failed export
    loaded = run_ranks(_load_full_worker, 1, str(folder))[0]
    hf = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(hf) <= set(new)
    for name, value in new.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0)
    for name, value in hf.items():
        torch.testing.assert_close(value, new[name], atol=0, rtol=0)


def test_an_export_that_fails_on_the_writer_leaves_the_previous_export_exactly(
        tmp_path: Path) -> None:
    folder = tmp_path / "export"
    run_ranks(_export_worker, 2, str(folder), [40_000], None)
    before = _snapshot(folder)
    results = run_ranks(_export_worker, 2, str(folder), [40_000, 40_000], 20_000, timeout_s=120)
    for res in results:
        assert res["error"] is not None and res["error"].startswith(
            f"ExportError: save_pretrained into {folder} failed, so nothing was replaced"), \
            res["error"]
        assert "rank 0: writing" in res["error"] and "File too large" in res["error"]
    assert _snapshot(folder) == before


# -- 6. ranks agree before they load -------------------------------------------------------


def _mixed_load_worker(rank: int, world: int, sources: list[str]) -> dict[str, Any]:
    model, inst = applied(world, "meta")
    try:
        inst.state.load_weights(sources[rank])
    except WeightLoadError as exc:
        unset = [r.state for r in inst.state.status() if r.what == "weights"]
        return {"error": str(exc), "unset": unset}
    return {"error": None}


def test_ranks_handed_different_checkpoints_all_refuse_before_loading(
        hf_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    other = _copy(hf_folder, tmp_path / "other")
    state = load_file(str(other / "model.safetensors"))
    save_file({k: v * 2 for k, v in state.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    short = _copy(hf_folder, tmp_path / "short")
    data = short / "model.safetensors"
    os.truncate(data, data.stat().st_size - 8)
    for second in (other, short):
        results = run_ranks(_mixed_load_worker, 2, [str(hf_folder), str(second)])
        for rank, res in enumerate(results):
            assert res["error"] is not None, "a rank loaded another checkpoint than its peer"
            assert res["error"].startswith(f"ranks read different checkpoints: this rank "
                                           f"(rank {rank}) reads"), res["error"]
            assert f"rank(s) [{1 - rank}] read other contents" in res["error"]
            assert res["unset"] == ["unset"]


def test_ranks_reading_their_own_copies_of_one_checkpoint_load(hf_folder: Path,
                                                               tmp_path: Path) -> None:
    copy = _copy(hf_folder, tmp_path / "copy")
    results = run_ranks(_mixed_load_worker, 2, [str(hf_folder), str(copy)])
    assert [r["error"] for r in results] == [None, None]


# -- 5b. the export's manifest -------------------------------------------------------------


def _tamper(folder: Path, how: str) -> str:
    """Change an export the way issue 28 saw it changed; return the file the error names."""
    from safetensors.torch import load_file, save_file

    data = folder / "model.safetensors"
    if how == "truncated":
        os.truncate(data, data.stat().st_size - 4)
    elif how == "relabelled-dtype":  # F32 read as I32: same size, values around 1e9
        raw = data.read_bytes()
        data.write_bytes(raw.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1))
    elif how == "cut-config":  # a kill while config.json was written, as issue 41 saw it
        config = folder / "config.json"
        config.write_bytes(config.read_bytes()[:40])
        return str(config)
    elif how == "stale-shard":
        save_file(load_file(str(data)), str(folder / "model-00001-of-00002.safetensors"),
                  metadata={"format": "pt"})
        return str(folder)
    return str(data)


@pytest.mark.parametrize("how", ["truncated", "relabelled-dtype", "stale-shard", "cut-config"])
def test_an_export_changed_after_it_was_written_is_refused_by_name(how: str,
                                                                   tmp_path: Path) -> None:
    folder = tmp_path / "export"
    run_ranks(_export_worker, 2, str(folder), [1 << 40], None)
    manifest = json.loads((folder / "hyperrecipe.manifest.json").read_text())
    # every file a loader reads, transformers' included: the configs too
    assert sorted(manifest["files"]) == ["config.json", "generation_config.json",
                                         "model.safetensors"]
    named = _tamper(folder, how)
    results = run_ranks(_load_weights_worker, 2, str(folder))
    errors = [res["error"] for res in results]
    assert all(e is not None for e in errors), errors
    own = [e for e in errors if e.startswith(named)]
    assert own, errors
    expected = {"truncated": "bytes, hyperrecipe.manifest.json says",
                "cut-config": "40 bytes, hyperrecipe.manifest.json says",
                "relabelled-dtype": "its xxh3_128 is not the one in hyperrecipe.manifest.json",
                "stale-shard": "['model-00001-of-00002.safetensors'] are not in"}[how]
    assert expected in own[0]
    for e in errors:
        assert e in own or "cannot read the checkpoint on rank(s) [0]" in e, e
    assert run_ranks(_load_weights_worker, 1, str(folder))[0]["error"].startswith(named)


def _bind(folder: Path, how: str) -> Path:
    """Rewrite an export's manifest so that it vouches for none of the files a load reads,
    and put the weights in ``pytorch_model.bin`` (a name no export writes): ``empty`` lists
    no files, ``unlisted`` lists only ``config.json`` (its right size and digest)."""
    from safetensors.torch import load_file

    from hyperrecipe.runtime.state.integrity import digest_file, manifest_document

    manifest = folder / "hyperrecipe.manifest.json"
    old = json.loads(manifest.read_text())
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    config = folder / "config.json"
    files = {} if how == "empty" else {
        "config.json": (config.stat().st_size, digest_file(config, old["digest"]))}
    manifest.write_text(json.dumps(manifest_document(old["format"], old["digest"], files)))
    return manifest


@pytest.mark.parametrize("how", ["empty", "unlisted"])
def test_a_manifest_that_vouches_for_none_of_the_files_read_is_refused(
        how: str, tmp_path: Path) -> None:
    """A manifest binds the folder: it must list every file the load reads (before, one that
    listed nothing, or only other files, let pytorch_model.bin load unchecked)."""
    folder = tmp_path / "export"
    run_ranks(_export_worker, 1, str(folder), [1 << 40], None)
    manifest = _bind(folder, how)
    error = run_ranks(_load_weights_worker, 1, str(folder))[0]["error"]
    assert error is not None, "the load trusted a manifest that vouches for nothing it read"
    if how == "empty":
        assert error.startswith(f"{manifest}: lists no files, while an export lists every "
                                f"file it wrote; it vouches for nothing; the folder no longer "
                                f"holds what its export wrote"), error
    else:
        assert error.startswith(f"{folder}: ['pytorch_model.bin'] are not in "
                                f"hyperrecipe.manifest.json"), error


# -- 5c. a DCP checkpoint is committed last ------------------------------------------------


def _save_checkpoint_worker(rank: int, world: int, folder: str, how: str) -> dict[str, Any]:
    """Save a committed checkpoint, step, then write the same folder again ``how``:
    ``limited`` (save_checkpoint with rank 1 under ``ulimit -f``) or ``plain`` (dcp.save)."""
    import resource

    import torch.distributed.checkpoint as dcp

    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inst.state.save_checkpoint(folder, opt)
    ids = torch.arange(8).view(1, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    error = None
    if how == "limited":
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            inst.state.save_checkpoint(folder, opt)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            error = f"{type(exc).__name__}: {exc}"
    else:
        dcp.save(inst.state.state_dict(opt), checkpoint_id=folder)
    return {"error": error}


def _resume_error(rank: int, world: int, folder: str) -> str | None:
    return resume_worker(rank, world, folder)["error"]


def test_a_checkpoint_written_again_by_a_plain_dcp_save_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    run_ranks(_save_checkpoint_worker, 2, str(folder), "plain")
    expected = f"{folder}: written again after it was committed"
    for error in run_ranks(_resume_error, 2, str(folder)):
        assert error is not None and expected in error, error
    assert expected in run_ranks(_load_weights_worker, 1, str(folder))[0]["error"]


def test_a_failed_save_checkpoint_leaves_the_committed_one_that_loads(tmp_path: Path) -> None:
    """A save that fails (rank 1 under ``ulimit -f``) over a committed checkpoint used to leave
    the folder ``writing``, the committed one gone; it is written beside the folder now, and
    switched in only when complete (tests/runtime/state/test_checkpoint_bounded.py has the
    kills and stopped ranks)."""
    folder = tmp_path / "ckpt"
    results = run_ranks(_save_checkpoint_worker, 2, str(folder), "limited")
    for res in results:
        assert res["error"].startswith(f"ExportError: save_checkpoint into {folder} failed; "
                                       f"the folder holds what it held before (the new "
                                       f"checkpoint was never switched in):\n  rank 1: "
                                       f"dcp.save failed: "), res["error"]
    assert json.loads((folder / "hyperrecipe.commit.json").read_text())["state"] == "committed"
    assert run_ranks(_resume_error, 2, str(folder)) == [None, None]
    assert run_ranks(_load_weights_worker, 1, str(folder))[0]["error"] is None


def test_save_checkpoint_then_load_checkpoint_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    run_ranks(_commit_only_worker, 2, str(folder))
    record = json.loads((folder / "hyperrecipe.commit.json").read_text())
    assert record["state"] == "committed"
    assert run_ranks(_resume_error, 1, str(folder)) == [None]


def _commit_only_worker(rank: int, world: int, folder: str) -> None:
    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inst.state.save_checkpoint(folder, opt)


def test_a_checkpoint_of_thousands_of_foreign_tensors_gives_a_short_error(
        hf_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy(hf_folder, tmp_path / "hf")
    state = load_file(str(folder / "model.safetensors"))
    foreign = {f"other.{i}.weight": torch.zeros(1) for i in range(3000)}
    save_file({**state, **foreign}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    error = run_ranks(_load_weights_worker, 1, str(folder))[0]["error"]
    assert "the checkpoint does not fit the model (3000 problems)" in error
    assert "  ... and 2950 more" in error
    assert len(error.splitlines()) < 60
