"""One training step of one rank in one mode, on the meta device under the fake process group.

The caller provides the mesh (:mod:`~hyperrecipe.verify.isolate`): ``apply`` allocates
nothing there (a meta-built model's shards stay on the meta device), and collectives on meta
tensors return at once.

The step is the one a trainer runs: ``model.train()``, forward with the model's own defaults,
the model's own loss where it has one (a causal LM given ``labels``), else ``check``'s (mean
of squares of the first output), then backward. A forward pre-hook on every module keeps the
stack of modules running, so a raw torch error names the module it came from.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hyperrecipe.verify.sample import Sample, loss_of, make_sample
from hyperrecipe.plan import Plan
from hyperrecipe.verify.attention import CpuAttentionOnMeta
from hyperrecipe.verify.findings import Failure, is_project_error, named_in
from hyperrecipe.verify.known_zeros import KnownZerosOnMeta
from hyperrecipe.verify.trace import StepTrace

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["float_grouped_experts", "meta_copy", "run_reference", "run_step", "step_sample", "uses_own_loss"]

_OWN_LOSS_CLASSES = ("ForCausalLM", "LMHeadModel")


def float_grouped_experts(model: nn.Module) -> bool:
    """Whether ``model`` runs fused experts through ``grouped_mm`` in a dtype other than bf16:
    ``aten._grouped_mm``'s meta kernel accepts bf16 only, so on fake tensors the step runs
    them through ``batched_mm`` (the same shapes, one op per expert) instead."""
    config = getattr(model, "config", None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return (getattr(config, "_experts_implementation", None) == "grouped_mm"
            and dtype != torch.bfloat16 and callable(getattr(model, "set_experts_implementation",
                                                             None)))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: free for a
    meta-built model, and no copy of the values of a real one (fused experts switched to a
    kernel fake tensors can run, :func:`float_grouped_experts`)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = (nn.Parameter(empty, requires_grad=t.requires_grad)
                       if isinstance(t, nn.Parameter) else empty)
    copied = copy.deepcopy(model, memo)
    if float_grouped_experts(copied):
        copied.set_experts_implementation("batched_mm")  # type: ignore[operator]
    return copied


def step_sample(model: nn.Module, plan: Plan, inputs: str | None) -> Sample:
    """The batch of the step: ``check``'s sample (token ids, pixel values, or the user's
    ``inputs`` function): as many rows as the ranks that split the model (at least two), of
    twice that many tokens (at least four: short, so a model's own length limit is not
    reached), on meta.

    Raises:
        ModelSpecError: no sample can be made for this model without ``inputs``.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = (f"hf:{model_type}" if isinstance(model_type, str)
            and hasattr(model, "main_input_name") else type(model).__name__)
    split = math.prod(plan.mesh_shape[d] for d in plan.model_parallel_dims)
    seq = max(4, 2 * split)  # a sequence shard per rank, twice (context parallel's halves)
    # rows too, one per rank at least: tokens flattened over the batch and sharded unflatten
    # back evenly only when every dim divides (DTensor refuses uneven unflattening)
    batch = max(2, split)
    return make_sample(model, spec, batch=batch, seq=seq, seed=0, inputs=inputs).to(
        torch.device("meta"))


def uses_own_loss(model: nn.Module, sample: Sample) -> bool:
    """A causal LM fed token ids computes its own loss from ``labels=`` (the loss on vocab
    shards of a ``loss_parallel`` plan included), as its trainer does."""
    accepted = inspect.signature(model.forward).parameters
    return ("labels" in accepted and "input_ids" in sample.kwargs
            and "labels" not in sample.kwargs
            and type(model).__name__.endswith(_OWN_LOSS_CLASSES))


class _Running:
    """The modules whose forward is running, innermost last; a failing forward leaves its
    module on top (no post-hook runs)."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for fqn, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(fqn)))
            self.handles.append(module.register_forward_hook(self._leave(fqn)))

    def _enter(self, fqn: str) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            self.stack.append(fqn)
        return hook

    def _leave(self, fqn: str) -> Any:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            if self.stack and self.stack[-1] == fqn:
                self.stack.pop()
        return hook

    def innermost(self) -> tuple[str, ...]:
        return tuple(reversed(self.stack))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _failure(mode: str, phase: str, exc: BaseException, plan: Plan | None, modules: tuple[str, ...],
             known: set[str]) -> Failure:
    return Failure(mode=mode, phase=phase, error_type=type(exc).__name__,
                   message=str(exc).strip().splitlines()[0][:2000] if str(exc).strip()
                   else type(exc).__name__,
                   modules=modules, named=named_in(exc, plan, known),
                   project_error=is_project_error(exc), error=exc)


def _loss(model: nn.Module, plan: Plan | None, sample: Sample, own: bool, out: Any) -> Tensor:
    """The loss a trainer computes: the model's own; on a ``loss_parallel`` plan whose caller
    computes it, ``vocab_parallel_cross_entropy`` of the sharded logits against the token
    ids; else ``check``'s."""
    given = getattr(out, "loss", None) if own else None
    if isinstance(given, Tensor):
        return given
    helper = plan is not None and plan.loss_parallel is not None and (
        plan.loss_parallel.kind == "helper")
    ids = sample.kwargs.get("input_ids", sample.args[0] if sample.args else None)
    if helper and isinstance(ids, Tensor):
        from hyperrecipe.verify.sample import first_output
        from hyperrecipe.runtime import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(first_output(out), ids)
    return loss_of(out)


def _train_step(model: nn.Module, plan: Plan | None, sample: Sample, mode: str,
                running: _Running, trace: StepTrace | None = None) -> Failure | None:
    known = {fqn for fqn, _ in model.named_modules()}
    phase = "forward"
    try:
        model.train()
        kwargs = dict(sample.kwargs)
        own = uses_own_loss(model, sample)
        if own:
            kwargs["labels"] = kwargs["input_ids"]
        with (CpuAttentionOnMeta(), KnownZerosOnMeta(),
              trace if trace is not None else contextlib.nullcontext()):
            if trace is not None:
                trace.stack = running.stack
            out = model(*sample.args, **kwargs)
        phase = "loss"
        loss = _loss(model, plan, sample, own, out)
        phase = "backward"
        running.stack.clear()
        loss.backward()  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - a finding, reported by the caller
        return _failure(mode, phase, exc, plan, running.innermost(), known)
    return None


def run_reference(model: nn.Module, sample: Sample) -> Failure | None:
    """The same step on a meta copy of the model without any plan, in one process: what fake
    tensors cannot run of the model itself (a kernel with no meta implementation, an op that
    needs values) is no finding about the recipe."""
    copied = meta_copy(model)
    running = _Running(copied)
    try:
        return _train_step(copied, None, sample, "reference", running)
    finally:
        running.remove()


def run_step(model: nn.Module, plan: Plan, mode: str, mesh: DeviceMesh,
             sample: Sample, trace: StepTrace | None = None) -> Failure | None:
    """Apply ``plan`` to a meta copy of ``model`` on ``mesh`` (from
    :func:`~hyperrecipe.verify.isolate.verification_world`) and run one training step.

    Returns:
        ``None`` when the step ran, else how it failed. ``trace``, when given, records what
        the model's code computes in the forward (:mod:`~hyperrecipe.verify.trace`).
    """
    from hyperrecipe.runtime import apply

    copied = meta_copy(model)
    known = {fqn for fqn, _ in copied.named_modules()}
    try:
        installation = apply(copied, plan, mesh, mode=mode)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - a finding, reported by the caller
        return _failure(mode, "apply", exc, plan, (), known)
    running = _Running(copied)
    try:
        return _train_step(copied, plan, sample, mode, running, trace)
    finally:
        running.remove()
        installation.restore()
