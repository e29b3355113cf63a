"""The attention kernel the CPU would run, chosen for the meta device too.

On the meta device ``F.scaled_dot_product_attention`` has no fused kernel to choose and takes its
math path (``_safe_softmax`` and matmuls), where the CPU runs
``aten._scaled_dot_product_flash_attention_for_cpu``. Validate mode propagates placements
through whichever ops run, and the two paths are different ops with different DTensor rules: a
step on the meta device would check another attention than the one the user's run computes
(Differential attention's heads came out replicated through the math path). While the
verification step runs, this mode asks torch which kernel it would pick for tensors of the same
shapes, strides and dtypes on the CPU (``torch._fused_sdp_choice``, on empty CPU stand-ins no
bigger than the step's inputs) and, where that is the flash kernel, calls it: it has meta
kernels for forward and backward. Everything else is left to torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CpuAttentionOnMeta"]

_FLASH = 1
"""``torch._fused_sdp_choice``'s answer for the flash kernel (``SDPBackend.FLASH_ATTENTION``)."""


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _stand_in(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _as_on_cpu(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor | None:
    q, k, v, m = (_local(t) for t in (query, key, value, attn_mask))
    if not all(isinstance(t, Tensor) and t.is_meta for t in (q, k, v)):
        return None
    if m is not None and (not isinstance(m, Tensor) or not m.is_meta):
        return None
    if m is not None and m.dtype == torch.bool:  # as sdpa converts it before choosing
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            attn_mask.logical_not(), float("-inf"))
        m = _local(attn_mask)
    choice = torch._fused_sdp_choice(
        _stand_in(q), _stand_in(k), _stand_in(v), None if m is None else _stand_in(m),
        dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != _FLASH:
        return None
    out: Tensor = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return out


class CpuAttentionOnMeta(TorchFunctionMode):
    """Inside: ``F.scaled_dot_product_attention`` on meta tensors runs the kernel the CPU would
    choose for them (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _as_on_cpu(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
