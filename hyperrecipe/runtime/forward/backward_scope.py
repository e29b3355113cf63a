"""Naming the boundary whose backward meets an op DTensor cannot shard.

Some ops have a DTensor rule forward and none backward: ``F.hardtanh`` (``ReLU6``) and
``F.hardsigmoid`` run on a sharded DTensor, and their ``aten.hardtanh_backward`` /
``aten.hardsigmoid_backward`` have no sharding strategy in torch 2.13. The forward's refusal
(:func:`~hyperrecipe.runtime.forward.validate_scope.validate_compute`) cannot see them: the
backward runs later, from ``loss.backward()``, when no boundary is running, and DTensor's bare
"does not have a sharding strategy registered" reached the user.

:func:`naming_backward_ops` wraps a validate-mode boundary's compute: after it ran, every autograd
node its compute created (walked back from its outputs, stopping at nodes older than the call;
parameters' accumulators are left alone) gets a pre-hook that enters a torch dispatch mode and a
hook that leaves it, so while one of these nodes runs, each aten op it calls goes through the
mode, which raises DTensor's refusal again as
:class:`~hyperrecipe.errors.ValidateUnsupportedError` (or
:class:`~hyperrecipe.errors.ValidateShardingError`) naming the boundary and the op. When the
node raises, autograd's thread-local state is restored to what it was before the node, the
mode with it. A nested boundary's nodes are hooked by it and by the enclosing one; the mode
entered first (the innermost boundary's) sees the error first and names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyperrecipe.runtime.forward.marshal import grad_roots
from hyperrecipe.runtime.forward.validate_scope import refuse_unsupported_op

__all__ = ["naming_backward_ops"]

Forward = Callable[..., Any]


class _BackwardOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Active while one node of a boundary's backward runs: DTensor's refusals named."""

    def __init__(self, fqn: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.fqn = fqn

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except RuntimeError as exc:  # NotImplementedError is one
            refuse_unsupported_op(exc, self.fqn, backward=True)
            raise


def _current_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will be near: that of
    a node made now (nodes are numbered in the order they are made, per thread)."""
    probe = torch.empty(0, requires_grad=True).view(0)
    node = probe.grad_fn
    assert node is not None
    return int(node._sequence_nr())


def _nodes_since(outputs: Any, start: int) -> list[Any]:
    roots = grad_roots(outputs)
    seen: set[int] = set()
    found: list[Any] = []
    stack = [n for n in roots if n._sequence_nr() > start]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        for nxt, _ in node.next_functions:
            if (nxt is not None and id(nxt) not in seen and not hasattr(nxt, "variable")
                    and nxt._sequence_nr() > start):
                stack.append(nxt)
    return found


def naming_backward_ops(compute: Forward, fqn: str) -> Forward:
    """``compute`` whose backward names ``fqn`` when DTensor refuses one of its ops (see the
    module docstring); a call without gradients is left as it is."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return compute(*args, **kwargs)
        start = _current_sequence_nr()
        out = compute(*args, **kwargs)
        for node in _nodes_since(out, start):
            mode = _BackwardOps(fqn)

            def enter(grad_outputs: Any, mode: _BackwardOps = mode) -> None:
                mode.__enter__()  # type: ignore[no-untyped-call]

            def leave(grad_inputs: Any, grad_outputs: Any, mode: _BackwardOps = mode) -> None:
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

            node.register_prehook(enter)
            node.register_hook(leave)
        return out

    return run
