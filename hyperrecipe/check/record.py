"""Recording one training step: every boundary's inputs and outputs, the output, the gradients.

The same code records the single-process reference and every rank, so the two traces line up
event for event. A :class:`Tracer` puts forward hooks (``register_forward_pre_hook`` and
``register_forward_hook``; no ``forward`` is touched) on each boundary module of the plan and
records, in execution order:

- an ``input`` event per declared input when the boundary is entered (``in_src`` layout), and
- an ``output`` event per declared output when it returns (``out_dst`` layout; a boundary with
  no declared outputs records its first output, taken as replicated).

Each event remembers the innermost boundary call it happened inside (``enclosing``), which is
what lets the comparison tell "this boundary computed something wrong" from "its input was
already wrong when it was entered". Values go through a *viewer*: the identity in the reference,
:func:`hyperrecipe.check.gather.full_view` in a rank. The tracer also keeps a stack of every
module being executed, so a forward that raises can be attributed to the innermost boundary and
module it raised in.

:func:`run_step` runs the step (forward, mean-of-squares loss, backward, optional SGD steps)
and returns a :class:`Trace`; if the step raises it raises :class:`StepFailed` carrying the
partial trace.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import StepFailed
from hyperrecipe.placement import REPLICATED, NamedPlacement
from hyperrecipe.plan import ArgLayout, BoundaryPlan
from hyperrecipe.verify.sample import Sample, first_output, loss_of
from hyperrecipe.runtime import declared_argument, get_output
from hyperrecipe.runtime import plain_vocab_slice

__all__ = ["Event", "Failure", "StepFailed", "Trace", "Tracer", "Viewer", "run_step"]

EventKind = Literal["input", "output", "send", "receive"]
"""``input``/``output`` of a boundary; ``send``/``receive`` of a pipeline stage boundary
(:mod:`hyperrecipe.check.pipeline`: ``fqn`` is ``"stage 0 -> 1"``, ``call`` the microbatch,
``name`` the exit or entry layer)."""
Viewer = Callable[[Tensor, NamedPlacement], "tuple[Tensor | None, str]"]
"""(value, its declared layout) → (whole tensor or None, why None)."""


@attrs.frozen(kw_only=True, eq=False)
class Event:
    """One recorded boundary input or output.

    ``enclosing`` is ``"fqn#call"`` of the innermost boundary call this event happened inside
    (for an output: the one around the returning boundary), ``None`` at top level.
    """

    fqn: str
    call: int
    kind: EventKind
    name: str
    enclosing: str | None
    value: Tensor | None
    note: str = ""

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.fqn, self.call, self.kind, self.name)

    @property
    def label(self) -> str:
        call = f", call {self.call}" if self.call else ""
        return f"{self.fqn or '<root>'} ({self.kind} {self.name}{call})"


@attrs.frozen(kw_only=True)
class Failure:
    """A step that raised: where, and what it raised.

    Attributes:
        phase: ``"forward"``, ``"backward"``, ``"gradients"`` or ``"step N"``.
        error: ``"Type: message"``.
        boundary: the innermost boundary being executed when it raised (forward only).
        module: the innermost module being executed.
        module_inputs: shapes of that module's tensor arguments, as this rank held them.
        placement: for a ``PlacementMismatchError``: (boundary, what, declared, actual).
    """

    phase: str
    error: str
    boundary: str | None = None
    module: str | None = None
    module_inputs: tuple[tuple[int, ...], ...] = ()
    placement: tuple[str, str, str, str] | None = None


@attrs.frozen(kw_only=True, eq=False)
class Trace:
    """What one run (the reference, or one rank in one mode) computed."""

    events: tuple[Event, ...]
    output: Tensor | None
    loss: float | None
    grads: dict[str, Tensor]
    params_after: dict[str, Tensor] | None
    failure: Failure | None = None
    timings: dict[str, float] = attrs.field(factory=dict)

    def to_payload(self) -> dict[str, Any]:
        """Plain dicts, lists and tensors (what the launcher pickles and ``torch.load`` reads
        with ``weights_only``)."""
        return {
            "events": [[e.fqn, e.call, e.kind, e.name, e.enclosing, e.value, e.note]
                       for e in self.events],
            "output": self.output,
            "loss": self.loss,
            "grads": dict(self.grads),
            "params_after": None if self.params_after is None else dict(self.params_after),
            "failure": None if self.failure is None else attrs.asdict(self.failure),
            "timings": dict(self.timings),
        }

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> Trace:
        failure = data["failure"]
        if failure is not None:
            failure = Failure(**{**failure,
                                 "module_inputs": tuple(tuple(s) for s in failure["module_inputs"]),
                                 "placement": None if failure["placement"] is None
                                 else tuple(failure["placement"])})
        return cls(
            events=tuple(Event(fqn=f, call=c, kind=k, name=n, enclosing=enc, value=v, note=note)
                         for f, c, k, n, enc, v, note in data["events"]),
            output=data["output"], loss=data["loss"], grads=dict(data["grads"]),
            params_after=None if data["params_after"] is None else dict(data["params_after"]),
            failure=failure, timings=dict(data["timings"]))


def _shapes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    from torch.distributed.tensor import DTensor

    out: list[tuple[int, ...]] = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, DTensor):
            out.append(tuple(v.to_local().shape))
        elif isinstance(v, Tensor):
            out.append(tuple(v.shape))
    return tuple(out)


class Tracer:
    """Hooks that record boundary events and track which modules are running.

    Use as a context manager; the hooks are removed on exit. Set ``recording = False`` to keep
    tracking the module stack without recording events (later SGD steps).
    """

    def __init__(self, model: nn.Module, boundaries: Sequence[BoundaryPlan], view: Viewer) -> None:
        self.model = model
        self.view = view
        modules = dict(model.named_modules(remove_duplicate=False))
        self.boundaries = [(modules[b.fqn], b) for b in boundaries if b.fqn in modules]
        self.events: list[Event] = []
        self.recording = True
        self.calls: Counter[str] = Counter()
        self.boundary_stack: list[str] = []
        self.module_stack: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Tracer:
        seen: set[int] = set()
        for fqn, module in self.model.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._handles.append(module.register_forward_pre_hook(
                self._enter_module(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave_module(), with_kwargs=True))
        for module, b in self.boundaries:
            self._handles.append(module.register_forward_pre_hook(self._enter(b), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave(b), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def innermost_boundary(self) -> str | None:
        return self.boundary_stack[-1].rsplit("#", 1)[0] if self.boundary_stack else None

    def _enter_module(self, fqn: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.module_stack.append((fqn, _shapes(args, kwargs)))

        return hook

    def _leave_module(self) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
            if self.module_stack:
                self.module_stack.pop()

        return hook

    def _record(self, b: BoundaryPlan, call: int, kind: EventKind, name: str, value: Any,
                placement: NamedPlacement) -> None:
        if not isinstance(value, Tensor):
            return
        value = plain_vocab_slice(value)  # a loss_parallel lm_head's output: recorded as placed
        enclosing = self.boundary_stack[-1] if self.boundary_stack else None
        with torch.no_grad():
            full, note = self.view(value, placement)
        self.events.append(Event(fqn=b.fqn, call=call, kind=kind, name=name,
                                 enclosing=enclosing, value=full, note=note))

    def _enter(self, b: BoundaryPlan) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = self.calls[b.fqn]
            if self.recording:
                for layout in b.inputs:
                    value = declared_argument(args, kwargs, layout.position, layout.name)
                    self._record(b, call, "input", layout.name, value, layout.src)
            self.boundary_stack.append(f"{b.fqn}#{call}")

        return hook

    def _leave(self, b: BoundaryPlan) -> Callable[..., None]:
        layouts = b.outputs or (ArgLayout(name="output", position=0, src=REPLICATED,
                                          dst=REPLICATED),)

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
            call = self.calls[b.fqn]
            self.calls[b.fqn] += 1
            if self.boundary_stack:
                self.boundary_stack.pop()
            if self.recording:
                for layout in layouts:
                    value = get_output(out, layout.position or 0, layout.name)
                    if value is None and not b.outputs:
                        value = first_output(out)
                    self._record(b, call, "output", layout.name, value, layout.dst)

        return hook


def _failure(tracer: Tracer, phase: str, exc: BaseException) -> Failure:
    from hyperrecipe.errors import PlacementMismatchError

    error = f"{type(exc).__name__}: {exc}"
    placement = None
    boundary = tracer.innermost_boundary if phase == "forward" else None
    if isinstance(exc, PlacementMismatchError):
        placement = (exc.fqn, exc.output, exc.declared, exc.actual)
        boundary = exc.fqn
    module, shapes = tracer.module_stack[-1] if phase == "forward" and tracer.module_stack \
        else (None, ())
    return Failure(phase=phase, error=error, boundary=boundary, module=module,
                   module_inputs=shapes, placement=placement)


def run_step(
    model: nn.Module,
    sample: Sample,
    tracer: Tracer,
    *,
    steps: int,
    lr: float,
    full_grads: Callable[[], dict[str, Tensor]],
    full_params: Callable[[], dict[str, Tensor]],
    view_output: Callable[[Tensor], Tensor],
) -> Trace:
    """Forward (recorded), loss, backward, gradients, then ``steps`` SGD steps.

    The gradients are those of the first backward; with ``steps`` > 0 the first SGD step uses
    them, each later step runs a fresh forward and backward (not recorded), and the parameters
    after the last step are returned too.

    Raises:
        StepFailed: anything raised on the way, with the partial trace and where it happened.
    """
    timings: dict[str, float] = {}
    phase = "forward"
    output: Tensor | None = None
    loss_value: float | None = None
    grads: dict[str, Tensor] = {}
    try:
        with tracer:
            t0 = time.perf_counter()
            out = model(*sample.args, **sample.kwargs)
            tracer.recording = False
            loss = loss_of(out)
            first = first_output(out)
            output = view_output(first.detach())
            t1 = time.perf_counter()
            phase = "backward"
            loss.backward()  # type: ignore[no-untyped-call]
            loss_value = float(loss.detach().float().item())
            t2 = time.perf_counter()
            phase = "gradients"
            grads = full_grads()
            timings.update(forward_s=t1 - t0, backward_s=t2 - t1)
            params_after: dict[str, Tensor] | None = None
            if steps > 0:
                t3 = time.perf_counter()
                opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
                for i in range(steps):
                    phase = f"step {i + 1}"
                    if i > 0:
                        opt.zero_grad(set_to_none=True)
                        loss_of(model(*sample.args, **sample.kwargs)).backward()  # type: ignore[no-untyped-call]
                    opt.step()
                params_after = full_params()
                timings["steps_s"] = time.perf_counter() - t3
    except Exception as exc:
        trace = Trace(events=tuple(tracer.events), output=output, loss=loss_value, grads=grads,
                      params_after=None, failure=_failure(tracer, phase, exc), timings=timings)
        raise StepFailed(trace) from exc
    return Trace(events=tuple(tracer.events), output=output, loss=loss_value, grads=grads,
                 params_after=params_after, timings=timings)
