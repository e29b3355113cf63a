"""``TrainingState.load_weights``: each rank reads only its slices of a checkpoint.

Loading is a chain of strategies in the shape of the design's capability fallback. Each
strategy says whether it can read a source (``ineligible`` with the reason when not), then
*plans* the whole load from metadata alone: every tensor it will read, its file, its shape, so
that a missing, unexpected or mis-shaped tensor is one error naming every such tensor and its
file before a byte of the model changes (``load_state_dict(strict=True)``'s contract). Only then
does it write, slice by slice; if writing fails anyway, what it wrote is rolled back (to the
previous values, or to "unset" for weights that were never loaded). The first strategy that
can read a source is the format the source declares: when it fails, no other is tried (a
folder handed over as safetensors is never read as a DCP folder because a ``.metadata`` is
hidden in it), and the error says which strategy failed and why.

Files are read only when they are regular files inside the folder (a FIFO would block
forever; an index naming ``../`` or an absolute path, or a symlink leading out of the folder,
is refused; a Hugging Face cache snapshot's symlinks into its ``blobs`` are followed), and
only through one :class:`~.snapshot.Snapshot` per load (:func:`open_snapshot`): the folder and
each file opened once, before any data is read; the manifest hashed, and the tensors read,
from those descriptors; the files checked unchanged after planning and after the copy;
indexes are read up to :data:`MAX_INDEX_BYTES`; DCP metadata is read without running code
(:mod:`~hyperrecipe.runtime.state.dcp_reader`).

Strategies:

- ``safetensors``: a ``.safetensors`` file, or a Hugging Face checkpoint folder (one
  ``model.safetensors``, an indexed ``model.safetensors.index.json``, or else any
  ``*.safetensors``; as in ``from_pretrained``, an index or ``model.safetensors`` wins over
  other files).
  Reads the rank's ranges only (chunked shards read one range per fused part) by positional
  reads straight into the shards (:mod:`.checkpoint_files`; no memory mapping, so a file
  shortened while loading is a located error, not SIGBUS), converting dtypes. Checkpoint keys that transformers converts at load time
  (per-expert MoE tensors into the fused ``experts.gate_up_proj``, renamed modules) are read
  the way ``from_pretrained`` would place them, still by slices (``hf_conversion.py``).
- ``torch``: ``pytorch_model.bin`` (sharded with ``pytorch_model.bin.index.json`` or not), or a
  ``.bin``/``.pt`` file of a state dict: parsed as data (``torch.load(mmap=True,
  weights_only=True)``, no tensor page touched), then read like safetensors by positional
  reads at each tensor's zip record, conversions included.
- ``dcp``: a ``torch.distributed.checkpoint`` folder (a ``.metadata`` file), as written by
  ``dcp.save(inst.state.state_dict())`` (keys ``model.<fqn>``) or by a trainer that saved the model's
  state dict at the top level (keys ``<fqn>``), on any mesh. After every check, one
  ``dcp.load`` reads straight into the shards (DTensors over the shards' own storage), so a
  load holds no second copy of the rank's shards; only a tied parameter stored under several
  names is read into buffers first, to compare its names before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import WeightLoadError
from hyperrecipe.plan import ParamPlan
from hyperrecipe.models import LIBRARY, Composite
from hyperrecipe.runtime.comm.sharding import Ranges, read_ranges, shard_ranges
from hyperrecipe.runtime.state.integrity import MANIFEST, new_hasher, parse_manifest
from hyperrecipe.runtime.state.snapshot import Snapshot, borrowed
from hyperrecipe.runtime.state.checkpoint_files import (
    MAX_LISTED,
    Staging,
    dtype_kind,
    listing,
    open_safetensors,
    open_torch_file,
)

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["LoadAttempt", "WeightLoadError", "load_weights", "open_snapshot",
           "persistent_buffers", "verify_manifest"]


@attrs.frozen(kw_only=True)
class LoadAttempt:
    """What one strategy did with a source: ``loaded``, ``ineligible``, ``failed`` or
    ``not tried``, with the reason."""

    strategy: str
    source: str
    state: str
    detail: str | None = None


@attrs.frozen(kw_only=True)
class _Target:
    """One tensor of the model to fill: a parameter's local shard or a whole buffer."""

    fqn: str
    aliases: tuple[str, ...]
    """Checkpoint names that hold it (a tied parameter's other names)."""
    shape: tuple[int, ...]
    local: Tensor
    plan: ParamPlan | None
    ranges: Ranges | None = None
    """The full tensor's ranges this rank holds (``None`` for a buffer: all of it)."""


@attrs.frozen(kw_only=True)
class _Reader:
    """What a strategy's plan hands the writer: ``read(target, key)`` gives this rank's part
    of ``target`` from the checkpoint tensor ``key`` (default: the first of the target's
    names the checkpoint holds); ``found`` lists, per target FQN, every name it holds (more
    than one for a tied parameter stored under several names); ``files`` names the file of
    each key, for messages; ``ignored`` are unexpected keys skipped as allowed."""

    read: Callable[[_Target, str | None], Tensor]
    found: Mapping[str, tuple[str, ...]]
    files: Mapping[str, str]
    ignored: tuple[str, ...] = ()
    write: Callable[[], None] | None = None
    """Writes every target in one call (a DCP load straight into the shards); ``read`` then
    serves only the tied names' check."""
    fill: Callable[[_Target, Tensor], bool] | None = None
    """``fill(target, out)`` writes the target's part of the checkpoint straight into ``out``
    (positional reads into the shard's memory, no tensor in between) and returns ``True``,
    or returns ``False`` having written nothing when it cannot (the writer then copies
    ``read``'s tensor)."""


class _Strategy(Protocol):
    name: str

    def ineligible(self, source: Path) -> str | None: ...

    def plan(self, source: Path, targets: Sequence[_Target],
             ignore: Callable[[str], bool]) -> _Reader: ...


# -- safetensors ---------------------------------------------------------------------------


class _Safetensors:
    name = "safetensors"
    suffixes: tuple[str, ...] = (".safetensors",)
    index_name = "model.safetensors.index.json"
    single_name = "model.safetensors"
    kind = "*.safetensors"

    def __init__(self, model: nn.Module, snapshot: Snapshot) -> None:
        self.model = model
        self.snapshot = snapshot
        """The load's files, each opened once (:mod:`.snapshot`)."""
        self.opened: dict[Path, Any] = {}
        """Each file's handle, opened (and its header checked) once per load."""
        self.staging = Staging()
        """One bounded staging buffer for every file of the load."""
        self.assembled = 0
        """How many model tensors the last plan assembles from several checkpoint tensors."""
        self.renamed = 0
        """How many model tensors the last plan reads from a checkpoint key of another name
        (transformers' renamings, a base model's keys without ``base_model_prefix``)."""

    def open(self, path: Path) -> Any:
        """A handle with ``keys()``, ``dtype(key)`` and ``get_slice(key)`` (``get_shape()``,
        ``[block]``), its header checked against the file (:mod:`.checkpoint_files`)."""
        if path not in self.opened:
            fd = self.snapshot.open(self.snapshot.name_of(path))
            self.opened[path] = open_safetensors(path, self.staging, fd=fd)
        return self.opened[path]

    @classmethod
    def files(cls, snapshot: Snapshot) -> list[Path]:
        """The weight files of a folder without an index, as ``from_pretrained`` picks them:
        ``model.safetensors`` alone when it is there (a folder may also hold another tool's
        files, such as Mistral's ``consolidated.safetensors``), else every file of the kind
        (as ``glob("*.safetensors")``: hidden names are not read)."""
        if snapshot.is_file(cls.single_name):
            return [snapshot.path(cls.single_name)]
        return [snapshot.path(n) for n in snapshot.names()
                if n.endswith(cls.suffixes) and not n.startswith(".")]

    def ineligible(self, source: Path) -> str | None:
        snapshot = self.snapshot
        if snapshot.exists and not snapshot.is_dir:
            return None if source.suffix in self.suffixes else (
                f"{source} is not a {' or '.join(self.suffixes)} file")
        if snapshot.is_dir:
            if snapshot.is_file(self.index_name) or self.files(snapshot):
                return None
            return f"{source} holds no {self.kind} file"
        return f"{source} does not exist"

    def plan(self, source: Path, targets: Sequence[_Target],
             ignore: Callable[[str], bool]) -> _Reader:
        where = _key_files(self, self.snapshot)
        handles: dict[Path, Any] = {}
        problems: list[str] = []
        for path in sorted(set(where.values())):
            try:
                handles[path] = self.open(path)
            except WeightLoadError as exc:
                problems.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - any reader failure is "cannot be read"
                problems.append(f"{path}: cannot be read: {exc}")
        if problems:
            raise WeightLoadError(_listing("the checkpoint cannot be read", problems))
        shapes: dict[str, tuple[int, ...]] = {}
        for key, path in where.items():
            try:
                shapes[key] = handles[path].shape(key)
            except Exception as exc:  # noqa: BLE001 - a key the file does not hold
                problems.append(f"{key!r} in {path.name}: listed in the index but not readable: {exc}")
        names = {p: p.name for p in set(where.values())}
        files = {k: names[p] for k, p in where.items()}
        composites: Mapping[str, Composite] = {}
        if not problems and any(not any(k in shapes for k in (t.fqn, *t.aliases))
                                for t in targets):
            # Keys the model does not hold by name: transformers may convert them at load
            # time (per-expert MoE tensors into fused ones); read them the way it would.
            conversion = LIBRARY.checkpoint_conversion(
                self.model, shapes, [k for t in targets for k in (t.fqn, *t.aliases)])
            if conversion is not None:
                problems.extend(conversion.problems)
                composites = conversion.tensors
                files = {**{k: _files_of(c, where) for k, c in composites.items()},
                         **{k: files[k] for k in conversion.unexpected}}
                shapes = {**{k: c.shape for k, c in composites.items()},
                          **{k: shapes[k] for k in conversion.unexpected}}
        self.assembled = sum(c.kind != "leaf" for c in composites.values())
        self.renamed = sum(c.kind == "leaf" and c.key != k for k, c in composites.items())
        hints = {**_tied_hints(self.model, shapes), **_base_model_hints(self.model, composites)}
        if not problems:
            problems.extend(_kind_changes(targets, shapes, composites, where, handles))
        ignored = _check_fit(targets, shapes, files, ignore, problems, hints)

        def open_key(key: str) -> Callable[[tuple[slice, ...]], Tensor]:
            sl = handles[where[key]].get_slice(key)
            return lambda block: sl[block]

        def read(target: _Target, key: str | None = None) -> Tensor:
            key = key or _key_for(target, shapes)
            composite = composites.get(key) or Composite.leaf(key, shapes[key])
            ranges = target.ranges or tuple(((0, n),) for n in target.shape)
            return read_ranges(lambda block: composite.read(block, open_key), ranges)

        def fill(target: _Target, out: Tensor) -> bool:
            key = _key_for(target, shapes)
            composite = composites.get(key) or Composite.leaf(key, shapes[key])
            read_into = getattr(handles[where[composite.key]], "read_into", None) \
                if composite.kind == "leaf" else None
            if read_into is None:  # assembled from several tensors, or a mapped .bin
                return False
            ranges = target.ranges or tuple(((0, n),) for n in target.shape)
            fill_ranges(out, ranges, lambda block, dest: read_into(composite.key, block, dest))
            return True

        return _Reader(read=read, found=_found(targets, shapes), files=files, ignored=ignored,
                       fill=fill)


def _kind_changes(targets: Sequence[_Target], shapes: Mapping[str, Any],
                  composites: Mapping[str, Composite], where: Mapping[str, Path],
                  handles: Mapping[Path, Any]) -> list[str]:
    """Checkpoint tensors that would be converted between kinds of dtype: floating point,
    complex and integers. A header relabelling F32 as I32 keeps every size and reads the bits
    as integers around 1e9; a complex tensor copied into a real one keeps its real part and
    drops the imaginary one with only a ``UserWarning`` of torch's. Dtypes convert among their
    own kind only."""
    problems: list[str] = []
    for t in targets:
        want = dtype_kind(t.local.dtype)
        for name in (t.fqn, *t.aliases):
            if name not in shapes:
                continue
            for key in (composites[name].keys() if name in composites else (name,)):
                dtype = handles[where[key]].dtype(key)
                kind = dtype_kind(dtype)
                if kind != want:
                    problems.append(
                        f"{key!r} in {where[key].name}: stored as {dtype}, the model's "
                        f"{t.fqn!r} is {t.local.dtype} ({kind} into {want}); load_weights "
                        f"converts dtypes within their kind only (floating, complex, integer): "
                        f"a header relabelled from F32 to I32 reads as integers, a complex "
                        f"tensor into a real one drops its imaginary part")
    return problems


def _files_of(composite: Composite, where: Mapping[str, Path]) -> str:
    names = sorted({where[k].name for k in composite.keys()})
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} files)"


class _TorchPickle(_Safetensors):
    """``pytorch_model.bin`` checkpoints (what ``save_pretrained`` wrote before safetensors, and
    many hub repositories still hold), sharded with ``pytorch_model.bin.index.json`` or not.
    ``torch.load(mmap=True, weights_only=True)`` reads the pickle as data (no pickled code
    runs) and maps the file without touching its tensors' pages; the rank's slices are then
    read by positional reads at each tensor's record (:class:`.checkpoint_files.TorchFile`)."""

    name = "torch"
    suffixes = (".bin", ".pt", ".pth")
    index_name = "pytorch_model.bin.index.json"
    single_name = "pytorch_model.bin"
    kind = "pytorch_model*.bin"

    @classmethod
    def files(cls, snapshot: Snapshot) -> list[Path]:
        if snapshot.is_file(cls.single_name):
            return [snapshot.path(cls.single_name)]
        return [snapshot.path(n) for n in snapshot.names()
                if re.fullmatch(r"pytorch_model.*\.bin", n, re.DOTALL)]

    def open(self, path: Path) -> Any:
        if path not in self.opened:
            fd = self.snapshot.open(self.snapshot.name_of(path))
            self.opened[path] = open_torch_file(path, self.staging, fd=fd)
        return self.opened[path]


MAX_INDEX_BYTES = 64 << 20
"""The largest ``*.index.json`` read (DeepSeek-V3's, 91,000 tensors, is under 9 MiB)."""


def _index_file(snapshot: Snapshot, index: Path, name: str) -> Path:
    """The file an index names, refused unless it is a relative name inside the folder (and,
    once opened, lies there: :meth:`.Snapshot.open`)."""
    folder = snapshot.source
    parts = Path(name).parts
    if not name or "\0" in name or Path(name).is_absolute() or ".." in parts:
        raise WeightLoadError(f"{index}: names {name!r:.200}, which is not a file name inside "
                              f"{folder}; an index may name only the folder's own files")
    snapshot.open(name)
    return folder / name


def _key_files(fmt: _Safetensors, snapshot: Snapshot) -> dict[str, Path]:
    """Checkpoint key → the file holding it (an index's weight map, or each file's keys),
    every file read through the load's snapshot."""
    source = snapshot.source
    if not snapshot.is_dir:
        snapshot.open(source.name)  # a FIFO given as the file itself: refused, not opened
        files = [source]
    else:
        index = source / fmt.index_name
        if snapshot.is_file(fmt.index_name):
            text = snapshot.read(fmt.index_name, limit=MAX_INDEX_BYTES)
            try:
                weight_map = json.loads(text.decode("utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise WeightLoadError(f"{index}: not a {fmt.name} index ({exc!r:.200})") from None
            if not (isinstance(weight_map, dict) and all(
                    isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items())):
                raise WeightLoadError(f"{index}: not a {fmt.name} index (weight_map must map "
                                      f"tensor names to file names)")
            missing = sorted({f for f in weight_map.values() if not snapshot.holds(f)})
            if missing:
                raise WeightLoadError(f"{index} names files that are not there: {missing}")
            checked = {f: _index_file(snapshot, index, f)
                       for f in sorted(set(weight_map.values()))}
            return {k: checked[f] for k, f in weight_map.items()}
        files = fmt.files(snapshot)
        for f in files:
            snapshot.open(snapshot.name_of(f))
    out: dict[str, Path] = {}
    for path in files:
        try:
            keys = list(fmt.open(path).keys())
        except WeightLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - any reader failure is "cannot be read"
            raise WeightLoadError(f"{path}: cannot be read: {exc}") from None
        both = out.keys() & keys
        if both:
            key = min(both)
            raise WeightLoadError(f"{key!r} is in both {out[key].name} and {path.name}")
        out.update(dict.fromkeys(keys, path))
    return out


# -- DCP -----------------------------------------------------------------------------------


class _DCP:
    name = "dcp"

    def __init__(self, live: LiveParams) -> None:
        self.live = live

    def ineligible(self, source: Path) -> str | None:
        if source.is_dir() and (source / ".metadata").is_file():
            return None
        return f"{source} is not a torch.distributed.checkpoint folder (no .metadata)"

    def plan(self, source: Path, targets: Sequence[_Target],
             ignore: Callable[[str], bool]) -> _Reader:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from hyperrecipe.runtime.state.dcp_reader import read_dcp_metadata, trusted_dcp_load

        metadata = read_dcp_metadata(source)  # no code runs; storage files checked
        stored = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                  if isinstance(v, TensorStorageMetadata)}
        prefix = "model." if any(k.startswith("model.") for k in stored) and not any(
            k in stored for t in targets for k in (t.fqn, *t.aliases)) else ""
        shapes = {k[len(prefix):]: s for k, s in stored.items() if k.startswith(prefix)}
        # A trainer's checkpoint holds more than the model (optimizer, data loader, step):
        # only keys under a top-level name the model uses can be "unexpected" here.
        roots = {k.split(".", 1)[0] for t in targets for k in (t.fqn, *t.aliases)}
        shapes = {k: s for k, s in shapes.items() if k.split(".", 1)[0] in roots}
        problems: list[str] = []
        for t in targets:  # dcp.load's copy_ would convert between kinds without a word
            for name in (t.fqn, *t.aliases):
                meta = metadata.state_dict_metadata.get(prefix + name)
                stored_dtype = getattr(getattr(meta, "properties", None), "dtype", None)
                if name in shapes and isinstance(stored_dtype, torch.dtype) and \
                        dtype_kind(stored_dtype) != dtype_kind(t.local.dtype):
                    problems.append(
                        f"{prefix + name!r} in {source.name}: stored as {stored_dtype}, the "
                        f"model's {t.fqn!r} is {t.local.dtype} ({dtype_kind(stored_dtype)} into "
                        f"{dtype_kind(t.local.dtype)}); load_weights converts dtypes within "
                        f"their kind only (floating, complex, integer)")
        files = {k: source.name for k in shapes}
        ignored = _check_fit(targets, shapes, files, ignore, problems,
                             _tied_hints(self.live.model, shapes))
        found = _found(targets, shapes)
        live = self.live

        def request_for(t: _Target, name: str, into: Tensor) -> tuple[Tensor, bool]:
            """The state-dict entry that loads ``name`` into ``into`` (``t``'s shard or a
            buffer like it), and whether DCP writes ``into`` itself (``False``: the layout is
            one DTensor cannot store, read whole and sliced after)."""
            if t.plan is None:
                return into, True
            stored = live.as_dtensor(t.plan, into)
            local = stored._local_tensor  # type: ignore[attr-defined]
            return stored, local.data_ptr() == into.data_ptr()

        # A tied parameter stored under several names is read first, each name into its own
        # buffer, so that names holding different values are refused before anything is
        # written (see _refuse_differing_ties); nothing else is read before the checks pass.
        tied: dict[str, Tensor] = {}
        first: dict[str, Tensor] = {}
        later: list[tuple[_Target, str, Tensor]] = []  # layouts read whole, sliced after
        for t in targets:
            if len(found[t.fqn]) < 2:
                continue
            for name in found[t.fqn]:
                tied[name] = (torch.empty(t.shape, dtype=t.local.dtype, device=t.local.device)
                              if t.plan is None else torch.empty_like(t.local))
                first[prefix + name], direct = request_for(t, name, tied[name])
                if not direct:
                    later.append((t, name, first[prefix + name]))
        if first:
            trusted_dcp_load(first, source)
        for t, name, whole in later:
            assert t.plan is not None
            tied[name] = live.shard_of(t.plan, whole)
        del first, later

        def read(target: _Target, key: str | None = None) -> Tensor:
            return tied[key or found[target.fqn][0]]

        def write() -> None:
            """One ``dcp.load`` straight into the shards (no second copy of the rank's
            shards); the tied names' values, already read and compared, are copied in."""
            request: dict[str, Tensor] = {}
            sliced: list[tuple[_Target, Tensor]] = []
            for t in targets:
                name = found[t.fqn][0]
                if name in tied:
                    continue
                request[prefix + name], direct = request_for(t, name, t.local)
                if not direct:
                    sliced.append((t, request[prefix + name]))
            if request:
                trusted_dcp_load(request, source)
            for t, whole in sliced:
                assert t.plan is not None
                t.local.copy_(live.shard_of(t.plan, whole))
            for t in targets:
                if found[t.fqn][0] in tied:
                    t.local.copy_(tied[found[t.fqn][0]])

        return _Reader(read=read, found=found, files=files, ignored=ignored, write=write)


# -- the chain -----------------------------------------------------------------------------


def _key_for(target: _Target, available: Mapping[str, Any]) -> str:
    for key in (target.fqn, *target.aliases):
        if key in available:
            return key
    raise KeyError(target.fqn)


def fill_ranges(out: Tensor, ranges: Ranges,
                fill_block: Callable[[tuple[slice, ...], Tensor], None]) -> None:
    """Fill ``out`` (a shard made of ``ranges`` of the full tensor, see
    :func:`~hyperrecipe.runtime.comm.sharding.shard_ranges`) block by block:
    ``fill_block(slices, view)`` writes the full tensor's ``slices`` into ``view``, the part
    of ``out`` they land in (the counterpart of ``read_ranges``, without the concatenation)."""
    _fill_block(out, ranges, (), 0, fill_block)


def _fill_block(out: Tensor, ranges: Ranges, prefix: tuple[slice, ...], dim: int,
                fill_block: Callable[[tuple[slice, ...], Tensor], None]) -> None:
    if dim == len(ranges):
        fill_block(prefix, out)
        return
    at = 0
    for a, b in ranges[dim]:
        _fill_block(out.narrow(dim, at, b - a), ranges, prefix + (slice(a, b),), dim + 1,
                    fill_block)
        at += b - a


def _found(targets: Sequence[_Target], shapes: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    return {t.fqn: tuple(k for k in (t.fqn, *t.aliases) if k in shapes) for t in targets}


def _check_fit(targets: Sequence[_Target], shapes: Mapping[str, tuple[int, ...]],
               files: Mapping[str, str], ignore: Callable[[str], bool],
               problems: list[str], hints: Mapping[str, str]) -> tuple[str, ...]:
    """Raise naming every missing, mis-shaped and unexpected tensor (with ``problems`` found
    earlier); return the unexpected keys ``ignore`` allows. ``hints`` adds a reason to a
    missing FQN's line."""
    used: set[str] = set()
    for t in targets:
        names = (t.fqn, *t.aliases)
        found = [k for k in names if k in shapes]
        used.update(found)
        if not found:
            hint = hints.get(t.fqn)
            problems.append(f"missing {t.fqn!r} (shape {list(t.shape)})"
                            + (f": {hint}" if hint else ""))
            continue
        for key in found:
            if shapes[key] != t.shape:
                problems.append(f"{key!r} in {files[key]}: shape {list(shapes[key])}, the model "
                                f"expects {list(t.shape)}")
    extra = sorted(set(shapes) - used)
    unexpected = [k for k in extra if not ignore(k)]
    # Only the lines the listing shows are formatted (a header may hold 300,000 foreign keys).
    problems.extend(f"unexpected {key!r} in {files[key]}" for key in unexpected[:MAX_LISTED])
    if problems or unexpected:
        message = _listing("the checkpoint does not fit the model", problems,
                           more=len(unexpected) - len(unexpected[:MAX_LISTED]))
        if unexpected:
            message += ("\nIf the checkpoint holds tensors this model does not use, name them in "
                        "load_weights(..., ignore_unexpected=[...]) (regular expressions searched "
                        f"in each key, e.g. {_pattern_for(unexpected)!r})")
        raise WeightLoadError(message)
    return tuple(extra)


def _pattern_for(keys: Sequence[str]) -> str:
    """A pattern that matches ``keys``: their longest common dotted prefix, else the first.
    (``commonprefix`` compares only the smallest and largest key: a header of 300,000 keys
    is not split into 300,000 lists.)"""
    import re

    common = os.path.commonprefix(list(keys))
    dotted = common[:common.rfind(".") + 1]
    if dotted and common not in keys:
        return "^" + re.escape(dotted)
    return "^" + re.escape(keys[0]) + "$"


def _tied_hints(model: nn.Module, shapes: Mapping[str, Any]) -> dict[str, str]:
    """Why a parameter transformers ties is missing from a checkpoint holding its source: the
    checkpoint was saved tied (stored once, under the source's name) and this model is built
    untied, so ``from_pretrained`` would initialize the missing one randomly."""
    tied = LIBRARY.tied_weight_keys(model)
    return {target: (f"the checkpoint stores it tied to {source!r} (saved with "
                     f"tie_word_embeddings=True, which writes the tensor once), and this model is "
                     f"built untied; build it with tie_word_embeddings=True and compile the plan "
                     f"for it")
            for target, source in tied.items()
            if source in shapes and target not in shapes}


def _base_model_hints(model: nn.Module, composites: Mapping[str, Composite]) -> dict[str, str]:
    """Why a tensor outside the base model is missing when the checkpoint was saved from the
    base model (keys without ``base_model_prefix``, as ``LlamaModel.save_pretrained`` writes
    them, read here as ``from_pretrained`` does by adding the prefix)."""
    prefix = LIBRARY.base_model_prefix(model)
    if not prefix or not any(c.kind == "leaf" and k == f"{prefix}.{c.key}"
                             for k, c in composites.items()):
        return {}
    base = getattr(model, prefix, None)
    base_name = type(base).__name__ if base is not None else "the base model"
    return {name: (f"the checkpoint was saved from the base model ({base_name}, keys without "
                   f"'{prefix}.'), which has no such tensor; from_pretrained would initialize "
                   f"it randomly. Load a checkpoint of {type(model).__name__}, or tie it to the "
                   f"embedding (tie_word_embeddings=True) if that is how it was trained")
            for name, _ in model.named_parameters() if not name.startswith(f"{prefix}.")}


_listing = listing


def _targets(live: LiveParams, model: nn.Module,
             extra: Mapping[str, Sequence[str]] | None = None) -> list[_Target]:
    aliases: dict[str, list[str]] = {k: list(v) for k, v in (extra or {}).items()}
    for p in live.plan.params:
        if p.tied_to is not None:
            aliases.setdefault(p.tied_to, []).append(p.fqn)
    out: list[_Target] = []
    for p, local in live.items():
        whole = tuple(local.shape) == p.shape  # validate keeps some replicated params whole
        ranges = (tuple(((0, n),) for n in p.shape) if whole
                  else shard_ranges(p.placement, p.shape, live.mesh, live.plan.mesh_dims))
        out.append(_Target(fqn=p.fqn, aliases=tuple(aliases.get(p.fqn, ())), shape=p.shape,
                           local=local, plan=p, ranges=ranges))
    for fqn, buf in persistent_buffers(model):
        out.append(_Target(fqn=fqn, aliases=(), shape=tuple(buf.shape), local=buf, plan=None))
    return out


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    for mod_fqn, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mod_fqn}.{name}" if mod_fqn else name), buf


STALE_BUFFERS = (r"(^|\.)rotary_emb\.inv_freq$", r"(^|\.)attn\.masked_bias$",
                 r"(^|\.)embeddings\.position_ids$")
"""Checkpoint keys of buffers that older transformers versions saved and current models compute
instead (Llama's per-layer ``rotary_emb.inv_freq``, GPT-2's ``attn.masked_bias``, BERT-style
``position_ids``). ``from_pretrained`` drops them; so does ``load_weights`` when the model has
no tensor of that name."""


def _ignore_patterns(model: nn.Module, extra: Sequence[str]) -> Callable[[str], bool]:
    """transformers models name checkpoint keys they deliberately do not load in
    ``_keys_to_ignore_on_load_unexpected``; with :data:`STALE_BUFFERS`, the model's
    non-persistent buffers and the caller's ``extra`` patterns, those are not "unexpected";
    everything else is."""
    import re

    sources = (*LIBRARY.ignored_checkpoint_keys(model), *STALE_BUFFERS, *extra)
    patterns = [re.compile(p) for p in sources]

    def each(key: str) -> bool:
        return any(p.search(key) for p in patterns)

    search: Callable[[str], object] = each
    if not any(re.search(r"\\[1-9]|\(\?P=", p) for p in sources):  # no back-reference to renumber
        try:  # one search per key (a header may hold 300,000 of them)
            search = re.compile("|".join(f"(?:{p})" for p in sources) or "(?!)").search
        except re.error:  # inline flags that are only allowed at the start
            pass
    non_persistent = {f"{m}.{n}" if m else n for m, mod in model.named_modules()
                      for n in mod._non_persistent_buffers_set}
    return lambda key: key in non_persistent or bool(search(key))


def _refuse_differing_ties(targets: Sequence[_Target], reader: _Reader, mesh: Any) -> None:
    """A tied parameter stored under several names must hold one value: ``from_pretrained``
    unties a pair whose stored values differ and loads both, while the plan's model shares one
    tensor, so loading either name alone would silently drop the other. Each rank compares its
    own slices (together they cover the tensor); the ranks agree over the mesh before any
    refusal, so either every rank loads or every rank raises."""
    import torch.distributed as dist

    pairs = [(t, reader.found[t.fqn][0], other) for t in targets
             for other in dict.fromkeys(reader.found[t.fqn][1:])
             if other != reader.found[t.fqn][0]]  # one stored key reached under two names
    if not pairs:
        return
    device = pairs[0][0].local.device
    differ = torch.tensor([0 if _same(reader.read(t, a), reader.read(t, b)) else 1
                           for t, a, b in pairs], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        for dim in range(mesh.ndim):
            dist.all_reduce(differ, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    problems = [f"{a!r} ({reader.files[a]}) and {b!r} ({reader.files[b]}) hold different values, "
                f"but the model ties them into one parameter; from_pretrained would untie them "
                f"and load both. Build the model untied (for word embeddings: "
                f"tie_word_embeddings=False in its config) and compile the plan for it, or, if "
                f"the tie is meant, keep one of the two names in the checkpoint"
                for (t, a, b), d in zip(pairs, differ.tolist(), strict=True) if d]
    if problems:
        raise WeightLoadError(_listing("the checkpoint does not fit the model", problems))


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal values, NaN equal to NaN (a tensor stored twice is the same tensor)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


MAX_MANIFEST_BYTES = 64 << 20


def verify_manifest(source: str | os.PathLike[str] | Snapshot, rank: int = 0,
                    world: int = 1) -> None:
    """Check a folder an export wrote against its manifest (``hyperrecipe.manifest.json``,
    written last by ``save_pretrained``): the export's files are exactly the ones it lists,
    each of its size, and the files of this rank's share (every ``world``-th, from ``rank``)
    hash to the digest it records (sha256 or xxh3_128, as it names), so the ranks together
    read every byte once. Nothing to do without a manifest (a checkpoint from another tool).
    Given the load's :class:`~.snapshot.Snapshot`, every file is hashed from the descriptor
    the tensors are then read from: what was checked is what is loaded.

    Raises:
        WeightLoadError: the manifest is malformed, a file is missing, extra (a later write by
            another tool, or an earlier export), of another size, or of other contents.
    """
    with borrowed(source) as snapshot:
        _verify_manifest(snapshot, rank, world)


def _verify_manifest(snapshot: Snapshot, rank: int, world: int) -> None:
    from hyperrecipe.runtime.state.export import EXPORT_FILES

    folder = snapshot.source
    path = folder / MANIFEST
    if not snapshot.is_dir or MANIFEST not in snapshot.names():
        return
    try:
        text = snapshot.read(MANIFEST, limit=MAX_MANIFEST_BYTES)
        algorithm, files = parse_manifest(json.loads(text.decode("utf-8")))
    except (ValueError, KeyError, TypeError, RecursionError, AttributeError) as exc:
        raise WeightLoadError(f"{path}: malformed ({exc!s:.200})") from None
    again = (f"; the folder no longer holds what its export wrote: export again, or remove "
             f"{MANIFEST} if its files were replaced on purpose by another tool")
    if not files:  # a manifest that binds nothing would pass every folder unchecked
        raise WeightLoadError(f"{path}: lists no files, while an export lists every file it "
                              f"wrote; it vouches for nothing{again}")
    extra = sorted({n for n in snapshot.names() if EXPORT_FILES.fullmatch(n)}
                   .union(_files_loading_reads(snapshot)) - set(files))
    if extra:
        raise WeightLoadError(f"{folder}: {extra} are not in {MANIFEST}{again}")
    for i, (name, entry) in enumerate(sorted(files.items())):
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise WeightLoadError(f"{path}: names {name!r:.200}, not a file of the folder")
        size = snapshot.size(name)
        if size != entry[0]:
            raise WeightLoadError(f"{folder / name}: {size} bytes, {MANIFEST} says "
                                  f"{entry[0]}{again}")
        if i % world != rank:
            continue
        if snapshot.digest(name, new_hasher(algorithm)) != entry[1]:
            raise WeightLoadError(f"{folder / name}: its {algorithm} is not the one in "
                                  f"{MANIFEST} (same size, other bytes: a relabelled header, "
                                  f"overwritten data){again}")


def _files_loading_reads(snapshot: Snapshot) -> set[str]:
    """The names of the files ``load_weights`` reads from the folder, through the first
    format that can read it (an index and the files it names, else the files ``files()``
    picks; a DCP folder's ``.metadata`` and storage files): all of them must be in a manifest
    that is there, or the manifest would vouch for a folder whose weights it never saw."""
    for fmt in (_Safetensors, _TorchPickle):
        if snapshot.is_file(fmt.index_name):
            try:
                weight_map = json.loads(snapshot.read(fmt.index_name, limit=MAX_INDEX_BYTES))[
                    "weight_map"]
                named = {v for v in weight_map.values() if isinstance(v, str)}
            except (WeightLoadError, ValueError, KeyError, TypeError, AttributeError,
                    RecursionError):
                named = set()  # loading names what is wrong with the index
            return {fmt.index_name, *named}
        found = fmt.files(snapshot)
        if found:
            return {f.name for f in found}
    if snapshot.is_file(".metadata"):
        return {".metadata", *(n for n in snapshot.names() if n.endswith(".distcp")
                               and not n.startswith("."))}
    return set()


def open_snapshot(source: str | os.PathLike[str]) -> Snapshot:
    """A :class:`~.snapshot.Snapshot` of ``source`` with every file a load of it reads
    already open: the manifest, each file the manifest lists, the index and the files it
    names (or the weight files :meth:`_Safetensors.files` picks). All are opened before any
    byte of data is read, so the load reads one moment of the folder; a folder exchanged
    after this is not read (its files are already open), and one exchanged during it is
    refused when a file is then missing. What cannot be opened here is opened again, and
    refused by name, where it is read.

    Raises:
        WeightLoadError: the folder cannot be opened.
    """
    snapshot = Snapshot(source)
    try:
        if snapshot.is_dir:
            snapshot.open_all([MANIFEST])
            listed: set[str] = set()
            if MANIFEST in snapshot.names():
                with contextlib.suppress(WeightLoadError, ValueError, KeyError, TypeError,
                                         RecursionError, AttributeError):
                    listed = set(parse_manifest(json.loads(
                        snapshot.read(MANIFEST, limit=MAX_MANIFEST_BYTES)))[1])
            # A DCP folder is read by dcp.load, by name: its storage files are not held here.
            reads = set() if snapshot.is_file(".metadata") and not any(
                snapshot.is_file(f.index_name) or f.files(snapshot)
                for f in (_Safetensors, _TorchPickle)) else _files_loading_reads(snapshot)
            snapshot.open_all(sorted(listed | reads))
        else:
            snapshot.open_all([snapshot.source.name])
    except BaseException:
        snapshot.close()
        raise
    return snapshot


Agree = Callable[[str | None], Mapping[int, str]]
"""``agree(error)``: every rank's outcome of a step in one bounded exchange (``error`` is this
rank's, ``None`` when it succeeded): ``{rank: its error}`` for each rank that failed, the same
on every rank. Raises (any exception) when a rank did not arrive in time."""


def _alone(error: str | None) -> Mapping[int, str]:
    return {} if error is None else {0: error}


def load_weights(live: LiveParams, model: nn.Module,
                 source: str | os.PathLike[str] | Snapshot, unloaded: set[str],
                 ignore_unexpected: Sequence[str] = (),
                 agree: Agree = _alone, *,
                 aliases: Mapping[str, Sequence[str]] | None = None) -> list[LoadAttempt]:
    """Load ``source`` into the applied model through the first strategy that can; return
    what each strategy did. ``unloaded`` (FQNs never given a value) shrinks as weights land;
    checkpoint keys matching a pattern of ``ignore_unexpected`` (``re.search``) are skipped.
    ``agree`` is called on every rank once the load is planned (before any write) and once
    after the copy, so that every rank loads or every rank raises (see :func:`_write_all`).

    ``source`` may be the load's :class:`~.snapshot.Snapshot` (:func:`open_snapshot`), so
    that the manifest check and the source digest that ran before read the same files;
    a path is opened as one here. The safetensors and torch strategies read only through
    it, and its files are checked unchanged (:meth:`~.snapshot.Snapshot.verify`) once the
    load is planned, before anything is written, and again after the copy (a change found
    then marks what was written unset, as any fault while copying does).

    Raises:
        WeightLoadError: no strategy could read the source, or the one that could found the
            checkpoint does not fit (every problem listed) or failed while writing (rolled
            back), or a file it read changed meanwhile; the message names each strategy's
            outcome.
    """
    if isinstance(source, Snapshot):
        return _load_snapshot(live, model, source, unloaded, ignore_unexpected, agree, aliases)
    with open_snapshot(source) as snapshot:
        return _load_snapshot(live, model, snapshot, unloaded, ignore_unexpected, agree, aliases)


def _load_snapshot(live: LiveParams, model: nn.Module, snapshot: Snapshot,
                   unloaded: set[str], ignore_unexpected: Sequence[str],
                   agree: Agree, aliases: Mapping[str, Sequence[str]] | None = None
                   ) -> list[LoadAttempt]:
    path = snapshot.source
    safetensors = _Safetensors(model, snapshot)
    strategies: list[_Strategy] = [safetensors, _TorchPickle(model, snapshot), _DCP(live)]
    attempts: list[LoadAttempt] = []
    targets = _targets(live, model, aliases)
    ignore = _ignore_patterns(model, ignore_unexpected)
    if snapshot.exists and not snapshot.is_dir:
        snapshot.open(path.name)  # a FIFO given as the file itself: refused, not opened
    for i, strategy in enumerate(strategies):
        why = strategy.ineligible(path)
        if why is not None:
            attempts.append(LoadAttempt(strategy=strategy.name, source=str(path),
                                        state="ineligible", detail=why))
            continue
        try:
            try:
                reader = strategy.plan(path, targets, ignore)
                snapshot.verify()  # a file written into while planned: nothing written yet
            except WeightLoadError as exc:
                _agree_or_raise(agree, str(exc))
                raise
            _agree_or_raise(agree, None)
            _refuse_differing_ties(targets, reader, live.mesh)
            _write_all(targets, reader, unloaded, agree, verify=snapshot.verify)
        except WeightLoadError as exc:
            # The first strategy that can read the source is the format it declares; trying
            # the next would read other files of the folder (a stale export, a .metadata
            # hidden beside the safetensors) without a word.
            rest = [s.name for s in strategies[i + 1:]]
            attempts.append(LoadAttempt(strategy=strategy.name, source=str(path), state="failed",
                                        detail=str(exc)))
            attempts.extend(LoadAttempt(strategy=n, source=str(path), state="not tried",
                                        detail=f"{path} is a {strategy.name} checkpoint")
                            for n in rest)
            tail = (f"\n(not tried: {', '.join(rest)}; {path} holds {strategy.name} files, so "
                    f"it is read as {strategy.name} only)" if rest else "")
            raise WeightLoadError(f"{strategy.name}: {exc}{tail}") from None
        notes = []
        if isinstance(strategy, _Safetensors) and strategy.renamed:
            notes.append(f"{strategy.renamed} tensors read from keys of other names "
                         "(transformers' renamings, the base model prefix)")
        if isinstance(strategy, _Safetensors) and strategy.assembled:
            notes.append(f"{strategy.assembled} tensors assembled from transformers' "
                         "checkpoint layout")
        if reader.ignored:
            shown = ", ".join(reader.ignored[:3]) + (", ..." if len(reader.ignored) > 3 else "")
            notes.append(f"{len(reader.ignored)} checkpoint tensors not used ({shown})")
        attempts.append(LoadAttempt(strategy=strategy.name, source=str(path), state="loaded",
                                    detail="; ".join(notes) or None))
        attempts.extend(LoadAttempt(strategy=s.name, source=str(path), state="not tried")
                        for s in strategies[i + 1:])
        return attempts
    reasons = "; ".join(f"{a.strategy}: {a.detail}" for a in attempts)
    raise WeightLoadError(f"no loading strategy can read {path}: {reasons}")


def _agree_or_raise(agree: Agree, error: str | None) -> None:
    """The ranks' agreement that every rank planned its load (before any rank writes): a rank
    that could not raises its own error; the others raise naming it, having written nothing."""
    try:
        failed = agree(error)
    except Exception as exc:  # noqa: BLE001 - a peer that never arrived: nothing was written
        if error is not None:
            return
        raise WeightLoadError(f"the agreement before writing failed: {exc}; nothing was "
                              f"written") from None
    others = {r: e for r, e in failed.items() if error is None}
    if others:
        first = min(others)
        raise WeightLoadError(f"rank(s) {sorted(others)} cannot load the checkpoint (rank "
                              f"{first}: {others[first]}...); no rank wrote anything")


def _write_all(targets: Sequence[_Target], reader: _Reader, unloaded: set[str],
               agree: Agree = _alone, verify: Callable[[], None] | None = None) -> None:
    """Copy every target in, each read straight into its shard where the reader can
    (``fill``), with no copy of the model's previous values.

    Everything that can be checked was checked before this runs (keys, shapes, dtype kinds,
    each file's header against its bytes, the manifest, the ranks' agreement), so a failure
    here is a fault while copying: a file changed or unreadable after its check. Putting the
    previous values back would need a second copy of every tensor (what a reload on a full GPU
    cannot hold), so the tensors written so far, and the one being written, are marked unset
    instead (NaN, and :meth:`TrainingState.status` lists them): the model is never a silent
    mixture of two checkpoints, and a load that fails its checks changes nothing.

    Once the copy is done, ``verify`` (the snapshot's check that no file it read changed
    meanwhile) runs as part of it: a file written into while it was read is a fault of the
    copy, with the same outcome.

    After the copy the ranks agree (``agree``, bounded): when any rank failed (or did not
    arrive), every rank marks what it wrote unset and raises naming the failing rank and its
    error, so no rank trains on while another raised."""
    written: list[_Target] = []
    current = targets[0] if targets else None
    error: Exception | None = None
    try:
        with torch.no_grad():
            if reader.write is not None:  # the strategy writes every target in one call
                written, current = list(targets), None
                reader.write()
            for t in targets if reader.write is None else ():
                current = t
                if reader.fill is not None:
                    written.append(t)  # a fill that fails may have written part of it
                    if reader.fill(t, t.local):
                        continue
                    written.pop()
                value = reader.read(t, None)
                written.append(t)
                t.local.copy_(value)
                del value
            current = None
            if verify is not None:
                verify()
    except Exception as exc:  # noqa: BLE001 - raised below, after every rank knows
        error = exc
    name = repr(current.fqn) if current is not None else "the checkpoint"
    head = (f"reading {name} failed after its checks passed (the file changed or could not "
            f"be read while loading)")
    text = None if error is None else f"{head}: {type(error).__name__}: {error}"
    try:
        failed = dict(agree(text))
    except Exception as exc:  # noqa: BLE001 - a rank that never arrived failed too
        failed = {-1: f"the agreement after the copy failed: {exc}"}
    if error is None and not failed:
        for t in targets:
            unloaded.discard(t.fqn)
        return
    what = _unset(written, unloaded)
    if error is not None:
        tail = f"\n(the ranks that failed: {sorted(failed)})" if len(failed) > 1 else ""
        raise WeightLoadError(f"{head}; {what}: {type(error).__name__}: {error}"
                              f"{tail}") from error
    ranks = sorted(r for r in failed if r >= 0)
    first = failed[ranks[0]] if ranks else failed[-1]
    who = f"rank(s) {ranks}" if ranks else "a rank"
    raise WeightLoadError(f"{who} failed while loading, after every check passed ({first}...); "
                          f"so that no rank trains on while another failed, {what}")


def _unset(written: Sequence[_Target], unloaded: set[str]) -> str:
    """Mark ``written`` unset (NaN, listed by ``status()``); what to tell the user."""
    from hyperrecipe.runtime.state.materialize import allocate_unloaded

    previously = [w.fqn for w in written if w.fqn not in unloaded]
    with torch.no_grad():
        for w in written:
            w.local.copy_(allocate_unloaded(tuple(w.local.shape), w.local.dtype,
                                            w.local.device))
            unloaded.add(w.fqn)
    return (f"{len(previously)} tensors that held weights before this load are now unset "
            f"(status() lists them); load a checkpoint again before training"
            if previously else f"the {len(written)} tensors this rank wrote are unset again"
            if written else "nothing was written")
