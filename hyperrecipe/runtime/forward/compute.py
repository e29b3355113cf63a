"""What a boundary runs between converting its inputs and its outputs.

Normally the module's own class forward. Two cases need a local kernel in production mode,
where DTensor would have done the work implicitly:

- a *deferred bias*: the forward runs without the bias, which the boundary adds once after the
  output's reduction (rowwise linear: otherwise every rank adds it and the sum counts it ``tp``
  times). ``nn.Linear`` computes ``F.linear(x, W)``; transformers' ``Conv1D`` (GPT-2), whose
  weight is stored ``[in, out]`` and whose forward cannot run without a bias (``addmm``),
  computes ``x @ W``; any other module runs with its ``bias`` entry set to ``None`` for the call.
- a *vocab-parallel embedding*: each rank owns a contiguous range of rows; ids outside it are
  looked up as row 0 and their vectors zeroed, so the all-reduce that follows sums exactly one
  real vector per token. DTensor's embedding does the same masking itself in validate mode.

The choice is made once, at install time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.models import LIBRARY
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.plan import BoundaryPlan
    from hyperrecipe.rewriter import Rewrite

__all__ = ["bias_free_forward", "class_forward", "vocab_parallel_embedding"]

Forward = Callable[..., Any]


def class_forward(module: nn.Module) -> Forward:
    """The module's class forward bound to it (what ``module.forward`` is before any rewrite)."""
    return type(module).forward.__get__(module, type(module))  # type: ignore[no-any-return]


def bias_free_forward(module: nn.Module, inner: Forward) -> Forward:
    """``inner`` with the module's bias left out."""
    if type(module) is nn.Linear:
        def linear(input: Tensor) -> Tensor:
            return F.linear(input, module.weight)

        return linear
    if LIBRARY.is_transposed_linear(module):
        def conv1d(x: Tensor) -> Tensor:
            return torch.matmul(x, module.get_parameter("weight"))

        return conv1d

    def without_bias(*args: Any, **kwargs: Any) -> Any:
        params = module._parameters
        bias = params["bias"]
        params["bias"] = None
        try:
            return inner(*args, **kwargs)
        finally:
            params["bias"] = bias

    return without_bias


def local_padding_idx(module: nn.Embedding, *, rank: int) -> int | None:
    """The padding row in this rank's slice of a row-sharded table, if it owns it."""
    rows = module.weight.shape[0]
    pad = module.padding_idx
    start = rank * rows
    return pad - start if pad is not None and start <= pad < start + rows else None


def vocab_parallel_embedding(module: nn.Module, inner: Forward, *, rank: int, fqn: str) -> Forward:
    """A masked lookup into this rank's rows of a row-sharded ``nn.Embedding`` (or subclass).

    ``inner`` (the class forward) runs on ids shifted into this rank's rows, so what a subclass
    adds around the lookup (Gemma scales it by sqrt(hidden)) is kept; vectors of ids this rank
    does not own are zeroed afterwards. The caller sets ``padding_idx`` to
    :func:`local_padding_idx` for the time the plan is applied.

    Raises:
        PlanMismatchError: the module is not an ``nn.Embedding`` or uses options (``max_norm``)
            whose semantics need the whole table.
    """
    if not isinstance(module, nn.Embedding):
        msg = (f"{fqn}: a vocab-parallel boundary needs an nn.Embedding in production mode, "
               f"found {type(module).__name__}")
        raise PlanMismatchError(msg)
    if module.max_norm is not None:
        msg = f"{fqn}: vocab-parallel embedding with max_norm is not supported"
        raise PlanMismatchError(msg)
    rows = module.weight.shape[0]
    start, stop = rank * rows, (rank + 1) * rows

    def lookup(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        outside = (input < start) | (input >= stop)
        local = torch.where(outside, torch.zeros_like(input), input - start)
        out: Tensor = inner(local, *args, **kwargs)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    return lookup


@answers("embedding_compute", "production")
def _masked_local_lookup(tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                         compute: Forward, mesh: DeviceMesh) -> Forward:
    from hyperrecipe.runtime.comm.collectives import group_for

    assert boundary.vocab_parallel is not None
    g = group_for(mesh, boundary.vocab_parallel)
    local = vocab_parallel_embedding(module, compute, rank=g.rank, fqn=boundary.fqn)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        tx.set_attribute(module, "padding_idx", local_padding_idx(module, rank=g.rank),
                         fqn=boundary.fqn)
    return local


@answers("embedding_compute", "validate")
def _dtensor_lookup(tx: Rewrite, boundary: BoundaryPlan, module: nn.Module,
                    compute: Forward, mesh: DeviceMesh) -> Forward:
    return compute  # DTensor looks a row-sharded table up itself
