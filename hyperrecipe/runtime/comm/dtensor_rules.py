"""DTensor sharding rules for the ops torch ships without one, registered once, on demand.

torch 2.13 registers DTensor strategies for the CUDA attention kernels (flash, efficient,
cuDNN) but none for the CPU flash kernel that ``F.scaled_dot_product_attention`` dispatches to
on the CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``. That is
transformers' default attention (``attn_implementation="sdpa"``), and the CPU is where users
first run validate mode, so without a rule validate mode dies in the first attention.

The rules are torch's own for the CUDA flash kernel, on the CPU kernel's signature (its outputs
are ``(output [B, H, L, E], logsumexp [B, H, L])``, its backward's ``(grad_q, grad_k, grad_v)``;
an optional ``attn_mask`` keyword is broadcast over batch and heads):

- every tensor replicated in, replicated out;
- heads sharded in (``Shard(1)`` on q, k, v), heads sharded out (output and logsumexp), a mask
  sharded by head where it has one row per head and replicated where it broadcasts;
- the batch sharded in (``Shard(0)``), the batch sharded out, a mask likewise.

Each rank then computes exactly its heads' (or rows') attention, as one process would for
them. They are registered through torch's public
:func:`torch.distributed.tensor.experimental.register_sharding` by
:func:`register_validate_rules`, which ``apply`` calls in validate mode (idempotent; never at
import of hyperrecipe, so compiling and production never touch DTensor's registry).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from hyperrecipe.errors import ValidateUnsupportedError
from hyperrecipe.models import LIBRARY
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hyperrecipe.plan import Plan

__all__ = ["register_validate_rules", "validate_rule_ops"]

_LOCK = threading.Lock()
_REGISTERED = threading.Event()


def _mask_placement(mask: Any, dim: int) -> Any:
    """How an attention mask is placed beside q/k/v sharded on ``dim`` (0 batch, 1 heads):
    sharded along with them where it has that dim in full, replicated where it broadcasts."""
    from torch.distributed.tensor import Replicate, Shard

    shape = tuple(mask.shape)
    full = len(shape) == 4 and shape[dim] > 1
    return Shard(dim) if full else Replicate()


def _tensor_kwarg(value: Any) -> bool:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(value, DTensorSpec)


def _sdpa_cpu_forward(query: Any, key: Any, value: Any, dropout_p: float = 0.0,
                      is_causal: bool = False, *, attn_mask: Any = None,
                      scale: float | None = None) -> list[tuple[list[Any], list[Any]]]:
    from torch.distributed.tensor import Replicate, Shard

    del query, key, value, dropout_p, is_causal, scale
    masked = _tensor_kwarg(attn_mask)
    rules: list[tuple[list[Any], list[Any]]] = []
    r = Replicate()
    rules.append(([r, r], [r, r, r, None, None] + ([r] if masked else [])))
    for dim in (1, 0):  # heads, then batch
        s = Shard(dim)
        mask = [_mask_placement(attn_mask, dim)] if masked else []
        rules.append(([s, s], [s, s, s, None, None] + mask))
    return rules


def _sdpa_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any,
                       logsumexp: Any, dropout_p: float, is_causal: bool, *,
                       attn_mask: Any = None, scale: float | None = None
                       ) -> list[tuple[list[Any], list[Any]]]:
    from torch.distributed.tensor import Replicate, Shard

    del grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale
    masked = _tensor_kwarg(attn_mask)
    rules: list[tuple[list[Any], list[Any]]] = []
    r = Replicate()
    rules.append(([r, r, r], [r] * 6 + [None, None] + ([r] if masked else [])))
    for dim in (1, 0):
        s = Shard(dim)
        mask = [_mask_placement(attn_mask, dim)] if masked else []
        rules.append(([s, s, s], [s] * 6 + [None, None] + mask))
    return rules


def validate_rule_ops() -> tuple[str, ...]:
    """The aten ops this module gives a rule to (docs/runtime.md lists them)."""
    return ("aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_flash_attention_for_cpu_backward.default")


def register_validate_rules() -> None:
    """Register the rules above with DTensor, once per process (later calls return at once).

    Only ops DTensor has no strategy for are registered: a torch that ships its own keeps it.
    """
    if _REGISTERED.is_set():
        return
    with _LOCK:
        if _REGISTERED.is_set():
            return
        import torch
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import register_sharding

        aten = torch.ops.aten
        propagator = DTensor._op_dispatcher.sharding_propagator
        known = [getattr(propagator, table, {}) for table in
                 ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")]
        rules = ((aten._scaled_dot_product_flash_attention_for_cpu.default, _sdpa_cpu_forward),
                 (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                  _sdpa_cpu_backward))
        for op, rule in rules:
            if not any(op in table for table in known):
                register_sharding(op)(rule)
        _REGISTERED.set()


NEW_TENSOR_METHODS = frozenset({"new_empty", "new_zeros", "new_ones", "new_full"})
"""``Tensor.new_*`` methods whose result keeps a sharded DTensor's placements in validate mode
(:func:`new_tensor_placed`)."""


def _size_of(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[Any, ...] | None:
    rest = args[1:]
    if name == "new_full":
        rest = rest[:1]
    if "size" in kwargs:
        rest = (kwargs["size"],)
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = tuple(rest[0])
    return tuple(rest) if all(isinstance(s, int) for s in rest) else None


def new_tensor_placed(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.new_empty(size)`` (``new_zeros``, ``new_ones``, ``new_full``) of a sharded DTensor
    ``x``, placed as ``x`` is, where DTensor would hand back a replicated tensor.

    torch 2.13 keeps ``x``'s placements only when ``size`` is ``x``'s shape; any other size
    comes back replicated, so a model that builds a tensor of heads this way and copies its
    head-sharded parts into it (DeepSeek-V2's ``expand_kv``: ``kv.new_empty(*kv.shape[:-1],
    d)``) leaves its attention with replicated keys where production holds this rank's heads.
    The values are a constant or unset, so any placement holds the same global tensor: placed as
    ``x``, each rank allocates its part. Applies where ``size`` has ``x``'s rank and ``x``'s size
    on every sharded dim, ``x`` has no partial placement and no gradient is asked for; returns
    ``NotImplemented`` otherwise (DTensor then does what it does).
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x = args[0] if args else None
    if not isinstance(x, DTensor) or kwargs.get("requires_grad"):
        return NotImplemented
    size = _size_of(args, dict(kwargs), name)
    if size is None or len(size) != x.ndim or tuple(size) == tuple(x.shape):
        return NotImplemented
    sharded = [p for p in x.placements if not isinstance(p, Replicate)]
    if not sharded or not all(type(p) is Shard for p in sharded):
        return NotImplemented  # partial, strided: left to DTensor
    dims = {p.dim % x.ndim for p in sharded if isinstance(p, Shard)}
    if any(size[d] != x.shape[d] for d in dims):
        return NotImplemented
    local_size = [x._local_tensor.shape[d] if d in dims else s for d, s in enumerate(size)]
    extra = {k: v for k, v in kwargs.items() if k != "size"}
    local_x = x._local_tensor
    if name == "new_full":
        fill = args[2] if len(args) > 2 else extra.pop("fill_value")
        local = local_x.new_full(local_size, fill, **extra)
    else:
        local = getattr(local_x, name)(local_size, **extra)
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                              shape=torch.Size(size), stride=stride)


@answers("prepare", "production")
def _nothing_to_prepare(model: nn.Module, plan: Plan) -> None:
    return None  # local kernels run whatever the model runs


@answers("prepare", "validate")
def _prepare_dtensor_kernels(model: nn.Module, plan: Plan) -> None:
    """The rules above, and the model library's refusal of a kernel DTensor cannot run."""
    register_validate_rules()
    refusal = LIBRARY.validate_refusal(model, plan)
    if refusal is not None:
        raise ValidateUnsupportedError(refusal, fqn=refusal.split(":", 1)[0],
                                       op="aten._grouped_mm.default")
