"""Where the single-process reference itself computes in 16 bits inside a float32 model.

A float32 model can still compute parts of its forward in bfloat16 or float16: torchtitan's
grouped experts cast to bfloat16 for ``_grouped_mm``, a forward calls ``x.to(torch.bfloat16)``
or opens an ``autocast`` region. Check's tolerances follow the parameters' dtype (float32:
atol 1e-5, rtol 1e-4), but a 16-bit matmul on a rank's shard rounds differently from the same
matmul on the whole tensor, so such a model diverges by 16-bit rounding under any correct plan.

:func:`half_precision_seen` re-runs the reference forward (the same model and batch, after the
compared step) under a ``TorchDispatchMode``, which sees every aten op after autocast has cast
its inputs, and records the floating-point ops whose output is 16-bit, with the innermost module
each ran in. It is called only when a mode diverged, so an agreeing check pays nothing for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyperrecipe.verify.sample import Sample

__all__ = ["HALF_DTYPES", "HALF_TOLERANCE", "HalfPrecision", "half_precision_seen"]

HALF_DTYPES = (torch.bfloat16, torch.float16)
HALF_TOLERANCE = (1e-2, 1e-2)
"""Check's (atol, rtol) for a 16-bit model (``--atol``/``--rtol`` override them): bfloat16
keeps 8 bits of mantissa, a relative step of 2**-8 ~ 4e-3."""

_NOT_COMPUTE = frozenset({"_to_copy", "copy_", "clone", "detach", "alias", "empty_like",
                          "zeros_like", "ones_like", "lift_fresh", "_local_scalar_dense"})
"""Ops that move or allocate 16-bit values without computing with them (the cast itself is
``_to_copy``); views are skipped by their schema."""


@attrs.frozen(kw_only=True)
class HalfPrecision:
    """16-bit computation the reference did while the model's parameters are float32.

    Attributes:
        params_dtype: the dtype of the model's floating-point parameters (``"float32"``).
        dtypes: the 16-bit dtypes seen (``("bfloat16",)``).
        ops: how many computing ops returned a 16-bit value.
        op_names: the distinct ops, in the order first seen (``("aten.mm", ...)``).
        modules: the innermost modules they ran in, in the order first seen (``"<root>"`` for
            the model's own forward).
    """

    params_dtype: str
    dtypes: tuple[str, ...]
    ops: int
    op_names: tuple[str, ...]
    modules: tuple[str, ...]

    def describe(self, limit: int = 3) -> str:
        """``"12 ops (aten.mm, aten.add) in bfloat16 inside layers.0.mlp"``."""
        names = ", ".join(self.op_names[:limit]) + (", ..." if len(self.op_names) > limit
                                                     else "")
        where = ", ".join(self.modules[:limit]) + (
            f" and {len(self.modules) - limit} more" if len(self.modules) > limit else "")
        return (f"{self.ops} op{'s' if self.ops != 1 else ''} ({names}) in "
                f"{' and '.join(self.dtypes)} inside {where}")


class _HalfOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the computing ops that return a 16-bit floating-point tensor."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.where = where
        self.seen: Counter[tuple[str, str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket.__name__
        if packet in _NOT_COMPUTE or func.is_view:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES:
                self.seen[(f"aten.{packet}", str(t.dtype).removeprefix("torch."),
                           self.where())] += 1
                break
        return out


def half_precision_seen(model: nn.Module, sample: Sample) -> HalfPrecision | None:
    """The 16-bit ops of ``model``'s forward on ``sample`` while every floating-point parameter
    is float32; ``None`` when the parameters are not all float32, when no op computes in 16 bits,
    or when the forward cannot be re-run (the finding is then simply not made)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:
        return None
    stack: list[str] = []

    def enter(fqn: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(fqn or "<root>")
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()  # returns None: a forward hook that returns a value replaces the output

    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(fqn)))
        handles.append(module.register_forward_hook(leave))
    mode = _HalfOps(lambda: stack[-1] if stack else "<root>")
    try:
        with torch.no_grad(), mode:
            model(*sample.args, **sample.kwargs)
    except Exception:  # noqa: BLE001 - a forward that will not re-run here tells nothing
        return None
    finally:
        for h in handles:
            h.remove()
    if not mode.seen:
        return None
    ops: dict[str, None] = {}
    kinds: dict[str, None] = {}
    modules: dict[str, None] = {}
    for op, dtype, where in mode.seen:
        ops[op] = None
        kinds[dtype] = None
        modules[where] = None
    return HalfPrecision(params_dtype="float32", dtypes=tuple(kinds), ops=sum(mode.seen.values()),
                         op_names=tuple(ops), modules=tuple(modules))
