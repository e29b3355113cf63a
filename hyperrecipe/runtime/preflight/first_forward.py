"""The first training forward's checks: one hook, one exchange.

Two things must hold on the ranks of each model-parallel group before a step trains on them,
and neither can be checked before there is a batch: they were handed the same batch
(:mod:`.batches`) and they draw the same dropout (:mod:`.randomness`). Both are checked by one
forward pre-hook on the applied model, at its first forward in training mode with gradients
enabled, in one bounded all-gather over the world of a fixed-size row per rank (:data:`ROW_BYTES`:
the generator digest, then up to :data:`SLOTS` inputs, each a name and a 120-bit digest).

Why one exchange over the world rather than one per dim (as the dropout check had): it is one
collective however many model-parallel dims the mesh has, and every rank reads every rank's row,
judges every group of the mesh from the same table and raises the same error, the ranks of a
group that agrees included (they would otherwise enter the step's first collective and wait for
peers that left). It asks what ``apply`` already asks: every rank of the world applied this plan
(its agreement is over the world) and so runs the model's first training forward too.

Not checked: a forward in ``eval()`` or under ``torch.no_grad()`` (nothing trains on it, and it
is not the step's path: evaluation and generation loops pass first), one rank, and a dry run
under torch's fake process group (its peers are imagined). After a pass the hook removes itself,
so nothing is left on the step's path (nor under ``torch.compile``); after a refusal it stays, so
a caller who catches the error and goes on is refused again at the next training forward. A rank
that does not arrive within the installation's ``collective_timeout_s`` makes its peers raise
instead of waiting for the process group's timeout. Installed by ``installation.attach`` in
both modes; ``restore()`` removes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hyperrecipe.errors import BatchMismatchError, PlanMismatchError
from hyperrecipe.runtime.preflight.agreement import current_scope, exchange_rows
from hyperrecipe.runtime.preflight.batches import (
    batch_refusal,
    group_differences,
    input_digests,
    sampler_fix,
)
from hyperrecipe.runtime.preflight.randomness import (
    dropout_settings,
    generator_digest,
    randomness_refusal,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

__all__ = ["ROW_BYTES", "SLOTS", "install_first_forward_checks"]

SLOTS = 16
"""Inputs compared one by one; past this many, the rest (by name) share one slot, ``...``."""
_NAME_WORDS = 3  # 7 bytes a word: the first 21 bytes of an argument's name
_SLOT_WORDS = _NAME_WORDS + 2  # the name, then the 120-bit digest as two 60-bit words
_GENERATOR_WORDS = 2
ROW_BYTES = 8 * (_GENERATOR_WORDS + SLOTS * _SLOT_WORDS)
"""Bytes each rank sends; each receives this many times the world size."""
_LOW = (1 << 60) - 1


def _digest_words(digest: bytes) -> list[int]:
    value = int.from_bytes(digest[:15].ljust(15, b"\0"), "big")
    return [value >> 60, value & _LOW]


def _name_words(name: str) -> list[int]:
    raw = name.encode("utf-8", "replace")[:7 * _NAME_WORDS]
    return [int.from_bytes(raw[i:i + 7], "little") for i in range(0, 7 * _NAME_WORDS, 7)]


def _slots(digests: Mapping[str, bytes]) -> list[int]:
    """``digests`` as :data:`SLOTS` slots of words: inputs whose names agree in their first
    21 bytes, and every input past the first ``SLOTS - 1`` when there are more, share a slot
    (a digest of their names and digests), so no input is left out of the comparison."""
    items = sorted(digests.items())
    keyed: dict[str, list[tuple[str, bytes]]] = {}
    for i, (name, digest) in enumerate(items):
        key = name if len(items) <= SLOTS or i < SLOTS - 1 else "..."
        key = key.encode("utf-8", "replace")[:7 * _NAME_WORDS].decode("utf-8", "ignore")
        keyed.setdefault(key, []).append((name, digest))
    words: list[int] = []
    for key, members in keyed.items():
        if len(members) == 1:
            digest = members[0][1]
        else:
            h = hashlib.sha256()
            for name, member in members:
                h.update(name.encode("utf-8", "replace") + b"\0" + member)
            digest = h.digest()[:15]
        words += [*_name_words(key), *_digest_words(digest)]
    return words + [0] * (SLOTS * _SLOT_WORDS - len(words))


def _read_slots(row: Sequence[int]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    body = row[_GENERATOR_WORDS:]
    for s in range(SLOTS):
        slot = body[s * _SLOT_WORDS:(s + 1) * _SLOT_WORDS]
        raw = b"".join(int(w).to_bytes(7, "little") for w in slot[:_NAME_WORDS]).rstrip(b"\0")
        if raw:
            out[raw.decode("utf-8", "replace")] = (int(slot[-2]), int(slot[-1]))
    return out


def _groups(mesh: DeviceMesh, dims: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Every group along each of ``dims`` as ``(dim, global ranks)``, in mesh order."""
    names = tuple(mesh.mesh_dim_names or ())
    out: list[tuple[str, list[int]]] = []
    for dim in dims:
        i = names.index(dim)
        lines = mesh.mesh.movedim(i, -1).reshape(-1, mesh.mesh.shape[i]).tolist()
        out += [(dim, [int(r) for r in line]) for line in lines]
    return out


def _judge(table: Mapping[int, Sequence[int]], groups: Sequence[tuple[str, list[int]]],
           settings: Sequence[str], fix: str) -> PlanMismatchError | None:
    """The refusal every rank raises for ``table`` (every rank's row), or ``None``."""
    batches: list[tuple[str, Sequence[int], Sequence[tuple[str, str]]]] = []
    draws: list[str] = []
    for dim, ranks in groups:
        differ = group_differences(ranks, [_read_slots(table[r]) for r in ranks])
        if differ:
            batches.append((dim, ranks, differ))
        if settings and len({tuple(table[r][:_GENERATOR_WORDS]) for r in ranks}) > 1:
            draws.append(randomness_refusal(dim, ranks, settings))
    if batches:
        first_dim, first_ranks, first_differ = batches[0]
        msg = batch_refusal(batches, fix) + (f". Also: {draws[0]}" if draws else "")
        return BatchMismatchError(msg, dim=first_dim, ranks=tuple(first_ranks),
                                  inputs=tuple(name for name, _ in first_differ))
    if draws:
        return PlanMismatchError(draws[0])
    return None


def install_first_forward_checks(model: nn.Module, mesh: DeviceMesh,
                                 model_parallel: Sequence[str],
                                 timeout_s: Callable[[], float]) -> RemovableHandle | None:
    """The checks of the module docstring as one forward pre-hook on ``model``, for the mesh
    dims ``model_parallel`` (those of size 1 skipped); ``None`` where there is nothing to check
    (no such dim, one rank, torch's fake process group).

    Args:
        model: the applied model (its own forward's inputs are digested).
        mesh: the mesh it was applied on.
        model_parallel: the plan's model-parallel dims (``Plan.model_parallel_dims``).
        timeout_s: read at the check: how long a rank waits for the others
            (``Installation.collective_timeout_s``).

    Returns:
        The hook's handle (``restore()`` removes it), or ``None``.
    """
    names = tuple(mesh.mesh_dim_names or ())
    dims = [d for d in model_parallel if d in names and mesh.size(names.index(d)) > 1]
    if not dims or not dist.is_initialized() or dist.get_world_size() == 1 \
            or dist.get_backend() == "fake":
        return None
    groups = _groups(mesh, dims)
    fix = sampler_fix(mesh, model_parallel)
    # a pipeline stage's model is applied among its stage's ranks only: the check exchanges
    # among them (the other stages' first forwards wait for this one's output)
    scope = current_scope()

    def check_first_training_forward(module: nn.Module, args: tuple[Any, ...],
                                     kwargs: dict[str, Any]) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        if any(p.is_meta for p in module.parameters()):
            handle.remove()  # the verification step: meta computes, draws and holds nothing
            return
        settings = dropout_settings(module)
        generator = _digest_words(bytes.fromhex(generator_digest(module))) if settings \
            else [0] * _GENERATOR_WORDS
        row = [*generator, *_slots(input_digests(module, args, kwargs))]
        wait = timeout_s()
        try:
            table = exchange_rows(row, "the first training forward's check", wait, scope=scope)
        except PlanMismatchError as exc:
            handle.remove()  # the group may hold an unfinished exchange: nothing to retry
            msg = (f"rank {dist.get_rank()}: not every rank reached the check at the first "
                   f"training forward (the same batch and dropout across each model-parallel "
                   f"group) within {wait:g} s: a rank stopped, hangs, runs other code or starts "
                   f"training later (raise Installation.collective_timeout_s if it is slow on "
                   f"purpose); destroy the process group before reusing it")
            raise PlanMismatchError(msg) from exc
        refusal = _judge(table, groups, settings, fix)
        if refusal is not None:
            raise refusal
        handle.remove()  # once: nothing is left on the step's path

    handle = model.register_forward_pre_hook(check_first_training_forward, with_kwargs=True)
    return handle
