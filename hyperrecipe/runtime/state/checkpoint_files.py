"""What a weight file's own structure says, checked before a byte of the model changes.

A folder that ``save_pretrained`` of transformers (or any other tool) wrote has no manifest of
ours, so its files are checked against themselves: a safetensors header is parsed here, not by
the ``safetensors`` library (whose refusals of a bad dtype or shape do not name the tensor),
and every entry must be a known dtype whose ``dtype x shape`` bytes equal its
``data_offsets`` span, the spans must tile the data section exactly (no overlap, no gap, none
past the end of the file: a truncated file is refused here), and the header is bounded
(:data:`MAX_HEADER_BYTES`) and parsed in one pass, so that 300,000 entries cost a fraction of
a second and a refusal lists a few names and a count. The tensors are then views of the
memory-mapped file: reading a rank's slice copies it once, straight into the model.

A ``pytorch_model.bin`` is memory-mapped by ``torch.load(mmap=True, weights_only=True)``, which
takes each storage's size from the pickle and never compares it with the zip record holding
the bytes: a record cut short would be read past its end (the next record's bytes, as
weights). :func:`check_torch_records` compares each storage with its record.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hyperrecipe.errors import WeightLoadError

__all__ = ["MAX_HEADER_BYTES", "SafetensorsEntry", "check_torch_records", "listing",
           "open_safetensors", "read_safetensors_header"]

MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (the ``safetensors`` library's own bound)."""

MAX_LISTED = 50
"""Problems an error lists one per line; the rest are counted (a header of 300,000 foreign
tensors made a 300,000-line error)."""

DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "C64": torch.complex64,
}
"""The safetensors dtypes read, by their header names."""


def listing(head: str, problems: Sequence[str], more: int = 0) -> str:
    """``head`` with the first :data:`MAX_LISTED` problems one per line and the rest counted;
    ``more`` problems were counted but not formatted (they come after ``problems``)."""
    total = len(problems) + more
    shown = list(problems[:MAX_LISTED])
    if total > len(shown):
        shown.append(f"... and {total - len(shown)} more")
    return f"{head} ({total} problem{'s' * (total != 1)}):\n  " + "\n  ".join(shown)


SafetensorsEntry = tuple[torch.dtype, list[int], int]
"""One tensor of a checked safetensors header: dtype, shape (as the header has it), and the
byte offset of its data in the file (a plain tuple: a header may hold hundreds of
thousands)."""

_KNOWN = {name: (dtype, dtype.itemsize) for name, dtype in DTYPES.items()}


def read_safetensors_header(path: Path) -> dict[str, SafetensorsEntry]:
    """The tensors of the safetensors file ``path``, each checked against the file, in one
    pass over the header.

    Raises:
        WeightLoadError: the file cannot be read, its header is too large or malformed, or an
            entry does not fit the file (its dtype is unknown, its dtype x shape bytes differ
            from its span, spans overlap, leave a gap or run past the end): every such entry
            named, with the file, in a bounded listing.
    """
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            if len(head) < 8:
                raise WeightLoadError(f"{path}: {size} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise WeightLoadError(
                    f"{path}: its header claims {length} bytes; the file holds {size - 8} after "
                    f"the length and headers are read up to {MAX_HEADER_BYTES} bytes")
            text = handle.read(length)
    except OSError as exc:
        raise WeightLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WeightLoadError(f"{path}: its header is not JSON ({exc!s:.200})") from None
    if not isinstance(header, dict):
        raise WeightLoadError(f"{path}: its header is not a JSON object")
    header.pop("__metadata__", None)
    base = 8 + length
    entries: dict[str, SafetensorsEntry] = {}
    spans: list[tuple[int, int, str]] = []
    problems: list[str] = []
    prod = math.prod
    for name, entry in header.items():
        try:
            dtype_name, shape, (lo, hi) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = prod(shape)  # not an int when a dimension is not one
            if (type(numel) is not int or type(lo) is not int or type(hi) is not int
                    or not 0 <= lo <= hi or type(shape) is not list
                    or (shape and min(shape) < 0)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            problems.append(f"{name!r:.200}: not a tensor entry (dtype, shape and data_offsets "
                            f"of non-negative integers)")
            continue
        known = _KNOWN.get(dtype_name) if type(dtype_name) is str else None
        if known is None:
            problems.append(f"{name!r:.200}: dtype {dtype_name!r:.20} is not one load_weights "
                            f"reads ({', '.join(DTYPES)})")
            continue
        spans.append((lo, hi, name))
        if numel * known[1] != hi - lo:
            problems.append(f"{name!r:.200}: {dtype_name} {shape} is {numel * known[1]} bytes, "
                            f"its data_offsets [{lo}, {hi}] span {hi - lo} (a relabelled dtype "
                            f"or shape)")
            continue
        entries[name] = (known[0], shape, base + lo)
    spans.sort()
    end = 0
    for lo, hi, name in spans:
        if lo != end:
            if lo < end:
                problems.append(f"{name!r:.200}: data_offsets [{lo}, {hi}] overlap another "
                                f"tensor's bytes (which end at {end})")
            else:
                problems.append(f"{name!r:.200}: data_offsets [{lo}, {hi}] leave {lo - end} "
                                f"bytes before it that no tensor holds")
        if hi > end:
            end = hi
    data = size - base
    if end > data:
        problems.append(f"the tensors' data_offsets end at {end}, the file holds {data} bytes "
                        f"of data (a truncated file)")
    elif end < data:
        problems.append(f"{data - end} bytes after the last tensor that no tensor holds")
    if problems:
        raise WeightLoadError(listing(f"{path}: the header does not fit the file", problems))
    return entries


class _SafetensorsFile:
    """A checked safetensors file, memory-mapped, with ``safe_open``'s ``keys()`` and
    ``get_slice(key)``; slices are views of the mapping (no copy until written into the
    model)."""

    def __init__(self, path: Path, entries: Mapping[str, SafetensorsEntry]) -> None:
        self.path = path
        self.entries = entries
        self._map: mmap.mmap | None = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key][1])

    def get_slice(self, key: str) -> _MappedTensor:
        dtype, shape, start = self.entries[key]
        numel = math.prod(shape)
        if numel == 0:
            return _MappedTensor(torch.empty(shape, dtype=dtype))
        if self._map is None:
            with open(self.path, "rb") as handle:
                # ACCESS_COPY: a private mapping, writable for torch.frombuffer, never the file.
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        if start % dtype.itemsize:  # another writer's unaligned offsets: no typed view there
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=numel * dtype.itemsize,
                                   offset=start)
            return _MappedTensor(raw.clone().view(dtype).view(shape))
        flat = torch.frombuffer(self._map, dtype=dtype, count=numel, offset=start)
        return _MappedTensor(flat.view(shape))


class _MappedTensor:
    """A tensor with a safetensors slice's ``get_shape()`` and ``[block]``."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, block: tuple[slice, ...]) -> Tensor:
        return self.tensor[block]


def open_safetensors(path: Path) -> _SafetensorsFile:
    """``path`` checked (:func:`read_safetensors_header`) and ready to be read by slices.

    Raises:
        WeightLoadError: as :func:`read_safetensors_header`; on a big-endian host (the format
            is little-endian and the views are not byte-swapped).
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise WeightLoadError(f"{path}: safetensors is little-endian; this host is not")
    return _SafetensorsFile(path, read_safetensors_header(path))


def check_torch_records(path: Path, state: Mapping[str, Tensor]) -> None:
    """Refuse a memory-mapped ``torch.load`` result whose storages do not lie in their zip
    records: each storage's bytes must start where a ``data/<key>`` record starts and fit in
    it.

    Raises:
        WeightLoadError: a storage is longer than its record (a record cut short) or lies at
            no record; every such tensor named.
    """
    try:
        reader: Any = torch._C.PyTorchFileReader(str(path))  # get_record_offset is not typed
        records = {reader.get_record_offset(n): (n, reader.get_record_size(n))
                   for n in reader.get_all_records() if n.startswith("data/")}
    except (RuntimeError, OSError) as exc:
        raise WeightLoadError(f"{path}: cannot read its zip records: {exc!s:.200}") from None
    storages: dict[int, tuple[int, list[str]]] = {}
    for key, tensor in state.items():
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1].append(key)
    if not storages:
        return
    if not records:
        raise WeightLoadError(f"{path}: holds tensors but no data records")
    base = min(storages) - min(records)  # the mapping's address of the file's first byte
    problems: list[str] = []
    for ptr, (nbytes, keys) in sorted(storages.items()):
        names = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
        record = records.get(ptr - base)
        if record is None:
            problems.append(f"{names}: its storage lies at no data record of the file")
        elif record[1] < nbytes:
            problems.append(f"{names}: its storage is {nbytes} bytes, its record {record[0]} "
                            f"holds {record[1]} (a record cut short)")
    if problems:
        raise WeightLoadError(listing(f"{path}: the tensors do not fit the file's records",
                                      problems))
