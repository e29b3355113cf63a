"""``Installation.save_pretrained``: consolidated safetensors, one gathered tensor at a time.

``from_pretrained`` wants whole tensors; an applied model holds shards. Each tensor in turn is
gathered to the one rank that writes (:func:`writer_gather`: its peers send their blocks to it
alone) and streamed straight into its file, hashed as it goes; the next tensor's gather runs
while the current one is written. The safetensors header is written first: every name, dtype
and shape is known from the plan before a byte is gathered, so each file is streamed and the
extra memory at any moment is about three full tensors on the writer (two in flight, one
spare), never a file's worth or the model's. Files are split at ``max_shard_bytes`` with a
``model.safetensors.index.json`` as transformers writes them; the model's ``config`` (and
``generation_config``) are saved beside them. Tied parameters are written once, under the
name that owns them, as ``save_pretrained`` does.

An export replaces the previous one in the folder whole or not at all: files are written
under temporary names and renamed into place once every rank got through, and an earlier
export's files that this one does not write are removed (see :func:`write_safetensors`).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import ExportAbortedError, ExportError, PlanMismatchError
from hyperrecipe.integrations.transformers import size_to_bytes
from hyperrecipe.plan import ParamPlan
from hyperrecipe.runtime.comm.gather_into import gather_to_writer, give_back
from hyperrecipe.runtime.state.file_digest import (
    FORMATS,
    Hasher,
    manifest_document,
    new_hasher,
    writing_digest,
)

if TYPE_CHECKING:  # pragma: no cover - checkpoint -> weights -> dcp_reader -> export
    from hyperrecipe.runtime.state.checkpoint import LiveParams

__all__ = ["MANIFEST", "ExportItem", "replace_text", "model_save_pretrained", "write_safetensors",
           "writer_gather"]

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


MANIFEST = "hyperrecipe.manifest.json"
"""Written last by an export: each weight file's size and digest (``load_weights`` checks them;
:mod:`~hyperrecipe.runtime.state.file_digest` says which digest and why)."""
MANIFEST_FORMAT = FORMATS[-1]

EXPORT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""Names an export writes: anything else of that name in the folder is an earlier export's."""

SYNC_BYTES = 64 << 20
"""The writer starts the disk on what it wrote every this many bytes (:func:`start_writeback`)."""


def write_safetensors(folder: str | os.PathLike[str], items: Sequence[ExportItem], *,
                      writer: bool, max_shard_bytes: int, model: nn.Module,
                      timeout_s: float | None = None, digest: str | None = None) -> list[Path]:
    """Gather every item (all ranks, in order) and, where ``writer``, stream it to disk.

    The gathers run on a thread of their own, one tensor ahead: while the writer writes and
    hashes tensor ``i``, tensor ``i + 1`` is being gathered, so at most two full tensors are
    in flight (a written one's memory is handed back to receive a later one). Each file is written under a temporary name in ``folder`` and synced; only
    when every rank got through (the ranks agree after the last gather) are the files renamed
    into place (``os.replace``, atomic per file) and what an earlier export left under the
    names an export writes (``model.safetensors``, ``model-*-of-*.safetensors``, the index)
    removed, so both ``load_weights`` and ``from_pretrained`` read the new weights. A failed
    write (a full disk, ``ulimit -f``) stops writing but not gathering, so the other ranks are
    not left waiting in a collective; every rank then raises, and the previous export is as it
    was. A gather that fails on a rank (or a rank that stops) cannot be gathered past: that
    rank raises at once and the others once a gather or the agreement has waited
    ``timeout_s`` (``None``: the process group's own timeout). ``digest`` is the manifest's
    algorithm (default :func:`~hyperrecipe.runtime.state.file_digest.writing_digest`).

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
    temps: list[Path] = []
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
            except OSError as exc:
                failure = f"cannot create {out}: {exc}"
        for name, group in zip(names, groups, strict=True):
            temp = out / f".{name}.tmp-{os.getpid()}"
            handle = None
            hasher = new_hasher(algorithm)  # hashed as the bytes stream: no second pass
            size = unsynced = 0
            if writer and failure is None:
                try:
                    handle = open(temp, "wb")  # noqa: SIM115 - closed below
                    temps.append(temp)
                    header = _header(group)
                    handle.write(header)
                    hasher.update(header)
                    size += len(header)
                except OSError as exc:
                    failure = f"writing {temp}: {exc}"
            for item in group:
                value = gathers.next()  # every rank; the next item's gather starts now
                if handle is not None and failure is None:
                    try:
                        written = _write(handle, hasher, hashing, value, item.dtype)
                        size += written
                        unsynced += written
                        if unsynced >= SYNC_BYTES:
                            start_writeback(handle.fileno(), size - unsynced, unsynced)
                            unsynced = 0
                    except OSError as exc:
                        failure = f"writing {temp}: {exc}"
                give_back(value)  # written (or not wanted): its memory serves the next gather
                del value  # before the next wait: two tensors at most, never three
            manifest[name] = (size, hasher.hexdigest())
            if handle is not None:
                try:
                    if failure is None:
                        handle.flush()
                        os.fsync(handle.fileno())
                    handle.close()
                except OSError as exc:
                    failure = failure or f"writing {temp}: {exc}"
        failures = gathers.agree(failure)
        if failures:
            raise ExportError(f"save_pretrained into {out} failed, so nothing was replaced and "
                              f"the folder holds what it held before:\n  " + "\n  ".join(
                                  f"rank {r}: {f}" for r, f in failures))
        if not writer:
            return []
        for temp, name in zip(temps, names, strict=True):
            os.replace(temp, out / name)
        temps = []
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(i.nbytes for i in items)},
                     "weight_map": {i.name: n for n, g in zip(names, groups, strict=True)
                                    for i in g}}
            text = json.dumps(index, indent=2) + "\n"
            replace_text(out / "model.safetensors.index.json", text)
            index_hash = new_hasher(algorithm)
            index_hash.update(text.encode())
            manifest["model.safetensors.index.json"] = (len(text.encode()),
                                                        index_hash.hexdigest())
        keep = set(names) | ({"model.safetensors.index.json"} if len(groups) > 1 else set())
        for stale in sorted(out.iterdir()):
            if EXPORT_FILES.fullmatch(stale.name) and stale.name not in keep:
                stale.unlink()
        document = manifest_document(MANIFEST_FORMAT, algorithm, manifest)
        replace_text(out / MANIFEST, json.dumps(document, indent=2, sort_keys=True) + "\n")
        _sync_folder(out)
    finally:
        gathers.close()
        hashing.shutdown()
        for temp in temps:
            temp.unlink(missing_ok=True)
    for attr in ("config", "generation_config"):
        config = getattr(model, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(out)
    return [out / name for name in names]


def _write(handle: BinaryIO, hasher: Hasher, hashing: ThreadPoolExecutor, value: Tensor,
           dtype: torch.dtype) -> int:
    """Write ``value``'s bytes as ``dtype`` and hash them beside the write (both release the
    GIL); return how many. Its views of the tensor end with the call."""
    data = value.detach().to("cpu", dtype).contiguous()
    if not data.numel():
        return 0
    view = data.reshape(-1).view(torch.uint8).numpy().data
    hashed = hashing.submit(hasher.update, view)
    try:
        handle.write(view)
    finally:
        hashed.result()
    return view.nbytes


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

    def next(self) -> Tensor:
        """The next item's full tensor; the one after it starts gathering before this returns."""
        if self._pending is None:
            self._pending = self._submit(self._items[self._done].gather)
        item = self._items[self._done]
        value: Tensor = self._wait(self._pending, f"gathering {item.name!r}")
        self._done += 1
        self._pending = (self._submit(self._items[self._done].gather)
                         if self._done < len(self._items) else None)
        return value

    def agree(self, failure: str | None) -> list[tuple[int, str]]:
        """Every rank's failure, the same list on every rank (see :func:`_agree`)."""
        result: list[tuple[int, str]] = self._wait(self._submit(lambda: _agree(failure)),
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


def _agree(failure: str | None) -> list[tuple[int, str]]:
    """Every rank's failure (rank, why), the same list on every rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [(0, failure)] if failure is not None else []
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failure)
    return [(r, f) for r, f in enumerate(everyone) if f is not None]


def replace_text(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    """Make the renames durable (a folder's entries are synced through the folder itself)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def model_save_pretrained(installation: Callable[[], Any]) -> Callable[..., None]:
    """The ``save_pretrained`` an applied transformers model carries while its plan is applied.

    transformers' own ``save_pretrained`` writes ``model.state_dict()`` from rank 0 alone: on an
    applied model those are DTensors or this rank's shards, and safetensors fails on them with
    ``Attempted to access the data pointer on an invalid python storage``. This one is
    :meth:`Installation.save_pretrained` (every rank gathers, rank 0 writes) for the arguments
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
                   f"Installation.save_pretrained(folder) on every rank, or restore() first")
            raise PlanMismatchError(msg)
        del is_main_process  # rank 0 writes; every rank gathers
        installation().save_pretrained(save_directory,
                                       max_shard_bytes=size_to_bytes(max_shard_size))

    return save_pretrained
