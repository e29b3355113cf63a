"""transformers' MoE load-balancing loss under a plan that sums the router's gradient.

The router loss (``output_router_logits=True``: Mixtral, Qwen2/3-MoE, OLMoE and the other
families whose modeling module defines ``load_balancing_loss_func``) is computed on every rank
from the same replicated router logits of the same tokens, so its gradient is whole on each
rank. A plan that shards the experts over a dim whose ranks see the same tokens makes the
router's *other* gradient partial (it comes through the top-k weights, which multiply this
rank's partial expert outputs), and so sums the router weight's gradient over that dim
(``reduce_grads``, ``recipes/mixtral.yaml``), and the MoE block's input gradient with it. Those
sums count the router loss's whole gradient once per rank: the router loss trained tp times
too strong, with nothing refused (tiny Mixtral at tp=2, the model's own ``labels=`` loss with
``output_router_logits=True``: 6 of 21 gradients off).

So, while the model runs, the loss function's result keeps its value and carries ``1 / n`` of
its gradient, ``n`` the number of ranks over which the plan sums the routers' gradients: the
sums then count it once, whether the model adds it to its ``loss`` or the user adds
``outputs.aux_loss`` to theirs. Nothing changes where the routers' gradients are not summed
(``recipes/mixtral-ep.yaml``: the experts whole on ``ep`` ranks).

Validate mode needs no scaling (DTensor counts a replicated gradient once), but the function
mixes the DTensor router logits with plain tensors of its own, which DTensor refused: there it
runs on the whole logits (``full_tensor``, differentiable), so validate mode computes the
router loss too and checks production's against it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.models import LIBRARY

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.plan import Plan
    from hyperrecipe.rewriter import Rewrite

__all__ = ["install_router_loss_scale", "router_gradient_ranks"]


def router_gradient_ranks(model: nn.Module, plan: Plan,
                          mesh_shape: Mapping[str, int]) -> tuple[int, tuple[str, ...]]:
    """Over how many ranks (and which mesh dims) the plan sums the gradients of the modules
    whose output the model records as router logits (its library's
    :meth:`~hyperrecipe.models.library.ModelLibrary.router_loss`): ``(1, ())`` where it sums
    none or the model records none.

    Raises:
        PlanMismatchError: routers whose gradients are summed over different dims (the router
            loss cannot be scaled for all of them at once).
    """
    router = LIBRARY.router_loss(model)
    if router is None:
        return 1, ()
    router_class = router.router_class
    by_fqn = {p.fqn: p for p in plan.params}
    summed: dict[tuple[str, ...], str] = {}
    for name, module in model.named_modules():
        if not issubclass(type(module), router_class):
            continue
        reduced: set[str] = set()
        for pname, _ in module.named_parameters(recurse=False):
            p = by_fqn.get(f"{name}.{pname}" if name else pname)
            if p is not None:
                reduced.update(op.mesh_dim for op in p.grad_reduce)
        summed.setdefault(tuple(sorted(d for d in reduced if mesh_shape.get(d, 1) > 1)), name)
    if len(summed) > 1:
        shown = "; ".join(f"{fqn}: {list(over) or 'none'}" for over, fqn in summed.items())
        msg = (f"the routers' gradients are summed over different mesh dims ({shown}): the "
               f"router load-balancing loss, whole on every rank, cannot be counted once for "
               f"all of them; give every router the same reduce_grads")
        raise PlanMismatchError(msg)
    over = next(iter(summed), ())
    return math.prod(mesh_shape[d] for d in over), over


def install_router_loss_scale(tx: Rewrite, model: nn.Module, plan: Plan,
                              mesh_shape: Mapping[str, int], *, dtensors: bool = False) -> int:
    """Scale the router loss's gradient by ``1 / n`` while ``model`` runs (module docstring),
    through the rewriter (``restore()`` puts the function back). Returns ``n`` (1: nothing
    scaled). With ``dtensors`` (validate mode) nothing is scaled, DTensor counting whole
    gradients once by itself; the loss computed from DTensor router logits is handed back as
    the plain tensor the model adds to its plain loss (DTensor refused the sum of the two)."""
    n, _ = router_gradient_ranks(model, plan, mesh_shape)
    router = LIBRARY.router_loss(model)
    if router is None or router.namespace is None or (n == 1 and not dtensors):
        return 1
    original = getattr(router.namespace, router.name)
    replacement = _as_plain(original) if dtensors else _counted_once(original, n)
    tx.replace_function_during(model, router.namespace, router.name, replacement,
                               fqn="<model>")
    return 1 if dtensors else n


@functools.cache
def _as_plain(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` on the full router logits: it mixes them with plain tensors of its own
    (``torch.histc`` counts, a zero accumulator), which DTensor refuses."""
    @functools.wraps(original)
    def router_loss(*args: Any, **kwargs: Any) -> Any:
        return original(*map(_plain, args), **{k: _plain(v) for k, v in kwargs.items()})

    return router_loss


def _plain(value: Any) -> Any:
    """``value`` with every DTensor in it (and in its tuples and lists) made whole: a
    replicated one keeps its gradient path (``full_tensor`` is differentiable)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if type(value) in (tuple, list):
        return type(value)(_plain(v) for v in value)
    return value


@functools.cache  # one replacement per (function, n): installations of one plan share it
def _counted_once(original: Callable[..., Any], n: int) -> Callable[..., Any]:
    @functools.wraps(original)
    def router_loss(*args: Any, **kwargs: Any) -> Any:
        loss = original(*args, **kwargs)
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return loss  # no router logits (0), or no gradient to count
        share = loss / n
        return share + (loss - share).detach()  # the value, and 1/n of the gradient

    return router_loss
