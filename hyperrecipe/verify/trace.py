"""What the model's own code computes in each mode: the silent mistakes neither mode fails on.

Production mode runs the model's code on local tensors; validate mode runs the same code on
DTensors. Wherever the plan is right, production computes what validate's DTensors hold
locally: the same local shapes, and no collective inside the model's code (production has
none there; its collectives are the plan's, at boundaries). Two mistakes break that without
an error in either mode, and the step's trace sees both.

**A shard split otherwise than the whole.** A module that splits a column-sharded width into
heads with a count fixed at build (``rearrange(q, 'b n (h d) -> b h n d', h=self.heads)``, an
einops ``Rearrange`` layer, ``q.view(B, T, self.n_head, -1)``) runs in production whenever the
shard's width is a multiple of that count: each rank computes ``h`` heads of width ``d / tp``,
parts of every head, instead of ``h / tp`` whole heads. Validate's DTensor view keeps the shard
on the heads, and computes it right. So each mode records the local shapes of every
``view``/``reshape``/``unflatten`` the model's code calls (directly or through einops), keyed by
the module running, the calling line and its occurrence there; a call both modes made, from the
same local input, whose output holds the same elements in another shape is the finding.

**A partial value reduced inside the model's code.** A reduction over a sharded dim (a norm's
mean over a width the plan sharded) gives validate's DTensor a ``Partial`` value, which DTensor
reduces over the mesh where the next op needs the whole (``variance + eps``). Production has
no collective there: it computes with this rank's partial sum. So validate mode records the
first op of the model's code that takes a partial DTensor and returns one that is not partial
on that mesh dim.

Calls of hyperrecipe's or torch's own code are not recorded (the rewriter's collectives,
DTensor's redistributions, ``nn.functional``'s internals), nor DTensor's own conversions a
model makes on purpose (``redistribute``, ``full_tensor``, ``to_local``); a reshape only one mode
made, or whose outputs differ in size (validate gathered the input to split it), is no finding:
the trace only refuses what it can show differs.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["PartialReduced", "Reshape", "StepTrace", "diverging"]

_RESHAPES = frozenset({Tensor.view, Tensor.reshape, torch.reshape, Tensor.unflatten,
                       torch.unflatten})
"""The calls that split or merge dims by sizes the caller computes."""

_ON_PURPOSE = frozenset({"redistribute", "full_tensor", "to_local"})
"""DTensor's own conversions: a model that calls them reduces a partial value knowingly."""

_TORCH = Path(torch.__file__).parent
_THROUGH = frozenset({str(_TORCH / "overrides.py"), str(_TORCH / "_tensor.py"),
                      str(_TORCH / "nn" / "modules" / "module.py")})
"""torch's own frames between a caller and the mode: Python-level ``Tensor`` methods, and
``nn.Module.__call__`` between a layer that reshapes (einops' ``Rearrange``) and its caller."""

_NOT_THE_MODEL = (f"{Path(__file__).resolve().parents[1]}{os.sep}", f"{_TORCH}{os.sep}")
"""hyperrecipe's and torch's own code."""


@attrs.frozen
class Reshape:
    """One recorded reshape: where it was made and the local shapes in and out."""

    module: str
    site: str
    """``file:line`` of the model's code that made the call."""
    occurrence: int
    local_in: tuple[int, ...]
    local_out: tuple[int, ...]
    sharded: bool
    """The output is a DTensor with a shard on some mesh dim (validate mode)."""


@attrs.frozen
class PartialReduced:
    """The first op of the model's code that reduced a partial DTensor (validate mode)."""

    module: str
    site: str
    op: str
    mesh_dim: str


def _local_shape(t: Tensor) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return tuple(int(s) for s in local.shape)


def _is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


def _partial_dims(values: Any) -> set[int]:
    """The mesh dims on which a DTensor among ``values`` (one level of lists) is partial."""
    from torch.distributed.tensor import DTensor

    dims: set[int] = set()
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, DTensor):
                dims.update(i for i, p in enumerate(t.placements) if p.is_partial())
    return dims


def _caller(frame: FrameType | None) -> FrameType | None:
    """The first frame outside this module, torch's method plumbing, torch-function modes
    (validate mode's own, the step's attention) and einops: who asked for the op."""
    while frame is not None and (frame.f_code.co_filename in _THROUGH
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_code.co_name == "__torch_function__"
                                 or "einops" in Path(frame.f_code.co_filename).parts):
        frame = frame.f_back
    return frame


class StepTrace(TorchFunctionMode):
    """Inside: the model's own reshapes, and validate mode's first partial value reduced in
    the model's code, each with the module running (``stack``, innermost last, kept by the
    step's module hooks: set by the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self._seen: Counter[tuple[str, str]] = Counter()
        self.reshapes: dict[tuple[str, str, int], Reshape] = {}
        self.reduced: PartialReduced | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _RESHAPES:
            if isinstance(out, Tensor) and args and isinstance(args[0], Tensor):
                self._reshaped(args[0], out)
        elif self.reduced is None and getattr(func, "__name__", "") not in _ON_PURPOSE:
            partial = _partial_dims(args) | _partial_dims(kwargs.values())
            if partial:
                self._reduced(func, partial - _partial_dims((out,)), out)
        return out

    def _site(self) -> tuple[str, str] | None:
        """The module running and the model's ``file:line`` that made the op, or ``None``
        where torch's or hyperrecipe's own code made it."""
        frame = _caller(sys._getframe(1))
        if frame is None or frame.f_code.co_filename.startswith(_NOT_THE_MODEL):
            return None
        return (self.stack[-1] if self.stack else "",
                f"{frame.f_code.co_filename}:{frame.f_lineno}")

    def _reshaped(self, source: Tensor, out: Tensor) -> None:
        where = self._site()
        if where is None:
            return
        n = self._seen[where]
        self._seen[where] += 1
        module, site = where
        self.reshapes[module, site, n] = Reshape(
            module=module, site=site, occurrence=n, local_in=_local_shape(source),
            local_out=_local_shape(out), sharded=_is_sharded(out))

    def _reduced(self, func: Any, dims: set[int], out: Any) -> None:
        from torch.distributed.tensor import DTensor

        placed = next((t for t in (out if isinstance(out, (list, tuple)) else (out,))
                       if isinstance(t, DTensor)), None)
        if not dims or placed is None:
            return  # still partial (a linear op), or no DTensor out (the model unwrapped it)
        where = self._site()
        if where is None:
            return
        names = placed.device_mesh.mesh_dim_names or ()
        dim = min(dims)
        self.reduced = PartialReduced(module=where[0], site=where[1],
                                      op=getattr(func, "__name__", str(func)),
                                      mesh_dim=names[dim] if dim < len(names) else str(dim))


def diverging(production: StepTrace, validate: StepTrace) -> tuple[Reshape, Reshape] | None:
    """The first reshape, in production's order, that both modes made from the same local
    input and that production split into another shape of the same size than validate's
    shard."""
    for key, made in production.reshapes.items():
        shard = validate.reshapes.get(key)
        if shard is None or not shard.sharded or made.local_in != shard.local_in:
            continue
        if made.local_out != shard.local_out and _numel(made.local_out) == _numel(
                shard.local_out):
            return made, shard
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
