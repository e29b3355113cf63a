"""Checkpoint tensors that transformers converts at load time, read by slices.

transformers 5 loads some families into a layout their checkpoints do not have: Mixtral's
experts are stored one file tensor per expert and projection
(``block_sparse_moe.experts.3.w1.weight``), and the model holds them stacked and fused
(``mlp.experts.gate_up_proj [E, 2I, H]``); Qwen2-MoE and the ~30 families transformers maps onto
it do the same, and ``save_pretrained`` writes the original layout back. ``from_pretrained``
reads every expert whole and stacks them; a sharded loader must instead know which *part* of
which file tensor each of its rank's elements comes from.

This module reads transformers' own conversion mapping for the model
(``conversion_mapping.get_model_conversion_mapping``) and its own key renaming
(``core_model_loading.rename_source_key``), so a checkpoint key lands where ``from_pretrained``
would put it, and turns each converted model tensor into a :class:`Composite`: a tree of
``stack``/``cat`` over file tensors whose :meth:`Composite.read` reads only the ranges asked
for. Only the layout operations transformers uses for experts and fused projections
(``MergeModulelist``, ``Concatenate``) can be read this way; any other operation (a
permutation, a dequantization, a split) is refused by name, never approximated.

What does not live here: reading files (``weights.py`` hands in a reader per key), and the fit
check (``weights.py`` checks the composites' shapes like any other tensor's).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

__all__ = ["Composite", "Conversion", "conversion_for"]

Reader = Callable[[tuple[slice, ...]], Tensor]
"""Reads a block (one contiguous slice per dim) of one file tensor."""


@attrs.frozen(kw_only=True)
class Composite:
    """A model tensor assembled from file tensors: a ``leaf`` (one file tensor), or a
    ``stack``/``cat`` of parts along ``dim``. ``shape`` is the assembled shape."""

    kind: str
    shape: tuple[int, ...]
    key: str = ""
    """The file tensor's key (``leaf`` only)."""
    dim: int = 0
    parts: tuple[Composite, ...] = ()

    @staticmethod
    def leaf(key: str, shape: Sequence[int]) -> Composite:
        return Composite(kind="leaf", shape=tuple(shape), key=key)

    @staticmethod
    def stack(dim: int, parts: Sequence[Composite]) -> Composite:
        first = parts[0].shape
        if any(p.shape != first for p in parts):
            shapes = sorted({p.shape for p in parts})
            raise ValueError(f"cannot stack tensors of different shapes {shapes}")
        d = dim if dim >= 0 else dim + len(first) + 1
        shape = (*first[:d], len(parts), *first[d:])
        return Composite(kind="stack", shape=shape, dim=d, parts=tuple(parts))

    @staticmethod
    def cat(dim: int, parts: Sequence[Composite]) -> Composite:
        first = parts[0].shape
        d = dim if dim >= 0 else dim + len(first)
        if any(len(p.shape) != len(first) or p.shape[:d] + p.shape[d + 1:]
               != first[:d] + first[d + 1:] for p in parts):
            raise ValueError(f"cannot concatenate shapes {[list(p.shape) for p in parts]} "
                             f"along dim {d}")
        shape = (*first[:d], sum(p.shape[d] for p in parts), *first[d + 1:])
        return Composite(kind="cat", shape=shape, dim=d, parts=tuple(parts))

    def keys(self) -> list[str]:
        """The file tensors this composite reads, in order."""
        if self.kind == "leaf":
            return [self.key]
        return [k for p in self.parts for k in p.keys()]

    def read(self, block: tuple[slice, ...], open_key: Callable[[str], Reader]) -> Tensor:
        """The assembled tensor's ``block`` (contiguous slices with explicit bounds), reading
        only the parts of file tensors that fall inside it."""
        if self.kind == "leaf":
            return open_key(self.key)(block)
        a, b = block[self.dim].start, block[self.dim].stop
        if self.kind == "stack":
            rest = block[:self.dim] + block[self.dim + 1:]
            return torch.stack([self.parts[i].read(rest, open_key) for i in range(a, b)],
                               dim=self.dim)
        pieces: list[Tensor] = []
        offset = 0
        for part in self.parts:
            lo, hi = max(a, offset), min(b, offset + part.shape[self.dim])
            if lo < hi:
                sub = (*block[:self.dim], slice(lo - offset, hi - offset), *block[self.dim + 1:])
                pieces.append(part.read(sub, open_key))
            offset += part.shape[self.dim]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


@attrs.frozen(kw_only=True)
class Conversion:
    """How a checkpoint's keys land in a model.

    Attributes:
        tensors: model key → the composite that fills it (renamed keys are one-leaf
            composites).
        unexpected: checkpoint keys that land on no model tensor.
        problems: conversions that cannot be read by slices, each naming the model key, the
            file keys and the operation.
    """

    tensors: Mapping[str, Composite]
    unexpected: tuple[str, ...]
    problems: tuple[str, ...]


def conversion_for(model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                   model_keys: Sequence[str]) -> Conversion | None:
    """How ``from_pretrained`` would map the checkpoint keys of ``shapes`` onto ``model``'s
    ``model_keys``, as composites, or ``None`` when transformers defines no conversion for this
    model (or is not installed, or is a version without conversion mappings)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    try:
        return _convert(model, shapes, model_keys, get_model_conversion_mapping,
                        rename_source_key, (WeightRenaming, WeightConverter, MergeModulelist,
                                            Concatenate))
    except Exception as exc:  # noqa: BLE001 - another transformers version's API: say so
        return Conversion(tensors={k: Composite.leaf(k, s) for k, s in shapes.items()
                                   if k in set(model_keys)},
                          unexpected=tuple(k for k in shapes if k not in set(model_keys)),
                          problems=(f"transformers' checkpoint conversion for "
                                    f"{type(model).__name__} could not be read "
                                    f"({type(exc).__name__}: {exc}); load with from_pretrained "
                                    "and save the model's own state dict instead",))


def _convert(model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
             model_keys: Sequence[str], get_mapping: Callable[..., Any],
             rename_source_key: Callable[..., Any], classes: tuple[type[Any], ...]
             ) -> Conversion | None:
    WeightRenaming, WeightConverter, MergeModulelist, Concatenate = classes  # noqa: N806
    transforms = get_mapping(model)
    if not transforms:
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    wanted = dict.fromkeys(model_keys, True)
    prefix = getattr(model, "base_model_prefix", None) or None

    renamed: dict[str, Composite] = {}
    collected: dict[str, dict[str, list[Composite]]] = {}
    converter_of: dict[str, Any] = {}
    unexpected: list[str] = []
    for key in sorted(shapes, key=_natural_key):  # transformers' order: experts 0, 1, 2, ...
        target, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if target not in wanted and key in wanted:
            target, pattern = key, None
        if target not in wanted:
            unexpected.append(key)
        elif pattern is None:
            renamed[target] = Composite.leaf(key, shapes[key])
        else:
            converter_of[target] = by_pattern[pattern]
            collected.setdefault(target, {}).setdefault(pattern, []).append(
                Composite.leaf(key, shapes[key]))

    problems: list[str] = []
    tensors: dict[str, Composite] = dict(renamed)
    for target, lists in collected.items():
        converter = converter_of[target]
        files = [leaf.key for parts in lists.values() for leaf in parts]
        try:
            tensors[target] = _assemble(converter, lists, MergeModulelist, Concatenate)
        except ValueError as exc:
            shown = files if len(files) <= 4 else [*files[:2], "...", files[-1]]
            problems.append(f"{target!r} from {shown}: {exc}")
    return Conversion(tensors=tensors, unexpected=tuple(unexpected), problems=tuple(problems))


def _assemble(converter: Any, lists: Mapping[str, list[Composite]], merge_op: type[Any],
              concat_op: type[Any]) -> Composite:
    """Replay the converter's operations on composites instead of tensors."""
    state: dict[str, list[Composite]] = {p: list(v) for p, v in lists.items()}
    ordered = [p for p in converter.source_patterns if p in state]
    for op in converter.operations:
        if isinstance(op, merge_op):
            state = {p: [Composite.stack(op.dim, state[p])] for p in ordered}
        elif isinstance(op, concat_op):
            merged = [c for p in ordered for c in state[p]]
            ordered = ["*"]
            state = {"*": [Composite.cat(op.dim, merged)]}
        else:
            raise ValueError(f"transformers converts it with {type(op).__name__}, which a "
                             "sharded load cannot read by slices; load it once with "
                             "from_pretrained and save the model's own state dict "
                             "(safetensors.torch.save_file), or save it with "
                             "TrainingState.save_pretrained, then load that")
    parts = [c for p in ordered for c in state[p]]
    if len(parts) != 1:
        raise ValueError(f"its {len(parts)} source groups are not combined into one tensor by "
                         f"{[type(op).__name__ for op in converter.operations]}")
    return parts[0]


def _natural_key(key: str) -> list[tuple[int, int | str]]:
    """``experts.10`` after ``experts.9``: numbers compare as numbers, as transformers sorts."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", key)
            if part]
