"""Model libraries: the floor below the runtime, answering what the runtime asks of the code a
model comes from, behind one protocol (:class:`~hyperrecipe.models.library.ModelLibrary`).

The runtime imports this package only, and asks :data:`LIBRARY`: each registered library in
turn, the first answer that is not "not mine" winning, and plain PyTorch's answers last. No
runtime module names a library's classes, functions or private attributes
(tests/test_layering.py keeps it so).

Owns ``library`` (the protocol, :class:`~hyperrecipe.models.library.PlainTorch`'s answers, and
the answers' shapes), ``transformers`` (transformers' answers: attention dispatch, the causal-LM
loss, the router loss, initializers, checkpoint conventions, the experts kernels' flag),
``hf_conversion`` (its checkpoint key conversions and renames), ``hf_kernels`` (its compute
kernels validate mode cannot run on DTensors, named before apply), ``hf_plans`` (its models' own
tensor-parallel plans, which ``suggest`` reads), ``hf_tiny`` (tiny configs of its families for
``suggest``) and ``torchtitan`` (torchtitan's model code built as its flavors build it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from hyperrecipe.models.hf_conversion import Composite, Conversion
from hyperrecipe.models.library import LossSeat, ModelLibrary, PlainTorch, RouterLoss
from hyperrecipe.models.transformers import Transformers

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hyperrecipe.plan import Plan

__all__ = ["LIBRARY", "Composite", "Conversion", "LossSeat", "ModelLibrary", "PlainTorch",
           "RouterLoss", "register_library"]


class _Libraries:
    """Every registered library asked in turn (:mod:`hyperrecipe.models`): a
    :class:`ModelLibrary` itself, so the runtime asks one object."""

    name = "libraries"

    def __init__(self, libraries: Sequence[ModelLibrary]) -> None:
        self.registered: list[ModelLibrary] = list(libraries)
        self._plain = PlainTorch()

    def _each(self) -> list[ModelLibrary]:
        return [*self.registered, self._plain]

    def attention_implementation(self, module: nn.Module) -> str | None:
        return next((a for lib in self._each()
                     if (a := lib.attention_implementation(module)) is not None), None)

    def attention_registry(self) -> tuple[MutableMapping[str, Any],
                                          MutableMapping[str, Any]] | None:
        return next((a for lib in self._each() if (a := lib.attention_registry()) is not None),
                    None)

    def loss_seat(self, owner: nn.Module) -> LossSeat | None:
        return next((a for lib in self._each() if (a := lib.loss_seat(owner)) is not None), None)

    def causal_lm_loss_name(self) -> str | None:
        names = [n for lib in self.registered if (n := lib.causal_lm_loss_name()) is not None]
        return " or ".join(names) or None

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        return next((a for lib in self._each() if (a := lib.router_loss(model)) is not None),
                    None)

    def initializer(self, model: nn.Module) -> Callable[[nn.Module], object] | None:
        return next((a for lib in self._each() if (a := lib.initializer(model)) is not None),
                    None)

    def is_transposed_linear(self, module: nn.Module) -> bool:
        return any(lib.is_transposed_linear(module) for lib in self._each())

    def size_to_bytes(self, size: int | str) -> int | None:
        return next((a for lib in self._each() if (a := lib.size_to_bytes(size)) is not None),
                    None)

    def tied_weight_keys(self, model: nn.Module) -> Mapping[str, str]:
        return next((a for lib in self._each() if (a := lib.tied_weight_keys(model))), {})

    def base_model_prefix(self, model: nn.Module) -> str | None:
        return next((a for lib in self._each() if (a := lib.base_model_prefix(model))), None)

    def ignored_checkpoint_keys(self, model: nn.Module) -> Sequence[str]:
        return next((a for lib in self._each() if (a := lib.ignored_checkpoint_keys(model))), ())

    def expert_kernel_flags(self, module: nn.Module) -> Mapping[str, object]:
        return next((a for lib in self._each() if (a := lib.expert_kernel_flags(module))), {})

    def checkpoint_conversion(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                              model_keys: Sequence[str]) -> Conversion | None:
        return next((a for lib in self._each()
                     if (a := lib.checkpoint_conversion(model, shapes, model_keys)) is not None),
                    None)

    def validate_refusal(self, model: nn.Module, plan: Plan) -> str | None:
        return next((a for lib in self._each()
                     if (a := lib.validate_refusal(model, plan)) is not None), None)


LIBRARY: ModelLibrary = _Libraries([Transformers()])
"""What the runtime asks: every registered library in turn, then plain PyTorch."""


def register_library(library: ModelLibrary) -> None:
    """Ask ``library`` before the libraries registered so far (docs/architecture.md, "How to add
    a model library"). Registering the same object twice is a no-op."""
    assert isinstance(LIBRARY, _Libraries)
    if library not in LIBRARY.registered:
        LIBRARY.registered.insert(0, library)
