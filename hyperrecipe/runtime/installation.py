"""What ``apply`` returns: the installed plan's status, full views of a sharded model, restore.

Everything here that produces full tensors gathers shards, so it is a collective: call it on
every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.rewriter import RewriteRecord, Rewritten
from hyperrecipe.runtime.inner import WrapperChoice
from hyperrecipe.runtime.sharding import local_shard

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Installation", "StatusRow"]


@attrs.frozen(kw_only=True)
class StatusRow:
    """One install: which module, what was changed, and where it stands."""

    fqn: str
    what: str
    state: str
    error: str | None = None


class Installation:
    """A plan applied to a model on this rank.

    Attributes:
        mode: ``"production"`` or ``"validate"``.
        plan: the plan that was applied.
    """

    def __init__(self, *, model: nn.Module, plan: Plan, mode: str, rewritten: Rewritten,
                 full_value: Callable[[ParamPlan, Tensor], Tensor], mesh: DeviceMesh,
                 params: Mapping[str, nn.Parameter],
                 wrapper_choices: Sequence[WrapperChoice] = ()) -> None:
        self.model = model
        self.plan = plan
        self.mode = mode
        self.mesh = mesh
        self._rewritten = rewritten
        self._full_value = full_value
        self._params = dict(params)
        self._wrapper_choices = tuple(wrapper_choices)

    def status(self) -> list[StatusRow]:
        """A row per install: fqn, what (``forward``, ``parameter weight``, ``adapter
        marshal``…), state, error. A method adapter's fqn is its target,
        ``pkg.mod:Class.method``; a function adapter has a row per module it is scoped to (fqn:
        the module; what: ``adapter marshal pkg.mod:function``)."""
        adapters = {a.target: a.mode for a in self.plan.adapters}

        def what(r: RewriteRecord) -> str:
            if r.kind == "method" and r.fqn in adapters:
                return f"adapter {adapters[r.fqn]}"
            if r.kind == "function":
                return f"adapter {adapters[r.what]} {r.what}" if r.what in adapters else r.what
            return r.what if r.kind in ("forward", "method") else f"{r.kind} {r.what}"

        rows = [StatusRow(fqn=r.fqn, what=what(r), state=r.state, error=r.error)
                for r in self._rewritten.records]
        rows.extend(StatusRow(fqn=c.fqn, what=f"inner wrapper {c.wrapper}",
                              state=c.state if not self.restored or c.state != "installed"
                              else "restored", error=c.reason)
                    for c in self._wrapper_choices)
        return rows

    def _own(self) -> list[ParamPlan]:
        return [p for p in self.plan.params if p.tied_to is None]

    def full_state_dict(self) -> dict[str, Tensor]:
        """FQN → full tensor for every parameter (tied names included) and buffer."""
        self._check_live()
        full = {p.fqn: self._full_value(p, self._params[p.fqn]) for p in self._own()}
        out: dict[str, Tensor] = {}
        for p in self.plan.params:
            out[p.fqn] = full[p.tied_to or p.fqn]
        for name, buf in self.model.named_buffers():
            out[name] = buf.detach().clone()
        return out

    def full_grads(self) -> dict[str, Tensor]:
        """FQN → full gradient, for parameters that have one (tied names included)."""
        self._check_live()
        grads: dict[str, Tensor] = {}
        for p in self._own():
            g = self._params[p.fqn].grad
            if g is not None:
                grads[p.fqn] = self._full_value(p, g)
        for p in self.plan.params:
            if p.tied_to is not None and p.tied_to in grads:
                grads[p.fqn] = grads[p.tied_to]
        return grads

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy full tensors in; each rank keeps its own shard.

        Raises:
            PlanMismatchError: a parameter is missing or has the wrong shape.
        """
        self._check_live()
        from torch.distributed.tensor import DTensor

        for p in self._own():
            if p.fqn not in state_dict:
                raise PlanMismatchError(f"load_full_state_dict: {p.fqn!r} is missing")
            full = state_dict[p.fqn]
            if tuple(full.shape) != p.shape:
                raise PlanMismatchError(f"load_full_state_dict: {p.fqn!r} has shape "
                                        f"{list(full.shape)}, the model {list(p.shape)}")
            param = self._params[p.fqn]
            target: Any = param.to_local() if isinstance(param, DTensor) else param
            with torch.no_grad():
                if isinstance(param, DTensor) or self.mode == "production":
                    target.copy_(local_shard(full.to(target.device), p.placement, self.mesh,
                                             self.plan.mesh_dims))
                else:
                    target.copy_(full)
        for name, buf in self.model.named_buffers():
            if name in state_dict:
                with torch.no_grad():
                    buf.copy_(state_dict[name])

    def restore(self) -> None:
        """Put the original forwards back and full parameters in place of the shards
        (gathered: call on every rank), and restore rewritten attributes."""
        self._rewritten.restore()

    @property
    def restored(self) -> bool:
        return self._rewritten.restored

    def _check_live(self) -> None:
        if self._rewritten.restored:
            raise PlanMismatchError("this installation was restored; its shards are gone")
