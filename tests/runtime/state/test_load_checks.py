"""What ``load_weights`` checks in a folder without a manifest of ours (issue 28, point 5 and
8), and a reload into a model that already holds weights (issue 29): every check runs before
the first write, so a refused load leaves the model bit-identical, and no second copy of the
model is kept.

Real files throughout: ``save_pretrained`` of a tiny Llama (transformers writes no
``hyperrecipe.manifest.json``), then damaged the way a bad disk, a bad tool or an attacker would;
real gloo ranks at tp=2.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import WeightLoadError
from tests.runtime.state.test_state_trust import _load_weights_worker
from tests.support.checkpoint_harness import applied

Header = dict[str, Any]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.runtime_harness import llama

    folder = tmp_path_factory.mktemp("hf")
    llama().save_pretrained(folder)
    assert not (folder / "hyperrecipe.manifest.json").exists()
    return folder


def _rewrite_header(path: Path, change: Callable[[Header, bytes], tuple[Header, bytes]]) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = change(json.loads(raw[8:8 + length]), raw[8 + length:])
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _by_offset(header: Header) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"),
                  key=lambda k: header[k]["data_offsets"][0])


def _damage(header: Header, data: bytes, how: str) -> tuple[Header, bytes, str, str]:
    """``header`` and ``data`` damaged ``how``; the tensor the refusal must name and a fragment
    of what it must say."""
    keys = _by_offset(header)
    last = keys[-1]
    if how == "relabelled-size":  # F32 relabelled F16: the bytes no longer fit the shape
        name = "model.layers.0.mlp.up_proj.weight"
        header[name]["dtype"] = "F16"
        lo, hi = header[name]["data_offsets"]
        return header, data, name, f"F16 [128, 64] is 16384 bytes, its data_offsets [{lo}, {hi}]"
    if how == "reshaped":
        name = "model.norm.weight"
        header[name]["shape"] = [32]
        return header, data, name, "F32 [32] is 128 bytes"
    if how == "overlap":  # two tensors of one shape read the same bytes
        name = "model.layers.1.self_attn.q_proj.weight"
        header[name]["data_offsets"] = header["model.layers.1.self_attn.o_proj.weight"][
            "data_offsets"]
        return header, data, name, "overlap another tensor's bytes"
    if how == "gap":
        lo, hi = header[last]["data_offsets"]
        header[last]["data_offsets"] = [lo + 4, hi + 4]
        return header, data + bytes(4), last, "leave 4 bytes before it that no tensor holds"
    if how == "truncated":  # the header is whole, the data is cut short
        return header, data[:-4], "the tensors' data_offsets end at", "(a truncated file)"
    assert how == "relabelled-kind"  # F32 as I32: every size fits, the bits read as ~1e9
    for key in keys:
        header[key]["dtype"] = "I32"
    return header, data, "model.embed_tokens.weight", "stored as torch.int32, the model's"


def _reload_worker(rank: int, world: int, good: str, bad: str) -> dict[str, Any]:
    """Load ``good``, then ``bad``: the refusal and whether the model is bit-identical."""
    model, inst = applied(world)
    inst.state.load_weights(good)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        inst.state.load_weights(bad)
    except WeightLoadError as exc:
        after = model.state_dict()
        return {"error": str(exc), "unchanged": all(torch.equal(before[k], after[k])
                                                    for k in before),
                "unset": [r.error for r in inst.state.status() if r.state == "unset"]}
    return {"error": None}


DAMAGES = ["relabelled-size", "reshaped", "overlap", "gap", "truncated", "relabelled-kind"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_safetensors_file_without_a_manifest_is_refused_by_name_before_writing(
        how: str, hf_folder: Path, tmp_path: Path) -> None:
    bad = shutil.copytree(hf_folder, tmp_path / "bad")
    named: list[str] = []

    def change(header: Header, data: bytes) -> tuple[Header, bytes]:
        header, data, name, says = _damage(header, data, how)
        named.extend((name, says))
        return header, data

    _rewrite_header(bad / "model.safetensors", change)
    name, says = named
    for res in run_ranks(_reload_worker, 2, str(hf_folder), str(bad)):
        error = res["error"]
        assert error is not None, f"{how}: the damaged file loaded"
        assert "model.safetensors" in error and says in error, error
        assert (f"{name!r}" if name.startswith("model.") else name) in error, error
        assert res["unchanged"], "a refused reload wrote into the model"
        assert res["unset"] == []
        assert len(error.splitlines()) < 60


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_pytorch_model_bin_with_a_record_cut_short_is_refused_by_name(
        hf_folder: Path, tmp_path: Path) -> None:
    from tests.support.runtime_harness import llama

    good = tmp_path / "good"
    good.mkdir()
    torch.save(llama().state_dict(), good / "pytorch_model.bin")
    bad = tmp_path / "bad"
    bad.mkdir()
    with zipfile.ZipFile(good / "pytorch_model.bin") as src, \
            zipfile.ZipFile(bad / "pytorch_model.bin", "w", zipfile.ZIP_STORED) as dst:
        records = src.namelist()
        victim = next(n for n in records if n.endswith("/data/10"))
        for record in records:
            raw = src.read(record)
            dst.writestr(record, raw[:len(raw) // 2] if record == victim else raw)
    # What the loader is up against: torch's mmap load takes the size from the pickle.
    mapped = torch.load(bad / "pytorch_model.bin", mmap=True, weights_only=True)
    assert len(mapped) == len(llama().state_dict())
    for res in run_ranks(_reload_worker, 2, str(good), str(bad)):
        error = res["error"]
        assert error is not None, "a record cut short loaded"
        assert f"{bad / 'pytorch_model.bin'}: the tensors do not fit the file's records" in error
        assert "holds 8192 (a record cut short)" in error, error
        assert "'model.layers.1.self_attn.q_proj.weight'" in error, error
        assert res["unchanged"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_header_of_300000_entries_gives_a_short_error_naming_the_file(
        hf_folder: Path, tmp_path: Path) -> None:
    bad = shutil.copytree(hf_folder, tmp_path / "bad")

    def change(header: Header, data: bytes) -> tuple[Header, bytes]:
        end = len(data)
        header.update({f"foreign.{i}.weight": {"dtype": "F32", "shape": [0],
                                               "data_offsets": [end, end]}
                       for i in range(300_000)})
        return header, data

    _rewrite_header(bad / "model.safetensors", change)
    error = run_ranks(_load_weights_worker, 1, str(bad))[0]["error"]
    assert error is not None
    # refused by its count before the header is parsed (main parsed it, then listed 50
    # unexpected keys and counted the rest)
    assert (f"{bad / 'model.safetensors'}: its header lists 300021 tensors; load_weights reads "
            f"at most 100000 per file") in error, error
    assert len(error.splitlines()) < 60
    assert len(error) < 10_000


@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_a_header_at_the_entry_bound_is_parsed_and_its_tensors_checked(
        hf_folder: Path, tmp_path: Path) -> None:
    """The bound counts entries; a header just under it is read as any other (here refused
    for its unexpected keys, listed by name)."""
    from hyperrecipe.runtime.state.checkpoint_files import (MAX_HEADER_ENTRIES,
                                                            read_safetensors_header)

    bad = shutil.copytree(hf_folder, tmp_path / "bad")
    count = len(read_safetensors_header(bad / "model.safetensors"))

    def change(header: Header, data: bytes) -> tuple[Header, bytes]:
        end = len(data)
        header.update({f"foreign.{i}.weight": {"dtype": "F32", "shape": [0],
                                               "data_offsets": [end, end]}
                       for i in range(MAX_HEADER_ENTRIES - count)})
        return header, data

    _rewrite_header(bad / "model.safetensors", change)
    assert len(read_safetensors_header(bad / "model.safetensors")) == MAX_HEADER_ENTRIES


def _reload_values_worker(rank: int, world: int, first: str, second: str) -> dict[str, Any]:
    model, inst = applied(world)
    inst.state.load_weights(first)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    inst.state.load_weights(second)
    return {"full": inst.state.full_state_dict(),
            "same_storage": ptrs == {n: p.data_ptr() for n, p in model.named_parameters()}}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_reload_of_another_checkpoint_holds_its_values_in_the_same_tensors(
        hf_folder: Path, tmp_path: Path) -> None:
    """The second load writes in place (an optimizer keeps its parameters) and converts a
    bf16 checkpoint to the model's fp32, as the first does."""
    from safetensors.torch import load_file, save_file

    second = shutil.copytree(hf_folder, tmp_path / "second")
    state = {k: (v * 2 + 1).to(torch.bfloat16)
             for k, v in load_file(str(hf_folder / "model.safetensors")).items()}
    save_file(state, str(second / "model.safetensors"), metadata={"format": "pt"})
    for res in run_ranks(_reload_values_worker, 2, str(hf_folder), str(second)):
        assert res["same_storage"]
        for key, value in state.items():
            assert torch.equal(res["full"][key], value.float()), key


def _faulty_reload_worker(rank: int, world: int, folder: str, fail_at: int) -> dict[str, Any]:
    """A fault while copying, after every check passed: the read of the ``fail_at``-th tensor
    raises (no real file fails there: a file changed after its check faults the mapping)."""
    from hyperrecipe.runtime.state import weights

    model, inst = applied(world)
    inst.state.load_weights(folder)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = weights._Safetensors.plan
    reads: list[str] = []

    def faulty_plan(self: Any, *args: Any) -> Any:
        reader = plan(self, *args)

        def read(target: Any, key: str | None = None) -> torch.Tensor:
            reads.append(target.fqn)
            if len(reads) == fail_at:
                raise OSError(5, "Input/output error")
            return reader.read(target, key)

        return weights._Reader(read=read, found=reader.found, files=reader.files,
                               ignored=reader.ignored)

    weights._Safetensors.plan = faulty_plan  # type: ignore[method-assign]
    try:
        inst.state.load_weights(folder)
    except WeightLoadError as exc:
        after = model.state_dict()
        written = reads[:fail_at - 1]
        return {"error": str(exc), "written": written, "failed": reads[fail_at - 1],
                "written_unset": all(torch.isnan(after[k]).all() for k in written),
                "rest_unchanged": all(torch.equal(before[k], after[k])
                                      for k in before if k not in written),
                "unset": [r.error for r in inst.state.status() if r.state == "unset"]}
    return {"error": None}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_fault_while_copying_marks_what_was_written_unset_not_a_silent_mixture(
        hf_folder: Path) -> None:
    for res in run_ranks(_faulty_reload_worker, 2, str(hf_folder), 3):
        assert res["error"] is not None
        assert len(res["written"]) == 2
        assert f"reading {res['failed']!r} failed after its checks passed" in res["error"]
        assert ("2 tensors that held weights before this load are now unset (status() lists "
                "them); load a checkpoint again before training: OSError") in res["error"]
        assert res["written_unset"] and res["rest_unchanged"]
        assert res["unset"] and res["unset"][0].startswith("2 tensors have no value yet")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_tensor_in_two_files_of_a_folder_without_an_index_is_refused(hf_folder: Path,
                                                                        tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "two"
    folder.mkdir()
    state = load_file(str(hf_folder / "model.safetensors"))
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:10]}, str(folder / "a.safetensors"))
    save_file({k: state[k] for k in keys[9:]}, str(folder / "b.safetensors"))
    error = run_ranks(_load_weights_worker, 1, str(folder))[0]["error"]
    assert error is not None and f"{keys[9]!r} is in both a.safetensors and b.safetensors" in error


def test_a_tensor_at_an_unaligned_offset_reads_its_values(tmp_path: Path) -> None:
    """safetensors' own writer orders tensors so every offset is aligned; another writer may
    put an F32 tensor after 3 bytes of U8."""
    from hyperrecipe.runtime.state.checkpoint_files import open_safetensors

    small = torch.tensor([1, 2, 3], dtype=torch.uint8)
    values = torch.arange(6, dtype=torch.float32).view(2, 3) / 7
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [3, 27]}}
    text = json.dumps(header).encode()
    path = tmp_path / "unaligned.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + small.numpy().tobytes()
                     + values.numpy().tobytes())
    handle = open_safetensors(path)
    assert torch.equal(handle.get_slice("b")[(slice(0, 2), slice(1, 3))], values[:, 1:])
    assert torch.equal(handle.get_slice("a")[(slice(0, 3),)], small)
