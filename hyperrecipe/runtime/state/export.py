"""``TrainingState.save_pretrained``: consolidated safetensors, one gathered tensor at a time.

``from_pretrained`` wants whole tensors; an applied model holds shards. Each tensor in turn is
gathered to the one rank that writes (:func:`writer_gather`: its peers send their blocks to it
alone) and streamed straight into its file, hashed as it goes; the next tensor's gather runs
while the current one is written. The safetensors header is written first: every name, dtype
and shape is known from the plan before a byte is gathered, so each file is streamed and the
extra memory at any moment is about three full tensors on the writer (two in flight, one
spare) and at most :data:`SMALL_QUEUE_BYTES` of small tensors' copies waiting to be written,
never a file's worth or the model's. Files are split at ``max_shard_bytes`` with a
``model.safetensors.index.json`` as transformers writes them; the model's ``config`` (and
``generation_config``) are saved beside them. Tied parameters are written once, under the
name that owns them, as ``save_pretrained`` does.

Ranks on the writer's host write their own blocks of each sharded tensor straight into the
writer's file instead of sending them (:mod:`~hyperrecipe.runtime.state.direct_write`); the
writer then hashes those tensors from the file, so the manifest is the same either way.

An export replaces the previous one in the folder whole or not at all: every file a loader
reads (weights, index, configs, manifest) is written into a staging folder beside it and
switched in by one atomic exchange once every rank got through
(:mod:`~hyperrecipe.runtime.state.folder_switch`), so neither our loader nor transformers'
ever sees a mix of two exports, and a failure after the agreement reaches every rank (see
:func:`write_safetensors`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import mmap
import os
import queue
import re
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import ExportAbortedError, ExportError, PlanMismatchError
from hyperrecipe.models import LIBRARY
from hyperrecipe.plan import ParamPlan
from hyperrecipe.runtime.comm.gather_into import (
    OwnBlocks,
    gather_to_writer,
    give_back,
    own_blocks,
)
from hyperrecipe.runtime.state.direct_write import (
    NONCE_BYTES,
    Reports,
    accept,
    hash_range,
    map_for_hashing,
    offer,
    wait_written,
    write_runs,
)
from hyperrecipe.runtime.preflight.agreement import every_rank_failure
from hyperrecipe.runtime.state.folder_switch import MARKER, Staging, SwitchIncompleteError
from hyperrecipe.runtime.state.folder_switch import abandon as abandon_switch
from hyperrecipe.runtime.state.folder_switch import begin as begin_switch
from hyperrecipe.runtime.state.folder_switch import commit as commit_switch
from hyperrecipe.runtime.state.integrity import (
    MANIFEST,
    MANIFEST_FORMAT,
    Hasher,
    digest_file,
    manifest_document,
    new_hasher,
    writing_digest,
)

if TYPE_CHECKING:  # pragma: no cover - checkpoint -> weights -> dcp_reader -> export
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["EXPORT_FILES", "ExportItem", "model_save_pretrained", "write_safetensors",
           "writer_blocks", "writer_gather"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


@attrs.frozen(kw_only=True)
class ExportItem:
    """One tensor to write: its checkpoint name, dtype, full shape, and how to get it (a
    collective every rank calls in the same order)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    gather: Callable[[], Tensor]
    blocks: Callable[[], OwnBlocks | None] | None = None
    """Where this rank's blocks lie in the full tensor (:func:`writer_blocks`), for ranks that
    can write them into the writer's file themselves; ``None`` (or a call that answers
    ``None`` on every rank alike): the writer gets the full tensor from ``gather``."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def writer_gather(live: LiveParams, p: ParamPlan, writer: int) -> Callable[[], Tensor]:
    """How an export gathers parameter ``p``: to ``writer`` alone, point to point, when it is
    sharded over one mesh dim (:func:`~hyperrecipe.runtime.comm.gather_into.gather_to_writer`;
    the others get an empty tensor, which they do not write), else the full tensor on every
    rank (``full_of``). Every rank takes the same way: it depends on the plan only."""

    def gather() -> Tensor:
        from torch.distributed.tensor import DTensor

        value = live.param(p)
        if not (isinstance(value, DTensor) and value.device_mesh != live.mesh):
            local = live.local(p)
            if tuple(local.shape) != p.shape:
                full = gather_to_writer(local, p.placement, p.shape, live.mesh,
                                        live.plan.mesh_dims, writer)
                if full is not None:
                    return full
        return live.full_of(p, value)

    return gather


def writer_blocks(live: LiveParams, p: ParamPlan, writer: int) -> Callable[[], OwnBlocks | None]:
    """Where this rank's blocks of parameter ``p`` lie in the full tensor, for the layouts
    :func:`writer_gather` sends point to point; ``None`` (on every rank alike) otherwise."""

    def blocks() -> OwnBlocks | None:
        from torch.distributed.tensor import DTensor

        value = live.param(p)
        if isinstance(value, DTensor) and value.device_mesh != live.mesh:
            return None
        local = live.local(p)
        if tuple(local.shape) == p.shape:
            return None
        return own_blocks(local, p.placement, p.shape, live.mesh, live.plan.mesh_dims, writer)

    return blocks


def _files(items: Sequence[ExportItem], max_shard_bytes: int) -> list[list[ExportItem]]:
    files: list[list[ExportItem]] = [[]]
    size = 0
    for item in items:
        if files[-1] and size + item.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += item.nbytes
    return files


EXPORT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""Names an export writes: anything else of that name in the folder is an earlier export's."""

SYNC_BYTES = 64 << 20
"""The writer starts the disk on what it wrote every this many bytes (:func:`start_writeback`)."""


def write_safetensors(folder: str | os.PathLike[str], items: Sequence[ExportItem], *,
                      writer: bool, max_shard_bytes: int, model: nn.Module,
                      timeout_s: float | None = None, digest: str | None = None,
                      direct: bool = True) -> list[Path]:
    """Gather every item (all ranks, in order) and, where ``writer``, stream it to disk.

    The gathers run on a thread of their own, one tensor ahead: while the writer writes and
    hashes tensor ``i``, tensor ``i + 1`` is being gathered, so at most two full tensors are
    in flight (a written one's memory is handed back to receive a later one); a tensor of at
    most :data:`SMALL_BYTES` is copied and left to the hashing thread to hash and write, so
    the writer waits behind the hashes queued before it only past :data:`SMALL_QUEUE_BYTES`
    of such copies. Each file is
    written into the writer's staging folder (:func:`~.folder_switch.begin`) and synced; only
    when every rank got through (the ranks agree after the last gather) does the writer add the
    index, the configs and the manifest there and switch the folder in whole
    (:func:`_switch_in`): what an earlier export left under the names an export owns
    (:func:`owned_by_export`) is gone with it, everything else in the folder is kept, and both
    ``load_weights`` and ``from_pretrained`` read the new export; a second exchange tells every
    rank how the switch went, so all raise the same ``ExportError`` or none does. A failed
    write (a full disk, ``ulimit -f``) stops writing but not gathering, so the other ranks are
    not left waiting in a collective; every rank then raises, and the previous export is as it
    was. A gather that fails on a rank (or a rank that stops) cannot be gathered past: that
    rank raises at once and the others once a gather or the agreement has waited
    ``timeout_s`` (``None``: the process group's own timeout). ``digest`` is the manifest's
    algorithm (default :func:`~hyperrecipe.runtime.state.integrity.writing_digest`).

    With ``direct`` (the default), ranks that run on the writer's kernel and see its
    temporary files write their own blocks of each item that has ``blocks`` straight into them
    (:mod:`~hyperrecipe.runtime.state.direct_write`); the writer hashes those tensors from the
    file once every rank reported its blocks written. The ranks agree on this before any
    tensor is written; otherwise every block is gathered to the writer.

    Returns the files written (empty on other ranks).

    Raises:
        ValueError: a dtype safetensors cannot store.
        ExportError: writing failed on a rank (the message names it and why).
        ExportAbortedError: a rank failed or stopped mid-gather (the folder is unchanged too).
    """
    for item in items:
        if item.dtype not in _DTYPES:
            raise ValueError(f"{item.name}: dtype {item.dtype} cannot be stored in safetensors")
    out = Path(folder)
    groups = _files(items, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    headers = [_header(group) for group in groups]
    staging: Staging | None = None
    temps: list[Path] = []  # the files in the staging folder
    fds: list[int] = []  # the writer's staged files, or a direct peer's handles to them
    mappings: dict[int, mmap.mmap | None] = {}
    failure: str | None = None
    algorithm = digest or writing_digest()
    new_hasher(algorithm)  # an unknown one is refused before any traffic
    manifest: dict[str, tuple[int, str]] = {}
    gathers = _Gathers(items, out, timeout_s)
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-hash")
    try:
        if writer:
            try:
                out.mkdir(parents=True, exist_ok=True)
                staging = begin_switch(out, owned_by_export)
                for name, header in zip(names, headers, strict=True):
                    temp = staging.path / name
                    fds.append(os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL
                                       | getattr(os, "O_CLOEXEC", 0), 0o666))
                    temps.append(temp)
                    _pwrite_all(fds[-1], memoryview(header), 0)
            except OSError as exc:
                failure = f"writing {temps[-1] if temps else staging.path if staging else out}: {exc}"
        on_host = False
        if direct and _distributed():  # the same on every rank: all negotiate, or none
            first = sum(i.nbytes for i in groups[0])
            peer_fds = gathers.negotiate(writer, failure is None and first >= NONCE_BYTES,
                                         fds, temps, len(headers[0]))
            on_host = peer_fds is not None
            if on_host and not writer:
                fds = peer_fds or []
        if on_host and writer and failure is None:
            for temp, fd, header, group in zip(temps, fds, headers, groups, strict=True):
                try:
                    os.ftruncate(fd, len(header) + sum(i.nbytes for i in group))
                except OSError as exc:
                    failure = f"writing {temp}: {exc}"
                    break
        state = _DirectState(failure=failure)  # once set, no rank writes blocks any more
        gathers.plan_jobs(_jobs(groups, headers, fds, temps, on_host, writer, state))
        for k, (name, group, header) in enumerate(zip(names, groups, headers, strict=True)):
            hasher = new_hasher(algorithm)  # hashed as the bytes stream: no second pass
            hasher.update(header)
            at = synced = len(header)
            hashes: list[Future[None]] = []
            queued: deque[tuple[Future[None], int]] = deque()  # small copies not yet written
            queued_bytes = 0
            for item in group:
                value = gathers.next()  # every rank; the next item's gather starts now
                start, at = at, at + item.nbytes
                if isinstance(value, _Direct):  # in the file already: the writer hashes it
                    failure = failure or value.failure
                    if writer and failure is None and not value.failed_peers:
                        if k not in mappings:
                            mappings[k] = map_for_hashing(fds[k])
                        hashes.append(hashing.submit(hash_range, hasher, fds[k], mappings[k],
                                                     start, at))
                else:
                    if writer and failure is None and item.nbytes <= SMALL_BYTES:
                        hashes.append(hashing.submit(_hash_and_write, fds[k], start, hasher,
                                                     _bytes_of(value, item.dtype)))
                        queued.append((hashes[-1], item.nbytes))
                        queued_bytes += item.nbytes
                        try:  # bounded: the copies wait for the hashing thread past a limit
                            while queued_bytes > SMALL_QUEUE_BYTES:
                                oldest, size = queued.popleft()
                                queued_bytes -= size
                                oldest.result()
                        except OSError as exc:
                            failure = f"writing {temps[k]}: {exc}"
                    elif writer and failure is None:
                        try:
                            _write(fds[k], start, hasher, hashing, value, item.dtype)
                        except OSError as exc:
                            failure = f"writing {temps[k]}: {exc}"
                    give_back(value)  # written (or not wanted): its memory serves the next
                del value  # before the next wait: two tensors at most, never three
                state.failure = state.failure or failure
                if writer and failure is None and at - synced >= SYNC_BYTES:
                    hashes.append(hashing.submit(start_writeback, fds[k], synced, at - synced))
                    synced = at
            if writer and failure is None:
                try:
                    for hashed in hashes:  # every hash (and small write) of the file is done
                        hashed.result()
                    if (mapping := mappings.pop(k, None)) is not None:
                        mapping.close()
                    os.fsync(fds[k])
                except OSError as exc:
                    failure = f"writing {temps[k]}: {exc}"
            manifest[name] = (at, hasher.hexdigest())
        failures = gathers.agree(failure, state.reports.finish)
        if failures:
            raise ExportError(f"save_pretrained into {out} failed, so nothing was replaced and "
                              f"the folder holds what it held before:\n  " + "\n  ".join(
                                  f"rank {r}: {f}" for r, f in failures))
        for fd in fds:
            os.close(fd)
        fds = []
        switched = None
        if writer and staging is not None:
            switched = _switch_in(staging, model, items, manifest, algorithm,
                                  index=_index(names, groups, items) if len(groups) > 1 else None)
            staging = None  # switched in, or abandoned by _switch_in
        # after the agreement: every rank learns the writer's outcome, and all raise alike
        try:
            after = gathers.agree(switched)
        except ExportAbortedError as exc:
            if not writer or switched is not None:
                raise
            raise ExportAbortedError(  # the generic text says nothing was replaced: not so
                f"save_pretrained into {out}: the new export was switched in whole, but a rank "
                f"did not confirm it afterwards ({exc!s:.300})") from exc
        if after:
            raise ExportError("\n".join(f"rank {r}: {f}" for r, f in after))
    finally:
        gathers.close()
        hashing.shutdown()
        for left in mappings.values():
            try:
                if left is not None:
                    left.close()
            except BufferError:  # a hash still reading it (an abort): unmapped when collected
                pass
        for fd in fds:
            os.close(fd)
        if staging is not None:
            with contextlib.suppress(OSError):
                abandon_switch(staging)
    return [out / name for name in names] if writer else []


OWNED_NAMES = frozenset({MANIFEST, "config.json", "generation_config.json"})
"""What an export writes besides :data:`EXPORT_FILES`: replaced with it, never carried over."""
_LEGACY_TEMP = re.compile(r"\.(model.*\.safetensors|model\.safetensors\.index\.json|"
                          r"hyperrecipe\.manifest\.json)\.tmp-\d+")
"""Temporaries a writer killed before this version's staging folder left in the folder."""


def owned_by_export(name: str) -> bool:
    """Whether ``name`` in an export folder belongs to the export (replaced by the next one,
    not carried over; :func:`~hyperrecipe.runtime.state.folder_switch.commit`)."""
    return (EXPORT_FILES.fullmatch(name) is not None or name in OWNED_NAMES
            or _LEGACY_TEMP.fullmatch(name) is not None)


def _index(names: Sequence[str], groups: Sequence[Sequence[ExportItem]],
           items: Sequence[ExportItem]) -> str:
    index = {"metadata": {"total_size": sum(i.nbytes for i in items)},
             "weight_map": {i.name: n for n, g in zip(names, groups, strict=True) for i in g}}
    return json.dumps(index, indent=2) + "\n"


def _switch_in(staging: Staging, model: nn.Module, items: Sequence[ExportItem],
               manifest: dict[str, tuple[int, str]], algorithm: str,
               index: str | None) -> str | None:
    """Write the rest of the export into the staging folder (the index, the configs, then the
    manifest listing every file a loader reads) and switch it in for the folder's earlier
    state: ``None``, or why it failed (the staging folder then removed: the folder holds what
    it held before, unless the failure came after the switch, which the text says)."""
    where = staging.path
    try:
        if index is not None:
            _write_synced(where / "model.safetensors.index.json", index.encode())
        for attr in ("config", "generation_config"):
            config = getattr(model, attr, None)
            if config is not None and callable(getattr(config, "save_pretrained", None)):
                if attr == "config":
                    config = _as_saved(config, model, items)
                config.save_pretrained(where)
        for path in sorted(where.iterdir()):
            if path.name not in manifest and path.name != MARKER:
                manifest[path.name] = (path.stat().st_size, digest_file(path, algorithm))
                _fsync_path(path)
        document = manifest_document(MANIFEST_FORMAT, algorithm, manifest)
        _write_synced(where / MANIFEST,
                      (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())
        commit_switch(staging, owned_by_export, last=[MANIFEST])
    except SwitchIncompleteError as exc:
        return (f"save_pretrained into {staging.target}: the new export was switched in, but "
                f"the switch did not finish ({exc!s:.300}); the next save into the folder "
                f"finishes it")
    except Exception as exc:  # noqa: BLE001 - every rank raises it, as ExportError
        with contextlib.suppress(OSError):
            abandon_switch(staging)
        return (f"save_pretrained into {staging.target} failed after every rank wrote its "
                f"part, before the switch, so nothing was replaced and the folder holds what "
                f"it held before: {type(exc).__name__}: {exc!s:.300}")
    return None


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                 0o666)
    try:
        _pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_saved(config: Any, model: nn.Module, items: Sequence[ExportItem]) -> Any:
    """A copy of the model's config as transformers' ``save_pretrained`` writes it: ``dtype``
    the dtype the floating tensors were written in, ``architectures`` the model's class.
    Written as it stood, a config still saying ``bfloat16`` over fp32 weights (a model loaded in
    bf16 and trained in fp32) made ``from_pretrained``'s default ``dtype="auto"`` reload the
    export rounded to bf16, silently; a config without ``architectures`` is refused by tools
    that go by it. The live model's config is left as it is."""
    import copy

    saved = copy.deepcopy(config)
    written = next((i.dtype for i in items if i.dtype.is_floating_point), None)
    if written is not None and hasattr(saved, "dtype"):
        saved.dtype = str(written).removeprefix("torch.")
    if hasattr(saved, "architectures"):
        saved.architectures = [type(model).__name__.removeprefix("FSDP")]
    return saved


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _pwrite_all(fd: int, view: memoryview, at: int) -> int:
    start = 0
    while start < len(view):
        done = os.pwrite(fd, view[start:], at + start)
        if done <= 0:
            raise OSError(f"pwrite wrote {done} bytes")
        start += done
    return start


def _jobs(groups: Sequence[Sequence[ExportItem]], headers: Sequence[bytes], fds: Sequence[int],
          temps: Sequence[Path], on_host: bool, writer: bool,
          state: _DirectState) -> list[Callable[[], Any]]:
    """Each item's work on the export's thread, in order: its gather, or where the ranks
    write their own blocks, the writer's wait for its peers' blocks (then it writes its own)
    or a peer's write of its blocks followed by its report to the writer."""
    jobs: list[Callable[[], Any]] = []
    for k, (group, header) in enumerate(zip(groups, headers, strict=True)):
        at = len(header)
        for item in group:
            if on_host and item.blocks is not None:
                jobs.append(functools.partial(_direct_job, item, fds[k] if fds else -1,
                                              temps[k] if temps else None, at, writer, state))
            else:
                jobs.append(item.gather)
            at += item.nbytes
    return jobs


def _direct_job(item: ExportItem, fd: int, temp: Path | None, at: int, writer: bool,
                state: _DirectState) -> Any:
    """Write this rank's blocks of ``item`` into the file at their places; then the writer
    waits for its peers' reports, and a peer reports to the writer."""
    assert item.blocks is not None
    blocks = item.blocks()
    if blocks is None:  # the same on every rank: this one is gathered after all
        return item.gather()
    if not blocks.length:  # not in the writer's group: nothing to write
        return _Direct()
    if state.failure is None:
        try:
            write_runs(fd, at, blocks)
        except OSError as exc:
            state.failure = (f"writing {temp}: {exc}" if writer else
                             f"writing its blocks of {item.name!r} into {temp}: {exc}")
    if writer:
        return _Direct(failed_peers=tuple(wait_written(blocks)), failure=state.failure)
    state.reports.send(blocks, failed=state.failure is not None)
    return _Direct(failure=state.failure)


@attrs.define
class _DirectState:
    """A direct peer's first failure to write (it writes nothing more, and says so), and its
    reports to the writer still in flight."""

    failure: str | None = None
    reports: Reports = attrs.field(factory=Reports)


@attrs.frozen(kw_only=True)
class _Direct:
    """An item whose blocks the ranks wrote themselves: this rank's failure to write, if any,
    and on the writer the peers that could not write theirs."""

    failed_peers: tuple[int, ...] = ()
    failure: str | None = None


def _write(fd: int, at: int, hasher: Hasher, hashing: ThreadPoolExecutor, value: Tensor,
           dtype: torch.dtype) -> int:
    """Write ``value``'s bytes as ``dtype`` at ``at`` and hash them beside the write (both
    release the GIL); return how many. Its views of the tensor end with the call."""
    data = value.detach().to("cpu", dtype).contiguous()
    if not data.numel():
        return 0
    view = data.reshape(-1).view(torch.uint8).numpy().data
    hashed = hashing.submit(hasher.update, view)
    try:
        _pwrite_all(fd, view, at)
    finally:
        hashed.result()
    return view.nbytes


SMALL_BYTES = 1 << 20
"""A gathered tensor at most this size (a norm's weight, a bias) is copied, then hashed and
written on the hashing thread while the writer goes on: waiting for the hashes queued before
it (every tensor of the layer above) stalled the writer once per layer."""

SMALL_QUEUE_BYTES = 64 << 20
"""At most this many bytes of those copies wait for the hashing thread (a model of
thousands of small tensors whose hashing falls behind its gathers): past it the writer waits
for the oldest."""


def _bytes_of(value: Tensor, dtype: torch.dtype) -> bytes:
    """A copy of ``value``'s bytes as ``dtype`` (for :data:`SMALL_BYTES` tensors)."""
    data = value.detach().to("cpu", dtype).contiguous()
    return data.reshape(-1).view(torch.uint8).numpy().tobytes()


def _hash_and_write(fd: int, at: int, hasher: Hasher, data: bytes) -> None:
    """Hash ``data`` (after every hash queued before it) and write it at ``at``."""
    hasher.update(data)
    if data:
        _pwrite_all(fd, memoryview(data), at)


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` to disk without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk works while the next
    tensors are gathered, hashed and written, and the ``fsync`` at the file's end (which the
    other ranks wait through) waits only for the tail. Elsewhere the ``fsync`` does it all."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: result unused


class _Gathers:
    """The export's collectives, in order, on one daemon thread, one gather ahead of the
    writer; each wait is bounded by ``timeout_s``.

    A collective cannot be interrupted, so a bounded wait needs it off the waiting thread. A
    daemon thread (not an executor's, which Python joins at exit) is left blocked when a peer
    never arrives; the process group's own timeout or the peer's exit ends it later. When
    every wait was answered, :meth:`close` joins the thread: no thread of the export outlives
    ``save_pretrained``, so none is still leaving (or inside a torch call) while the
    interpreter shuts down right after a last export.
    """

    def __init__(self, items: Sequence[ExportItem], folder: Path,
                 timeout_s: float | None) -> None:
        self._items = list(items)
        self._jobs_of: list[Callable[[], Any]] = [item.gather for item in self._items]
        self._folder = folder
        self._timeout = timeout_s
        self._done = 0
        self._pending: Future[Tensor] | None = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._stuck = False  # a wait timed out: the thread may be blocked in a collective

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with torch.no_grad():
                    result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="export-gather", daemon=True)
            self._thread.start()
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future

    def _wait(self, future: Future[Any], what: str) -> Any:
        rank = _rank()
        try:
            return future.result(timeout=self._timeout)
        except FutureTimeout:
            self._stuck = True
            why = (f"{what} got no answer from the other ranks within {self._timeout:g} s "
                   f"(collective_timeout_s): a rank failed or stopped mid-export (its own "
                   f"error says why)")
            exc: BaseException | None = None
        except ExportError:
            raise
        except Exception as caught:  # noqa: BLE001 - named below, with the cause chained
            why = f"{what} failed: {type(caught).__name__}: {caught!s:.500}"
            exc = caught
        msg = (f"save_pretrained into {self._folder} stopped, so nothing was replaced and the "
               f"folder holds what it held before:\n  rank {rank}: {why}. The ranks' "
               f"collectives are out of step now: restart every rank")
        raise ExportAbortedError(msg) from exc

    def plan_jobs(self, jobs: Sequence[Callable[[], Any]]) -> None:
        """Each item's work (its gather unless said otherwise): before the first :meth:`next`."""
        assert self._done == 0 and self._pending is None and len(jobs) == len(self._items)
        self._jobs_of = list(jobs)

    def next(self) -> Any:
        """The next item's full tensor (or what its job returns); the one after it starts
        before this returns."""
        if self._pending is None:
            self._pending = self._submit(self._jobs_of[self._done])
        item = self._items[self._done]
        value = self._wait(self._pending, f"gathering {item.name!r}")
        self._done += 1
        self._pending = (self._submit(self._jobs_of[self._done])
                         if self._done < len(self._items) else None)
        return value

    def negotiate(self, writer: bool, candidate: bool, fds: Sequence[int],
                  temps: Sequence[Path], nonce_at: int) -> list[int] | None:
        """Whether every rank writes its own blocks into the writer's temporary files (see
        :mod:`~hyperrecipe.runtime.state.direct_write`): a peer's handles to them, ``[]`` on
        the writer, or ``None`` on every rank when any rank cannot. A collective."""
        result: list[int] | None = self._wait(
            self._submit(lambda: _negotiate(writer, candidate, fds, temps, nonce_at)),
            "agreeing whether the ranks write their own blocks")
        return result

    def agree(self, failure: str | None,
              first: Callable[[], None] | None = None) -> list[tuple[int, str]]:
        """Every rank's failure, the same list on every rank (:func:`every_rank_failure`),
        after ``first`` (on the export's thread, within the same bounded wait)."""

        def agree() -> list[tuple[int, str]]:
            if first is not None:
                first()
            return every_rank_failure(failure)

        result: list[tuple[int, str]] = self._wait(self._submit(agree),
                                                   "agreeing that every rank got through")
        return result

    def close(self) -> None:
        """Let the thread end after its current job (the queue's end marker), and wait for it
        unless a wait timed out (then it may be blocked in a collective for good)."""
        busy = self._stuck
        if self._pending is not None and not self._pending.cancel():
            busy = busy or not self._pending.done()  # a gather running: peers may be gone
        if self._thread is not None:
            self._jobs.put(None)
            if not busy:  # idle: it reads the end marker and returns at once
                self._thread.join()


def _negotiate(writer: bool, candidate: bool, fds: Sequence[int], temps: Sequence[Path],
               nonce_at: int) -> list[int] | None:
    import torch.distributed as dist

    offered = offer(fds, temps, nonce_at) if writer and candidate else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (writer, offered))
    offers = [o for w, o in everyone if w]
    mine = ([] if offered is not None else None) if writer else (
        accept(offers[0]) if len(offers) == 1 else None)
    agreed: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(agreed, mine is not None)
    if all(agreed):
        return mine
    for fd in mine or []:
        os.close(fd)
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _header(group: Sequence[ExportItem]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in group:
        header[item.name] = {"dtype": _DTYPES[item.dtype], "shape": list(item.shape),
                             "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(text)) + text


def model_save_pretrained(installation: Callable[[], Any]) -> Callable[..., None]:
    """The ``save_pretrained`` an applied transformers model carries while its plan is applied.

    transformers' own ``save_pretrained`` writes ``model.state_dict()`` from rank 0 alone: on an
    applied model those are DTensors or this rank's shards, and safetensors fails on them with
    ``Attempted to access the data pointer on an invalid python storage``. This one is
    :meth:`TrainingState.save_pretrained` (every rank gathers, rank 0 writes) for the arguments
    a plain save passes; a call with anything else is refused by name. Called on one rank only
    (``if rank == 0``, as ``Trainer`` does), the gather's monitored barrier refuses it within
    ``collective_timeout_s`` instead of hanging.
    """

    def save_pretrained(save_directory: str | os.PathLike[str], is_main_process: bool = True,
                        state_dict: Any = None, max_shard_size: int | str = "50GB",
                        safe_serialization: bool = True, **kwargs: Any) -> None:
        unsupported = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if state_dict is not None:
            unsupported.insert(0, "state_dict")
        if not safe_serialization:
            unsupported.append("safe_serialization=False")
        if unsupported:
            msg = (f"model.save_pretrained({', '.join(unsupported)}) on a model with an applied "
                   f"plan: the weights are gathered from the shards, so only a folder, "
                   f"max_shard_size and is_main_process are supported; call "
                   f"inst.state.save_pretrained(folder) on every rank, or restore() first")
            raise PlanMismatchError(msg)
        del is_main_process  # rank 0 writes; every rank gathers
        max_shard_bytes = LIBRARY.size_to_bytes(max_shard_size)
        if max_shard_bytes is None:
            msg = (f"model.save_pretrained(max_shard_size={max_shard_size!r}): not a size "
                   f"(bytes, or a string such as '5GB')")
            raise PlanMismatchError(msg)
        installation().state.save_pretrained(save_directory, max_shard_bytes=max_shard_bytes)

    return save_pretrained
