"""That the ranks of a model-parallel group are handed the same batch.

The ranks along a dim the plan splits the model over (``tp``, ``cp``, ``ep``:
:attr:`~hyperrecipe.plan.Plan.model_parallel_dims`) hold one model replica between them and
must compute on the same inputs. The usual torchrun data pattern, a ``DistributedSampler`` over
the whole world, hands them different batches instead: each rank's shards then compute on other
data, the ranks report different losses and every gradient is silently wrong, in both modes
(validate mode's DTensors marked ``Replicate`` hold whatever each rank was handed). Ranks that
differ only over the data dims (the mesh dims the plan splits nothing over: ``dp``, ``fsdp``)
should see different batches and are not compared.

Context parallelism is no exception here. No rule can match the root module, so the plan never
declares a layout for the model's own inputs: they arrive as the caller hands them, and every
shipped cp recipe expects the whole sequence on every cp rank and slices it itself (where it
enters the first decoder layer, ``recipes/llama-cp.yaml``, after the model derived positions and
the causal mask from the whole sequence). Feeding each cp rank its own shard of the sequence
would be wrong under these plans, so the cp ranks are compared like the tp ranks.

This module digests the inputs and judges a table of every rank's digests; the hook and the one
exchange it shares with the dropout check are :mod:`.first_forward`'s.

What is digested: every tensor among the root forward's arguments and keywords (``input_ids``,
``labels``, ``attention_mask``, ``pixel_values``, tensors nested in lists, tuples and dicts),
one digest per argument: the first 120 bits of a SHA-256 of its dtype, shape and bytes (not
BLAKE2b: with the CPU's SHA instructions SHA-256 hashed a 2.4 MB sample 3x faster here).
Tensors of up to :data:`WHOLE_ELEMENTS` elements are hashed whole, so no difference at all is
missed (a language-model batch of 8 x 4096 token ids is 32 K elements); a larger one is hashed
over an evenly strided sample of at most that many elements (every k-th element of the
flattened tensor). Different samples of a dataset differ almost everywhere, so a sample of a
million positions cannot miss them in practice; what it can miss is a difference confined to
the unsampled positions of a huge tensor, which is not what a wrong sampler produces, and the
values of a tensor whose bytes torch will not hand out (a subclass without storage): of it only
the dtype is compared (a nested tensor is compared component by component). Sums and other reductions were not used: a permutation of the same rows
(one sampler's order against another's) has the same sums, and floating-point sums can differ
by reduction order.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["WHOLE_ELEMENTS", "batch_refusal", "group_differences", "input_digests", "sampler_fix"]

WHOLE_ELEMENTS = 1 << 20
"""Tensors with at most this many elements are hashed whole; larger ones over a strided sample
of this many."""

_DIGEST_BYTES = 15  # 120 bits: two 60-bit words of the exchange


def _argument_names(module: nn.Module, count: int) -> list[str]:
    """The names of the first ``count`` positional arguments of ``module.forward``
    (``args[i]`` past its named parameters, as under ``*args``)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    named = [p.name for p in params
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return [named[i] if i < len(named) else f"args[{i}]" for i in range(count)]


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for key in sorted(value, key=str) for t in _tensors_in(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _update(h: Any, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s dtype, shape and (sampled) bytes to ``h``: the bytes as they are in
    memory, so equal digests mean bit-equal values, whatever the dtype."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor argument
    h.update(f"{local.dtype}|".encode())
    if getattr(local, "is_nested", False):  # ragged: its components one by one
        for part in local.unbind():
            _update(h, part)
        return
    try:
        h.update(f"{tuple(local.shape)}|".encode())
        if local.device.type == "meta":  # nothing to read (a dry run is not checked anyway)
            return
        flat = local.detach()
        if flat.layout != torch.strided:
            flat = flat.to_dense()
        flat = flat.reshape(-1)
        n = flat.numel()
        if n > WHOLE_ELEMENTS:
            flat = flat[::-(-n // WHOLE_ELEMENTS)]
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy())  # no copy into bytes
    except (RuntimeError, TypeError, ValueError) as exc:
        # A tensor whose bytes or sizes torch will not hand out (a subclass): only what was
        # fed before is compared. Raising here instead would leave this rank out of the
        # exchange and its peers waiting for it.
        h.update(f"unreadable {type(exc).__name__}".encode())


def input_digests(module: nn.Module, args: Sequence[Any],
                  kwargs: Mapping[str, Any]) -> dict[str, bytes]:
    """``{argument name: 15-byte digest}`` for every argument of ``module``'s call that holds a
    tensor (positional arguments named by ``module.forward``'s signature), as the module
    docstring describes."""
    named = [*zip(_argument_names(module, len(args)), args, strict=True), *kwargs.items()]
    out: dict[str, bytes] = {}
    with torch.no_grad():
        for name, value in named:
            tensors = _tensors_in(value)
            if not tensors:
                continue
            h = hashlib.sha256()
            for tensor in tensors:
                _update(h, tensor)
            out[name] = h.digest()[:_DIGEST_BYTES]
    return out


def sampler_fix(mesh: DeviceMesh, model_parallel: Sequence[str]) -> str:
    """What to do instead, for this mesh: a sampler over the data dim's rank and size."""
    names = tuple(mesh.mesh_dim_names or ())
    data = [d for d in names if d not in model_parallel and mesh.size(names.index(d)) > 1]
    helper = ("the trainer integrations (hyperrecipe.trainers: the Hugging Face Trainer, "
              "accelerate, Lightning, torchtitan) split batches this way")
    if not data:
        return (f"every rank of this mesh belongs to one model replica, so every rank must be "
                f"handed the same batch: use no DistributedSampler over the world (or "
                f"DistributedSampler(dataset, num_replicas=1, rank=0)), the same shuffle seed "
                f"on every rank; {helper}")
    if len(data) == 1:
        (dim,) = data
        size = mesh.size(names.index(dim))
        return (f"split batches over the data dim {dim!r} only: "
                f"DistributedSampler(dataset, num_replicas=mesh[{dim!r}].size() (= {size}), "
                f"rank=mesh.get_local_rank({dim!r})), the same shuffle seed on every rank, "
                f"instead of a sampler over the world; {helper}")
    return (f"split batches over the data dims {data} only, as one: flatten them "
            f"(flat = mesh[{tuple(data)}]._flatten('dp')) and use DistributedSampler(dataset, "
            f"num_replicas=flat.size(), rank=flat.get_local_rank()), the same shuffle seed on "
            f"every rank; {helper}")


def group_differences(ranks: Sequence[int],
                      seen: Sequence[Mapping[str, object]]) -> list[tuple[str, str]]:
    """``(input name, what differs)`` for each input on which the ranks ``ranks`` (global, one
    group along a model-parallel dim) disagree, given each rank's ``{input name: digest}`` in
    ``seen`` (same order); empty when they agree."""
    out: list[tuple[str, str]] = []
    for name in sorted({name for row in seen for name in row}):
        holders = [r for r, row in zip(ranks, seen, strict=True) if name in row]
        if len(holders) < len(ranks):
            out.append((name, f"{name!r} is passed on rank(s) {holders} only"))
            continue
        classes: dict[object, list[int]] = {}
        for r, row in zip(ranks, seen, strict=True):
            classes.setdefault(row[name], []).append(r)
        if len(classes) > 1:
            split = " vs ".join(str(group) for group in classes.values())
            out.append((name, f"{name!r} differs (ranks {split})"))
    return out


def batch_refusal(found: Sequence[tuple[str, Sequence[int], Sequence[tuple[str, str]]]],
                  fix: str) -> str:
    """The message for the groups in ``found`` (``(mesh dim, ranks, group_differences)``, at
    least one, in mesh order): the first in full, the others by their ranks and inputs, then
    why it is refused and ``fix``."""
    (dim, ranks, differ), *more = found
    msg = (f"the ranks {list(ranks)} of mesh dim {dim!r} were handed different inputs at the "
           f"first training forward: {'; '.join(detail for _, detail in differ)}")
    if more:
        others = ", ".join(f"ranks {list(r)} of {d!r} ({', '.join(repr(n) for n, _ in diff)})"
                           for d, r, diff in more)
        msg += f"; so were {others}"
    return (f"{msg}. The ranks along a model-parallel dim hold one model replica between them "
            f"and must see the same batch: with different ones each rank's shards compute on "
            f"other data, the ranks' losses differ and every gradient is silently wrong. "
            f"Fix: {fix}")
