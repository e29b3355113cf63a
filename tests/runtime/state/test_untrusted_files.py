"""Weight files built to cost the loader memory or time, or to be misread, refused by name
before they can: a ``pytorch_model.bin`` whose pickle record is a zip bomb, a safetensors header
whose entries escape the count, a valid ``.bin`` that starts with an empty tensor, and a complex
tensor bound for a real parameter.

Real files throughout: written by ``torch.save``, ``safetensors`` and ``save_pretrained``,
then rewritten with :mod:`zipfile` or byte by byte the way a hostile tool would.
"""

from __future__ import annotations

import resource
import struct
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import WeightLoadError
from hyperrecipe.runtime.state.checkpoint_files import (
    MAX_HEADER_ENTRIES,
    MAX_HEADER_ITEMS,
    MAX_TORCH_RECORDS,
    open_safetensors,
    open_torch_file,
    read_safetensors_header,
)
from tests.runtime.state.test_state_trust import _load_weights_worker


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_header(path: Path, text: bytes, data: bytes = b"") -> Path:
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


# pytorch_model.bin: the zip directory, read before torch.load


def test_a_bin_whose_pickle_record_is_deflated_is_refused_before_torch_inflates_it(
        tmp_path: Path) -> None:
    """torch.load inflates ``data.pkl`` whole before the unpickler reads a byte: 256 MiB of
    zeros after the pickle deflate to 250 KB and would be allocated in full (the review's 1 MB
    file cost 2 GB). torch.save never compresses a record, so any compressed one is refused
    from the zip directory alone."""
    plain = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.randn(4, 4)}, plain)
    bomb = tmp_path / "bomb" / "pytorch_model.bin"
    bomb.parent.mkdir()
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(bomb, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                packed = zipfile.ZipInfo(info.filename)
                packed.compress_type = zipfile.ZIP_DEFLATED
                with dst.open(packed, "w") as out:  # the pickle, then padding it never reads
                    out.write(data)
                    for _ in range(256):
                        out.write(bytes(1 << 20))
            else:
                dst.writestr(info, data)
    assert bomb.stat().st_size < 2 << 20
    rss = _max_rss_mb()
    start = time.perf_counter()
    with pytest.raises(WeightLoadError) as caught:
        open_torch_file(bomb)
    assert time.perf_counter() - start < 1.0
    assert _max_rss_mb() - rss < 64, "the record was inflated"
    assert str(caught.value) == (
        f"{bomb}: its zip records are not what torch.save writes (1 problem):\n"
        f"  record 'pytorch_model/data.pkl': compressed (method 8, deflate); torch.save "
        f"stores every record uncompressed (method 0), and torch.load would inflate it whole "
        f"before anything is checked")


def _central_entry(raw: bytes, name: bytes) -> int:
    """The byte offset of ``name``'s entry in the zip directory of ``raw``."""
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        (length,) = struct.unpack_from("<H", raw, at + 28)
        if raw[at + 46:at + 46 + length] == name:
            return at
        at = raw.find(b"PK\x01\x02", at + 46 + length)
    raise AssertionError(f"{name!r} not in the zip directory")


def test_a_bin_record_declaring_more_bytes_than_the_file_is_refused_by_name(
        tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.randn(4, 4)}, path)
    raw = bytearray(path.read_bytes())
    at = _central_entry(bytes(raw), b"pytorch_model/data/0")
    struct.pack_into("<2L", raw, at + 20, 1 << 30, 1 << 30)  # compressed, uncompressed size
    path.write_bytes(bytes(raw))
    (offset,) = struct.unpack_from("<L", raw, at + 42)
    with pytest.raises(WeightLoadError) as caught:
        open_torch_file(path)
    assert str(caught.value) == (
        f"{path}: its zip records are not what torch.save writes (1 problem):\n"
        f"  record 'pytorch_model/data/0': declares {1 << 30} bytes at byte {offset}; the file "
        f"holds {len(raw)}")


def _directory_of(count: int, size: int = 0) -> bytes:
    """A zip of ``count`` directory entries declaring ``size`` bytes each (in a zip64 extra
    field past 4 GiB) and zip64 end records, as torch.save writes, and no data: 50 bytes an
    entry, so 200,000 take 10 MB."""
    extra = struct.pack("<2H2Q", 1, 16, size, size) if size >= 0xFFFFFFFF else b""
    small = min(size, 0xFFFFFFFF)
    entry = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 45, 45, 0, 0, 0, 0, 0, small, small, 4,
                        len(extra), 0, 0, 0, 0, 0) + b"a/xx" + extra
    directory = entry * count
    zip64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count,
                        len(directory), 0)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(directory), 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                      0xFFFFFFFF, 0)
    return directory + zip64 + locator + end


def test_a_bin_whose_directory_lists_too_many_records_is_refused_without_walking_it(
        tmp_path: Path) -> None:
    """Checked against the count the end record declares, before a directory entry is
    parsed: :mod:`zipfile` would build an object for each of them first."""
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(_directory_of(200_000))
    rss = _max_rss_mb()
    start = time.perf_counter()
    with pytest.raises(WeightLoadError) as caught:
        open_torch_file(path)
    assert time.perf_counter() - start < 0.5
    assert _max_rss_mb() - rss < 32
    assert str(caught.value) == (
        f"{path}: its zip directory declares 200000 records; load_weights reads at most "
        f"{MAX_TORCH_RECORDS} (a storage per tensor, at most {MAX_HEADER_ENTRIES}, and "
        f"torch.save's own few)")


def test_a_size_past_4_gib_is_read_from_the_zip64_extra_field(tmp_path: Path) -> None:
    """A record of a checkpoint over 4 GiB gives its size in the entry's zip64 extra field;
    the 32-bit field holds 0xFFFFFFFF."""
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(_directory_of(1, 5 << 32))
    with pytest.raises(WeightLoadError) as caught:
        open_torch_file(path)
    assert str(caught.value) == (
        f"{path}: its zip records are not what torch.save writes (1 problem):\n"
        f"  record 'a/xx': declares {5 << 32} bytes at byte 0; the file holds "
        f"{path.stat().st_size}")


def test_a_file_that_is_not_a_zip_is_refused_before_torch_load(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"not a zip" * 10)
    with pytest.raises(WeightLoadError) as caught:
        open_torch_file(path)
    assert str(caught.value) == (
        f"{path}: not a zip archive (no end of central directory record in its last 90 "
        f"bytes); load_weights reads the format torch.save has written since torch 1.6 "
        f"(re-save a legacy file with torch.save)")


# pytorch_model.bin: where the storages lie


@pytest.mark.parametrize("state", [
    {"a.empty": torch.zeros(0), "b.weight": torch.randn(8, 4)},
    {"a.weight": torch.randn(3, 5), "b.empty": torch.zeros(0, 4), "c.bias": torch.randn(7)},
    {"a.empty": torch.zeros(0, dtype=torch.int64), "b.empty": torch.zeros(2, 0)},
], ids=["empty-first", "empty-between", "only-empty"])
def test_a_bin_holding_empty_tensors_reads_every_tensor_with_its_values(
        tmp_path: Path, state: dict[str, torch.Tensor]) -> None:
    """An empty tensor's record holds no bytes and no storage lies there: the file's first
    byte is found from the first record that holds some (from the first record of any size,
    a file saved with an empty tensor first was refused as lying at no record)."""
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    handle = open_torch_file(path)
    assert handle.keys() == list(state)
    for key, value in state.items():
        assert handle.dtype(key) == value.dtype and handle.shape(key) == tuple(value.shape)
        read = handle.get_slice(key)[tuple(slice(0, n) for n in value.shape)]
        assert read.shape == value.shape and torch.equal(read, value)
        out = torch.full_like(value, 7)
        handle.read_into(key, tuple(slice(0, n) for n in value.shape), out)
        assert torch.equal(out, value)


# safetensors headers: counted while parsed


def test_header_entries_spelled_with_a_json_escape_are_counted(tmp_path: Path) -> None:
    """``"data\\u005foffsets"`` is ``"data_offsets"`` once parsed, but not to a count of its
    bytes: 150,000 such entries were read as 150,000 tensors."""
    count = 150_000
    assert count * 7 < MAX_HEADER_ITEMS  # below the bound on separators: the count decides
    parts = [f'"k{i}":{{"dtype":"U8","shape":[0],"data\\u005foffsets":[0,0]}}'
             for i in range(count)]
    path = _write_header(tmp_path / "model.safetensors", ("{" + ",".join(parts) + "}").encode())
    start = time.perf_counter()
    with pytest.raises(WeightLoadError) as caught:
        read_safetensors_header(path)
    assert time.perf_counter() - start < 5.0
    assert str(caught.value) == (
        f"{path}: its header lists more than {MAX_HEADER_ENTRIES} tensors; load_weights reads "
        f"at most {MAX_HEADER_ENTRIES} per file (real checkpoints list at most a few thousand "
        f"per file); re-save it in several files (save_pretrained(max_shard_size=...))")


def test_header_entries_that_are_no_tensor_are_counted(tmp_path: Path) -> None:
    """``"k0":0`` names no ``data_offsets`` at all: 300,000 of them were parsed, then
    listed as 300,000 problems."""
    parts = [f'"k{i}":0' for i in range(300_000)]
    path = _write_header(tmp_path / "model.safetensors", ("{" + ",".join(parts) + "}").encode())
    with pytest.raises(WeightLoadError) as caught:
        read_safetensors_header(path)
    assert str(caught.value) == (
        f"{path}: its header lists more than {MAX_HEADER_ENTRIES} tensors; load_weights reads "
        f"at most {MAX_HEADER_ENTRIES} per file (real checkpoints list at most a few thousand "
        f"per file); re-save it in several files (save_pretrained(max_shard_size=...))")


def test_one_header_entry_holding_millions_of_values_is_refused_before_parsing(
        tmp_path: Path) -> None:
    """One entry can hide what the count of entries cannot see: 2,000,000 empty lists are
    6 MB of header and were 128 MB once parsed."""
    text = b'{"k":[' + b",".join([b"[]"] * 2_000_000) + b"]}"
    path = _write_header(tmp_path / "model.safetensors", text)
    rss = _max_rss_mb()
    with pytest.raises(WeightLoadError) as caught:
        read_safetensors_header(path)
    assert _max_rss_mb() - rss < 48
    assert str(caught.value) == (
        f"{path}: its header holds 4000001 JSON separators and brackets (',', '[', '{{'); "
        f"load_weights parses at most {MAX_HEADER_ITEMS} (16 per tensor of the "
        f"{MAX_HEADER_ENTRIES} a file may list; a tensor entry holds 6 plus one per dim of its "
        f"shape)")


def test_a_name_listed_twice_in_a_header_is_refused(tmp_path: Path) -> None:
    """json.loads keeps the last of two members of one name and drops the first unseen."""
    entry = '{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'
    path = _write_header(tmp_path / "model.safetensors",
                         f'{{"w":{entry},"w":{entry}}}'.encode(), b"ab")
    with pytest.raises(WeightLoadError) as caught:
        read_safetensors_header(path)
    assert str(caught.value) == (
        f"{path}: its header lists 'w' twice; a tensor's name is listed once")


def test_many_bad_header_entries_give_50_lines_and_a_count(tmp_path: Path) -> None:
    parts = [f'"k{i}":{{"dtype":"X9","shape":[0],"data_offsets":[0,0]}}' for i in range(1000)]
    path = _write_header(tmp_path / "model.safetensors", ("{" + ",".join(parts) + "}").encode())
    with pytest.raises(WeightLoadError) as caught:
        read_safetensors_header(path)
    lines = str(caught.value).splitlines()
    assert lines[0] == f"{path}: the header does not fit the file (1000 problems):"
    assert lines[1].startswith("  'k0': dtype 'X9' is not one load_weights reads (F64, F32,")
    assert lines[-1] == "  ... and 950 more"
    assert len(lines) == 52


@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_a_header_at_the_bounds_with_metadata_and_whitespace_is_read(tmp_path: Path) -> None:
    """The bounds count tensors, not ``__metadata__``; JSON whitespace anywhere is JSON."""
    parts = [f'"t{i}" : {{ "dtype" : "U8" , "shape" : [ 1 , 1 ] , "data_offsets" : [ {i} , '
             f'{i + 1} ] }}' for i in range(MAX_HEADER_ENTRIES)]
    text = ('\n{ "__metadata__" : { "format" : "pt" } ,\n' + " ,\n".join(parts) + "\n}\n").encode()
    path = _write_header(tmp_path / "model.safetensors", text, bytes(MAX_HEADER_ENTRIES))
    entries = read_safetensors_header(path)
    assert len(entries) == MAX_HEADER_ENTRIES
    assert entries[f"t{MAX_HEADER_ENTRIES - 1}"][1] == [1, 1]


# dtype kinds: complex is its own


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_complex_tensor_into_a_real_parameter_is_refused_by_name(tmp_path: Path) -> None:
    """copy_ from complex64 into float32 keeps the real part and warns; the imaginary part
    would be gone without an error."""
    from tests.support.runtime_harness import llama

    folder = tmp_path / "complex"
    model: Any = llama()  # a transformers model: save_pretrained is not typed on nn.Module
    model.save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    norm = state["model.norm.weight"]
    state["model.norm.weight"] = torch.complex(norm, torch.ones_like(norm))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    error = run_ranks(_load_weights_worker, 1, str(folder))[0]["error"]
    assert error is not None, "a complex tensor loaded into a real parameter"
    assert ("'model.norm.weight' in model.safetensors: stored as torch.complex64, the model's "
            "'model.norm.weight' is torch.float32 (complex into floating); load_weights "
            "converts dtypes within their kind only (floating, complex, integer): a header "
            "relabelled from F32 to I32 reads as integers, a complex tensor into a real one "
            "drops its imaginary part") in error, error


def test_a_complex_tensor_still_reads_into_a_complex_destination(tmp_path: Path) -> None:
    value = torch.tensor([1 + 5j, 2 - 7j], dtype=torch.complex64)
    path = tmp_path / "c.safetensors"
    save_file({"w": value}, str(path))
    out = torch.empty(2, dtype=torch.complex128)
    open_safetensors(path).read_into("w", (slice(0, 2),), out)
    assert torch.equal(out, value.to(torch.complex128))
