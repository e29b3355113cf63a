"""The built-in inner wrapper ``mha_heads``: ``torch.nn.MultiheadAttention`` run on a rank's heads.

``nn.MultiheadAttention`` cannot be sharded by a recipe's layouts alone: q, k and v live in one
``in_proj_weight`` that is a parameter of the attention itself, and its forward,
``F.multi_head_attention_forward``, checks the input's width against ``embed_dim``, derives the
head size from it, and applies ``out_proj.weight`` and ``out_proj.bias`` itself without calling
``out_proj`` (a boundary on ``out_proj`` would never run). This wrapper replaces that forward
inside the attention's boundary (``hook="forward"``) with the same computation on the rank's
heads:

- ``in_proj_weight`` / ``in_proj_bias`` are sharded ``shard(0, chunks=3)`` over ``tp``, so a rank
  holds whole heads of q, of k and of v (the resolver refuses any other placement: a plain
  ``shard(0)`` would hand one rank q and half of k with no shape error);
- the attention runs on ``num_heads / tp`` heads of the module's own ``head_dim`` (read from the
  module, never from the input's width);
- ``out_proj`` is **called as a module**: it must be a row-wise boundary nested in the
  attention (``style: rowwise``), which all-reduces its partial output and adds its bias once.

Averaged attention weights (the default ``need_weights=True``) come back as each rank's sum over
its heads divided by the global head count: a ``partial`` sum the boundary reduces (declared
``inner_out_src: {1: {tp: partial}}``); per-head weights (``average_attn_weights=False``) come
back zero outside the rank's heads, so their partial sum is the whole tensor. A per-head
``attn_mask`` (``[batch * num_heads, L, S]``) is cut to the rank's heads.

Refused at install time, by name: separate q/k/v weights (``kdim``/``vdim`` different from
``embed_dim``), ``add_bias_kv``, ``add_zero_attn``, and an ``out_proj`` that is no boundary.
The declaration (mesh dim, required placements, nested boundary, output layout) is data in
:data:`hyperrecipe.wrappers.BUILTIN_WRAPPERS`, read by the resolver without importing this
module; nothing here assigns a forward (the inner-wrapper installer hands the callable to the
rewriter).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.rewriter import installed_forward_owner
from hyperrecipe.runtime.features.local_region import with_local_parameters
from hyperrecipe.wrappers import WrapperContext, builtin_wrapper

__all__ = ["mha_heads"]


def _refusal(ctx: WrapperContext, module: nn.Module) -> str | None:
    """Why ``module`` cannot run on a rank's heads here, or ``None``."""
    if not isinstance(module, nn.MultiheadAttention):
        return (f"mha_heads wraps torch.nn.MultiheadAttention, not {type(module).__name__}; "
                f"shard a custom attention with colwise/rowwise rules instead")
    if getattr(module, "in_proj_weight", None) is None:  # kdim/vdim != embed_dim: q/k/v_proj_weight instead
        return (f"kdim={module.kdim} / vdim={module.vdim} differ from embed_dim="
                f"{module.embed_dim}: q, k and v are separate q_proj_weight/k_proj_weight/"
                f"v_proj_weight, which mha_heads does not shard; leave this attention "
                f"replicated (no rule on it) or replace it with nn.Linear projections")
    if module.bias_k is not None or module.bias_v is not None:
        return ("add_bias_kv=True appends one learned key/value over every head, which "
                "mha_heads does not shard; leave this attention replicated")
    if module.add_zero_attn:
        return ("add_zero_attn=True is not supported by mha_heads; leave this attention "
                "replicated")
    if installed_forward_owner(module.out_proj) is None:
        return (f"{ctx.fqn}.out_proj is no boundary: mha_heads calls it as a module and needs "
                f"it row-wise (`match: {ctx.fqn}.out_proj`, `style: rowwise`), so that its "
                f"partial output is reduced and its bias added once")
    return None


def _float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``nn.MultiheadAttention``'s mask convention as an additive mask: ``True`` (bool) means
    *not allowed* (−inf), a float mask is added as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf"))
    return mask.to(dtype)


def mha_on_heads(module: nn.MultiheadAttention, *, tp: int, rank: int) -> Callable[..., Any]:
    """``module``'s forward computed on this rank's ``num_heads / tp`` heads (local tensors in,
    local tensors out; the parameters are read at call time, so the caller may swap them for
    their local views). Same arguments and results as ``nn.MultiheadAttention.forward``."""
    heads, head_dim = module.num_heads, module.head_dim
    if heads % tp:
        msg = f"mha_heads: {heads} heads do not divide over tp={tp}"
        raise PlanMismatchError(msg)
    local_heads = heads // tp
    first = rank * local_heads

    def forward(query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if is_causal and attn_mask is None:  # as F.multi_head_attention_forward refuses it
            msg = ("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                   "module method `generate_square_subsequent_mask` to create this mask.")
            raise RuntimeError(msg)
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not module.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, tgt, _ = query.shape
        src = key.shape[1]
        weight, bias = module.in_proj_weight, module.in_proj_bias
        if weight.shape[0] != 3 * local_heads * head_dim:
            msg = (f"mha_heads: in_proj_weight holds {weight.shape[0]} rows on this rank, not "
                   f"3 x {local_heads} heads x {head_dim}: it must be shard(0, chunks=3) over tp")
            raise PlanMismatchError(msg)
        w_q, w_k, w_v = weight.chunk(3)
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        if query is key and key is value:
            q, k, v = F.linear(query, weight, bias).chunk(3, dim=-1)
        else:
            q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        q = q.reshape(batch, tgt, local_heads, head_dim).transpose(1, 2)
        k = k.reshape(batch, src, local_heads, head_dim).transpose(1, 2)
        v = v.reshape(batch, src, local_heads, head_dim).transpose(1, 2)
        mask: Tensor | None = None
        if attn_mask is not None:
            m = _float_mask(attn_mask, q.dtype)
            if m.dim() == 3:  # [batch * heads, L, S]: this rank's heads
                m = m.reshape(batch, heads, tgt, src)[:, first:first + local_heads]
            mask = m
        if key_padding_mask is not None:
            kp = _float_mask(key_padding_mask, q.dtype).reshape(batch, 1, 1, src)
            mask = kp if mask is None else mask + kp
        dropout = module.dropout if module.training else 0.0
        if need_weights:
            scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            probs = scores.softmax(dim=-1)
            if dropout > 0.0:
                probs = F.dropout(probs, p=dropout)
            attn = probs @ v
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        attn = attn.transpose(1, 2).reshape(batch, tgt, local_heads * head_dim)
        out: Tensor = module.out_proj(attn)  # a row-wise boundary: reduced, bias added once
        if unbatched:
            out = out.squeeze(0)
        elif not module.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:  # this rank's share of the mean over all heads: partial
            weights = probs.sum(dim=1) / heads
        else:  # zero outside this rank's heads: the partial sum is every head
            weights = probs.new_zeros(batch, heads, tgt, src)
            weights = torch.cat([weights[:, :first], probs,
                                 weights[:, first + local_heads:]], dim=1)
        return out, (weights.squeeze(0) if unbatched else weights)

    return forward


@builtin_wrapper("mha_heads")
def mha_heads(ctx: WrapperContext) -> Callable[..., Any]:
    """The ``mha_heads`` inner wrapper's factory (see the module docstring).

    Raises:
        PlanMismatchError: the module is not an ``nn.MultiheadAttention`` this wrapper can
            shard (separate q/k/v weights, ``add_bias_kv``, ``add_zero_attn``), or its
            ``out_proj`` is not a boundary.
    """
    module = ctx.module
    why = _refusal(ctx, module)
    if why is not None:
        raise PlanMismatchError(f"{ctx.fqn}: {why}")
    assert isinstance(module, nn.MultiheadAttention)
    g = ctx.group("tp")
    local = with_local_parameters(module, mha_on_heads(module, tp=g.size, rank=g.rank))

    def wrapper(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        del original  # F.multi_head_attention_forward cannot run on a rank's heads
        return local(*args, **kwargs)

    return wrapper
