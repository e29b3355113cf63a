"""Global optimizer step pre-hooks that live as long as the model they serve, not forever.

Optimizers are built after ``apply``, so the installation finds them through torch's *global*
step pre-hook registry. That registry is a module-level dict: a hook closing over the model (its
``LiveParams``) kept the model, every shard and every gradient alive for the rest of the process
after the user dropped both the model and the installation (measured: a tiny Llama's parameter
still alive after ``del model, inst; gc.collect()``). A notebook or a sweep that builds one
model after another ran out of memory that way.

Here the registry holds a trampoline with a *weak* reference to the hook, and the model holds
the hook itself, so the hook lives exactly as long as the model (an installation dropped while
the model trains on keeps working: the model's optimizers still need the hooks). Once the model
is collected the trampoline does nothing, and it leaves torch's registry at the next
registration: not at once, because torch iterates that dict while it calls the hooks, and a
collection can run in the middle of a step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ScopedHandle", "model_scoped_step_pre_hook"]

StepPreHook = Callable[[Any, Any, Any], Any]

_KEPT = "_hyperrecipe_step_hooks"  # the list in the model's __dict__ holding the hooks
_DEAD: list[Any] = []  # handles of trampolines whose model is gone, removed at the next register


class ScopedHandle:
    """``.remove()`` takes the hook out of torch's registry and out of the model."""

    def __init__(self, handle: Any, model: nn.Module, hook: StepPreHook) -> None:
        self._handle, self._model, self._hook = handle, weakref.ref(model), hook

    def remove(self) -> None:
        self._handle.remove()
        model = self._model()
        kept = model.__dict__.get(_KEPT, []) if model is not None else []
        if any(h is self._hook for h in kept):
            kept[:] = [h for h in kept if h is not self._hook]


def model_scoped_step_pre_hook(model: nn.Module, hook: StepPreHook) -> ScopedHandle:
    """Register ``hook`` as a global optimizer step pre-hook for as long as ``model`` lives."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    while _DEAD:
        _DEAD.pop().remove()
    ref = weakref.ref(hook)

    def step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
        live = ref()
        return None if live is None else live(optimizer, args, kwargs)

    handle = register_optimizer_step_pre_hook(step_pre_hook)
    weakref.finalize(hook, _DEAD.append, handle)
    model.__dict__.setdefault(_KEPT, []).append(hook)
    return ScopedHandle(handle, model, hook)
