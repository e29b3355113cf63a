"""``Installation.load_weights``: each rank reads only its slices of a checkpoint.

Loading is a chain of strategies in the shape of the design's capability fallback. Each
strategy says whether it can read a source (``ineligible`` with the reason when not), then
*plans* the whole load from metadata alone: every tensor it will read, its file, its shape, so
that a missing, unexpected or mis-shaped tensor is one error naming every such tensor and its
file before a byte of the model changes (``load_state_dict(strict=True)``'s contract). Only then
does it write, slice by slice; if writing fails anyway, what it wrote is rolled back (to the
previous values, or to "unset" for weights that were never loaded) before the next strategy is
tried.

Strategies:

- ``safetensors``: a ``.safetensors`` file, or a Hugging Face checkpoint folder (one
  ``model.safetensors``, an indexed ``model.safetensors.index.json``, or any ``*.safetensors``).
  Reads ``safe_open(...).get_slice`` of the rank's ranges only (chunked shards read one range
  per fused part), converting dtypes. Checkpoint keys that transformers converts at load time
  (per-expert MoE tensors into the fused ``experts.gate_up_proj``, renamed modules) are read
  the way ``from_pretrained`` would place them, still by slices (``hf_conversion.py``).
- ``dcp``: a ``torch.distributed.checkpoint`` folder (a ``.metadata`` file), as written by
  ``dcp.save(inst.state_dict())`` (keys ``model.<fqn>``) or by a trainer that saved the model's
  state dict at the top level (keys ``<fqn>``), on any mesh.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import WeightLoadError
from hyperrecipe.plan import ParamPlan
from hyperrecipe.runtime.hf_conversion import Composite, conversion_for
from hyperrecipe.runtime.sharding import Ranges, read_ranges, shard_ranges

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.checkpoint import LiveParams

__all__ = ["LoadAttempt", "WeightLoadError", "load_weights", "persistent_buffers"]


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


class _Strategy(Protocol):
    name: str

    def ineligible(self, source: Path) -> str | None: ...

    def plan(self, source: Path, targets: Sequence[_Target],
             ignore: Callable[[str], bool]) -> Callable[[_Target], Tensor]: ...


# -- safetensors ---------------------------------------------------------------------------


class _Safetensors:
    name = "safetensors"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.converted = 0
        """How many model tensors the last plan assembles from converted checkpoint keys."""

    def ineligible(self, source: Path) -> str | None:
        if source.is_file():
            return None if source.suffix == ".safetensors" else f"{source} is not a .safetensors file"
        if source.is_dir():
            if _safetensors_files(source):
                return None
            return f"{source} holds no *.safetensors file"
        return f"{source} does not exist"

    def plan(self, source: Path, targets: Sequence[_Target],
             ignore: Callable[[str], bool]) -> Callable[[_Target], Tensor]:
        from safetensors import SafetensorError, safe_open

        where = _key_files(source)
        handles: dict[Path, Any] = {}
        problems: list[str] = []
        for path in sorted(set(where.values())):
            try:
                handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                problems.append(f"{path}: cannot be read: {exc}")
        if problems:
            raise WeightLoadError(_listing("the checkpoint cannot be read", problems))
        shapes: dict[str, tuple[int, ...]] = {}
        for key, path in where.items():
            try:
                shapes[key] = tuple(handles[path].get_slice(key).get_shape())
            except (SafetensorError, KeyError) as exc:
                problems.append(f"{key!r} in {path.name}: listed in the index but not readable: {exc}")
        files = {k: p.name for k, p in where.items()}
        composites: Mapping[str, Composite] = {}
        if not problems and any(not any(k in shapes for k in (t.fqn, *t.aliases))
                                for t in targets):
            # Keys the model does not hold by name: transformers may convert them at load
            # time (per-expert MoE tensors into fused ones); read them the way it would.
            conversion = conversion_for(self.model, shapes,
                                        [k for t in targets for k in (t.fqn, *t.aliases)])
            if conversion is not None:
                problems.extend(conversion.problems)
                composites = conversion.tensors
                files = {**{k: _files_of(c, where) for k, c in composites.items()},
                         **{k: files[k] for k in conversion.unexpected}}
                shapes = {**{k: c.shape for k, c in composites.items()},
                          **{k: shapes[k] for k in conversion.unexpected}}
        self.converted = sum(c.kind != "leaf" or c.key != k for k, c in composites.items())
        _check_fit(targets, shapes, files, ignore, problems)

        def open_key(key: str) -> Callable[[tuple[slice, ...]], Tensor]:
            sl = handles[where[key]].get_slice(key)
            return lambda block: sl[block]

        def read(target: _Target) -> Tensor:
            key = _key_for(target, shapes)
            composite = composites.get(key) or Composite.leaf(key, shapes[key])
            ranges = target.ranges or tuple(((0, n),) for n in target.shape)
            return read_ranges(lambda block: composite.read(block, open_key), ranges)

        return read


def _files_of(composite: Composite, where: Mapping[str, Path]) -> str:
    names = sorted({where[k].name for k in composite.keys()})
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} files)"


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _key_files(source: Path) -> dict[str, Path]:
    """Checkpoint key → the file holding it (an index's weight map, or each file's keys)."""
    from safetensors import SafetensorError, safe_open

    if source.is_file():
        files = [source]
    else:
        index = source / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise WeightLoadError(f"{index}: not a safetensors index ({exc!r:.200})") from None
            if not (isinstance(weight_map, dict) and all(
                    isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items())):
                raise WeightLoadError(f"{index}: not a safetensors index (weight_map must map "
                                      f"tensor names to file names)")
            missing = sorted({f for f in weight_map.values() if not (source / f).is_file()})
            if missing:
                raise WeightLoadError(f"{index} names files that are not there: {missing}")
            return {k: source / f for k, f in weight_map.items()}
        files = _safetensors_files(source)
    out: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                keys = list(handle.keys())
        except (SafetensorError, OSError) as exc:
            raise WeightLoadError(f"{path}: cannot be read: {exc}") from None
        for key in keys:
            if key in out:
                raise WeightLoadError(f"{key!r} is in both {out[key].name} and {path.name}")
            out[key] = path
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
             ignore: Callable[[str], bool]) -> Callable[[_Target], Tensor]:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = FileSystemReader(str(source)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - any reader failure is "cannot be read"
            raise WeightLoadError(f"{source}: cannot read DCP metadata: {exc}") from None
        stored = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                  if isinstance(v, TensorStorageMetadata)}
        prefix = "model." if any(k.startswith("model.") for k in stored) and not any(
            k in stored for t in targets for k in (t.fqn, *t.aliases)) else ""
        shapes = {k[len(prefix):]: s for k, s in stored.items() if k.startswith(prefix)}
        # A trainer's checkpoint holds more than the model (optimizer, data loader, step):
        # only keys under a top-level name the model uses can be "unexpected" here.
        roots = {t.fqn.split(".", 1)[0] for t in targets}
        shapes = {k: s for k, s in shapes.items() if k.split(".", 1)[0] in roots}
        problems: list[str] = []
        _check_fit(targets, shapes, {k: source.name for k in shapes}, ignore, problems)
        # Read everything this rank needs in one dcp.load, into fresh buffers: a failure
        # leaves the model untouched.
        buffers: dict[str, Tensor] = {}
        request: dict[str, Tensor] = {}
        gathered: list[_Target] = []  # layouts DTensor cannot store: loaded whole, then sliced
        for t in targets:
            key = prefix + _key_for(t, shapes)
            if t.plan is None:
                buffers[t.fqn] = request[key] = torch.empty(t.shape, dtype=t.local.dtype,
                                                             device=t.local.device)
                continue
            buffers[t.fqn] = torch.empty_like(t.local)
            request[key] = self.live.as_dtensor(t.plan, buffers[t.fqn])
            if request[key]._local_tensor.data_ptr() != buffers[t.fqn].data_ptr():  # type: ignore[attr-defined]
                gathered.append(t)
        try:
            dcp_load(request, checkpoint_id=str(source))
        except Exception as exc:  # noqa: BLE001 - reported with the source, model untouched
            raise WeightLoadError(f"{source}: dcp.load failed: {exc}") from None
        for t in gathered:
            assert t.plan is not None
            buffers[t.fqn] = self.live.shard_of(t.plan, request[prefix + _key_for(t, shapes)])

        def read(target: _Target) -> Tensor:
            return buffers[target.fqn]

        return read


# -- the chain -----------------------------------------------------------------------------


def _key_for(target: _Target, available: Mapping[str, Any]) -> str:
    for key in (target.fqn, *target.aliases):
        if key in available:
            return key
    raise KeyError(target.fqn)


def _check_fit(targets: Sequence[_Target], shapes: Mapping[str, tuple[int, ...]],
               files: Mapping[str, str], ignore: Callable[[str], bool],
               problems: list[str]) -> None:
    used: set[str] = set()
    for t in targets:
        names = (t.fqn, *t.aliases)
        found = [k for k in names if k in shapes]
        used.update(found)
        if not found:
            problems.append(f"missing {t.fqn!r} (shape {list(t.shape)})")
            continue
        for key in found:
            if shapes[key] != t.shape:
                problems.append(f"{key!r} in {files[key]}: shape {list(shapes[key])}, the model "
                                f"expects {list(t.shape)}")
    for key in sorted(set(shapes) - used):
        if not ignore(key):
            problems.append(f"unexpected {key!r} in {files[key]}")
    if problems:
        raise WeightLoadError(_listing("the checkpoint does not fit the model", problems))


def _listing(head: str, problems: Sequence[str]) -> str:
    return f"{head} ({len(problems)} problem{'s' * (len(problems) != 1)}):\n  " + "\n  ".join(problems)


def _targets(live: LiveParams, model: nn.Module) -> list[_Target]:
    aliases: dict[str, list[str]] = {}
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


def _ignore_patterns(model: nn.Module) -> Callable[[str], bool]:
    """transformers models name checkpoint keys they deliberately do not load (old rotary
    buffers, say) in ``_keys_to_ignore_on_load_unexpected``; everything else is unexpected."""
    import re

    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                or ()]
    non_persistent = {f"{m}.{n}" if m else n for m, mod in model.named_modules()
                      for n in mod._non_persistent_buffers_set}
    return lambda key: key in non_persistent or any(p.search(key) for p in patterns)


def load_weights(live: LiveParams, model: nn.Module, source: str | os.PathLike[str],
                 unloaded: set[str]) -> list[LoadAttempt]:
    """Load ``source`` into the applied model through the first strategy that can; return
    what each strategy did. ``unloaded`` (FQNs never given a value) shrinks as weights land.

    Raises:
        WeightLoadError: no strategy could read the source, or the one that could found the
            checkpoint does not fit (every problem listed) or failed while writing (rolled
            back); the message names each strategy's outcome.
    """
    path = Path(source)
    safetensors = _Safetensors(model)
    strategies: list[_Strategy] = [safetensors, _DCP(live)]
    attempts: list[LoadAttempt] = []
    targets = _targets(live, model)
    ignore = _ignore_patterns(model)
    errors: list[str] = []
    for i, strategy in enumerate(strategies):
        why = strategy.ineligible(path)
        if why is not None:
            attempts.append(LoadAttempt(strategy=strategy.name, source=str(path),
                                        state="ineligible", detail=why))
            continue
        try:
            read = strategy.plan(path, targets, ignore)
            _write_all(targets, read, unloaded)
        except WeightLoadError as exc:
            attempts.append(LoadAttempt(strategy=strategy.name, source=str(path), state="failed",
                                        detail=str(exc)))
            errors.append(f"{strategy.name}: {exc}")
            continue
        detail = (f"{safetensors.converted} tensors assembled from transformers' checkpoint "
                  "layout" if strategy is safetensors and safetensors.converted else None)
        attempts.append(LoadAttempt(strategy=strategy.name, source=str(path), state="loaded",
                                    detail=detail))
        attempts.extend(LoadAttempt(strategy=s.name, source=str(path), state="not tried")
                        for s in strategies[i + 1:])
        return attempts
    if not errors:
        reasons = "; ".join(f"{a.strategy}: {a.detail}" for a in attempts)
        raise WeightLoadError(f"no loading strategy can read {path}: {reasons}")
    raise WeightLoadError("\n".join(errors))


def _write_all(targets: Sequence[_Target], read: Callable[[_Target], Tensor],
               unloaded: set[str]) -> None:
    """Copy every target in; on any failure put back what was written (previous values, or
    NaN for never-loaded ones) and raise."""
    from hyperrecipe.runtime.materialize import allocate_unloaded

    written: list[tuple[_Target, Tensor | None]] = []
    try:
        with torch.no_grad():
            for t in targets:
                value = read(t)
                backup = None if t.fqn in unloaded else t.local.detach().clone()
                written.append((t, backup))
                t.local.copy_(value.to(dtype=t.local.dtype, device=t.local.device))
    except Exception as exc:
        with torch.no_grad():
            for t, backup in reversed(written):
                if backup is None:
                    t.local.copy_(allocate_unloaded(tuple(t.local.shape), t.local.dtype,
                                                    t.local.device))
                else:
                    t.local.copy_(backup)
        raise WeightLoadError(f"reading {t.fqn!r} failed after writing; rolled back: "
                              f"{type(exc).__name__}: {exc}") from exc
    for t in targets:
        unloaded.discard(t.fqn)
