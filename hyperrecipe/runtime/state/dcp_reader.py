"""Reading ``torch.distributed.checkpoint`` folders without running code a folder holds.

A DCP folder is pickles: ``.metadata`` is read by torch's ``FileSystemReader`` with a plain
``pickle.load``, and the non-tensor entries of a state dict (an optimizer's ``param_groups``)
are read by ``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``. A folder
someone else handed over can therefore run any code on ``dcp.load``. Here:

- ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which admits only the globals that
  DCP's own metadata pickles name (found by pickling the metadata of real checkpoints, saved
  by ``dcp.save(inst.state.state_dict(opt))`` and by ``get_state_dict`` in both modes), and the
  result must be a ``Metadata`` whose every file name is a regular file of the folder that
  holds the bytes the metadata says it does: a refused global, a path out of the folder, a
  FIFO or a truncated ``.distcp`` are a :class:`WeightLoadError` naming the file, before
  torch reads anything;
- non-tensor entries are read with ``torch.load(weights_only=True)`` first (plain data:
  numbers, strings, lists, dicts, tensors) and handed to the planner only if that succeeds.

:class:`TrustedFileSystemReader` is torch's reader with both; pass it as ``storage_reader`` to
``dcp.load``, or call :func:`trusted_dcp_load`, which also turns torch's
``CheckpointException`` (a ``BaseException``) into a :class:`WeightLoadError`.

A folder that ``save_checkpoint`` wrote carries a commit record
(:data:`~hyperrecipe.runtime.state.integrity.COMMIT`, written by
:func:`~hyperrecipe.runtime.state.integrity.committed_dcp_save`): the ``.metadata``'s sha256
and each storage file's size and sampled fingerprint, which every reader here checks before it
reads a tensor, so a folder that a later ``dcp.save`` wrote into is refused by name instead of
loading a mix of two saves. This module only reads; the record and its checks live in
:mod:`~hyperrecipe.runtime.state.integrity`.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from hyperrecipe._files import open_regular, read_regular_file
from hyperrecipe.errors import WeightLoadError
from hyperrecipe.runtime.state.integrity import (
    MAX_METADATA_BYTES,
    check_commit,
    commit_of,
    describe_failure,
    verify_fingerprints,
)

__all__ = ["MAX_CHUNK_PROBLEMS", "TrustedFileSystemReader", "check_chunks", "kind_changes",
           "read_dcp_metadata", "trusted_dcp_load", "trusted_reader"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # torch before 2.2 pickled TensorProperties from the sharded-tensor package
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})
"""Every global a DCP ``.metadata`` may name, besides ``torch.<dtype>`` / ``torch.<layout>`` /
``torch.<memory_format>`` constants. Each is a class whose construction only stores its
arguments (dataclasses, ``torch.Size``, paths, an enum) or a lookup in torch's own table."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only :data:`_ALLOWED` and torch's
    dtype, layout and memory-format constants; every way a pickle reaches a callable
    (``GLOBAL``, ``STACK_GLOBAL``, ``EXT*``) goes through ``find_class``, and persistent ids
    are refused."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise self._refuse(f"{module}.{name}"[:200])

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse(f"the persistent id {pid!r:.80}")

    def _refuse(self, what: str) -> WeightLoadError:
        msg = (f"{self.path}: refused: the pickle names {what}, which is not one of DCP's "
               f"metadata classes; a checkpoint is data and loading it runs no code (see "
               f"docs/security.md, 'Checkpoints'). Re-save it with torch.distributed.checkpoint")
        return WeightLoadError(msg)


def _metadata_path(folder: Path, rank: int | None) -> Path:
    return folder / (".metadata" if rank is None else f"__{rank}.metadata")


def read_dcp_metadata(folder: str | os.PathLike[str], rank: int | None = None, *,
                      check_fingerprints: bool = True) -> Any:
    """The ``Metadata`` of a DCP folder, read without running code, with every storage file
    checked: a plain name inside the folder, a regular file, long enough for the bytes the
    metadata places in it, and, in a folder ``save_checkpoint`` committed, of the size and
    (unless ``check_fingerprints`` is false: the caller checks them, split over its ranks)
    the sampled fingerprint the commit record holds (:func:`verify_fingerprints`).

    Raises:
        WeightLoadError: the file is not a regular file, too large, names a global outside the
            allow-list (the message names it), is not DCP metadata, or names a storage file
            that is missing, outside the folder, not a regular file, or too short; or the
            folder was written again after its commit.
    """
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                        StorageMeta, TensorStorageMetadata)

    base = Path(folder)
    path = _metadata_path(base, rank)
    try:
        data = read_regular_file(path, limit=MAX_METADATA_BYTES)
    except OSError as exc:
        raise WeightLoadError(f"{path}: cannot read DCP metadata: {exc.strerror or exc}") from None
    try:
        metadata = _MetadataUnpickler(data, path).load()
    except WeightLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is "not DCP metadata"
        msg = f"{path}: not DCP metadata ({type(exc).__name__}: {exc!s:.200})"
        raise WeightLoadError(msg) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not all(isinstance(k, str) and isinstance(v, (TensorStorageMetadata,
                                                            BytesStorageMetadata))
                       for k, v in metadata.state_dict_metadata.items()):
        raise WeightLoadError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
    record = commit_of(base) if rank is None else None  # "not committed" says most: first
    check_chunks(path, metadata)
    sizes = _check_storage(base, path, metadata)
    if record is not None:
        check_commit(base, record, data, sizes)
        if check_fingerprints:
            verify_fingerprints(base, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def storage_view_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why this rank does not see the checkpoint ``dcp.save`` just wrote into ``folder`` as
    the rank that wrote ``.metadata`` does (``None`` when it does): ``.metadata`` missing or
    unreadable, or a storage file it names missing or shorter than the bytes it places there.

    Each rank writes its own storage files into the folder *it* sees, so with node-local
    folders (``--out`` on a local disk of each node) ``dcp.save`` returns on every rank and the
    pieces lie on different machines: no single folder holds a loadable checkpoint.
    """
    base = Path(folder)
    path = _metadata_path(base, None)
    try:
        data = read_regular_file(path, limit=MAX_METADATA_BYTES)
        metadata = _MetadataUnpickler(data, path).load()
        _check_storage(base, path, metadata)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    except WeightLoadError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is "not DCP metadata"
        return f"{path}: not DCP metadata ({type(exc).__name__}: {exc!s:.200})"
    return None


def _check_storage(base: Path, path: Path, metadata: Any) -> dict[str, int]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise WeightLoadError(f"{path}: not DCP metadata (storage_data is not a mapping)")
    ends: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) or \
                not isinstance(info.offset, int) or not isinstance(info.length, int) or \
                info.offset < 0 or info.length < 0:
            raise WeightLoadError(f"{path}: not DCP metadata (storage entry {index!r:.120})")
        name = info.relative_path
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            msg = (f"{path}: storage file {name!r:.120} is not a plain file name in the folder; "
                   f"a checkpoint reads only its own files")
            raise WeightLoadError(msg)
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = base / name
        try:
            st = os.lstat(file)
        except OSError as exc:
            raise WeightLoadError(f"{file}: named by {path.name} but cannot be read: "
                                  f"{exc.strerror or exc}") from None
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a symlink" if stat.S_ISLNK(
                st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a device")
            raise WeightLoadError(f"{file}: not a regular file ({kind}); DCP writes its storage "
                                  f"files as regular files, and only those are read")
        if st.st_size < end:
            raise WeightLoadError(f"{file}: {st.st_size} bytes, but {path.name} places data up "
                                  f"to byte {end}: the file is truncated or belongs to another "
                                  f"checkpoint")
        sizes[name] = st.st_size
    return sizes


MAX_CHUNK_PROBLEMS = 20
"""The most chunk problems one refusal lists (then it counts the rest)."""


def check_chunks(path: Path, metadata: Any) -> None:
    """Refuse a ``.metadata`` whose tensor chunks do not describe each tensor exactly once,
    before anything is read: every chunk's offsets and sizes are integers within the
    tensor's global size, every chunk has a storage entry, the chunks do not overlap and
    together tile the global shape (no row left out, none read twice), and no two storage
    entries share a byte of a storage file (so no chunk reads another tensor's bytes).

    torch reads what the metadata says: a chunk left out keeps whatever the destination
    held (the previous weights, or NaN), a chunk listed twice or pointing at another
    layer's bytes loads those, and a chunk past the tensor's end fails halfway through the
    copy.

    Raises:
        WeightLoadError: naming ``path``, the tensor and what is wrong, at most
            :data:`MAX_CHUNK_PROBLEMS` of them.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    problems: list[str] = []
    storage = metadata.storage_data
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        problem = _chunk_problem(fqn, meta, storage, MetadataIndex)
        if problem is not None:
            problems.append(problem)
            if len(problems) > MAX_CHUNK_PROBLEMS:
                break
    if isinstance(storage, Mapping):
        problems.extend(_shared_bytes(storage))
    if problems:
        shown = problems[:MAX_CHUNK_PROBLEMS]
        more = f"\n  ... and more" if len(problems) > len(shown) else ""
        msg = (f"{path}: refused before reading: the chunks it lists do not cover each tensor "
               f"exactly once:\n  " + "\n  ".join(shown) + more + "\nThe file was edited or "
               f"belongs to another checkpoint; nothing was loaded. Save the checkpoint again "
               f"(or resume from an earlier one)")
        raise WeightLoadError(msg)


def kind_changes(state: Mapping[str, Any], metadata: Any) -> list[str]:
    """The tensors of ``state`` (nested as ``dcp.load`` takes it) that ``metadata`` stores as
    another kind of dtype (floating point, complex, integer): ``dcp.load`` copies with
    ``copy_``, which converts an ``int32`` chunk into a float tensor (or drops a complex
    one's imaginary part) without a word. Dtypes of one kind convert, as ``load_weights``
    does for safetensors."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hyperrecipe.runtime.state.checkpoint_files import dtype_kind

    flat, _ = flatten_state_dict(dict(state))
    problems: list[str] = []
    for fqn, value in flat.items():
        meta = metadata.state_dict_metadata.get(fqn)
        if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
            continue
        stored = getattr(getattr(meta, "properties", None), "dtype", None)
        if not isinstance(stored, torch.dtype):
            problems.append(f"{fqn!r}: no dtype recorded ({stored!r:.40})")
        elif dtype_kind(stored) != dtype_kind(value.dtype):
            problems.append(f"{fqn!r}: stored as {stored}, loads into {value.dtype} "
                            f"({dtype_kind(stored)} into {dtype_kind(value.dtype)})")
    return problems


def _ints(value: Any, ndim: int) -> tuple[int, ...] | None:
    """``value`` as ``ndim`` non-negative ints (``torch.Size``, a tuple or list of them),
    else ``None``."""
    if not isinstance(value, (tuple, list)) or len(value) != ndim or not all(
            type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


def _chunk_problem(fqn: str, meta: Any, storage: Any, index: Any) -> str | None:
    size = getattr(meta, "size", None)
    shape = _ints(size, len(size)) if isinstance(size, (tuple, list)) else None
    chunks = getattr(meta, "chunks", None)
    if shape is None or not isinstance(chunks, list):
        return f"{fqn!r}: not tensor metadata (size {size!r:.80}, chunks {type(chunks).__name__})"
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for n, chunk in enumerate(chunks):
        offsets = _ints(getattr(chunk, "offsets", None), len(shape))
        sizes = _ints(getattr(chunk, "sizes", None), len(shape))
        if offsets is None or sizes is None:
            return (f"{fqn!r}: chunk {n} is not {len(shape)} non-negative offsets and sizes "
                    f"(offsets {getattr(chunk, 'offsets', None)!r:.80}, sizes "
                    f"{getattr(chunk, 'sizes', None)!r:.80})")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            return (f"{fqn!r}: chunk {n} (offsets {list(offsets)}, sizes {list(sizes)}) reaches "
                    f"past the tensor's global size {list(shape)}")
        if isinstance(storage, Mapping) and index(fqn, offsets) not in storage:
            return f"{fqn!r}: chunk {n} (offsets {list(offsets)}) has no storage entry"
        if all(sizes):
            boxes.append((offsets, sizes))
    numel = 1
    for d in shape:
        numel *= d
    covered = 0
    for _, sizes in boxes:
        volume = 1
        for s in sizes:
            volume *= s
        covered += volume
    budget = [_TILING_WORK * len(boxes) * (len(shape) + 1) + 1024]
    tiled = covered == numel and _tiles(boxes, (0,) * len(shape), shape, 0, budget)
    if tiled is None:
        return (f"{fqn!r}: its {len(boxes)} chunks are too irregular to check in bounded time "
                f"(dcp.save writes a grid of shards: rows, columns or blocks); refused")
    if not tiled:
        listed = ", ".join(f"{list(o)}+{list(s)}" for o, s in boxes[:8])
        what = ("cover less than" if covered < numel else "overlap in" if covered > numel
                else "overlap and leave gaps in")
        return (f"{fqn!r}: its chunks (offsets+sizes: {listed}{', ...' if len(boxes) > 8 else ''}) "
                f"{what} the global size {list(shape)} ({covered} of {numel} elements listed)")
    return None


_TILING_WORK = 4
"""Chunk visits :func:`_tiles` may make per chunk and dim (a grid of shards takes about
two); past it the layout is refused as too irregular rather than checked in quadratic time."""


def _tiles(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], lo: tuple[int, ...],
           hi: tuple[int, ...], dim: int, budget: list[int]) -> bool | None:
    """Whether ``boxes`` (offsets, sizes; each within ``lo``..``hi`` in the dims before
    ``dim`` already) tile the box ``lo``..``hi`` exactly in dims ``dim`` on: swept along
    ``dim``, every slab between two consecutive chunk edges must be tiled by the chunks
    spanning it in the remaining dims. Work is the sum over slabs of the chunks spanning them
    (one per slab for row or column shards, a row of a grid for 2-D shards), taken from
    ``budget[0]``; ``None`` when it runs out (a forged layout whose slabs each hold many
    chunks would otherwise take quadratic time)."""
    if dim == len(lo):
        return len(boxes) == 1
    edges = sorted({lo[dim], hi[dim], *(o[dim] for o, _ in boxes),
                    *(o[dim] + s[dim] for o, s in boxes)})
    order = sorted(boxes, key=lambda b: b[0][dim])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    at = 0
    for start, end in zip(edges, edges[1:]):
        while at < len(order) and order[at][0][dim] <= start:
            active.append(order[at])
            at += 1
        active = [b for b in active if b[0][dim] + b[1][dim] >= end]
        budget[0] -= len(active) + 1
        if budget[0] < 0:
            return None
        inner = _tiles(active, lo, hi, dim + 1, budget)
        if not inner:
            return inner
    return True


def _shared_bytes(storage: Mapping[Any, Any]) -> list[str]:
    """Storage entries whose byte ranges overlap in one file: ``dcp.save`` writes every item
    once, so two entries on the same bytes mean one reads what another item holds."""
    spans: dict[str, list[tuple[int, int, Any]]] = {}
    for index, info in storage.items():
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is int and type(length) is int and length > 0:
            spans.setdefault(str(getattr(info, "relative_path", "")), []).append(
                (offset, offset + length, index))
    problems: list[str] = []
    for name, ranges in sorted(spans.items()):
        ranges.sort(key=lambda r: (r[0], r[1]))
        for (a0, a1, a), (b0, b1, b) in zip(ranges, ranges[1:]):
            if b0 < a1:
                problems.append(f"{_entry(a)} and {_entry(b)} read the same bytes of {name} "
                                f"({a0}..{a1} and {b0}..{b1})")
                if len(problems) > MAX_CHUNK_PROBLEMS:
                    return problems
    return problems


def _entry(index: Any) -> str:
    offset = getattr(index, "offset", None)
    return f"{getattr(index, 'fqn', index)!r}" + (f" (offsets {list(offset)})"
                                                  if offset is not None else "")


class TrustedFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that reads metadata with :func:`read_dcp_metadata`, checks
    every storage file's sampled fingerprint against the commit record
    (:func:`verify_fingerprints`) and reads non-tensor entries as plain data
    (``torch.load(weights_only=True)``)."""

    check_fingerprints = True
    """``False`` where the caller verified them already (:func:`trusted_dcp_load`, which
    splits the files over the ranks)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_dcp_metadata(Path(os.fspath(self.path)), kwargs.get("rank"),
                                     check_fingerprints=self.check_fingerprints)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _PlainBytes(planner))  # type: ignore[arg-type]


class _RegularFiles(FileSystem):
    """torch's ``FileSystem`` whose read streams are opened by :func:`open_regular`: a
    storage file swapped for a FIFO after :func:`read_dcp_metadata` checked it is refused
    (``OSError``, reported by ``dcp.load`` as the rank's failure), not waited on forever."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with os.fdopen(open_regular(path), "rb") as stream:
            yield cast(io.IOBase, stream)


class _PlainBytes:
    """A load planner whose ``load_bytes`` admits only what ``torch.load(weights_only=True)``
    reads; the wrapped planner then reads the same bytes (which name only those globals)."""

    def __init__(self, planner: Any) -> None:
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - reported by name
            fqn = getattr(getattr(read_item, "dest_index", None), "fqn", "?")
            msg = (f"refused the non-tensor entry {fqn!r}: it is not plain data "
                   f"(torch.load(weights_only=True): {exc!s:.300})")
            raise WeightLoadError(msg) from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def trusted_reader(folder: str | os.PathLike[str]) -> TrustedFileSystemReader:
    """A :class:`TrustedFileSystemReader` on ``folder``, for ``dcp.load(storage_reader=...)``."""
    return TrustedFileSystemReader(os.fspath(folder))


def trusted_dcp_load(state: dict[str, Any], folder: str | os.PathLike[str],
                     process_group: Any = None,
                     agree: Callable[[str | None, str], Mapping[int, str]] | None = None
                     ) -> None:
    """``dcp.load(state, checkpoint_id=folder)`` through :func:`trusted_reader`: the metadata
    is checked first (on every rank, so all raise the same error), and torch's
    ``CheckpointException`` becomes a :class:`WeightLoadError` naming the folder. With
    ``agree`` (every rank's outcome of a step, by rank: the installation's bounded agreement),
    the storage files' fingerprints are split over the world's ranks; without it every rank
    checks every file.

    Raises:
        WeightLoadError: the folder is refused (see :func:`read_dcp_metadata` and
            :func:`verify_fingerprints`) or a rank failed reading it.
        PlanMismatchError: a rank did not reach the fingerprint check's exchange in time.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    metadata = read_dcp_metadata(folder, check_fingerprints=False)
    kinds = kind_changes(state, metadata)
    if kinds:
        shown = "\n  ".join(kinds[:MAX_CHUNK_PROBLEMS])
        more = f"\n  ... and {len(kinds) - MAX_CHUNK_PROBLEMS} more" \
            if len(kinds) > MAX_CHUNK_PROBLEMS else ""
        raise WeightLoadError(f"{folder}: refused before reading: tensors stored as another "
                              f"kind of dtype than the state they load into:\n  {shown}{more}\n"
                              f"dcp.load would convert them silently; nothing was loaded")
    _verify_fingerprints_together(folder, metadata, process_group, agree)
    reader = trusted_reader(folder)
    reader.check_fingerprints = False
    try:
        dcp_load(state, storage_reader=reader, process_group=process_group)
    except CheckpointException as exc:
        failures = getattr(exc, "failures", {}) or {}
        lines = [f"rank {r}: {describe_failure(e)}" for r, e in sorted(failures.items())]
        raise WeightLoadError(f"{folder}: dcp.load failed:\n  " + "\n  ".join(
            lines or [str(exc)])) from None
    except WeightLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with the folder
        raise WeightLoadError(f"{folder}: dcp.load failed: {type(exc).__name__}: "
                              f"{exc!s:.500}") from None


def _verify_fingerprints_together(folder: str | os.PathLike[str], metadata: Any,
                                  process_group: Any,
                                  agree: Callable[[str | None, str], Mapping[int, str]] | None
                                  ) -> None:
    """:func:`verify_fingerprints` with the files split over the world's ranks and the outcome
    agreed through ``agree``; where a rank failed, every rank checks every file, so that all
    raise the same error. Under a ``process_group`` smaller than the world, or without
    ``agree``, every rank checks every file (no exchange)."""
    import torch.distributed as dist

    if agree is None or not dist.is_initialized() or dist.get_world_size() == 1 or (
            process_group is not None
            and dist.get_world_size(process_group) != dist.get_world_size()):
        verify_fingerprints(folder, metadata)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    error: WeightLoadError | None = None
    try:
        verify_fingerprints(folder, metadata, rank, world)
    except WeightLoadError as exc:
        error = exc
    failed = agree(None if error is None else str(error),
                   f"the fingerprint check of {os.fspath(folder)!r:.200}")
    if not failed:
        return
    verify_fingerprints(folder, metadata)  # raises the error of the first file that fails
    first = min(failed)
    raise WeightLoadError(f"rank {first} refused {os.fspath(folder)!r}: {failed[first]}")
