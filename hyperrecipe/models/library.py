"""The protocol a model library answers: everything the runtime asks of the code a model comes
from, and nothing else.

The runtime never names a library's classes, functions or private attributes: it asks
:data:`hyperrecipe.models.LIBRARY`, which asks each registered :class:`ModelLibrary` in turn and
takes the first answer that is not "not mine" (``None``, an empty mapping or tuple, ``False``).
A library answers only for objects it recognises, so a plain PyTorch model gets the defaults of
:class:`PlainTorch` (no attention registry, no loss to replace, no conversions) and a model from
a library nobody registered behaves as plain torch: the runtime never guesses at internals.

Adding a library (docs/architecture.md, "How to add a model library"): subclass
:class:`PlainTorch`, override the questions your library has an answer to, and call
:func:`hyperrecipe.models.register_library`. Each question says what the runtime does with the
answer, so an answer that is wrong for a model is a wrong result: answer only what you know.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hyperrecipe.models.hf_conversion import Conversion
    from hyperrecipe.plan import Plan

__all__ = ["ModelLibrary", "PlainTorch", "LossSeat", "RouterLoss"]


@attrs.frozen
class LossSeat:
    """Where a model keeps the loss function the vocab-sharded loss replaces."""

    #: the loss function the model computes ``labels=`` with
    function: Callable[..., Any]
    #: the attribute of the owner module that holds it (replaced through the rewriter)
    attribute: str


@attrs.frozen
class RouterLoss:
    """Where a mixture-of-experts model computes its router load-balancing loss."""

    #: the class of the modules whose output is the router logits the loss reads
    router_class: type
    #: the namespace (a module object) holding the loss function and its name there, or
    #: ``None`` when the model records router logits but computes no loss from them
    namespace: Any
    name: str


class ModelLibrary(Protocol):
    """What the runtime asks of a model's library. Every answer has a "not mine" value."""

    name: str

    def attention_implementation(self, module: nn.Module) -> str | None:
        """The attention function ``module`` dispatches to (``"sdpa"``, ``"eager"``): inner
        attention wrappers and context parallelism replace that function."""

    def attention_registry(self) -> tuple[MutableMapping[str, Any],
                                          MutableMapping[str, Any]] | None:
        """The registry attention functions are looked up in, and the mapping a hook writes
        to; ``None`` when the library keeps none (or is not imported)."""

    def loss_seat(self, owner: nn.Module) -> LossSeat | None:
        """The causal-LM cross entropy ``owner`` computes ``labels=`` with, and where it keeps
        it, when the vocab-sharded loss can reproduce it step for step; else ``None``."""

    def causal_lm_loss_name(self) -> str | None:
        """The name of the loss :meth:`loss_seat` accepts, for messages."""

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        """Where ``model`` computes its router load-balancing loss, when it has one."""

    def initializer(self, model: nn.Module) -> Callable[[nn.Module], object] | None:
        """The per-module initializer that recomputes non-persistent buffers (rotary
        frequencies) after a meta apply."""

    def is_transposed_linear(self, module: nn.Module) -> bool:
        """Whether ``module`` is a linear layer whose weight is stored ``[in, out]``."""

    def size_to_bytes(self, size: int | str) -> int | None:
        """A checkpoint shard size as the library writes it (``"5GB"``) in bytes."""

    def tied_weight_keys(self, model: nn.Module) -> Mapping[str, str]:
        """The parameters the library ties (target name -> source name)."""

    def base_model_prefix(self, model: nn.Module) -> str | None:
        """The attribute a head model keeps its base model under (base-model checkpoints carry
        keys without it)."""

    def ignored_checkpoint_keys(self, model: nn.Module) -> Sequence[str]:
        """Regexes of checkpoint keys the model deliberately does not load."""

    def expert_kernel_flags(self, module: nn.Module) -> Mapping[str, object]:
        """Attributes an experts module needs set when it holds a slice of the experts."""

    def checkpoint_conversion(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                              model_keys: Sequence[str]) -> Conversion | None:
        """How the library's own loader maps a checkpoint's keys onto ``model_keys``."""

    def validate_refusal(self, model: nn.Module, plan: Plan) -> str | None:
        """Why validate mode cannot run ``model`` under ``plan`` as built (a kernel DTensor
        cannot run), with the way out; ``None`` when nothing is known."""


class PlainTorch:
    """The answers for a plain PyTorch model: no library internals at all. Libraries subclass
    it and override what they know."""

    name = "torch"

    def attention_implementation(self, module: nn.Module) -> str | None:
        return None

    def attention_registry(self) -> tuple[MutableMapping[str, Any],
                                          MutableMapping[str, Any]] | None:
        return None

    def loss_seat(self, owner: nn.Module) -> LossSeat | None:
        return None

    def causal_lm_loss_name(self) -> str | None:
        return None

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        return None

    def initializer(self, model: nn.Module) -> Callable[[nn.Module], object] | None:
        return None

    def is_transposed_linear(self, module: nn.Module) -> bool:
        return False

    def size_to_bytes(self, size: int | str) -> int | None:
        return size if isinstance(size, int) else None

    def tied_weight_keys(self, model: nn.Module) -> Mapping[str, str]:
        return {}

    def base_model_prefix(self, model: nn.Module) -> str | None:
        return None

    def ignored_checkpoint_keys(self, model: nn.Module) -> Sequence[str]:
        return ()

    def expert_kernel_flags(self, module: nn.Module) -> Mapping[str, object]:
        return {}

    def checkpoint_conversion(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                              model_keys: Sequence[str]) -> Conversion | None:
        return None

    def validate_refusal(self, model: nn.Module, plan: Plan) -> str | None:
        return None
