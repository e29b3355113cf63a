"""What a weight file's own structure says, checked before a byte of the model changes.

A folder that ``save_pretrained`` of transformers (or any other tool) wrote has no manifest of
ours, so its files are checked against themselves: a safetensors header is parsed here, not by
the ``safetensors`` library (whose refusals of a bad dtype or shape do not name the tensor),
and every entry must be a known dtype whose ``dtype x shape`` bytes equal its
``data_offsets`` span, the spans must tile the data section exactly (no overlap, no gap, none
past the end of the file: a truncated file is refused here), and the header is bounded
(:data:`MAX_HEADER_BYTES`, :data:`MAX_HEADER_ITEMS` JSON values counted before parsing, and
:data:`MAX_HEADER_ENTRIES` tensors counted while parsing) and checked in one pass, so that a
refusal is fast and lists a few names and a count. The tensors are then read by positional
reads (``os.preadv``) of the descriptor the header was checked through, straight into the
model's shard where the bytes can land as they are, else through one bounded staging buffer;
never through a memory mapping, where a file shortened after its check (another process, a
network filesystem) kills the process with SIGBUS instead of raising.

A ``pytorch_model.bin`` is memory-mapped by ``torch.load(mmap=True, weights_only=True)``, which
takes each storage's size from the pickle and never compares it with the zip record holding
the bytes: a record cut short would be read past its end (the next record's bytes, as
weights). :func:`check_torch_records` compares each storage with its record. Before that
load, :func:`check_torch_archive` reads the zip's central directory itself: ``torch.load``
inflates a compressed record (``torch.save`` never compresses one) whole before anything is
checked, so a 1 MB file whose ``data.pkl`` is deflated zeros made it allocate 2 GB.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hyperrecipe._files import open_regular
from hyperrecipe.errors import WeightLoadError

__all__ = ["MAX_HEADER_BYTES", "MAX_HEADER_ENTRIES", "MAX_HEADER_ITEMS", "MAX_TORCH_RECORDS",
           "SafetensorsEntry", "Staging", "TorchFile", "check_torch_archive",
           "check_torch_records", "dtype_kind", "listing", "open_safetensors", "open_torch_file",
           "read_safetensors_header"]

MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (the ``safetensors`` library's own bound)."""

MAX_HEADER_ENTRIES = 100_000
"""The most tensors one safetensors file may list, counted while its header is parsed, member
by member, so the parse stops at the first one past it however the names are spelled (a
header of 300,000 entries cost 1.6 s in ``json.loads`` alone before it was refused; a count
of ``"data_offsets"`` bytes before parsing missed names spelled with a JSON escape, and
entries that are no tensor at all). Real checkpoints list far fewer per file: hub exports
are sharded at a few GB, so a file of Llama 3.1 405B or DeepSeek-V3 lists hundreds to about
1,500 tensors; even a whole DeepSeek-V3 (about 91,000 tensors with its FP8 scales, the
largest count of a published model we know) would fit in one file."""

MAX_HEADER_ITEMS = 16 * MAX_HEADER_ENTRIES
"""The most ``,``, ``[`` and ``{`` bytes a safetensors header may hold, counted before it is
parsed. Every JSON value but the first of its container follows a comma, so this bounds the
values a parse builds at any depth: a header of one entry holding millions of empty lists
(``[[],[],...]``, 3 bytes each, 64 bytes each once parsed) cannot make the parse allocate
gigabytes. A tensor entry holds 6 plus one per dim of its shape; 16 per tensor leaves room
for 10-dim shapes and metadata (bytes inside strings count too, which only errs high)."""

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


def dtype_kind(dtype: torch.dtype) -> str:
    """``"complex"``, ``"floating"`` or ``"integer"`` (``bool`` among the integers)."""
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


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
        fd = open_regular(path)  # not blocking: a FIFO swapped in is refused
    except OSError as exc:
        raise WeightLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        return _read_header(path, fd)
    finally:
        os.close(fd)


def _read_header(path: Path, fd: int) -> dict[str, SafetensorsEntry]:
    try:
        with os.fdopen(os.dup(fd), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(0)  # a shared descriptor may have been read (hashed) before
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
    listed = text.count(b'"data_offsets"')  # a plainly oversized header, refused unparsed
    if listed > MAX_HEADER_ENTRIES:
        raise WeightLoadError(_too_many_tensors(path, str(listed)))
    items = text.count(b",") + text.count(b"[") + text.count(b"{")
    if items > MAX_HEADER_ITEMS:
        per = MAX_HEADER_ITEMS // MAX_HEADER_ENTRIES
        raise WeightLoadError(
            f"{path}: its header holds {items} JSON separators and brackets (',', '[', '{{'); "
            f"load_weights parses at most {MAX_HEADER_ITEMS} ({per} per tensor of the "
            f"{MAX_HEADER_ENTRIES} a file may list; a tensor entry holds 6 plus one per dim "
            f"of its shape)")
    header = _header_members(path, text)
    header.pop("__metadata__", None)
    if len(header) > MAX_HEADER_ENTRIES:
        raise WeightLoadError(_too_many_tensors(path, str(len(header))))
    base = 8 + length
    entries: dict[str, SafetensorsEntry] = {}
    spans: list[tuple[int, int, str]] = []
    problems = _Problems()
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
            problems.add(f"{name!r:.200}: not a tensor entry (dtype, shape and data_offsets "
                         f"of non-negative integers)")
            continue
        known = _KNOWN.get(dtype_name) if type(dtype_name) is str else None
        if known is None:
            problems.add(f"{name!r:.200}: dtype {dtype_name!r:.20} is not one load_weights "
                         f"reads ({', '.join(DTYPES)})")
            continue
        spans.append((lo, hi, name))
        if numel * known[1] != hi - lo:
            problems.add(f"{name!r:.200}: {dtype_name} {shape} is {numel * known[1]} bytes, "
                         f"its data_offsets [{lo}, {hi}] span {hi - lo} (a relabelled dtype "
                         f"or shape)")
            continue
        entries[name] = (known[0], shape, base + lo)
    spans.sort()
    end = 0
    for lo, hi, name in spans:
        if lo != end:
            if lo < end:
                problems.add(f"{name!r:.200}: data_offsets [{lo}, {hi}] overlap another "
                             f"tensor's bytes (which end at {end})")
            else:
                problems.add(f"{name!r:.200}: data_offsets [{lo}, {hi}] leave {lo - end} "
                             f"bytes before it that no tensor holds")
        if hi > end:
            end = hi
    data = size - base
    if end > data:
        problems.add(f"the tensors' data_offsets end at {end}, the file holds {data} bytes "
                     f"of data (a truncated file)")
    elif end < data:
        problems.add(f"{data - end} bytes after the last tensor that no tensor holds")
    if problems:
        raise WeightLoadError(problems.listing(f"{path}: the header does not fit the file"))
    return entries


def _too_many_tensors(path: Path, count: str) -> str:
    return (f"{path}: its header lists {count} tensors; load_weights reads at most "
            f"{MAX_HEADER_ENTRIES} per file (real checkpoints list at most a few thousand per "
            f"file); re-save it in several files (save_pretrained(max_shard_size=...))")


_DECODER = json.JSONDecoder()
_OPEN = re.compile(r"[ \t\n\r]*\{[ \t\n\r]*(\}[ \t\n\r]*)?")  # JSON's whitespace only
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
_NEXT = re.compile(r"[ \t\n\r]*([,}])[ \t\n\r]*")


def _header_members(path: Path, text: bytes) -> dict[str, Any]:
    """The members of the JSON object ``text``, counted while they are parsed: the parse
    stops at the first member past :data:`MAX_HEADER_ENTRIES` tensors (and one
    ``__metadata__``), however the names are spelled (a count of ``"data_offsets"`` bytes
    misses ``"data\\u005foffsets"`` and entries that are no tensor at all). Each member's
    value is parsed by json's C scanner; a name listed twice is refused (``json.loads``
    would keep the last and silently drop the first).

    Raises:
        WeightLoadError: not UTF-8, not a JSON object, more members than the bound, or a
            name listed twice.
    """
    members: dict[str, Any] = {}
    try:
        doc = text.decode("utf-8")
        match = _OPEN.match(doc)
        if match is None:
            raise WeightLoadError(f"{path}: its header is not a JSON object")
        at, closed = match.end(), match.group(1) is not None
        while not closed:
            if not doc.startswith('"', at):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes",
                                           doc, at)
            name, at = _DECODER.raw_decode(doc, at)  # a str: it starts with a quote
            match = _COLON.match(doc, at)
            if match is None:
                raise json.JSONDecodeError("Expecting ':' delimiter", doc, at)
            value, at = _DECODER.raw_decode(doc, match.end())
            if name in members:
                raise WeightLoadError(f"{path}: its header lists {name!r:.200} twice; a "
                                      f"tensor's name is listed once")
            members[name] = value
            if len(members) > MAX_HEADER_ENTRIES + 1:  # one may be __metadata__
                raise WeightLoadError(_too_many_tensors(path, f"more than {MAX_HEADER_ENTRIES}"))
            match = _NEXT.match(doc, at)
            if match is None:
                raise json.JSONDecodeError("Expecting ',' delimiter", doc, at)
            at, closed = match.end(), match.group(1) == "}"
        if at != len(doc):
            raise json.JSONDecodeError("Extra data", doc, at)
    except WeightLoadError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WeightLoadError(f"{path}: its header is not JSON ({exc!s:.200})") from None
    return members


class _Problems:
    """What is wrong with one file: the first :data:`MAX_LISTED` problems kept as text, the
    rest only counted, so a header of 100,000 bad entries holds 50 strings, not 100,000."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.more = 0

    def __bool__(self) -> bool:
        return bool(self.shown)

    def add(self, problem: str) -> None:
        if len(self.shown) < MAX_LISTED:
            self.shown.append(problem)
        else:
            self.more += 1

    def listing(self, head: str) -> str:
        return listing(head, self.shown, self.more)


STAGING_BYTES = 8 << 20
"""The largest staging buffer of a read whose bytes cannot land in place (a slice across an
inner dim, a dtype conversion, a destination on an accelerator): such a read streams through
it in pieces, so its extra memory is bounded whatever the tensor's size."""


_SKIP_READ_BYTES = 64 << 10
"""Between two runs of a column shard, up to this many bytes are read into a scratch buffer
within one ``preadv`` of many rows; more are skipped by a read call per run (measured here: a
call costs ~3.5 us, reading a byte ~0.3 ns)."""
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class Staging:
    """One reusable staging buffer of at most :data:`STAGING_BYTES`, shared by the files of
    one load (a folder of a hundred files still holds one buffer)."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def take(self, nbytes: int) -> Tensor:
        """A uint8 tensor of ``nbytes`` (at most :data:`STAGING_BYTES`), reused between calls."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(min(max(nbytes, 1 << 16), STAGING_BYTES),
                                       dtype=torch.uint8)
        return self._buffer[:nbytes]


def _writable_bytes(out: Tensor) -> memoryview | None:
    """``out``'s memory as a writable byte view when bytes read from a file can land there
    as they are: a contiguous CPU tensor (``None`` otherwise)."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.numel() == 0:
        return None
    return _bytes_of(out.detach().view(-1).view(torch.uint8))


def _bytes_of(flat: Tensor) -> memoryview:
    """A writable byte view of a contiguous 1-D CPU uint8 tensor's memory."""
    array: Any = flat.numpy()  # numpy's stubs do not declare the buffer protocol
    return memoryview(array).cast("B")


class _SafetensorsFile:
    """A checked safetensors file read by positional reads (``os.preadv``) of the descriptor
    its header was checked through, with ``safe_open``'s ``keys()`` and ``get_slice(key)``.

    No mapping: a file shortened after its check (another process, a network filesystem)
    would make a memory-mapped read kill the process with SIGBUS; here it is a short read,
    raised as a :class:`WeightLoadError` naming the file, the tensor and the byte offset.
    :meth:`read_into` puts a block's bytes straight into the destination when they are
    contiguous in the file and the destination is a contiguous CPU tensor of the file's dtype
    (a row shard, a replicated tensor); otherwise they stream through a bounded
    :class:`Staging` buffer and are copied (and converted) into place piece by piece."""

    def __init__(self, path: Path, entries: Mapping[str, SafetensorsEntry], fd: int,
                 staging: Staging | None = None) -> None:
        self.path = path
        self.entries = entries
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)  # also at interpreter exit
        self.staging = staging or Staging()

    def close(self) -> None:
        self._closer()

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key][1])

    def get_slice(self, key: str) -> _SliceReader:
        return _SliceReader(self, key)

    def read_into(self, key: str, block: Sequence[slice], out: Tensor) -> None:
        """Fill ``out`` (shaped like ``block`` of ``key``; any dtype, device or strides) with
        that block of the stored tensor.

        Raises:
            WeightLoadError: the file ends before the block's bytes (shortened after its
                check) or cannot be read: names the file, the tensor and the byte offset.
        """
        dtype, shape, start = self.entries[key]
        bounds = [(sl.start or 0, n if sl.stop is None else sl.stop)
                  for sl, n in zip(block, shape, strict=True)]
        if out.numel():
            self._fill(key, out, dtype, list(shape), bounds, start)

    def _fill(self, key: str, out: Tensor, dtype: torch.dtype, shape: list[int],
              bounds: list[tuple[int, int]], offset: int) -> None:
        if not shape:  # a 0-d tensor
            out.copy_(self._staged(key, offset, dtype.itemsize).view(dtype).view(()))
            return
        row = math.prod(shape[1:]) * dtype.itemsize  # bytes of one index of dim 0
        a, b = bounds[0]
        inner_whole = all(lo == 0 and hi == n for (lo, hi), n in zip(bounds[1:], shape[1:]))
        if inner_whole and out.dtype == dtype:
            target = _writable_bytes(out)
            if target is not None:  # the block is one run of the file: read it in place
                self._pread(key, target, offset + a * row)
                return
        if len(shape) > 1 and out.dtype == dtype and out.device.type == "cpu" and self._read_runs(
                key, out, shape, bounds, offset, row):
            return
        if row > STAGING_BYTES and len(shape) > 1:  # one index does not fit: go a dim deeper
            for i in range(a, b):
                self._fill(key, out[i - a], dtype, shape[1:], bounds[1:], offset + i * row)
            return
        step = max(1, STAGING_BYTES // max(row, 1))
        inner = tuple(slice(lo, hi) for lo, hi in bounds[1:])
        for lo in range(a, b, step):
            hi = min(b, lo + step)
            rows = self._staged(key, offset + lo * row, (hi - lo) * row)
            piece = rows.view(dtype).view(hi - lo, *shape[1:])
            out[lo - a:hi - a].copy_(piece if inner_whole else piece[(slice(None), *inner)])

    def _read_runs(self, key: str, out: Tensor, shape: list[int],
                   bounds: list[tuple[int, int]], offset: int, row: int) -> bool:
        """Read a block whose inner dims make one run of bytes per index of dim 0 (a column
        shard) straight into the rows of ``out``: one ``preadv`` per up to 512 rows, the
        bytes between runs landing in a small scratch buffer, or one read per run when the
        bytes skipped exceed :data:`_SKIP_READ_BYTES`. ``False`` when ``out`` cannot take the
        bytes as they are (nothing read)."""
        if not all(lo == 0 and hi == n for (lo, hi), n in zip(bounds[2:], shape[2:])):
            return False
        lo1, hi1 = bounds[1]
        tail = math.prod(shape[2:]) * out.dtype.itemsize
        run, start, skip = (hi1 - lo1) * tail, lo1 * tail, row - (hi1 - lo1) * tail
        a, b = bounds[0]
        whole = _writable_bytes(out)
        if whole is not None:
            rows = [whole[(i - a) * run:(i - a + 1) * run] for i in range(a, b)]
        else:
            views = [_writable_bytes(out[i - a]) for i in range(a, b)]
            if any(v is None for v in views):
                return False
            rows = [v for v in views if v is not None]
        if skip > _SKIP_READ_BYTES:
            for i, target in enumerate(rows):
                self._pread(key, target, offset + (a + i) * row + start)
            return True
        scratch = _bytes_of(self.staging.take(skip)) if skip else None
        per = _IOV_MAX // 2
        for first in range(0, len(rows), per):
            chunk = rows[first:first + per]
            iov: list[memoryview] = []
            for target in chunk:
                iov.append(target)
                if scratch is not None:
                    iov.append(scratch)
            if scratch is not None:
                iov.pop()  # nothing to skip after the last run
            self._preadv_all(key, iov, offset + (a + first) * row + start)
        return True

    def _preadv_all(self, key: str, iov: list[memoryview], offset: int) -> None:
        """``preadv`` of ``iov`` from ``offset``, completed by plain reads after a short one."""
        total = sum(len(v) for v in iov)
        try:
            done = _preadv(self._fd, iov, offset) if self._closer.alive else 0
        except OSError as exc:
            msg = (f"{self.path}: reading {key!r} at byte {offset} failed: "
                   f"{exc.strerror or exc}")
            raise WeightLoadError(msg) from None
        if done == total:
            return
        at = offset
        for target in iov:  # a short read: finish (or locate the end) one buffer at a time
            if done >= len(target):
                done -= len(target)
            else:
                self._pread(key, target[done:], at + done)
                done = 0
            at += len(target)

    def _staged(self, key: str, offset: int, nbytes: int) -> Tensor:
        buffer = self.staging.take(nbytes)
        self._pread(key, _bytes_of(buffer), offset)
        return buffer

    def _pread(self, key: str, target: memoryview, offset: int) -> None:
        """Fill ``target`` from byte ``offset`` of the file, or raise naming where it ended."""
        if not self._closer.alive:
            raise WeightLoadError(f"{self.path}: reading {key!r}: the file was closed")
        done, total = 0, len(target)
        try:
            while done < total:
                n = _preadv(self._fd, [target[done:]], offset + done)
                if n <= 0:
                    size = os.fstat(self._fd).st_size
                    msg = (f"{self.path}: reading {key!r}: {total} bytes from byte {offset}, "
                           f"but the file ends at byte {size} (read {done}); it was shortened "
                           f"after its header was checked (another process or a network "
                           f"filesystem changed it while loading)")
                    raise WeightLoadError(msg)
                done += n
        except OSError as exc:
            msg = (f"{self.path}: reading {key!r} at byte {offset + done} failed: "
                   f"{exc.strerror or exc}")
            raise WeightLoadError(msg) from None


def _preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, buffers, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # pragma: no cover - hosts without preadv
    return os.readv(fd, buffers)  # pragma: no cover


class _SliceReader:
    """A safetensors slice's ``get_shape()`` and ``[block]`` (a new tensor of the file's
    dtype, read by :meth:`_SafetensorsFile.read_into`)."""

    def __init__(self, file: _SafetensorsFile, key: str) -> None:
        self.file = file
        self.key = key

    def get_shape(self) -> list[int]:
        return list(self.file.entries[self.key][1])

    def __getitem__(self, block: tuple[slice, ...]) -> Tensor:
        dtype, shape, _ = self.file.entries[self.key]
        block = (*block, *(slice(None),) * (len(shape) - len(block)))
        sizes = [len(range(*sl.indices(n))) for sl, n in zip(block, shape, strict=True)]
        if any(sl.step not in (None, 1) for sl in block):
            raise ValueError(f"{self.key!r}: only contiguous slices are read, not {block}")
        out = torch.empty(sizes, dtype=dtype)
        self.file.read_into(self.key, tuple(slice(*sl.indices(n)[:2]) for sl, n
                                            in zip(block, shape, strict=True)), out)
        return out


def open_safetensors(path: Path, staging: Staging | None = None, *,
                     fd: int | None = None) -> _SafetensorsFile:
    """``path`` checked (:func:`read_safetensors_header`) and ready to be read by slices,
    through the descriptor its header was read from (a file replaced after the check is not
    read in its place). ``staging`` is shared by the files of one load. ``fd``: the file as
    a load's :class:`~hyperrecipe.runtime.state.snapshot.Snapshot` opened it (read through a
    duplicate of it, so the tensors come from the very file the manifest was hashed from);
    without it ``path`` is opened here.

    Raises:
        WeightLoadError: as :func:`read_safetensors_header`; on a big-endian host (the format
            is little-endian and the bytes are not byte-swapped).
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise WeightLoadError(f"{path}: safetensors is little-endian; this host is not")
    fd = _own_descriptor(path, fd)
    try:
        entries = _read_header(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return _SafetensorsFile(path, entries, fd, staging)


def _own_descriptor(path: Path, fd: int | None) -> int:
    """A descriptor of ``path`` for a reader to own and close: a duplicate of ``fd`` (one
    file opened once, shared), or ``path`` opened without blocking (a FIFO is refused)."""
    try:
        return os.dup(fd) if fd is not None else open_regular(path)
    except OSError as exc:
        raise WeightLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None


MAX_TORCH_RECORDS = MAX_HEADER_ENTRIES + 16
"""The most zip records one ``pytorch_model.bin`` may hold: a storage per tensor (at most
:data:`MAX_HEADER_ENTRIES`, as for a safetensors file) and the few records of torch.save's own
(``data.pkl``, ``version``, ``byteorder``...). Checked against the count the end-of-directory
record declares before a directory entry is read, so a directory of millions of entries is
refused without walking it."""

_ZIP_STORED = 0
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # a central directory entry, before its name


def check_torch_archive(path: Path, fd: int) -> None:
    """Refuse a ``pytorch_model.bin`` whose zip records ``torch.load`` would inflate or read
    past the file, from its central directory alone (read here rather than by
    :mod:`zipfile`, which builds an object for every entry the directory's bytes hold,
    whatever count the directory declares): at most :data:`MAX_TORCH_RECORDS` entries, none
    compressed (``torch.save`` stores every record as it is; ``torch.load`` inflates a
    compressed one whole before anything is checked), none declaring bytes past the end of
    the file. Time and memory are bounded by the directory's size, itself at most the file's.

    Raises:
        WeightLoadError: not a zip archive, too many records, or a record compressed or
            larger than the file: each such record named, with the file, in a bounded
            listing.
    """
    try:
        with os.fdopen(os.dup(fd), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            count, cd_size, cd_offset = _zip_directory(path, handle, size)
            handle.seek(cd_offset)
            directory = handle.read(cd_size)
    except OSError as exc:
        raise WeightLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    problems = _Problems()
    at = 0
    for _ in range(count):
        if at + _CENTRAL.size > len(directory):
            problems.add(f"the zip directory ends after {at} of its {cd_size} bytes, "
                         f"before the last of the {count} records it declares")
            break
        fields = _CENTRAL.unpack_from(directory, at)
        if fields[0] != b"PK\x01\x02":
            problems.add(f"the zip directory holds no entry at its byte {at}, before the last "
                         f"of the {count} records it declares")
            break
        method, stored, declared, offset = fields[4], fields[8], fields[9], fields[16]
        name_end = at + _CENTRAL.size + fields[10]
        extra_end = name_end + fields[11]
        name = directory[at + _CENTRAL.size:name_end].decode("utf-8", "replace")
        declared, stored, offset = _zip64_sizes(directory[name_end:extra_end], declared,
                                                stored, offset)
        at = extra_end + fields[12]
        if method != _ZIP_STORED:
            problems.add(f"record {name!r:.200}: compressed (method {method}, "
                         f"{_ZIP_METHODS.get(method, 'unknown')}); torch.save stores every "
                         f"record uncompressed (method 0), and torch.load would inflate it "
                         f"whole before anything is checked")
        elif declared > size or offset + stored > size:
            problems.add(f"record {name!r:.200}: declares {max(declared, stored)} bytes at "
                         f"byte {offset}; the file holds {size}")
    if problems:
        raise WeightLoadError(problems.listing(
            f"{path}: its zip records are not what torch.save writes"))


_ZIP_METHODS = {8: "deflate", 9: "deflate64", 12: "bzip2", 14: "lzma", 93: "zstd"}


def _zip_directory(path: Path, handle: Any, size: int) -> tuple[int, int, int]:
    """The record count, size and offset of the zip central directory of ``handle``, from
    its end record (the zip64 one where there is one, as torch.save always writes), checked
    against :data:`MAX_TORCH_RECORDS` and the file's size."""
    tail_size = min(size, _EOCD.size + 0xFFFF)  # the record, then a comment of at most 64 KiB
    handle.seek(size - tail_size)
    tail = handle.read(tail_size)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        raise WeightLoadError(
            f"{path}: not a zip archive (no end of central directory record in its last "
            f"{tail_size} bytes); load_weights reads the format torch.save has written since "
            f"torch 1.6 (re-save a legacy file with torch.save)")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    where = size - tail_size + at
    if where >= _ZIP64_LOCATOR.size:
        handle.seek(where - _ZIP64_LOCATOR.size)
        locator = _ZIP64_LOCATOR.unpack(handle.read(_ZIP64_LOCATOR.size))
        if locator[0] == b"PK\x06\x07" and locator[2] + _ZIP64_EOCD.size <= size:
            handle.seek(locator[2])
            record = _ZIP64_EOCD.unpack(handle.read(_ZIP64_EOCD.size))
            if record[0] == b"PK\x06\x06":
                count, cd_size, cd_offset = record[7], record[8], record[9]
    if count > MAX_TORCH_RECORDS:
        raise WeightLoadError(
            f"{path}: its zip directory declares {count} records; load_weights reads at most "
            f"{MAX_TORCH_RECORDS} (a storage per tensor, at most {MAX_HEADER_ENTRIES}, and "
            f"torch.save's own few)")
    if cd_offset + cd_size > size:
        raise WeightLoadError(
            f"{path}: its zip directory declares {cd_size} bytes at byte {cd_offset}; the "
            f"file holds {size}")
    return count, cd_size, cd_offset


def _zip64_sizes(extra: bytes, declared: int, stored: int,
                 offset: int) -> tuple[int, int, int]:
    """A directory entry's sizes and offset, each 0xFFFFFFFF replaced by its 8-byte value in
    the entry's zip64 extra field (tag 1), in the order the zip format gives them."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, at)
        if tag == 1:
            values = extra[at + 4:at + 4 + length]
            taken = 0
            fields = [declared, stored, offset]
            for i, value in enumerate(fields):
                if value == 0xFFFFFFFF and taken + 8 <= len(values):
                    (fields[i],) = struct.unpack_from("<Q", values, taken)
                    taken += 8
            return fields[0], fields[1], fields[2]
        at += 4 + length
    return declared, stored, offset


def check_torch_records(path: Path, state: Mapping[str, Tensor], *,
                        opened: str | None = None) -> dict[str, int]:
    """Refuse a memory-mapped ``torch.load`` result whose storages do not lie in their zip
    records: each storage's bytes must start where a ``data/<key>`` record starts and fit in
    it. Returns the byte offset in the file of each contiguous tensor's data (which lies
    inside its storage), for positional reads. ``opened`` is where the records are read
    (``/proc/self/fd/N`` of the descriptor the load reads; default ``path``).

    Raises:
        WeightLoadError: a storage is longer than its record (a record cut short) or lies at
            no record; every such tensor named.
    """
    try:
        reader: Any = torch._C.PyTorchFileReader(opened or str(path))  # get_record_offset is not typed
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
        return {}
    if not records:
        raise WeightLoadError(f"{path}: holds tensors but no data records")
    # The mapping's address of the file's first byte: the first storage lies at the first
    # record holding bytes (an empty tensor's record holds none, and no storage lies there).
    filled = [offset for offset, (_, nbytes) in records.items() if nbytes]
    if not filled:
        raise WeightLoadError(f"{path}: holds tensors but no data records")
    base = min(storages) - min(filled)
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
    offsets: dict[str, int] = {}
    for key, tensor in state.items():
        storage = tensor.untyped_storage()
        start = tensor.storage_offset() * tensor.element_size()
        if storage.nbytes() and tensor.is_contiguous() and \
                start + tensor.numel() * tensor.element_size() <= storage.nbytes():
            offsets[key] = storage.data_ptr() - base + start
    return offsets


class TorchFile(_SafetensorsFile):
    """A checked ``pytorch_model.bin``: names, dtypes and shapes from torch's memory-mapped
    load (whose pages are never touched), the bytes of each contiguous tensor by positional
    reads at the offset of its zip record (:func:`check_torch_records`), so a file shortened
    while loading is a located error here too; a non-contiguous tensor (rare: a view saved
    as such) is read from the mapping."""

    def __init__(self, path: Path, state: Mapping[str, Tensor], offsets: Mapping[str, int],
                 fd: int, staging: Staging | None = None) -> None:
        entries = {k: (t.dtype, list(t.shape), offsets[k]) for k, t in state.items()
                   if k in offsets}
        super().__init__(path, entries, fd, staging)
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def dtype(self, key: str) -> torch.dtype:
        return self.state[key].dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def get_slice(self, key: str) -> Any:
        return super().get_slice(key) if key in self.entries else _Mapped(self.state[key])

    def read_into(self, key: str, block: Sequence[slice], out: Tensor) -> None:
        if key in self.entries:
            super().read_into(key, block, out)
        else:
            out.copy_(self.state[key][tuple(block)])


class _Mapped:
    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, block: tuple[slice, ...]) -> Tensor:
        return self.tensor[block]


def open_torch_file(path: Path, staging: Staging | None = None, *,
                    fd: int | None = None) -> TorchFile:
    """``path`` (a ``pytorch_model.bin``) loaded as data (``weights_only``) once its zip
    directory is checked (:func:`check_torch_archive`), its storages checked against their
    records, ready for positional reads. ``fd`` as for :func:`open_safetensors`: the load,
    the record check and the positional reads all go through that file (``/proc/self/fd``).

    Raises:
        WeightLoadError: as :func:`check_torch_archive` and :func:`check_torch_records`; not
            a state dict of tensors.
    """
    fd = _own_descriptor(path, fd)
    try:
        check_torch_archive(path, fd)
        opened = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else str(path)
        state = torch.load(opened, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, Mapping) or not all(isinstance(v, Tensor)
                                                     for v in state.values()):
            raise WeightLoadError(f"{path}: cannot be read: not a state dict of tensors")
        offsets = check_torch_records(path, state, opened=opened)
    except BaseException:
        os.close(fd)
        raise
    return TorchFile(path, state, offsets, fd, staging)
