"""What a validate-mode boundary's compute runs under, and who gets local tensors back.

**Plain tensors the model makes itself.** In validate mode a boundary's compute runs on DTensors,
and DTensor refuses an op that mixes a DTensor with a plain tensor. Model code makes plain
tensors of its own inside a boundary, and one pattern is in every default forward of a
generative model: a KV cache starts empty and grows by concatenation. transformers'
``DynamicLayer`` (and its sliding-window variant) starts as ``torch.tensor([])`` and runs
``torch.cat([self.keys, key_states], dim=-2)``; ``torch.cat`` skips such a *legacy empty* tensor
(1-D, no elements) whatever the others' shapes, DTensor has no such rule and refuses the mix.
:func:`validate_compute` runs the compute under a torch-function mode that drops legacy empty
plain tensors from a concatenation that also has a DTensor — exactly what ``torch.cat`` does
with them — so the cache holds DTensors from the first token on (their global meaning, heads
sharded as the boundary computed them) and every later step concatenates DTensors. A plain
tensor that broadcasts over every dim the DTensors beside it are sharded on (a causal mask
``[1, 1, q, kv]`` beside a head-sharded position bias) is the same whole or local, and becomes a
replicated DTensor when DTensor refuses the mix
(:mod:`~hyperrecipe.runtime.forward.plain_tensors`). Any other plain tensor meeting a DTensor is
still refused: treating it as replicated (DTensor's ``implicit_replication``) would also accept a
rank's local piece as a whole tensor, silently.

**Fused projections.** The same mode splits a chunk-sharded DTensor (``_StridedShard``: the
output of a fused q/k/v or gate/up projection) on its chunk boundaries locally, each part a
``Shard(d)`` DTensor, where DTensor itself would gather it, and runs a linear layer whose weight
is held in unequal parts part by part (:mod:`~hyperrecipe.runtime.comm.strided`).

**Ops DTensor cannot shard.** DTensor's own error for an op it has no rule for (or whose rule
refuses the inputs) names the aten op and nothing else. :func:`validate_compute` raises it again
as :class:`~hyperrecipe.errors.ValidateUnsupportedError` naming the boundary and the way out
(a local region or a function adapter); the innermost boundary names it, an enclosing one lets
it through. The ops torch lacks a rule for that real models run by default (CPU SDPA) get one
from :mod:`~hyperrecipe.runtime.comm.dtensor_rules` instead.

**Local code calling a boundary.** Inner wrappers with ``hook="forward"`` and local regions run
their module's code on local tensors (:mod:`~hyperrecipe.runtime.forward.marshal`). A boundary nested in
such a module is called *from local code*: it must hand local tensors back, as the outermost
boundary does. :func:`running_local_code` marks the local call (a context variable, so it holds
per thread and per task), :func:`validate_compute` clears the mark for the boundary's own compute
(it runs on DTensors again), and :func:`caller_is_local` tells the output converter which case
it is in.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hyperrecipe.errors import HyperrecipeError, ValidateShardingError, ValidateUnsupportedError
from hyperrecipe.runtime.comm.dtensor_rules import NEW_TENSOR_METHODS, new_tensor_placed
from hyperrecipe.runtime.comm.strided import (
    SPLITS,
    elementwise_by_parts,
    linear_by_parts,
    split_strided,
)
from hyperrecipe.runtime.forward.plain_tensors import (
    MIXED_TENSORS,
    explicit_causal_mask,
    plain_operands,
    replicate_broadcast_plain,
)
from hyperrecipe.runtime.forward.unwrapped_params import refuse_unwrapped_param

__all__ = ["caller_is_local", "refuse_unsupported_op", "running_local_code", "validate_compute"]

Forward = Callable[..., Any]

_NO_STRATEGY = re.compile(r"Operator (\S+) does not have a sharding strategy")
_PROPAGATION_FAILED = re.compile(r"Sharding propagation failed for (aten\.[\w.]+)\(")
_CONCATENATIONS = frozenset({torch.cat, torch.concat, torch.concatenate})
_LOCAL_CODE: contextvars.ContextVar[bool] = contextvars.ContextVar("hyperrecipe_local_code",
                                                                   default=False)
_SCOPED: contextvars.ContextVar[bool] = contextvars.ContextVar("hyperrecipe_validate_scope",
                                                              default=False)


def _is_tensor_method(func: Any) -> bool:
    return getattr(torch.Tensor, getattr(func, "__name__", ""), None) is func


def _legacy_empty(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim == 1 and t.numel() == 0


class _ValidateComputeMode(TorchFunctionMode):
    """``torch.cat`` of DTensors and legacy empty plain tensors: the empty ones dropped; a split
    of a chunk-sharded DTensor on its chunk boundaries: done locally; a plain operand that is a
    sharded parameter's unwrapped shard: refused naming ``fqn``, the boundary
    (:mod:`~hyperrecipe.runtime.forward.unwrapped_params`)."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in SPLITS:
            parts = split_strided(func, args, kwargs)
            if parts is not NotImplemented:
                return parts
        elif getattr(func, "__name__", None) in NEW_TENSOR_METHODS and _is_tensor_method(func):
            placed = new_tensor_placed(func.__name__, tuple(args), kwargs)
            if placed is not NotImplemented:
                return placed
        elif func is torch.nn.functional.linear and len(args) >= 2:
            out = linear_by_parts(args, kwargs)
            if out is not NotImplemented:
                return out
        elif args and isinstance(args[0], torch.Tensor):
            out = elementwise_by_parts(func, args, kwargs)
            if out is not NotImplemented:
                return out
        tensors = args[0] if args else kwargs.get("tensors")
        if func in _CONCATENATIONS and isinstance(tensors, (list, tuple)):
            from torch.distributed.tensor import DTensor

            if any(isinstance(t, DTensor) for t in tensors):
                kept = [t for t in tensors if isinstance(t, DTensor) or not _legacy_empty(t)]
                if len(kept) == 1 and len(tensors) > 1 and "out" not in kwargs:
                    # what is left is the result: a copy, placed as it is (DTensor's cat would
                    # gather a dim sharded along the concatenation, a sequence split on cp)
                    return kept[0].clone()
                if len(kept) != len(tensors):
                    if args:
                        args = (kept, *args[1:])
                    else:
                        kwargs["tensors"] = kept
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if MIXED_TENSORS not in str(exc):
                raise
            refuse_unwrapped_param(func, plain_operands(args, kwargs), self.fqn)
            converted = (replicate_broadcast_plain(args, kwargs)
                         or explicit_causal_mask(func, args, kwargs))
            if converted is None:
                raise
        return func(*converted[0], **converted[1])


def _data_dependent(exc: BaseException | None) -> bool:
    """Whether DTensor failed because the op's output shape depends on the data (``nonzero``,
    boolean-mask indexing): no placement can describe it, whatever the inputs."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return isinstance(exc, (DynamicOutputShapeException, DataDependentOutputException))


def refuse_unsupported_op(exc: RuntimeError, fqn: str, *, backward: bool = False) -> None:
    """DTensor's bare "does not have a sharding strategy" / "Sharding propagation failed"
    errors, raised again naming the boundary: an op DTensor cannot shard at all as
    :class:`~hyperrecipe.errors.ValidateUnsupportedError` with the way out, inputs its rule
    refuses as :class:`~hyperrecipe.errors.ValidateShardingError`; any other error is left
    alone. ``backward``: the op ran in the backward of the boundary's compute
    (:mod:`~hyperrecipe.runtime.forward.backward_scope`)."""
    if isinstance(exc, HyperrecipeError):
        return  # a nested boundary's refusal already names its module
    text = str(exc)
    found = _NO_STRATEGY.search(text) or _PROPAGATION_FAILED.search(text)
    if found is None:
        return
    op = found.group(1)
    version = f"DTensor (torch {torch.__version__})"
    here = "in the backward of this boundary's compute" if backward else "here"
    if found.re is _NO_STRATEGY or _data_dependent(exc.__cause__):
        why = ("has no sharding rule for it" if found.re is _NO_STRATEGY
               else "cannot shard it: its output's shape depends on the data")
        msg = (f"{fqn}: validate mode cannot run {op} {here}: {version} {why}. To check this "
               f"boundary in validate mode, run the code that calls it on local tensors: mark "
               f"the boundary `local_region: true` (its compute then sees this rank's shards, "
               f"with its head counts divided), or give the function that calls it a function "
               f"adapter (`adapters: [{{target: pkg.mod:function, mode: marshal, within: "
               f"{fqn}}}]`, docs/adapters.md). Production mode needs no DTensor rule")
        raise ValidateUnsupportedError(msg, fqn=fqn, op=op) from exc
    cause = str(exc.__cause__ or "").strip().splitlines()
    detail = f": {cause[0]}" if cause else ""
    stage = " (in backward)" if backward else ""
    msg = (f"{fqn}: {version} refused {op}{stage} on these inputs in validate mode{detail}. The "
           f"module computed a shape that does not fit the DTensors it was given (a count or "
           f"size that should be divided, or was divided twice), or DTensor's rule for {op} "
           f"does not accept these placements")
    raise ValidateShardingError(msg, fqn=fqn, op=op) from exc


def validate_compute(compute: Forward, fqn: str = "<compute>") -> Forward:
    """``compute`` run as a validate-mode boundary's compute: DTensor code (not local code, even
    when the boundary was called from local code) in which a concatenation drops legacy empty
    plain tensors next to DTensors and a chunk-sharded DTensor splits into its parts locally.
    An op DTensor has no rule for is refused naming ``fqn`` (the boundary), not with DTensor's
    bare error."""

    def run(*args: Any, **kwargs: Any) -> Any:
        local = _LOCAL_CODE.set(False)
        try:
            if _SCOPED.get():
                return compute(*args, **kwargs)
            scoped = _SCOPED.set(True)
            try:
                with _ValidateComputeMode(fqn):
                    return compute(*args, **kwargs)
            finally:
                _SCOPED.reset(scoped)
        except RuntimeError as exc:  # NotImplementedError is one
            refuse_unsupported_op(exc, fqn)
            raise
        finally:
            _LOCAL_CODE.reset(local)

    return run


@contextlib.contextmanager
def running_local_code() -> Iterator[None]:
    """Marks the enclosed call as local code (an inner wrapper's or a local region's)."""
    token = _LOCAL_CODE.set(True)
    try:
        yield
    finally:
        _LOCAL_CODE.reset(token)


def caller_is_local() -> bool:
    """Whether the boundary being called was called from local code (validate mode)."""
    return _LOCAL_CODE.get()
