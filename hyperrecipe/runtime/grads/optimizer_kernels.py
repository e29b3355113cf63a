"""Validate mode's mixed parameters against torch's multi-tensor optimizer kernels.

In validate mode the parameters of every boundary are DTensors, while replicated parameters
outside every boundary (a Llama's RMSNorm weights under ``recipes/llama.yaml``) stay plain
tensors: the model's own code outside the boundaries runs on the plain activations the
outermost boundaries hand back, and a DTensor weight there would meet a plain input (measured:
``aten.mul.Tensor got mixed torch.Tensor and DTensor`` in the first ``input_layernorm``).

torch's optimizers run one kernel over a list of tensors when a param group's ``foreach`` or
``fused`` is set, and ``foreach=None`` resolves to ``foreach=True`` for CUDA tensors. DTensor
refuses such a list when it mixes DTensors and plain tensors, and the error it raises
(``aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor``) names neither the
parameters nor the fix. :func:`install_mixed_kernel_check` registers a global optimizer step
pre-hook, in validate mode only (production mode's parameters are all plain, its steps pay
nothing), that raises :class:`~hyperrecipe.errors.MixedParametersError` before such a step:
it names the kernel, both kinds of parameters and the fix, ``foreach=False``.

``torch.nn.utils.clip_grad_value_`` (whose ``foreach=None`` takes the multi-tensor path on the
CPU too) raises the same DTensor error; nothing we install sees that call
(docs/training.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hyperrecipe.errors import MixedParametersError
from hyperrecipe.runtime.mode import answers

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.state.live_params import LiveParams

__all__ = ["install_mixed_kernel_check", "mixed_kernel_refusal", "multi_tensor_kernel"]


def _is_torch_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is (a subclass of) one of torch's own optimizers, whose ``step``
    reads ``foreach``/``fused`` from its param groups; another class may mean something else."""
    return any(c.__module__.startswith("torch.optim.") and c is not torch.optim.Optimizer
               for c in type(optimizer).__mro__)


def multi_tensor_kernel(group: Mapping[str, Any], params: Sequence[Tensor]) -> str | None:
    """How torch's optimizer runs ``group`` over ``params`` (those with a gradient) when that
    is a multi-tensor kernel: ``"fused=True"``, ``"foreach=True"``, or ``foreach=None`` with
    the device torch's default resolved it for; ``None`` for one tensor at a time.

    The default is torch's own resolution (``_default_to_fused_or_foreach``, as each optimizer's
    functional form calls it when neither flag is given), with Adam's exception for a tensor
    ``lr`` without ``capturable``; where in doubt this answers ``None``, leaving any error to
    torch rather than refusing a step that would run.
    """
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused:
        return "fused=True"
    if foreach:
        return "foreach=True"
    if fused is not None or foreach is not None or "foreach" not in group:
        return None
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - a torch that resolves the default elsewhere
        return None
    _, default = _default_to_fused_or_foreach(list(params),
                                              bool(group.get("differentiable", False)),
                                              use_fused=False)
    if not default or (isinstance(group.get("lr"), Tensor) and not group.get("capturable")):
        return None
    devices = sorted({p.device.type for p in params})
    return f"foreach=None, which torch resolves to foreach=True for {'/'.join(devices)} tensors"


def _shown(names: Sequence[str]) -> str:
    return f"{len(names)}: " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def mixed_kernel_refusal(optimizer: torch.optim.Optimizer, index: int, group: Mapping[str, Any],
                         names: Mapping[int, str]) -> MixedParametersError | None:
    """The error for param group ``index`` of ``optimizer``, or ``None`` when its step runs:
    it holds one of this model's parameters (``names``: id → FQN), a multi-tensor kernel runs
    it, and some list that kernel gets (torch groups by device and dtype) mixes DTensors with
    plain tensors."""
    from torch.distributed.tensor import DTensor

    params = [p for p in group["params"] if p.grad is not None]
    if not any(id(p) in names for p in params):
        return None
    kinds: dict[tuple[torch.device, torch.dtype], set[bool]] = {}
    for p in params:
        kinds.setdefault((p.device, p.dtype), set()).add(isinstance(p, DTensor))
    if not any(len(k) == 2 for k in kinds.values()):
        return None
    kernel = multi_tensor_kernel(group, params)
    if kernel is None:
        return None
    dtensors = tuple(names.get(id(p), "<not this model's>") for p in params
                     if isinstance(p, DTensor))
    plain = tuple(names.get(id(p), "<not this model's>") for p in params
                  if not isinstance(p, DTensor))
    msg = (f"optimizer.step(): {type(optimizer).__name__} param group {index} runs torch's "
           f"multi-tensor kernel ({kernel}) over DTensor and plain parameters together, which "
           f"DTensor refuses. Validate mode holds the parameters of boundaries as DTensors "
           f"({_shown(dtensors)}) and keeps replicated parameters outside every boundary plain "
           f"tensors ({_shown(plain)}). Build the optimizer with foreach=False (and no "
           f"fused=True): validate mode is for checking, not speed; production mode holds plain "
           f"tensors only and runs either kernel (docs/training.md)")
    return MixedParametersError(msg, dtensors=dtensors, plain=plain)


def install_mixed_kernel_check(live: LiveParams) -> list[Any]:
    """Register the validate-mode step pre-hook (see the module docstring); returns its handle
    (``.remove()`` it). It looks at every step, not once per optimizer: a param group's
    ``foreach`` can be changed between steps, and validate mode is not about speed."""
    from hyperrecipe.runtime.state.scoped_hooks import model_scoped_step_pre_hook

    def on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not _is_torch_optimizer(optimizer):
            return
        names = {id(live.param(p)): p.fqn for p in live.own}
        for index, group in enumerate(optimizer.param_groups):
            error = mixed_kernel_refusal(optimizer, index, group, names)
            if error is not None:
                raise error

    return [model_scoped_step_pre_hook(live.model, on_step)]


@answers("install_optimizer_checks", "production")
def _no_optimizer_checks(live: LiveParams) -> list[Any]:
    return []


answers("install_optimizer_checks", "validate")(install_mixed_kernel_check)
