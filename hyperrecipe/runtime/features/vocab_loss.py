"""The loss on vocab shards: cross entropy over logits sharded on their last (vocab) dim.

A plan with ``loss_parallel`` (:class:`~hyperrecipe.plan.LossParallel`) lets the ``lm_head``'s
logits leave vocab-sharded instead of all-gathering ``[batch, seq, vocab]`` on every rank. What
lives here:

- :class:`VocabShardedLogits`: the marked local logits every call of that boundary returns
  (rank ``r``'s slice ``[r * V / n, (r + 1) * V / n)`` of the vocab). They refuse every torch
  operation with a :class:`~hyperrecipe.errors.LossParallelError` naming what to do instead, so
  ``F.cross_entropy`` or an ``argmax`` over a vocab slice cannot give a silently wrong result.
- :func:`vocab_parallel_cross_entropy`: ``F.cross_entropy`` over such logits (or over a DTensor
  sharded on its last dim). Production mode runs :class:`_ShardedCrossEntropy` on the local
  shards: one all-gather of three numbers per token forward (each rank's log-sum-exp, target
  logit and logit sum), none backward (the gradient of the local logits is the local softmax
  minus the local part of the target's one-hot). Validate mode runs the same formula as DTensor
  ops, so DTensor's sharding propagation checks it.
- The transformers side (``kind: "model"``): the model's ``loss_function`` is replaced, for the
  installation's lifetime, by :func:`_causal_lm_loss` (transformers' ``ForCausalLMLoss``
  semantics: shift, ``ignore_index``, ``num_items_in_batch``), and the owner's forward gathers
  the logits when no loss ran during the call (no ``labels``: inference, ``generate()``).

Installation goes through the rewriter (:mod:`hyperrecipe.runtime.install` calls
:func:`install_loss_parallel`); nothing here assigns a forward.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import Tensor

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.errors import LossParallelError, PlanMismatchError
from hyperrecipe.models import LIBRARY
from hyperrecipe.plan import LossParallel, Transition
from hyperrecipe.runtime.comm.collectives import MeshDimGroup, execute, group_for, transition
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.rewriter import Rewrite

__all__ = [
    "VocabShard",
    "plain_vocab_slice",
    "VocabShardedLogits",
    "install_loss_parallel",
    "vocab_parallel_cross_entropy",
]

_REDUCTIONS = ("mean", "sum", "none")


@attrs.frozen(kw_only=True, eq=False)
class VocabShard:
    """Where a rank's logits sit in the vocab, and how the loss over them is computed.

    ``dtensor``: compute with DTensor ops (validate mode) rather than the local kernel.
    """

    mesh: DeviceMesh
    mesh_dims: tuple[str, ...]
    mesh_dim: str
    group: MeshDimGroup
    vocab: int
    local_vocab: int
    loss_op: CollectiveOp
    boundary: str
    dtensor: bool

    @property
    def start(self) -> int:
        return self.group.rank * self.local_vocab


_ALLOWED: frozenset[Any] = frozenset(
    [Tensor.size, Tensor.dim, Tensor.__len__, Tensor.numel, Tensor.__hash__, Tensor.__repr__]
    + [getattr(Tensor, name).__get__ for name in ("shape", "dtype", "device", "ndim",
                                                 "requires_grad", "grad_fn", "is_leaf")])
"""What a marked slice still answers: its shape and kind, its identity hash and its printed form;
nothing that computes with its values."""


_SCALED: frozenset[Any] = frozenset([
    Tensor.__mul__, Tensor.__rmul__, Tensor.__truediv__, Tensor.mul, Tensor.div, torch.mul,
    torch.div, Tensor.tanh, torch.tanh, Tensor.float, Tensor.to, Tensor.contiguous])
"""Elementwise operations that keep a marked slice a slice of the same logits when every other
operand is a number (or a 0-dim tensor that takes no gradient): scaling, dividing and ``tanh`` (a final soft-capping,
Gemma 2's ``tanh(logits / cap) * cap``, Cohere's ``logit_scale``, Granite's ``logits_scaling``),
a dtype cast. Their result stays marked, so the loss still runs on the shards."""


def _scalar_operand(value: Any) -> bool:
    if isinstance(value, VocabShardedLogits):
        return True  # the slice itself (checked to be the only one by the caller)
    if isinstance(value, Tensor):
        # a 0-dim tensor that takes a gradient (a learnable logit scale) would get only this
        # rank's vocab share of it, which nothing reduces: not a scalar here, so refused
        return value.dim() == 0 and not value.requires_grad
    return isinstance(value, (bool, int, float, str, torch.dtype, torch.device)) or value is None


def _scaled_slice(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``func`` run on the slice when it is a :data:`_SCALED` op of one marked slice and
    scalars, the result marked as the same slice; ``NotImplemented`` otherwise."""
    if func not in _SCALED:
        return NotImplemented
    operands = (*args, *kwargs.values())
    marked = [v for v in operands if isinstance(v, VocabShardedLogits)]
    if len(marked) != 1 or not all(_scalar_operand(v) for v in operands):
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if not isinstance(out, Tensor) or out.shape != marked[0].shape:
        return NotImplemented
    return mark_vocab_shard(out, marked[0]._hyperrecipe_vocab)


class VocabShardedLogits(Tensor):
    """This rank's slice of the vocab of a ``loss_parallel`` plan's logits.

    Any torch operation on it raises :class:`~hyperrecipe.errors.LossParallelError`: a loss,
    a softmax or an ``argmax`` over a slice of the vocab would be silently wrong. Pass it to
    :func:`hyperrecipe.vocab_parallel_cross_entropy`, or call the model without ``labels`` (a
    transformers model) to get the full logits. Shape queries (``shape``, ``size()``,
    ``dim()``, ``dtype``, ``device``) and printing are allowed, and so are the elementwise
    operations with scalars that keep it a slice of the same logits (:data:`_SCALED`: a final
    logit scaling or soft-capping in the model's own forward); their result stays marked.
    """

    _hyperrecipe_vocab: VocabShard

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "__get__":  # a property: metadata, or a tensor
            with torch._C.DisableTorchFunctionSubclass():
                value = func(*args, **(kwargs or {}))
            if not isinstance(value, Tensor):
                return value  # is_sparse, layout, names, ...: nothing computed from the values
        scaled = _scaled_slice(func, args, kwargs or {})
        if scaled is not NotImplemented:
            return scaled
        shard = _first_shard((*args, *(kwargs or {}).values()))
        name = getattr(func, "__name__", repr(func))
        where = ("" if shard is None else
                 f" of {shard.boundary!r}, which are this rank's slice [{shard.start}, "
                 f"{shard.start + shard.local_vocab}) of the {shard.vocab}-entry vocab")
        if _LOSS_CALLS.get() == []:
            # inside the forward of the model that owns the loss, before any loss ran: the
            # model's own code computes with the logits, with or without labels
            msg = (f"{name}() on the logits{where} (the plan declares loss_parallel), inside the "
                   f"model's forward before its loss: the model computes with its logits between "
                   f"the lm_head and the loss in a way that needs the whole vocab (only scaling, "
                   f"dividing or tanh by scalars and dtype casts stay on the shards, as a final "
                   f"logit soft-capping does), so no call of this model can run with "
                   f"loss_parallel, with labels or without. Drop loss_parallel from the recipe "
                   f"and gather the logits (out_dst: {{0: replicate}}) "
                   f"(docs/training.md#loss-on-vocab-shards)")
            raise LossParallelError(msg)
        msg = (f"{name}() on the logits{where} (the plan declares loss_parallel): compute the "
               f"loss with "
               f"hyperrecipe.vocab_parallel_cross_entropy(logits, labels), or call the model "
               f"without labels to get the full logits (docs/training.md#loss-on-vocab-shards)")
        raise LossParallelError(msg)


def _first_shard(values: Sequence[Any]) -> VocabShard | None:
    """The mark of the first marked slice among ``values`` (lists and tuples searched too)."""
    for v in values:
        if isinstance(v, VocabShardedLogits):
            return v._hyperrecipe_vocab
        if isinstance(v, (list, tuple)):
            found = _first_shard(v)
            if found is not None:
                return found
    return None


def mark_vocab_shard(local: Tensor, shard: VocabShard) -> VocabShardedLogits:
    """``local`` (this rank's logits, still in the autograd graph) marked as a vocab slice."""
    with torch._C.DisableTorchFunctionSubclass():
        marked = local.as_subclass(VocabShardedLogits)
    marked._hyperrecipe_vocab = shard
    return marked


def _unmark(logits: VocabShardedLogits) -> Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return logits.as_subclass(Tensor)


def plain_vocab_slice(value: Any) -> Any:
    """``value`` without the mark when it is a marked vocab slice (for code that knows it holds
    a slice: ``hyperrecipe check`` records the lm_head's output with its ``shard(-1)`` layout
    and reassembles it); anything else as it is."""
    return _unmark(value) if isinstance(value, VocabShardedLogits) else value


# ------------------------------------------------------------------------------ kernels


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of ``[N, V/n]`` local logits (float32 math), one all-gather.

    Forward, each rank computes over its slice: the log-sum-exp (shifted by its own max, so no
    max needs exchanging), the target's logit where it owns the target (0 elsewhere) and, with
    label smoothing, the sum of its logits; one all-gather of these ``[N, 3]`` numbers gives
    every rank the global values. Backward needs no communication: the saved local softmax
    (``exp(x - lse)``), minus ``1 - eps`` at the owned target, minus ``eps / V``.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, shard: VocabShard, ignore_index: int,
                smoothing: float) -> Tensor:
        x = logits.float()
        local_max = x.detach().amax(dim=-1, keepdim=True)
        z = x - local_max  # a new tensor: the input is never modified
        local_target = target - shard.start
        valid = target != ignore_index
        owned = valid & (local_target >= 0) & (local_target < shard.local_vocab)
        index = torch.where(owned, local_target, 0).unsqueeze(-1)
        picked = torch.where(owned, z.gather(-1, index).squeeze(-1) + local_max.squeeze(-1), 0.0)
        total = (z.sum(-1) + local_max.squeeze(-1) * shard.local_vocab if smoothing
                 else torch.zeros_like(picked))
        z.exp_()
        local_lse = z.sum(-1).log() + local_max.squeeze(-1)
        stats = torch.stack((local_lse, picked, total), dim=-1)  # [N, 3]
        g = shard.group
        everyone = execute(stats, shard.loss_op, g.group, group_size=g.size, group_rank=g.rank)
        everyone = everyone.view(*stats.shape[:-1], g.size, 3)
        lse = torch.logsumexp(everyone[..., 0], dim=-1)
        target_logit = everyone[..., 1].sum(-1)
        loss = lse - target_logit
        if smoothing:
            loss = (1.0 - smoothing) * loss + smoothing * (lse - everyone[..., 2].sum(-1)
                                                           / shard.vocab)
        loss = torch.where(valid, loss, 0.0)
        # z holds exp(x - local_max); rescale in place to the softmax exp(x - lse)
        z.mul_(torch.exp(local_max.squeeze(-1) - lse).unsqueeze(-1))
        ctx.save_for_backward(z, index, owned, valid)
        ctx.smoothing = smoothing
        ctx.vocab = shard.vocab
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, index, owned, valid = ctx.saved_tensors
        g = softmax  # modified in place: a second backward through this graph raises
        g.scatter_add_(-1, index, -(1.0 - ctx.smoothing) * owned.to(g.dtype).unsqueeze(-1))
        if ctx.smoothing:
            g.sub_(ctx.smoothing / ctx.vocab)
        # where, not a product: a batch whose every label is ignored has a mean over no
        # token, so grad is inf there, and inf * 0 put NaN in every gradient of the model
        # (one process gives zeros: ignored tokens take no part)
        g.mul_(torch.where(valid, grad, 0.0).unsqueeze(-1))
        return g.to(ctx.input_dtype), None, None, None, None


def _dtensor_cross_entropy(logits: Any, target: Tensor, vocab: int, ignore_index: int,
                           smoothing: float) -> Tensor:
    """The same per-token loss as DTensor ops on ``[N, V]`` logits sharded on dim 1: DTensor
    propagates every placement (a partial max, a partial sum, a masked gather of the target's
    logit), so validate mode checks the formula. Returns a plain ``[N]`` tensor."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = logits.device_mesh
    replicated = [Replicate()] * mesh.ndim

    def plain(t: Tensor) -> Any:
        return DTensor.from_local(t, mesh, replicated, run_check=False)

    x = logits.float()
    z = x - x.detach().amax(dim=-1, keepdim=True)
    lse = z.exp().sum(-1).log()
    valid = target != ignore_index
    index = plain(torch.where(valid, target, 0).unsqueeze(-1))
    picked = z.gather(-1, index).redistribute(mesh, replicated).squeeze(-1)
    loss = lse - picked
    if smoothing:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - z.sum(-1) / vocab)
    full: Tensor = loss.full_tensor()
    return torch.where(valid, full, 0.0)


def _reduce(per_token: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum()  # all ignored: nan, as F.cross_entropy


def _sharded_per_token(logits: Any, target: Tensor, ignore_index: int,
                       smoothing: float) -> Tensor:
    """Per-token loss over vocab-sharded ``[..., V_local]`` logits and ``[...]`` targets."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(logits, VocabShardedLogits):
        shard = logits._hyperrecipe_vocab
        local = _unmark(logits)
        if local.shape[:-1] != target.shape:
            raise LossParallelError(f"vocab_parallel_cross_entropy: logits {tuple(local.shape)} "
                                    f"and target {tuple(target.shape)} disagree (the target has "
                                    f"the logits' shape without the vocab dim)")
        flat = local.reshape(-1, local.shape[-1])
        flat_target = target.reshape(-1).to(flat.device)
        if shard.dtensor:
            placements = [Shard(1) if d == shard.mesh_dim else Replicate()
                          for d in shard.mesh_dims]
            d = DTensor.from_local(flat, shard.mesh, placements, run_check=False,
                                   shape=torch.Size((flat.shape[0], shard.vocab)),
                                   stride=(shard.vocab, 1))
            per = _dtensor_cross_entropy(d, flat_target, shard.vocab, ignore_index, smoothing)
        else:
            per = _ShardedCrossEntropy.apply(  # type: ignore[no-untyped-call]
                flat, flat_target, shard, ignore_index, smoothing)
        return per.view(target.shape)
    if isinstance(logits, DTensor):
        last = logits.ndim - 1
        shards = [p for p in logits.placements if not p.is_replicate()]
        if len(shards) != 1 or not shards[0].is_shard(last):
            raise LossParallelError(f"vocab_parallel_cross_entropy: a DTensor's logits must be "
                                    f"sharded on their last dim over one mesh dim, found "
                                    f"{tuple(logits.placements)}")
        if logits.shape[:-1] != target.shape:
            raise LossParallelError(f"vocab_parallel_cross_entropy: logits "
                                    f"{tuple(logits.shape)} and target {tuple(target.shape)} "
                                    f"disagree")
        if isinstance(target, DTensor):
            target = target.full_tensor()
        flat = logits.reshape(-1, logits.shape[-1])
        per = _dtensor_cross_entropy(flat, target.reshape(-1), logits.shape[-1], ignore_index,
                                     smoothing)
        return per.view(target.shape)
    msg = (f"vocab_parallel_cross_entropy needs vocab-sharded logits (those of a plan that "
           f"declares loss_parallel, or a DTensor sharded on its last dim); found a plain "
           f"{type(logits).__name__} of shape {tuple(logits.shape)}. Full logits take "
           f"torch.nn.functional.cross_entropy")
    raise LossParallelError(msg)


def vocab_parallel_cross_entropy(
    input: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` over logits sharded on the vocab (last) dim, without gathering them.

    ``input`` is what the ``lm_head`` of a plan with ``loss_parallel`` returns (this rank's
    vocab slice, marked as such), or a DTensor sharded on its last dim. Every rank of the mesh
    dim must call it with the same targets: production mode exchanges a few numbers per token
    (one all-gather), validate mode computes with DTensor. The result equals
    ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ...)`` of one process, and
    so does the gradient that reaches the logits.

    Args:
        input: logits ``[..., V / n]`` (the class dim is the last one, unlike
            ``F.cross_entropy``'s dim 1 for more than two dims).
        target: class indices ``[...]`` (the logits' shape without the vocab dim), the same on
            every rank.
        ignore_index: targets with this value add nothing to the loss nor to the mean's count.
        reduction: ``"mean"`` (over targets that are not ignored), ``"sum"`` or ``"none"``
            (the per-token loss, shaped like ``target``).
        label_smoothing: in ``[0, 1)``, as ``F.cross_entropy``.

    Returns:
        The loss, the same on every rank.

    Raises:
        LossParallelError: ``input`` is a plain tensor (full logits take
            ``F.cross_entropy``; a slice of the vocab without its plan cannot be told apart from
            full logits of a smaller vocab), a DTensor not sharded on its last dim alone, shapes
            that disagree, or an unknown reduction or smoothing outside ``[0, 1)``.

    Example::

        plan = hyperrecipe.compile_recipe("recipe.yaml", meta_model, {"tp": 2})
        hyperrecipe.apply(model, plan, mesh)           # the recipe declares loss_parallel
        logits = model(input_ids)                      # this rank's vocab slice
        labels = F.pad(input_ids[:, 1:], (0, 1), value=-100)  # shift the labels, not the logits
        loss = hyperrecipe.vocab_parallel_cross_entropy(logits, labels)
        loss.backward()
    """
    if reduction not in _REDUCTIONS:
        raise LossParallelError(f"vocab_parallel_cross_entropy: reduction must be one of "
                                f"{', '.join(_REDUCTIONS)}, not {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise LossParallelError(f"vocab_parallel_cross_entropy: label_smoothing must be in "
                                f"[0, 1), not {label_smoothing!r}")
    per = _sharded_per_token(input, target, ignore_index, float(label_smoothing))
    valid = target != ignore_index
    return _reduce(per, valid.to(per.device), reduction)


# ------------------------------------------------------------------------------ installing

_LOSS_CALLS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "hyperrecipe_loss_calls", default=None)
"""The losses computed on shards during the current owner forward (``None`` outside one)."""


def _causal_lm_loss(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """transformers' ``ForCausalLMLoss`` on vocab-sharded logits (full logits: ``original``).

    The same steps as transformers: targets are the labels shifted left (padded with
    ``ignore_index``) unless ``shift_labels`` is given; the sum over targets that are not
    ignored is divided by ``num_items_in_batch`` when given (gradient accumulation), otherwise
    by their count. Other keyword arguments are ignored, as transformers ignores them.
    """

    def loss_function(logits: Tensor, labels: Tensor, vocab_size: int,
                      num_items_in_batch: Tensor | int | None = None, ignore_index: int = -100,
                      shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        if not isinstance(logits, VocabShardedLogits):
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        shard = logits._hyperrecipe_vocab
        if vocab_size != shard.vocab:
            msg = (f"the model's loss was called with vocab_size={vocab_size}, but the logits of "
                   f"{shard.boundary!r} span {shard.vocab} entries (the plan's lm_head rows)")
            raise LossParallelError(msg)
        if shift_labels is None:
            padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        per = _sharded_per_token(logits, shift_labels, ignore_index, 0.0)
        total = per.sum()
        if num_items_in_batch is None:
            result = total / (shift_labels != ignore_index).sum()
        else:
            if isinstance(num_items_in_batch, Tensor):
                num_items_in_batch = num_items_in_batch.to(total.device)
            result = total / num_items_in_batch
        calls = _LOSS_CALLS.get()
        if calls is not None:
            calls.append(shard.boundary)
        return result

    return loss_function


def _gather_logits(shard: VocabShard, gather: Sequence[Transition]) -> Callable[[Tensor], Tensor]:
    """The full logits from this rank's marked slice (autograd-aware: backward slices)."""
    g = shard.group

    def full(logits: Tensor) -> Tensor:
        local = _unmark(logits) if isinstance(logits, VocabShardedLogits) else logits
        if shard.dtensor:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placements = [Shard(local.ndim - 1) if d == shard.mesh_dim else Replicate()
                          for d in shard.mesh_dims]
            d = DTensor.from_local(local, shard.mesh, placements, run_check=False)
            out: Tensor = d.redistribute(shard.mesh, [Replicate()] * len(placements)).to_local()
            return out
        for t in gather:
            local = transition(local, t.forward, t.backward, g.group, group_size=g.size,
                               group_rank=g.rank)
        return local

    return full


def _gathered(out: Any, full: Callable[[Tensor], Tensor]) -> Any:
    """``out`` with every marked vocab slice in it replaced by the full logits."""
    if isinstance(out, VocabShardedLogits):
        return full(out)
    if isinstance(out, tuple):
        return type(out)(*(_gathered(v, full) for v in out)) if hasattr(out, "_fields") \
            else tuple(_gathered(v, full) for v in out)
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict
        for key, value in list(out.items()):
            if isinstance(value, VocabShardedLogits):
                out[key] = full(value)
    return out


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` kept out of ``torch.compile`` (with everything it calls): the marked slice is a
    tensor subclass whose every op raises, which Dynamo cannot trace. ``torch.compile(model)``
    of the model that calls the lm_head therefore runs it eagerly; compile its decoder layers
    instead (docs/training.md#loss-on-vocab-shards)."""
    disabled: Callable[..., Any] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    return disabled


def vocab_shard_output(forward: Callable[..., Any], shard: VocabShard) -> Callable[..., Any]:
    """The loss-parallel boundary's forward: its logits (output 0, local on return in both
    modes since the boundary is outermost) come back marked as this rank's vocab slice."""

    def marked(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if isinstance(out, Tensor):
            return mark_vocab_shard(out, shard)
        if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
            return (mark_vocab_shard(out[0], shard), *out[1:])
        return out

    return _eager(marked)


def make_vocab_shard(loss: LossParallel, mesh: DeviceMesh, mesh_dims: tuple[str, ...], *,
                     dtensor: bool) -> VocabShard:
    """What the marked logits of ``loss.boundary`` carry on this rank."""
    return VocabShard(mesh=mesh, mesh_dims=mesh_dims, mesh_dim=loss.mesh_dim,
                      group=group_for(mesh, loss.mesh_dim), vocab=loss.vocab,
                      local_vocab=loss.local_vocab, loss_op=loss.loss_op,
                      boundary=loss.boundary, dtensor=dtensor)


def install_loss_parallel(tx: Rewrite, owner: nn.Module, loss: LossParallel, shard: VocabShard,
                          compute: Callable[..., Any]) -> None:
    """For a ``"model"`` loss: the owner's ``loss_function`` runs on the shards, and its forward
    gathers the logits of a call during which no loss ran (no labels).

    Raises:
        PlanMismatchError: the owner has no transformers ``ForCausalLMLoss`` loss function
            (another loss type, or a model that is not a transformers ``ForCausalLM``).
    """
    where = loss.owner or "<root>"
    seat = LIBRARY.loss_seat(owner)
    if seat is None:
        original = getattr(owner, "loss_function", None)
        found = getattr(original, "__qualname__", None) or type(original).__name__
        expected = LIBRARY.causal_lm_loss_name() or "a model library's causal-LM loss"
        msg = (f"{where} ({type(owner).__name__}) takes labels=, but its loss_function is "
               f"{found}, not {expected}: only a causal-LM cross entropy runs "
               f"on vocab shards. Drop loss_parallel from the recipe (or compute the loss "
               f"yourself from a model whose forward takes no labels, with "
               f"hyperrecipe.vocab_parallel_cross_entropy)")
        raise PlanMismatchError(msg)
    tx.set_attribute(owner, seat.attribute, _causal_lm_loss(seat.function), fqn=where)
    full = _gather_logits(shard, loss.gather)

    def forward(*args: Any, **kwargs: Any) -> Any:
        token = _LOSS_CALLS.set([])
        try:
            out = compute(*args, **kwargs)
            ran = bool(_LOSS_CALLS.get())
        finally:
            _LOSS_CALLS.reset(token)
        return out if ran else _gathered(out, full)

    tx.install_forward(owner, _eager(forward), fqn=where,
                       companions={"_hyperrecipe_loss_parallel": loss})


@answers("vocab_shard", "production")
def _local_vocab_shard(loss: LossParallel, mesh: DeviceMesh,
                       mesh_dims: tuple[str, ...]) -> VocabShard:
    return make_vocab_shard(loss, mesh, mesh_dims, dtensor=False)


@answers("vocab_shard", "validate")
def _dtensor_vocab_shard(loss: LossParallel, mesh: DeviceMesh,
                         mesh_dims: tuple[str, ...]) -> VocabShard:
    return make_vocab_shard(loss, mesh, mesh_dims, dtensor=True)
