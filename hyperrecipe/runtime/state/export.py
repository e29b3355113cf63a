"""``Installation.save_pretrained``: consolidated safetensors, one gathered tensor at a time.

``from_pretrained`` wants whole tensors; an applied model holds shards. Every rank gathers each
tensor in turn (a collective) and one rank writes it straight into its file. The safetensors
header is written first: every name, dtype and shape is known from the plan before a byte is
gathered, so each file is streamed and the extra memory at any moment is about one full
tensor, never a file's worth or the model's. Files are split at ``max_shard_bytes`` with a
``model.safetensors.index.json`` as transformers writes them; the model's ``config`` (and
``generation_config``) are saved beside them. Tied parameters are written once, under the
name that owns them, as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.integrations.transformers import size_to_bytes

__all__ = ["ExportItem", "model_save_pretrained", "write_safetensors"]

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


def write_safetensors(folder: str | os.PathLike[str], items: Sequence[ExportItem], *,
                      writer: bool, max_shard_bytes: int, model: nn.Module) -> list[Path]:
    """Gather every item (all ranks, in order) and, where ``writer``, stream it to disk.

    Returns the files written (empty on other ranks).

    Raises:
        ValueError: a dtype safetensors cannot store.
    """
    for item in items:
        if item.dtype not in _DTYPES:
            raise ValueError(f"{item.name}: dtype {item.dtype} cannot be stored in safetensors")
    out = Path(folder)
    groups = _files(items, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, group in zip(names, groups, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for item in group:
            header[item.name] = {"dtype": _DTYPES[item.dtype], "shape": list(item.shape),
                                 "data_offsets": [offset, offset + item.nbytes]}
            offset += item.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data start to 8 bytes
        handle = open(out / name, "wb") if writer else None  # noqa: SIM115 - closed below
        try:
            if handle is not None:
                handle.write(struct.pack("<Q", len(text)) + text)
            for item in group:
                value = item.gather()  # every rank: a collective
                if handle is not None:
                    data = value.detach().to("cpu", item.dtype).contiguous()
                    if data.numel():
                        handle.write(data.reshape(-1).view(torch.uint8).numpy().data)
                del value
        finally:
            if handle is not None:
                handle.close()
        if writer:
            written.append(out / name)
    if writer:
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(i.nbytes for i in items)},
                     "weight_map": {i.name: n for n, g in zip(names, groups, strict=True)
                                    for i in g}}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for attr in ("config", "generation_config"):
            config = getattr(model, attr, None)
            if config is not None and callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(out)
    return written


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
