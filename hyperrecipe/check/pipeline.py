"""``check`` of a plan with a ``pipeline`` section: every stage boundary value, the loss and
every gradient against one process.

A pipelined model is not one program sharded over ranks: each rank runs its stages' part of the
model's forward and sends the hidden states on. What can go wrong is what crosses (or fails to
cross) a stage boundary, so the values compared are, for each boundary ``s -> s+1`` and each
microbatch, in this order:

- ``send``: the hidden states stage ``s`` sends (recorded at the stage's exit, a forward hook on
  the stage module torch's ``PipelineStage`` runs), against the reference's output of layer
  ``stop - 1`` for the same microbatch rows;
- ``receive``: the hidden states stage ``s + 1`` receives (a forward pre-hook on its stage
  module), against what the reference hands layer ``start`` in one process. The two differ when
  the model's own code between two layers changes the hidden states (``h = layer(h) + x0``): a
  pipeline sends the layer's output, so the next stage starts from something else.

then the loss (``pipe.step``'s, the same on every rank; it stands for the model's output, which
no stage returns whole) and every gradient a rank holds (a parameter tied across stages is held,
already summed, on each rank that uses it). With ``--steps`` the parameters after that many SGD
steps are compared too. The loss is the model's own where it takes ``labels`` (token ids as
labels, the first two tokens of the first row ignored so that microbatches weigh differently);
otherwise the check's mean of squares of the first output, per microbatch divided by the
microbatch count.

The reference is the model's plain forward in this process with forward hooks on the exit and
entry layers (no ``forward`` is touched). The events reuse :class:`~hyperrecipe.check.record.Event`
(``fqn`` ``"stage 0 -> 1"``, ``call`` the microbatch, ``name`` the layer), so
:func:`~hyperrecipe.check.compare.compare_mode` names the first divergent stage boundary and the
report reads like a tensor-parallel one.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.check.record import Event, Failure, Trace
from hyperrecipe.check.worker import RankJob, _to_cpu, seeded_rank, side_file
from hyperrecipe.errors import ModelSpecError
from hyperrecipe.plan import PipelinePlan, Plan
from hyperrecipe.verify.sample import Sample, loss_of

__all__ = ["StepInputs", "pipeline_batch", "pipeline_rank", "pipeline_reference", "step_inputs"]

IGNORED_LABELS = 2
"""Label tokens ignored (``-100``) at the start of the first row."""


@attrs.frozen(kw_only=True, eq=False)
class StepInputs:
    """What one pipelined step takes: the model's keyword inputs and either ``labels`` (the
    model computes its own loss) or ``None`` (the check's loss through ``loss_fn``)."""

    kwargs: dict[str, Any]
    labels: Tensor | None


def pipeline_batch(batch: int, microbatches: int) -> tuple[int, str | None]:
    """The sample batch a pipeline check runs: ``batch`` rounded up to a multiple of the plan's
    microbatch count (so every microbatch has the same rows), and the note saying so."""
    if batch % microbatches == 0:
        return batch, None
    rows = -(-batch // microbatches) * microbatches
    return rows, (f"sample batch {rows} rows instead of {batch}: the pipeline cuts it into "
                  f"{microbatches} microbatches of equal size")


def step_inputs(model: nn.Module, sample: Sample) -> StepInputs:
    """The sample as keywords (a positional argument named by the model's forward), with
    ``labels`` when the model's forward takes them and the sample has ``input_ids``.

    Raises:
        ModelSpecError: the sample has more positional arguments than the forward names.
    """
    kwargs = dict(sample.kwargs)
    params = list(inspect.signature(model.forward).parameters.values())
    named = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(sample.args) > len(named):
        msg = (f"a pipeline stage takes the model's inputs as keywords; the sample has "
               f"{len(sample.args)} positional arguments and the forward names {named}")
        raise ModelSpecError(msg)
    kwargs.update(zip(named, sample.args))
    ids = kwargs.get("input_ids")
    if "labels" not in {p.name for p in params} or not isinstance(ids, Tensor):
        return StepInputs(kwargs=kwargs, labels=None)
    labels = ids.clone()
    labels[0, :IGNORED_LABELS] = -100
    return StepInputs(kwargs=kwargs, labels=labels)


def _own_loss(out: Any) -> Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, Tensor):
        msg = "the model was given labels= but returned no loss"
        raise ModelSpecError(msg)
    return loss


def _check_loss() -> Callable[[Any, Any], Tensor]:
    """``loss_fn`` for a model without labels: the check's loss of one microbatch; the
    pipeline divides by the microbatch count, so equal microbatches sum to the batch's."""

    def loss_fn(output: Any, target: Any) -> Tensor:
        del target
        return loss_of(output)

    return loss_fn


def _boundaries(pipeline: PipelinePlan) -> list[tuple[int, str, str]]:
    """(sending stage, its exit layer, the next stage's entry layer) per stage boundary."""
    stages = sorted(pipeline.stages, key=lambda s: s.index)
    return [(s.index, f"{pipeline.layers}.{s.stop - 1}", f"{pipeline.layers}.{nxt.start}")
            for s, nxt in zip(stages, stages[1:])]


def _boundary_name(stage: int) -> str:
    return f"stage {stage} -> {stage + 1}"


def _hidden_of(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def _first_argument(module: nn.Module, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> Tensor | None:
    if args:
        return _hidden_of(args[0])
    params = list(inspect.signature(module.forward).parameters)
    return _hidden_of(kwargs.get(params[0])) if params else None


def _events(pipeline: PipelinePlan, sends: Mapping[int, list[Tensor]],
            receives: Mapping[int, list[Tensor]]) -> tuple[Event, ...]:
    """Events in comparison order: boundary by boundary, microbatch by microbatch, the send
    before the receive. A rank records the boundaries of the stages it holds."""
    events: list[Event] = []
    for stage, exit_layer, entry_layer in _boundaries(pipeline):
        sent, got = sends.get(stage, []), receives.get(stage + 1, [])
        for k in range(max(len(sent), len(got))):
            if k < len(sent):
                events.append(Event(fqn=_boundary_name(stage), call=k, kind="send",
                                    name=exit_layer, enclosing=None, value=sent[k]))
            if k < len(got):
                events.append(Event(fqn=_boundary_name(stage), call=k, kind="receive",
                                    name=entry_layer, enclosing=None, value=got[k]))
    return tuple(events)


def _microbatches(calls: Mapping[int, list[Tensor]], m: int) -> dict[int, list[Tensor]]:
    """The last ``m`` forward calls of each stage: torch's schedule runs every stage once more
    when it sets the stage up on the first step (``_prepare_forward_infra``, on the example
    inputs: a receiving stage's are uninitialised), before the microbatches, which run in order."""
    return {stage: values[-m:] for stage, values in calls.items()}


def _sgd_steps(params: list[nn.Parameter], steps: int, lr: float,
               again: Callable[[], object]) -> None:
    """``steps`` SGD steps; the first uses the gradients already there, each later one
    ``again()`` (a fresh forward and backward)."""
    opt = torch.optim.SGD(params, lr=lr, foreach=False)
    for i in range(steps):
        if i > 0:
            opt.zero_grad(set_to_none=True)
            again()
        opt.step()


def pipeline_reference(model: nn.Module, plan: Plan, sample: Sample, *, steps: int,
                       lr: float) -> Trace:
    """The single-process step: every stage boundary's hidden states (the exit layer's output
    and the entry layer's input, cut into the plan's microbatches), the loss, the gradients and,
    with ``steps``, the parameters after the SGD steps.

    Raises:
        ModelSpecError: the model takes labels but returns no loss.
    """
    pipeline = plan.pipeline
    assert pipeline is not None
    inputs = step_inputs(model, sample)
    outputs: dict[str, Tensor] = {}
    entries: dict[str, Tensor] = {}

    def keep_output(fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            value = _hidden_of(out)
            if fqn not in outputs and value is not None:
                outputs[fqn] = value.detach().clone()
        return hook

    def keep_input(fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            value = _first_argument(module, args, kwargs)
            if fqn not in entries and value is not None:
                entries[fqn] = value.detach().clone()
        return hook

    def forward_loss() -> Tensor:
        if inputs.labels is not None:
            return _own_loss(model(**inputs.kwargs, labels=inputs.labels))
        return loss_of(model(**inputs.kwargs))

    handles = []
    for _, exit_layer, entry_layer in _boundaries(pipeline):
        handles.append(model.get_submodule(exit_layer).register_forward_hook(keep_output(exit_layer)))
        handles.append(model.get_submodule(entry_layer).register_forward_pre_hook(
            keep_input(entry_layer), with_kwargs=True))
    t0 = time.perf_counter()
    try:
        loss = forward_loss()
    finally:
        for h in handles:
            h.remove()
    t1 = time.perf_counter()
    loss.backward()  # type: ignore[no-untyped-call]
    t2 = time.perf_counter()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    m = pipeline.microbatches
    sends = {s: list(outputs[exit_layer].tensor_split(m)) for s, exit_layer, _ in _boundaries(pipeline)
             if exit_layer in outputs}
    receives = {s + 1: list(entries[entry].tensor_split(m)) for s, _, entry in _boundaries(pipeline)
                if entry in entries}
    params_after = None
    if steps > 0:
        _sgd_steps(list(model.parameters()), steps, lr,
                   lambda: forward_loss().backward())  # type: ignore[no-untyped-call]
        params_after = {n: p.detach().clone()
                        for n, p in model.named_parameters(remove_duplicate=False)}
    return Trace(events=_events(pipeline, sends, receives), output=loss.detach().float(),
                 loss=float(loss.item()), grads=grads, params_after=params_after,
                 timings={"forward_s": t1 - t0, "backward_s": t2 - t1})


def _named(modules: tuple[nn.Module, ...], what: Callable[[nn.Parameter], Tensor | None]
           ) -> dict[str, Tensor]:
    """``what`` of every parameter this rank holds, under each FQN it has in its stages (a
    weight tied between two local stages under both names)."""
    out: dict[str, Tensor] = {}
    for module in modules:
        for fqn, p in module.named_parameters(remove_duplicate=False):
            value = what(p)
            if value is not None and fqn not in out:
                out[fqn] = value.detach().clone()
    return out


def _full_params(pipe: Any) -> dict[str, Tensor]:
    """Every parameter of this rank's stages, whole (each stage's installation gathers its
    shards over the stage's tensor-parallel ranks)."""
    out: dict[str, Tensor] = {}
    for inst in pipe.installations:
        names = {p.fqn for p in inst.plan.params}
        out.update({k: v for k, v in inst.state.full_state_dict().items() if k in names})
    return out


def pipeline_rank(rank: int, world_size: int, job: RankJob) -> dict[str, Any]:
    """One rank of a pipeline check: build, pipeline, one recorded step (and ``job.steps`` SGD
    steps); returns the trace as a payload. A step that raises leaves its partial trace in the
    side file, blamed on the stage that was running, before the exception propagates."""
    from hyperrecipe.runtime import build_pipeline

    t0 = time.perf_counter()
    model, plan, mesh, device = seeded_rank(job, rank)
    pipeline = plan.pipeline
    assert pipeline is not None
    inputs = step_inputs(model, job.sample.to(device))
    loss_fn = None if inputs.labels is not None else _check_loss()
    t1 = time.perf_counter()
    pipe = build_pipeline(model, plan, mesh, mode=job.mode,  # type: ignore[arg-type]
                          loss_fn=loss_fn)
    t2 = time.perf_counter()

    sends: dict[int, list[Tensor]] = {}
    receives: dict[int, list[Tensor]] = {}
    running: list[int] = []
    recording = [True]

    def entered(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            running.append(index)
            if recording[0] and torch.is_grad_enabled() and args:  # not the shape probe
                receives.setdefault(index, []).append(args[0].detach().clone())
        return hook

    def left(index: int, is_last: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            running.pop()
            if recording[0] and torch.is_grad_enabled() and not is_last:
                sends.setdefault(index, []).append(out.detach().clone())
        return hook

    handles = []
    for stage in pipe.stage_modules:
        handles.append(stage.register_forward_pre_hook(entered(stage.index), with_kwargs=True))
        handles.append(stage.register_forward_hook(left(stage.index, stage.is_last)))

    def step() -> Tensor:
        if inputs.labels is not None:
            loss: Tensor = pipe.step(**inputs.kwargs, labels=inputs.labels)
        else:
            rows = next(iter(inputs.kwargs.values()))
            loss = pipe.step(**inputs.kwargs, target=torch.zeros(len(rows), device=device))
        return loss

    phase = "forward and backward"
    loss_value: float | None = None
    grads: dict[str, Tensor] = {}
    timings = {"build_s": t1 - t0, "apply_s": t2 - t1}
    try:
        t3 = time.perf_counter()
        loss = step()
        recording[0] = False
        loss_value = float(loss.item())
        timings["step_s"] = time.perf_counter() - t3
        phase = "gradients"
        # beside tensor parallel a stage's installation gathers its shards whole
        grads = (pipe.full_grads() if pipe.installations
                 else _named(pipe.modules, lambda p: p.grad))
        params_after = None
        if job.steps > 0:
            phase = "SGD steps"
            _sgd_steps(list(pipe.parameters()), job.steps, job.lr, step)
            params_after = (_full_params(pipe) if pipe.installations
                            else _named(pipe.modules, lambda p: p))
    except Exception as exc:
        where = f"stage {running[-1]}" if running else None
        failure = Failure(phase=phase, error=f"{type(exc).__name__}: {exc}", boundary=where,
                          module=None)
        # which of a failed step's calls were microbatches is unknown (see _microbatches)
        trace = Trace(events=(), output=None, loss=loss_value,
                      grads=grads, params_after=None, failure=failure, timings=timings)
        torch.save(_to_cpu(trace.to_payload()), side_file(job.side_dir, job.mode, rank))
        raise
    finally:
        for h in handles:
            h.remove()
    m = pipeline.microbatches
    trace = Trace(events=_events(pipeline, _microbatches(sends, m), _microbatches(receives, m)),
                  output=loss.detach().float(),
                  loss=loss_value, grads=grads, params_after=params_after, timings=timings)
    payload = _to_cpu(trace.to_payload())
    assert isinstance(payload, dict)
    return payload
