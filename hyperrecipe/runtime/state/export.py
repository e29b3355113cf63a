"""``Installation.save_pretrained``: consolidated safetensors, one gathered tensor at a time.

``from_pretrained`` wants whole tensors; an applied model holds shards. Every rank gathers each
tensor in turn (a collective) and one rank writes it straight into its file. The safetensors
header is written first: every name, dtype and shape is known from the plan before a byte is
gathered, so each file is streamed and the extra memory at any moment is about one full
tensor, never a file's worth or the model's. Files are split at ``max_shard_bytes`` with a
``model.safetensors.index.json`` as transformers writes them; the model's ``config`` (and
``generation_config``) are saved beside them. Tied parameters are written once, under the
name that owns them, as ``save_pretrained`` does.

An export replaces the previous one in the folder whole or not at all: files are written
under temporary names and renamed into place once every rank got through, and an earlier
export's files that this one does not write are removed (see :func:`write_safetensors`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import ExportError, PlanMismatchError
from hyperrecipe.integrations.transformers import size_to_bytes

__all__ = ["MANIFEST", "ExportItem", "replace_text", "model_save_pretrained", "write_safetensors"]

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
"""Written last by an export: each weight file's size and sha256 (``load_weights`` checks them)."""
MANIFEST_FORMAT = "hyperrecipe-export/1"

EXPORT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""Names an export writes: anything else of that name in the folder is an earlier export's."""


def write_safetensors(folder: str | os.PathLike[str], items: Sequence[ExportItem], *,
                      writer: bool, max_shard_bytes: int, model: nn.Module) -> list[Path]:
    """Gather every item (all ranks, in order) and, where ``writer``, stream it to disk.

    Each file is written under a temporary name in ``folder`` and synced; only when every rank
    got through (the ranks agree after the last gather) are the files renamed into place
    (``os.replace``, atomic per file) and what an earlier export left under the names an
    export writes (``model.safetensors``, ``model-*-of-*.safetensors``, the index) removed,
    so both ``load_weights`` and ``from_pretrained`` read the new weights. A failed write
    (a full disk, ``ulimit -f``) stops writing but not gathering, so the other ranks are not
    left waiting in a collective; every rank then raises, and the previous export is as it was.

    Returns the files written (empty on other ranks).

    Raises:
        ValueError: a dtype safetensors cannot store.
        ExportError: writing failed on a rank (the message names it and why).
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
    manifest: dict[str, dict[str, Any]] = {}
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-hash")
    try:
        if writer:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                failure = f"cannot create {out}: {exc}"
        for name, group in zip(names, groups, strict=True):
            temp = out / f".{name}.tmp-{os.getpid()}"
            handle = None
            digest = hashlib.sha256()  # hashed as the bytes stream: no second pass
            size = 0
            if writer and failure is None:
                try:
                    handle = open(temp, "wb")  # noqa: SIM115 - closed below
                    temps.append(temp)
                    header = _header(group)
                    handle.write(header)
                    digest.update(header)
                    size += len(header)
                except OSError as exc:
                    failure = f"writing {temp}: {exc}"
            for item in group:
                value = item.gather()  # every rank: a collective
                if handle is not None and failure is None:
                    data = value.detach().to("cpu", item.dtype).contiguous()
                    try:
                        if data.numel():
                            view = data.reshape(-1).view(torch.uint8).numpy().data
                            # hashlib and the write both release the GIL: hash beside the
                            # write, so the hash costs about nothing where writing is slower
                            hashed = hasher.submit(digest.update, view)
                            handle.write(view)
                            hashed.result()
                            size += view.nbytes
                    except OSError as exc:
                        failure = f"writing {temp}: {exc}"
                del value
            manifest[name] = {"bytes": size, "sha256": digest.hexdigest()}
            if handle is not None:
                try:
                    if failure is None:
                        handle.flush()
                        os.fsync(handle.fileno())
                    handle.close()
                except OSError as exc:
                    failure = failure or f"writing {temp}: {exc}"
        failures = _agree(failure)
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
            manifest["model.safetensors.index.json"] = {
                "bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
        keep = set(names) | ({"model.safetensors.index.json"} if len(groups) > 1 else set())
        for stale in sorted(out.iterdir()):
            if EXPORT_FILES.fullmatch(stale.name) and stale.name not in keep:
                stale.unlink()
        replace_text(out / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": manifest},
                                                 indent=2, sort_keys=True) + "\n")
        _sync_folder(out)
    finally:
        hasher.shutdown()
        for temp in temps:
            temp.unlink(missing_ok=True)
    for attr in ("config", "generation_config"):
        config = getattr(model, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(out)
    return [out / name for name in names]


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
