"""torch's own ``clip_grad_norm_`` made right on an applied model's shards, or refused by name.

Why this module patches torch: trainers we do not write clip with torch's function (Lightning's
precision plugins, ``accelerator.clip_grad_norm_`` on a model it did not wrap in FSDP, a user's
loop, ``torch.nn.utils.get_total_norm`` for logging). On production shards that norm is each
rank's own (replicated parameters counted in full, sharded ones only in part): the ranks clip
by different coefficients and replicated weights drift apart without an error. No hook on the
model or the optimizer sees that call, so the only seam is torch's module itself:
``torch.nn.utils.clip_grad.clip_grad_norm_`` looks its helper ``_get_total_norm`` up in its
module's globals at every call (torch 2.13), whoever imported it however.

While at least one installation with sharded parameters is alive, that global and its public
alias ``torch.nn.utils.get_total_norm`` are replaced by :func:`_guarded_total_norm`'s. It compares
the identity of every tensor it is given with the live ``.grad`` of each installation's planned
parameters (a dict of a few hundred ids, no device work):

- none is an installation's: torch's own function, unchanged;
- all are one installation's (the whole model or any subset): the true norm of those gradients
  from the plan's layouts (:func:`~hyperrecipe.runtime.grads.grad_norm.total_grad_norm`, a
  collective, the same on every rank), so torch's clipping then scales as one process does;
- anything else (two installations' gradients, or an installation's beside a tensor whose
  layout is unknown): :class:`~hyperrecipe.errors.ShardedGradNormError`, before anything is
  scaled, naming ``inst.clip_grad_norm_``.

Validate mode's gradients are DTensors inside boundaries and plain outside; torch's multi-tensor
scaling refuses that mix, so ``_clip_grads_with_norm_`` (and ``clip_grads_with_norm_``) is
replaced too and scales such a list tensor by tensor (what ``foreach=False`` does).

On a torch without ``_get_total_norm`` (a release that renames it) ``clip_grad_norm_`` itself
is replaced on ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``; a caller that bound it by
name before the first apply (``from torch.nn.utils import clip_grad_norm_`` at import time) is
then not covered.

This module only builds the replacements (each over the function it replaces, which it calls
for gradients that are no installation's); the patches are declared in
:data:`hyperrecipe.process_patches.PROCESS_PATCHES` and assigned there, held by each
installation: the last to go (``restore()``, or its live parameters garbage collected) puts
torch's functions back, unless another library has patched over ours since (then ours stays
in its chain as a pass-through).
``clip_grad_value_`` is elementwise, right on shards, and left alone.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from hyperrecipe.errors import ShardedGradNormError
from hyperrecipe.process_patches import ProcessHold, hold_process_patches
from hyperrecipe.runtime.grads.grad_norm import total_grad_norm

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["GuardHandle", "guard_torch_clipping", "guarded"]

_INSTEAD = ("use inst.clip_grad_norm_(max_norm) (inst.grad_norm() for the norm alone) on each "
            "applied model, which knows every parameter's layout")


class _Owner:
    """One installation, held weakly: its live parameters and its pre-use check (restored,
    gradient buckets lost to ``fully_shard``)."""

    def __init__(self, live: LiveParams, check: Callable[[str], None]) -> None:
        self.live = weakref.ref(live)
        self.check: Callable[[], Callable[[str], None] | None]
        self.check = (weakref.WeakMethod(check) if hasattr(check, "__self__")
                      else (lambda: check))

    def grads(self) -> tuple[LiveParams, dict[int, str]] | None:
        """id of each planned parameter's current gradient → its FQN (``None``: gone)."""
        live = self.live()
        if live is None:
            return None
        out: dict[int, str] = {}
        for p in live.own:
            param = live.modules[p.module]._parameters.get(p.name)
            grad = None if param is None else param.grad
            if grad is not None:
                out[id(grad)] = p.fqn
        return live, out


_OWNERS: dict[int, _Owner] = {}
_HOLDS: dict[int, ProcessHold] = {}
_KEYS = itertools.count()


class GuardHandle:
    """What :func:`guard_torch_clipping` returns: ``remove()`` forgets the installation (and
    puts torch's functions back when it was the last); idempotent."""

    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        _forget(self._key)


def guard_torch_clipping(live: LiveParams, check: Callable[[str], None]) -> GuardHandle:
    """Route torch's gradient norm over ``live``'s gradients to the plan's full norm while
    ``live`` exists (see the module). ``check(what)`` is called before each such norm and may
    raise (an installation restored, or with partial gradients)."""
    key = next(_KEYS)
    _HOLDS[key] = hold_process_patches(_builders())
    _OWNERS[key] = _Owner(live, check)
    weakref.finalize(live, _forget, key)
    return GuardHandle(key)


def guarded() -> bool:
    """Whether torch's functions are replaced now."""
    return bool(_HOLDS)


def _forget(key: int) -> None:
    _OWNERS.pop(key, None)
    hold = _HOLDS.pop(key, None)
    if hold is not None:
        hold.release()


_CLIP_GRAD = "torch.nn.utils.clip_grad"
_UTILS = "torch.nn.utils"


def _builders() -> dict[str, Callable[[Any], Callable[..., Any]]]:
    """Declared patch (``hyperrecipe.process_patches``) -> its replacement's factory, for
    this torch."""
    from torch.nn.utils import clip_grad

    if hasattr(clip_grad, "_get_total_norm"):
        out: dict[str, Callable[[Any], Callable[..., Any]]] = {
            f"{_CLIP_GRAD}:_get_total_norm": _guarded_total_norm,
            f"{_UTILS}:get_total_norm": _guarded_total_norm}
        if hasattr(clip_grad, "_clip_grads_with_norm_"):
            out[f"{_CLIP_GRAD}:_clip_grads_with_norm_"] = _guarded_clip_with_norm
            out[f"{_UTILS}:clip_grads_with_norm_"] = _guarded_clip_with_norm
        return out
    return {f"{_CLIP_GRAD}:clip_grad_norm_": _guarded_clip_grad_norm,
            f"{_UTILS}:clip_grad_norm_": _guarded_clip_grad_norm}


def _describe(t: Tensor) -> str:
    return f"a {type(t).__name__} of shape {list(t.shape)}"


def _owner_of(tensors: list[Tensor]) -> tuple[LiveParams, _Owner, set[int]] | None:
    """The installation whose gradients ``tensors`` are and their ids, ``None`` when none is
    an installation's, or a refusal when they mix in anything else."""
    ids = {id(t) for t in tensors}
    found: list[tuple[LiveParams, _Owner, dict[int, str]]] = []
    for owner in list(_OWNERS.values()):
        got = owner.grads()
        if got is not None and not ids.isdisjoint(got[1]):
            found.append((got[0], owner, got[1]))
    if not found:
        return None
    if len(found) > 1:
        names = [f"{type(live.model).__name__} ({sum(1 for i in ids if i in g)} gradients)"
                 for live, _, g in found]
        msg = (f"torch.nn.utils.clip_grad_norm_ / get_total_norm got the gradients of "
               f"{len(found)} applied models at once ({', '.join(names)}); their norm together "
               f"has no single layout to be computed by. Clip each model on its own: "
               f"{_INSTEAD}")
        raise ShardedGradNormError(msg, foreign=tuple(names))
    live, owner, grads = found[0]
    stray = [t for t in tensors if id(t) not in grads]
    if stray:
        unplanned = {id(q.grad): n for n, q in live.model.named_parameters()
                     if q.grad is not None}
        foreign = tuple(f"the gradient of {unplanned[id(t)]} (not in the plan: added after "
                        f"apply?)" if id(t) in unplanned else _describe(t) for t in stray[:3])
        more = f" and {len(stray) - 3} more" if len(stray) > 3 else ""
        msg = (f"torch.nn.utils.clip_grad_norm_ / get_total_norm got {len(ids & grads.keys())} "
               f"gradients of the applied {type(live.model).__name__} together with "
               f"{', '.join(foreign)}{more}, whose layout on the mesh is unknown, so no norm of "
               f"them is the one a single process computes, and clipping by a norm that differs "
               f"between ranks trains replicated weights apart. {_INSTEAD}; clip any other "
               f"tensors separately")
        raise ShardedGradNormError(msg, foreign=foreign)
    return live, owner, ids


def _true_norm(found: tuple[LiveParams, _Owner, set[int]], norm_type: float,
               error_if_nonfinite: bool, foreach: bool | None) -> Tensor:
    live, owner, ids = found
    check = owner.check()
    if check is not None:
        check("torch.nn.utils.clip_grad_norm_")
    total = total_grad_norm(live, norm_type, foreach, only=ids)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        msg = (f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
               f"non-finite, so it cannot be clipped. To disable this error and scale the "
               f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        raise RuntimeError(msg)
    return total


def _as_list(tensors: Tensor | Iterable[Tensor]) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def _guarded_total_norm(original: Callable[..., Any]) -> Callable[..., Tensor]:
    """``torch.nn.utils.get_total_norm`` over ``original``: the full norm when given an
    installation's gradients (see the module)."""

    def _guarded_total_norm(tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0,
                            error_if_nonfinite: bool = False,
                            foreach: bool | None = None) -> Tensor:
        listed = _as_list(tensors)
        found = _owner_of(listed)
        if found is None:
            return cast(Tensor, original(listed, norm_type, error_if_nonfinite, foreach))
        with torch.no_grad():
            return _true_norm(found, norm_type, error_if_nonfinite, foreach)

    return _guarded_total_norm


def _mixed(grads: list[Tensor]) -> bool:
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(g, DTensor) for g in grads}
    return len(kinds) == 2


def _guarded_clip_with_norm(original: Callable[..., Any]) -> Callable[..., None]:
    """``torch.nn.utils.clip_grads_with_norm_`` over ``original``, tensor by tensor over a
    list mixing DTensor and plain gradients (validate mode), which torch's multi-tensor
    kernels refuse."""

    def _guarded_clip_with_norm(parameters: Tensor | Iterable[Tensor], max_norm: float,
                                total_norm: Tensor, foreach: bool | None = None) -> None:
        listed = _as_list(parameters)
        if foreach is not False and _mixed([p.grad for p in listed if p.grad is not None]):
            foreach = False
        original(listed, max_norm, total_norm, foreach)

    return _guarded_clip_with_norm


def _guarded_clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Tensor]:
    """``torch.nn.utils.clip_grad_norm_`` over ``original``, on a torch without
    ``_get_total_norm``."""

    def _guarded_clip_grad_norm(parameters: Tensor | Iterable[Tensor], max_norm: float,
                                norm_type: float = 2.0, error_if_nonfinite: bool = False,
                                foreach: bool | None = None) -> Tensor:
        listed = _as_list(parameters)
        grads = [p.grad for p in listed if p.grad is not None]
        found = _owner_of(grads)
        if found is None:
            return cast(Tensor, original(listed, max_norm, norm_type, error_if_nonfinite,
                                         foreach))
        with torch.no_grad():
            total = _true_norm(found, norm_type, error_if_nonfinite, foreach)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device))
        return total

    return _guarded_clip_grad_norm
