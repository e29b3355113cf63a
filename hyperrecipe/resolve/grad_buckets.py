"""Stage 4b: gradient buckets: the parameters whose gradients a step reduces, grouped so that
one flat collective serves many of them.

A sequence-parallel Llama has two replicated norm weights per layer whose gradients are
partial; reducing them one at a time costs a collective (and its latency) each. As PyTorch's
DDP does, the resolver groups them into buckets: parameters with the same ``grad_reduce`` ops
and dtype, walked in reverse parameter order (the order their gradients roughly become ready
in backward), each bucket closed once it reaches :data:`GRAD_BUCKET_CAP_BYTES` of local
gradient. The runtime flattens a bucket's gradients and runs each op once on the flat tensor
(:mod:`hyperrecipe.runtime.grads.grad_buckets`); the manifest lists one ``param_grad`` entry per
bucket and op, so it still equals what runs. Buckets are numbered in launch order: by the
position of the last gradient each waits for.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.plan import GradBucket, ParamPlan

__all__ = ["GRAD_BUCKET_CAP_BYTES", "dtype_itemsize", "plan_grad_buckets"]

GRAD_BUCKET_CAP_BYTES = 25 * 2**20
"""The size at which a bucket is closed (local gradient bytes): DDP's default ``bucket_cap_mb``."""

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a plan dtype name (``float32``), without importing torch."""
    return _ITEMSIZE.get(dtype.removeprefix("torch."), 4)


def plan_grad_buckets(params: Sequence[ParamPlan], *,
                      cap_bytes: int = GRAD_BUCKET_CAP_BYTES) -> tuple[GradBucket, ...]:
    """The buckets of every parameter with a ``grad_reduce`` (see the module docstring).

    Args:
        params: the plan's parameters, in parameter order (tied aliases reduce nothing).
        cap_bytes: close a bucket once its local gradients reach this many bytes.

    Returns:
        The buckets in launch order, ``index`` 0 first.
    """
    open_: dict[_Key, _Open] = {}
    closed: list[_Open] = []
    for position, p in enumerate(reversed(params)):
        if not p.grad_reduce or p.tied_to is not None:
            continue
        key = (p.grad_reduce, p.dtype)
        bucket = open_.setdefault(key, _Open(key))
        bucket.add(p, position)
        if bucket.size >= cap_bytes:
            closed.append(open_.pop(key))
    closed.extend(open_.values())
    closed.sort(key=lambda b: b.ready_at)
    return tuple(
        GradBucket(index=i, ops=b.key[0], dtype=b.key[1], params=tuple(m.fqn for m in b.members),
                   numel=sum(_numel(m) for m in b.members))
        for i, b in enumerate(closed))


_Key = tuple[tuple[CollectiveOp, ...], str]


class _Open:
    """A bucket being filled: its members, their bytes, the position of the last one."""

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.members: list[ParamPlan] = []
        self.size = 0
        self.ready_at = -1

    def add(self, p: ParamPlan, position: int) -> None:
        self.members.append(p)
        self.size += _numel(p) * _ITEMSIZE.get(p.dtype, 4)
        self.ready_at = position


def _numel(p: ParamPlan) -> int:
    n = 1
    for s in p.local_shape:
        n *= s
    return n
