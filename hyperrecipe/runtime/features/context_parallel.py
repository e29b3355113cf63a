"""Context-parallel attention for transformers' attention modules (the built-in inner wrappers).

Under context parallelism (mesh dim ``cp``) every rank holds a contiguous slice of the sequence:
rank ``r`` of ``n`` holds positions ``[r*L, (r+1)*L)`` of a sequence of ``n*L`` (the layout a
``replicate -> shard(1)`` slice makes). Everything but attention is per token; attention needs
every query to see the keys before it, wherever they live. Two ways, both registered here:

- ``cp_allgather_kv``: all-gather K and V along the sequence (backward: reduce-scatter their
  gradients) and attend the local queries to the whole sequence. The causal mask must be
  **offset by the rank's position**: local query ``i`` is global position ``r*L + i`` and may see
  keys ``0 .. r*L + i``. SDPA's ``is_causal`` aligns the mask top-left (query ``i`` sees keys
  ``0 .. i``) whenever ``q_len != kv_len``, which is wrong on every rank but the first, so the
  wrapper builds the mask itself (:func:`causal_mask_for_rank`) and passes it explicitly.
  Memory per rank grows with the full K/V; traffic is one all-gather of K and V per layer.
- ``ulysses`` (DeepSpeed-Ulysses): an all-to-all turns ``[B, H, L, D]`` (local sequence, all
  heads) into ``[B, H/n, n*L, D]`` (whole sequence, a slice of heads), attention runs unmasked
  by CP (``is_causal`` is right again: the sequence is whole), and a second all-to-all turns the
  output back. Needs the local query and key/value head counts divisible by ``n`` — a declared
  requirement, so ``inner_wrapper: [ulysses, cp_allgather_kv]`` falls back where it does not hold.

Both call the attention function the module would have called (transformers' ``sdpa``), with
local tensors, so GQA handling, scaling and dropout stay transformers'. A mask the model built
for the whole sequence may be passed in already sliced to the local query rows (declare
``attention_mask: {cp: shard(2)}`` as the attention boundary's ``in_dst``); it is used as is
(all-gathered back to whole rows for Ulysses). Sliding windows (Mistral's ``sliding_window``
keyword) are applied by the offset mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.models import LIBRARY
from hyperrecipe.runtime.comm.collectives import execute, transition
from hyperrecipe.wrappers import WrapperContext, builtin_wrapper, requirement

__all__ = ["causal_mask_for_rank", "cp_allgather_kv", "ulysses"]

_SEQ = 2  # [batch, heads, seq, head_dim], as transformers hands q/k/v to attention functions


def causal_mask_for_rank(q_len: int, kv_len: int, q_offset: int, *,
                         sliding_window: int | None = None,
                         device: torch.device | None = None) -> Tensor:
    """Boolean ``[q_len, kv_len]`` mask (True = attend) for queries at global positions
    ``q_offset .. q_offset + q_len - 1`` over keys at ``0 .. kv_len - 1``.

    Query ``i`` sees key ``j`` when ``j <= q_offset + i`` and, with a sliding window ``w``,
    ``q_offset + i - j < w`` (transformers' convention: a window of ``w`` keys, itself included).
    """
    q_pos = torch.arange(q_offset, q_offset + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (q_pos - k_pos < sliding_window)
    return allowed


def _gather_op(dim: int) -> tuple[CollectiveOp, CollectiveOp]:
    return (CollectiveOp(kind="all_gather", mesh_dim="cp", gather_dim=dim),
            CollectiveOp(kind="reduce_scatter", mesh_dim="cp", scatter_dim=dim))


def _swap_op(gather: int, scatter: int) -> tuple[CollectiveOp, CollectiveOp]:
    return (CollectiveOp(kind="all_to_all", mesh_dim="cp", gather_dim=gather, scatter_dim=scatter),
            CollectiveOp(kind="all_to_all", mesh_dim="cp", gather_dim=scatter, scatter_dim=gather))


def _check_mask(mask: Tensor, q_len: int, kv_len: int, fqn: str) -> None:
    if mask.shape[-2] != q_len or mask.shape[-1] != kv_len:
        msg = (f"{fqn}: under context parallel the attention mask must cover this rank's "
               f"{q_len} query rows and the whole sequence of {kv_len} keys, found "
               f"{list(mask.shape)}; build it for the whole sequence and declare "
               f"`in_dst: {{attention_mask: {{cp: shard(2)}}}}` on the attention boundary")
        raise PlanMismatchError(msg)


@requirement("sdpa attention")
def _sdpa(ctx: WrapperContext) -> str | None:
    """The wrappers pass SDPA's calling convention (a 4-D boolean mask, ``is_causal=False``);
    another implementation (flash attention's padding masks) would misread it."""
    impl = LIBRARY.attention_implementation(ctx.module)
    return None if impl == "sdpa" else f"attn_implementation is {impl!r}"


@builtin_wrapper("cp_allgather_kv", requires=(_sdpa,))
def cp_allgather_kv(ctx: WrapperContext) -> Any:
    """Context-parallel attention by all-gathering K/V along the sequence (module docstring)."""
    cp = ctx.group("cp")
    fqn = ctx.fqn
    fwd, bwd = _gather_op(_SEQ)

    def attention(original: Any, module: Any, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, *args: Any, **kwargs: Any) -> Any:
        q_len = query.shape[_SEQ]
        key = transition(key, fwd, bwd, cp.group, group_size=cp.size, group_rank=cp.rank)
        value = transition(value, fwd, bwd, cp.group, group_size=cp.size, group_rank=cp.rank)
        kv_len = key.shape[_SEQ]
        if attention_mask is None:
            causal = kwargs.pop("is_causal", None)
            if causal is None:
                causal = getattr(module, "is_causal", True)
            if causal:
                attention_mask = causal_mask_for_rank(
                    q_len, kv_len, cp.rank * q_len, sliding_window=kwargs.get("sliding_window"),
                    device=query.device)[None, None]
        else:
            _check_mask(attention_mask, q_len, kv_len, fqn)
        kwargs["is_causal"] = False  # the mask says it all; is_causal would align top-left
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def _local_heads(module: Any, projection: str) -> int | None:
    proj = getattr(module, projection, None)
    weight = getattr(proj, "weight", None)
    head_dim = getattr(module, "head_dim", None)
    if weight is None or not isinstance(head_dim, int) or head_dim <= 0:
        return None
    from torch.distributed.tensor import DTensor

    rows = (weight.to_local() if isinstance(weight, DTensor) else weight).shape[0]
    return int(rows // head_dim)


@requirement("query and key/value heads divisible by cp")
def _heads_divisible(ctx: WrapperContext) -> str | None:
    n = ctx.group("cp").size
    counts = {p: _local_heads(ctx.module, p) for p in ("q_proj", "k_proj")}
    if None in counts.values():
        return (f"cannot tell the head counts of {type(ctx.module).__name__} (needs q_proj, "
                f"k_proj and head_dim)")
    bad = {p: c for p, c in counts.items() if c is not None and c % n}
    if bad:
        found = ", ".join(f"{p}: {c} local heads" for p, c in bad.items())
        return f"{found}; not divisible by cp={n}"
    return None


@builtin_wrapper("ulysses", requires=(_sdpa, _heads_divisible))
def ulysses(ctx: WrapperContext) -> Any:
    """Context-parallel attention by all-to-all between heads and sequence (module docstring)."""
    cp = ctx.group("cp")
    fqn = ctx.fqn
    to_heads = _swap_op(gather=_SEQ, scatter=1)        # [B, H, L, D] -> [B, H/n, nL, D]
    to_sequence = _swap_op(gather=2, scatter=1)        # out [B, nL, H/n, D] -> [B, L, H, D]
    mask_gather = CollectiveOp(kind="all_gather", mesh_dim="cp", gather_dim=-2)

    def attention(original: Any, module: Any, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, *args: Any, **kwargs: Any) -> Any:
        q_len = query.shape[_SEQ]
        g, n, r = cp.group, cp.size, cp.rank
        query, key, value = (transition(t, *to_heads, g, group_size=n, group_rank=r)
                             for t in (query, key, value))
        if attention_mask is not None:
            _check_mask(attention_mask, q_len, q_len * n, fqn)
            flag = attention_mask.dtype == torch.bool  # gloo gathers no bool tensors
            rows = attention_mask.to(torch.uint8) if flag else attention_mask
            rows = execute(rows.contiguous(), mask_gather, g, group_size=n, group_rank=r)
            attention_mask = rows.bool() if flag else rows
        out, _ = original(module, query, key, value, attention_mask, *args, **kwargs)
        out = transition(out.contiguous(), *to_sequence, g, group_size=n, group_rank=r)
        return out, None  # per-head-slice weights cannot be reassembled; sdpa returns None

    return attention
