"""Another stage's module, as this stage sees it: a shape, never a weight.

Each rank runs the model's own top-level forward, so the code between layers (masks, positions,
the loop over the split list) is the model's and needs no porting. The modules that belong to
other stages still get called by that forward; :class:`StagePlaceholder` stands in for them. It
runs a meta copy of the module (no storage) to learn the output's structure and shapes and returns
zeros of that structure on the stage's device. The zeros are never used as data: the stage entry
swaps the received hidden states in, and :class:`StageRun` makes every other use loud.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from hyperrecipe.errors import StageBoundaryError

__all__ = ["Side", "StagePlaceholder", "StageRun"]

Side = Literal["before", "after"]
"""Where a placeholder's module runs relative to the stage: ``before`` its first owned layer
(``pipeline.first`` modules, earlier layers) or ``after`` its last one (``pipeline.last``
modules, later layers)."""

Phase = Literal["idle", "before", "inside"]


class StageRun:
    """The state of one stage's forward call, shared by its placeholders and its entry/exit.

    ``phase`` moves ``before`` -> ``inside`` when the first owned layer starts. Every tensor a
    placeholder returns is *derived from another stage*, and so is every tensor an op computes
    from one while the stage runs up to its first layer (:meth:`tracking`): the entry refuses
    any such tensor in an argument other than the hidden states (a per-layer input or a second
    running state the model computes from the embeddings would otherwise reach the stage's
    layers as zeros).
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.phase: Phase = "idle"
        self.received: torch.Tensor | None = None
        self._derived: dict[int, weakref.ref[torch.Tensor]] = {}
        self.probing = False
        """A probe call stops at the first owned layer and returns its hidden states, whose
        shape is what crosses every stage boundary (the static example for torch's stages)."""

    def begin(self, received: torch.Tensor | None) -> None:
        self.phase = "before"
        self.received = received
        self._derived = {}

    def end(self) -> None:
        self.phase = "idle"
        self.received = None
        self._derived = {}

    def note(self, tensor: torch.Tensor) -> None:
        """``tensor`` comes from another stage's module (or was computed from such a tensor)."""
        self._derived[id(tensor)] = weakref.ref(tensor)

    def has_derived(self) -> bool:
        return bool(self._derived)

    def any_derived(self, values: Any) -> bool:
        """Whether a derived tensor is among ``values`` or the lists and tuples in them."""
        derived = self._derived
        for value in values:
            if isinstance(value, torch.Tensor):
                if id(value) in derived and self.made_here(value):
                    return True
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor) and id(item) in derived \
                            and self.made_here(item):
                        return True
        return False

    def made_here(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is derived from another stage's module in this call."""
        ref = self._derived.get(id(tensor))
        return ref is not None and ref() is tensor

    def tracking(self) -> contextlib.AbstractContextManager[object]:
        """While the model's forward runs up to this stage's first layer: mark what ops compute
        from derived tensors (a ``TorchFunctionMode``, inert once the stage is inside its
        layers). Stage 0 has nothing before its layers and is not tracked."""
        if self.stage == 0:
            return contextlib.nullcontext()
        return _Derivation(self)


_VALUE_FREE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                         "randn_like", "new_zeros", "new_ones", "new_empty", "new_full",
                         "new_tensor"})
"""Ops whose result takes only the shape, dtype or device of their tensor argument."""


class _Derivation(TorchFunctionMode):
    """Propagates "derived from another stage" through every torch op before the entry, and
    refuses a derived tensor's values being used once the stage is inside its layers."""

    def __init__(self, run: StageRun) -> None:
        super().__init__()
        self.run = run

    def run_layers_hint(self) -> str:
        return "this split list (only stage 0 would see the value whole)"

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        run = self.run
        if run.phase == "idle" or not run.has_derived():
            return out
        # every op of the stage's layers passes here: a flat look at the arguments (and one
        # level of lists, torch.cat's) instead of a pytree walk
        if not (run.any_derived(args) or (kwargs and run.any_derived(kwargs.values()))):
            return out
        results = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        name = getattr(func, "__name__", str(func))
        if not results or name in _VALUE_FREE:
            return out  # its shape, dtype or device: not another stage's values
        if run.phase == "before":
            for leaf in results:
                run.note(leaf)
            return out
        msg = (f"pipeline stage {run.stage}: the model's forward computes {name} inside this "
               f"stage's layers from a value another stage's module produced (a placeholder "
               f"stands in for it here, so it would be zeros): only the hidden states cross a "
               f"stage boundary. The model carries something besides the hidden states from "
               f"before its layers into them (embeddings added back, a second running state, "
               f"per-layer inputs), which no stage sends on: this model cannot be pipelined "
               f"over {self.run_layers_hint()}")
        raise StageBoundaryError(msg)


_MISSING = object()


def _plain(value: Any) -> bool:
    """Data with no tensor, module or callable in it (what a placeholder may hand out)."""
    if value is None or isinstance(value, (str, int, float, bool, torch.dtype)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


class StagePlaceholder(nn.Module):
    """Stands in for ``fqn``, a module of another stage, on stage ``run.stage``.

    Args:
        fqn: the module's FQN in the original model.
        meta: a meta-device copy of the module (never the live one: a live module may share a
            tied parameter with an owned module). Held outside ``_modules`` so it is neither a
            submodule nor moved by ``.to``/``to_empty``.
        side: where the module runs relative to the stage (:data:`Side`).
        owner: the stage that owns it, in words (``"stage 1 (pipeline.last)"``), for messages.
        run: the stage's call state.
        like_input: when the meta copy cannot run (an op without a meta kernel), return zeros
            shaped like the first tensor argument: true for layers of the split list, whose
            contract is hidden states in, hidden states of the same shape out.
    """

    def __init__(self, fqn: str, meta: nn.Module, side: Side, owner: str, run: StageRun, *,
                 like_input: bool) -> None:
        super().__init__()
        self.fqn = fqn
        self.side: Side = side
        self.owner = owner
        self.like_input = like_input
        object.__setattr__(self, "_hr_meta", meta)
        object.__setattr__(self, "_hr_run", run)
        object.__setattr__(self, "_hr_shapes", {})

    def extra_repr(self) -> str:
        return f"{self.fqn!r} of {self.owner}, runs {self.side} stage {self._run.stage}"

    def __getattr__(self, name: str) -> Any:
        """A plain attribute of the module stood in for (a string, a number, ``None``, or
        structures of them; its class's too), which the model's own forward reads off every
        layer, owned or not: Inkling-2's ``decoder_layer.attention_type`` and Nemotron-H's
        ``block_type`` pick each layer's mask. Tensors, modules and methods stay refused: a
        weight of another stage has no value here."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_hr_meta")
            if meta is None or name.startswith("__"):
                raise
            value = getattr(meta, name, _MISSING)
            if value is _MISSING:
                raise
            if not _plain(value):
                # still an AttributeError (hasattr() keeps working), saying why
                msg = (f"{self.fqn}.{name}: {self.fqn} belongs to pipeline {self.owner}; stage "
                       f"{self._run.stage} holds a placeholder for it, without its tensors, "
                       f"submodules or methods, and the model's forward reads {name!r} off it "
                       f"here: a model that reads another stage's weights (their device, dtype "
                       f"or values) outside its layers cannot be pipelined by this split")
                raise AttributeError(msg) from None
            return value

    @property
    def _run(self) -> StageRun:
        run: StageRun = self.__dict__["_hr_run"]
        return run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self._run
        if self.side == "after":
            msg = (f"{self.fqn} belongs to pipeline {self.owner} but was called on stage "
                   f"{run.stage}, which stops after its last layer: the model uses it before "
                   f"or inside this stage's layers, so it cannot live on a later stage; "
                   f"declare it in the recipe's pipeline.first (stage 0 owns those), or move "
                   f"the split")
            raise StageBoundaryError(msg)
        if run.phase == "inside":
            msg = (f"{self.fqn} belongs to pipeline {self.owner} but was called on stage "
                   f"{run.stage} after that stage's first layer started: the model uses it on "
                   f"the wrong side of the split, where its output would matter; declare it in "
                   f"the recipe's pipeline.last (the last stage owns those), or move the split")
            raise StageBoundaryError(msg)
        out = self._shape_of(args, kwargs)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                run.note(leaf)
        return out

    def _shape_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Zeros shaped as the module's output for these arguments. The meta run's result is
        kept per call signature (the arguments' structure, tensor shapes and dtypes, plain
        values, other objects' types): every microbatch of a step calls with the same, and
        re-running an earlier stage's layers on meta was most of a later stage's step."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
        # autocast changes what dtype the module returns for the same arguments
        autocast = _autocast_state(device)
        key = (str(spec), tuple(_signature_of(x) for x in leaves), autocast)
        shapes: dict[Any, Any] = self.__dict__["_hr_shapes"]
        out = shapes.get(key)
        if out is None:
            out = self._meta_output(args, kwargs)
            if len(shapes) >= _MAX_SIGNATURES:
                shapes.clear()
            shapes[key] = out
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device),
            out,
        )

    def _meta_output(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        meta: Callable[..., Any] = self.__dict__["_hr_meta"]
        to_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"),
                                       (args, kwargs))
        try:
            with torch.no_grad():
                out = meta(*to_meta[0], **to_meta[1])
        except (RuntimeError, NotImplementedError):
            if not self.like_input:
                raise
            first = next((x for x in pytree.tree_leaves((args, kwargs))
                          if isinstance(x, torch.Tensor)), None)
            if first is None:
                raise
            out = first.to("meta")
        return out


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    try:
        enabled = torch.is_autocast_enabled(device.type)
        return enabled, torch.get_autocast_dtype(device.type) if enabled else None
    except RuntimeError:  # a device type autocast does not know (meta)
        return False, None


_MAX_SIGNATURES = 16
"""Call signatures a placeholder remembers (a new sequence length is a new one)."""


def _signature_of(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return leaf
    return ("object", type(leaf).__qualname__)
