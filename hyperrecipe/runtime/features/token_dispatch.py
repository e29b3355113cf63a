"""Expert-parallel token dispatch: each (token, expert) pair travels to its expert's rank and back.

When every rank of the expert-parallel mesh dim ``X`` holds its *own* tokens (``X`` doubling as
data parallel, or after a sequence split), the experts a token is routed to mostly live on other
ranks. :func:`dispatch_forward` is the local kernel of such a region, run on local tensors in
both modes:

1. each of this rank's ``T * k`` routing slots goes to the rank that owns its expert
   (``expert_id // E_local``); slots are sorted by destination and the per-destination counts
   are exchanged (an all-to-all of ``X`` integers), so every rank knows how many rows it will
   receive from each other rank;
2. an all-to-all with those uneven splits moves each slot's hidden state, its routing weight and
   its *local* expert id to the owner;
3. the owner runs the experts module's own class forward on what it received, one expert per
   row (``top_k = 1``), weighted by the routing weight, so transformers' implementation
   (``eager``, ``batched_mm``, ``grouped_mm``) and its numerics stay in charge;
4. a second all-to-all with the splits reversed brings each weighted expert output home, where
   the slots are put back in order and the ``k`` outputs of a token summed in one reduction.

Gradients take the same paths backwards (:class:`_Exchange` is its own dual with the splits
swapped), so hidden states and routing weights get their gradients on the rank that holds them
and each expert's weights get theirs from every token routed to it: nothing is partial
afterwards, and the region's output is this rank's tokens, complete (``out_src {X: shard(0)}``).

Every rank must issue the same backward exchanges in the same order, whatever its tokens: the
hidden states and routing weights travel through *one* autograd node (one backward, its two
exchanges in a fixed order). ``inner`` must reach its inputs even when this rank received no
rows: ``apply`` passes the experts' compute through
:func:`~hyperrecipe.runtime.features.reach.reaching_forward` (transformers' ``eager`` experts return a
tensor that depends on nothing when no expert is hit, and this rank would skip the backward
exchanges its peers wait in).
Traffic per layer is ``2 * T * k`` rows of ``H`` values out and back, against the all-gather
fallback's ``X * T`` rows gathered and reduce-scattered.

Expert ids are integers: they travel without autograd, and the region's recipe should declare
``top_k_index`` as ``no_grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from hyperrecipe.errors import PlanMismatchError

__all__ = ["dispatch_forward"]

Forward = Callable[..., Any]


def _exchange_plain(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def _exchange(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    out: Tensor = _Exchange.apply(x, send, recv, group)  # type: ignore[no-untyped-call]
    return out


class _Exchange(torch.autograd.Function):
    """Rows ``send[i]`` of each input go to rank ``i``; rows ``recv[j]`` arrive from rank
    ``j``. The backward is the same exchange with ``send`` and ``recv`` swapped, input by input
    in a fixed order, so one node carries several tensors without reordering across ranks."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: Any,
                *more: Tensor) -> Any:
        ctx.send, ctx.recv, ctx.group, ctx.many = send, recv, group, bool(more)
        outs = tuple(_exchange_plain(t, send, recv, group) for t in (x, *more))
        return outs if more else outs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> Any:
        back = [_exchange_plain(g, ctx.recv, ctx.send, ctx.group) for g in grads]
        return (back[0], None, None, None, *back[1:])


def _exchange_pair(x: Tensor, y: Tensor, send: list[int], recv: list[int], group: Any
                   ) -> tuple[Tensor, Tensor]:
    a, b = _Exchange.apply(x, send, recv, group, y)  # type: ignore[no-untyped-call]
    return a, b


def dispatch_forward(inner: Forward, *, count: int, group: Any, size: int) -> Forward:
    """``inner`` (the experts' class forward, seeing ``count`` local experts) run where each
    routed token's expert lives (global expert ``e`` lives on rank ``e // count``).

    Args:
        inner: called as ``inner(hidden [N, H], local_ids [N, 1], weights [N, 1])``.
        count: experts per rank.
        group: the expert-parallel mesh dim's process group.
        size: its size.
    """

    def experts_forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                        *args: Any, **kwargs: Any) -> Any:
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        bad = bool(((ids < 0) | (ids >= size * count)).any())
        owner = torch.div(ids, count, rounding_mode="floor").clamp(0, size - 1)
        order = torch.argsort(owner, stable=True)
        token_of_slot = torch.arange(tokens, device=ids.device).repeat_interleave(k)[order]
        send_counts = torch.bincount(owner, minlength=size)
        if bad:  # tell every peer through the counts, so all ranks fail together, none hangs
            send_counts = torch.full_like(send_counts, -1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        if bool((recv_counts < 0).any()):
            msg = (f"expert dispatch: a router chose an expert id outside [0, {size * count}), "
                   f"the {size} x {count} experts of the plan's expert sharding"
                   + (f" (here: {int(ids.min())}..{int(ids.max())})" if bad else
                      " (on another rank)"))
            raise PlanMismatchError(msg)
        send, recv = send_counts.tolist(), recv_counts.tolist()

        rows, weights = _exchange_pair(hidden_states[token_of_slot],
                                       top_k_weights.reshape(-1)[order].unsqueeze(1),
                                       send, recv, group)
        local_ids = _exchange_plain((ids[order] - owner[order] * count).unsqueeze(1), send,
                                    recv, group)
        done = inner(rows, local_ids, weights, *args, **kwargs)
        back = _exchange(done, recv, send, group)
        # slots back in (token, k) order, summed over k in one reduction as transformers'
        # experts do (deterministic, unlike index_add with repeated indices on CUDA)
        slots = back.index_select(0, torch.argsort(order))
        return slots.view(tokens, k, slots.shape[-1]).sum(dim=1).to(hidden_states.dtype)

    return experts_forward
