"""Keeping every rank's backward in step when data-dependent code used nothing on one rank.

Backward collectives (a boundary input's all-reduce, an expert dispatch's return exchange) run
when autograd reaches them, and every rank of the group must run each of them. Data-dependent
code can cut that path on one rank only: transformers' ``eager`` experts, when no token reached
this rank's experts, return a fresh zeros tensor that depends on nothing, so this rank's
backward would never reach the input collectives its peers are waiting in (a hang), and its
experts would get ``None`` gradients where one process gets zeros (an optimizer that skips
``None`` would then step them differently).

:func:`tie_unreached` repairs exactly that case (:func:`reaching_forward` applies it to a
module's compute, with its arguments and parameters as sources): when no output tensor requires grad although
some source does, the first floating output gets an exact zero computed from every source, so
backward reaches each of them with zero gradients. Outputs that already require grad are
returned untouched (nothing is computed), which is the common case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hyperrecipe.runtime.forward.marshal import map_tensors

__all__ = ["reaching_forward", "tie_unreached"]

Forward = Callable[..., Any]


def tie_unreached(out: Any, sources: Iterable[Tensor]) -> Any:
    """``out``, or ``out`` with its first floating tensor tied to ``sources`` (module docstring).

    Args:
        out: a tensor or a nest of tuples, lists and dicts holding tensors.
        sources: the tensors backward must reach (inputs, parameters); those that do not
            require grad are ignored.
    """
    if not torch.is_grad_enabled():
        return out
    found: list[Tensor] = []
    map_tensors(out, found.append)
    if any(t.requires_grad for t in found):
        return out
    needed = [s for s in sources if s.requires_grad]
    first = next((t for t in found if t.is_floating_point()), None)
    if not needed or first is None:
        return out
    # the sum of an empty slice: exactly 0 whatever the values (s.sum() * 0 is NaN when a
    # sum overflows), yet it reaches s, whose gradient is then zeros
    zero = sum((s.reshape(-1)[:0].sum() for s in needed),
               start=torch.zeros((), device=first.device))
    tied = first + zero.to(first.dtype)
    done = False

    def swap(t: Tensor) -> Tensor:
        nonlocal done
        if t is first and not done:
            done = True
            return tied
        return t

    return map_tensors(out, swap)


def reaching_forward(inner: Forward, module: nn.Module) -> Forward:
    """``inner`` whose output, when it depends on nothing, is tied to every tensor argument and
    every parameter ``module`` holds at call time (local views, inside a local region)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)

        def sources() -> Iterator[Tensor]:  # walked only when the output depends on nothing
            found: list[Tensor] = []
            map_tensors((args, kwargs), found.append)
            yield from found
            yield from module.parameters()

        return tie_unreached(out, sources())

    return forward
