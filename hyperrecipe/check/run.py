"""``hyperrecipe check`` end to end: reference in this process, every mode on local ranks, verdict.

:func:`run_check` builds the model on the CPU with a fixed seed, compiles the recipe against it
(a recipe that does not fit fails here, before any rank starts), makes the sample batch
(:mod:`hyperrecipe.verify.sample`), records the single-process reference step
(:mod:`hyperrecipe.check.record`), then for each mode launches ``world_size`` ranks with
:func:`~hyperrecipe.check.launcher.run_ranks` (gloo on CPU, NCCL when there is a GPU per rank),
compares their traces with the reference (:mod:`hyperrecipe.check.compare`) and looks for a
known cause (:mod:`hyperrecipe.check.diagnose`). Rendering is :mod:`hyperrecipe.check.report`.
A plan with a ``pipeline`` section is recorded by :mod:`hyperrecipe.check.pipeline` instead
(stage boundary values, the loss, the gradients each rank holds) and compared the same way;
its sample batch is rounded up to a multiple of the microbatch count.

A rank whose step *raised* (a shape error inside a boundary, a ``PlacementMismatchError`` in
validate mode) is a finding of that mode, attributed to the boundary it raised in. A rank that
fails anywhere else (building the model, applying the plan, an op DTensor has no strategy for)
or hangs is an *error of that mode*: the launcher stops every rank, the mode's result carries
the error (:attr:`ModeResult.error`), and the next mode still runs, so one mode's failure never
hides another mode's verdict. The report's exit code is then 2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import nn

from hyperrecipe.check.compare import ModeComparison, compare_mode
from hyperrecipe.check.diagnose import DiagnosisContext, Suggestion, suggest
from hyperrecipe.check.launcher import RankFailedError, default_backend, run_ranks
from hyperrecipe.check.pipeline import pipeline_batch, pipeline_rank, pipeline_reference
from hyperrecipe.check.precision import HALF_TOLERANCE, HalfPrecision, half_precision_seen
from hyperrecipe.check.record import StepFailed, Trace, Tracer, run_step
from hyperrecipe.verify.sample import (
    build_seeded_noting,
    make_sample,
    weights_fingerprint,
)
from hyperrecipe.check.worker import RankJob, check_rank, side_file
from hyperrecipe.errors import CheckError, DeadlinePassed, HyperrecipeError, ModelSpecError
from hyperrecipe.forward_hazards import ForwardHazard, forward_hazards
from hyperrecipe.model_tree import load_model_config, snapshot
from hyperrecipe.plan import Plan
from hyperrecipe.runtime import ModeName

__all__ = ["CheckError", "CheckOptions", "CheckReport", "Mode", "ModeResult", "SGD_LR",
           "parent_deadline", "run_check"]

Mode = ModeName
"""The mode names a check runs (the same as ``apply``'s)."""
SGD_LR = 1e-2
"""Learning rate of the SGD steps (``--steps``); fixed so that runs are comparable."""

FP32_TOLERANCE = (1e-5, 1e-4)


@attrs.frozen(kw_only=True)
class CheckOptions:
    """What to check; the CLI flags of ``hyperrecipe check``, one for one.

    Attributes:
        recipe: recipe file or shipped recipe name.
        model: ``pkg.module:factory`` or ``hf:<model_type>``.
        model_config: JSON file, inline JSON or mapping of config fields.
        mesh: mesh dim → size; the world size is their product.
        modes: the modes to run, in order.
        steps: SGD steps (lr :data:`SGD_LR`) after the compared step; 0 compares one step.
        atol, rtol: ``None``: 1e-5 / 1e-4, or 1e-2 / 1e-2 for a 16-bit model.
        seed: model initialisation (``torch.manual_seed``) and sample batch.
        batch, seq: the sample batch shape (token ids).
        inputs: ``pkg.module:make_inputs`` for models that take something else.
        timeout_s: per launch (one mode), start-up included.
        backend: process-group backend; ``None`` lets the launcher choose.
    """

    recipe: str
    model: str
    mesh: Mapping[str, int]
    model_config: str | Mapping[str, Any] | None = None
    modes: tuple[Mode, ...] = ("production", "validate")
    steps: int = 0
    atol: float | None = None
    rtol: float | None = None
    seed: int = 0
    batch: int = 2
    seq: int = 8
    inputs: str | None = None
    timeout_s: float = 300.0
    backend: str | None = None


@attrs.frozen(kw_only=True)
class ModeResult:
    """One mode's verdict: a comparison, or the error that kept the mode from producing one."""

    mode: str
    comparison: ModeComparison | None
    suggestion: Suggestion | None
    timings: dict[str, float]
    #: rank 0's inner-wrapper choices: ``(fqn, wrapper, state, reason)`` per candidate tried
    wrapper_choices: tuple[tuple[str, str, str, str], ...] = ()
    #: why the mode has no comparison: a rank failed outside the compared step, or the launch
    #: timed out (the launcher's message, the failing rank's traceback included)
    error: str | None = None

    @property
    def agree(self) -> bool:
        return self.comparison is not None and self.comparison.agree


@attrs.frozen(kw_only=True)
class CheckReport:
    """The whole check: what ran, each mode's result, timings and notes."""

    recipe: str
    source: str
    recipe_files: tuple[str, ...]
    model: str
    mesh: dict[str, int]
    world_size: int
    backend: str
    seed: int
    sample: str
    steps: int
    atol: float
    rtol: float
    loss: float | None
    boundaries: int
    modes: tuple[ModeResult, ...]
    timings: dict[str, float]
    notes: tuple[str, ...] = ()
    #: the plan pipelines the model: the boundary values are stage boundaries' hidden states
    #: and the output is the loss (:mod:`hyperrecipe.check.pipeline`)
    pipelined: bool = False

    @property
    def agree(self) -> bool:
        return all(m.agree for m in self.modes)

    @property
    def errors(self) -> tuple[ModeResult, ...]:
        """The modes that could not run to a comparison."""
        return tuple(m for m in self.modes if m.error is not None)

    @property
    def exit_code(self) -> int:
        """0 when every mode agrees, 1 when one diverged, 2 when one could not run."""
        return 2 if self.errors else 0 if self.agree else 1


def _tolerances(model: torch.nn.Module, options: CheckOptions) -> tuple[float, float]:
    half = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    atol, rtol = HALF_TOLERANCE if half else FP32_TOLERANCE
    return (options.atol if options.atol is not None else atol,
            options.rtol if options.rtol is not None else rtol)


def _ignore(message: str) -> None:
    del message


def _launch_progress(mode: str, world: int, progress: Callable[[str], None]
                     ) -> Callable[[str], None]:
    ready = 0

    def relay(message: str) -> None:
        nonlocal ready
        progress(f"mode {mode}: {message}")
        if message.endswith("process group ready"):
            ready += 1
            if ready == world:
                progress(f"mode {mode}: running (all {world} ranks ready)")

    return relay


def _run_experts_batched(model: nn.Module, plan: Plan, config: dict[str, Any]) -> str | None:
    """Switch transformers' fused experts from ``grouped_mm`` to ``batched_mm`` for every run
    when validate mode would run them on DTensors; return the note saying so, else ``None``.

    ``aten._grouped_mm`` has no float32 path under DTensor on the CPU (its meta kernel requires
    bf16), so validate mode would fail inside the experts for a reason that is not the recipe's.
    Experts in a local region compute on local tensors and keep transformers' default.
    """
    if getattr(getattr(model, "config", None), "_experts_implementation", None) != "grouped_mm":
        return None
    regions = {b.fqn for b in plan.boundaries if b.local_region}
    local = {p.module for p in plan.params if regions.intersection(plan.boundary_chain(p.boundary))}
    experts = [n for n, m in model.named_modules()
               if "_is_expert_parallel" in vars(m) and n not in local]
    setter = getattr(model, "set_experts_implementation", None)
    if not experts or not callable(setter):
        return None
    setter("batched_mm")
    config["experts_implementation"] = "batched_mm"
    return (f"experts_implementation=batched_mm for every run ({len(experts)} experts modules run "
            f"on DTensors in validate mode, where grouped_mm has no float32 CPU path; the "
            f"reference uses the same)")


def _verification_finding(model: nn.Module, plan: Plan, inputs: str | None) -> str | None:
    """What ``compile``'s verification step refuses of ``plan`` (the ``RecipeError``'s text),
    or ``None``. ``check`` runs such a plan all the same (it resolves without verifying: it is
    how one sees what the refusal would have cost) and, at a divergence, names the finding as
    the likely cause."""
    from hyperrecipe.errors import RecipeError
    from hyperrecipe.verify import verify_plan

    try:
        verify_plan(model, plan, inputs=inputs)
    except RecipeError as exc:
        return str(exc)
    return None


def _refuse_default_config(options: CheckOptions) -> None:
    """``hf:<type>`` with no config at all builds transformers' default, usually billions of
    parameters, for real in this process and on every rank: refuse, say how big it is and how to
    ask for it on purpose (``--model-config '{}'``)."""
    from hyperrecipe.model_tree import build_model, default_config_note, shipped_tiny_config

    with parent_deadline(options.timeout_s, f"building {options.model}", _SLOW_FACTORY):
        meta = build_model(options.model, None)
    note = default_config_note(options.model, meta, tiny_config=shipped_tiny_config(options.model))
    world = 1
    for size in options.mesh.values():
        world *= size
    msg = (f"{note}. check builds that model for real, in this process and on each of the "
           f"{world} ranks; to check the default config on purpose, pass --model-config '{{}}'")
    raise ModelSpecError(msg)


_SLOW_FACTORY = "the model factory hangs or is too slow for this check"


@contextlib.contextmanager
def parent_deadline(timeout_s: float, what: str, cause: str) -> Iterator[None]:
    """Stop work in this process (the one that runs the check) that takes longer than
    ``timeout_s`` seconds: building the model, making the sample batch, the reference step.

    The ranks' launches have their own timeout; this covers the parent's part, where a model
    factory or forward that hangs would otherwise never be stopped. It uses ``SIGALRM``, so it
    works on the main thread of a POSIX process (the CLI's case) and waits without a limit
    elsewhere. Python code, ``time.sleep`` and blocking system calls are interrupted; a C
    extension that loops without returning to the interpreter is not.

    Args:
        timeout_s: the limit (``--timeout``).
        what: what is running, for the message (``"building hf:llama"``).
        cause: the likely cause, for the message.

    Raises:
        CheckError: the deadline passed; the message names what ran, the limit and the cause.
    """
    if (not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        del signum, frame
        raise DeadlinePassed

    previous = signal.signal(signal.SIGALRM, expire)
    left, _interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    except DeadlinePassed:
        msg = (f"{what} in this process did not finish within {timeout_s:g} s (--timeout); "
               f"{cause}")
        raise CheckError(msg) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:  # someone else's timer was running: give it back what it had left
            signal.setitimer(signal.ITIMER_REAL, left)


def run_check(options: CheckOptions, on_progress: Callable[[str], None] | None = None, *,
              started: float | None = None) -> CheckReport:
    """Check a recipe on local ranks against a single-process reference.

    Args:
        options: what to check.
        on_progress: called with one-line progress messages, one per phase (recipe loaded,
            model built, plan compiled, reference, each mode launching, running, compared).
        started: ``time.perf_counter()`` the total time is counted from (the CLI passes the
            moment the command started, so that imports count); default: when this is called.

    Returns:
        The report; ``report.exit_code`` is 0 when every mode agrees, 1 when one diverged and 2
        when one could not run.

    Raises:
        RecipeError: the recipe does not load or does not fit the model and mesh.
        ModelSpecError: the model or the sample batch cannot be built, or ``hf:<type>`` was
            given without ``model_config`` (transformers' default config, built for real on
            every rank, is refused with its size; pass ``{}`` to mean it).
        CheckError: the model fails in a single process.
        CheckError: a step in this process (building the model, the sample batch, the
            reference step) took longer than ``timeout_s``.

    A rank that fails outside the compared step, or a launch that times out, does not raise:
    that mode's :attr:`ModeResult.error` says what happened and the other modes still run.
    """
    from hyperrecipe.recipe import load_recipe
    from hyperrecipe.resolve import resolve_recipe

    progress = on_progress if on_progress is not None else _ignore
    t_start = time.perf_counter() if started is None else started
    recipe = load_recipe(options.recipe)
    config = load_model_config(options.model_config)
    if options.model.startswith("hf:") and options.model_config is None:
        _refuse_default_config(options)
    progress(f"recipe {recipe.name!r} loaded ({len(recipe.rules)} rules)")
    notes: list[str] = []
    first = "; transformers is imported first" if options.model.startswith("hf:") else ""
    progress(f"building {options.model} on the CPU (seed {options.seed}{first})")
    t_build = time.perf_counter()
    with (torch.random.fork_rng(devices=[]),
          parent_deadline(options.timeout_s, f"building {options.model}", _SLOW_FACTORY)):
        model, drawn = build_seeded_noting(options.model, config, options.seed)
    if drawn:
        shown = ", ".join(drawn[:3]) + (f" and {len(drawn) - 3} more" if len(drawn) > 3 else "")
        notes.append(f"{len(drawn)} parameters initialised to zero drawn from N(0, 0.1^2) for "
                     f"every run ({shown}): a zero bias would hide its own misplacement")
    tree = snapshot(model)
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"built {options.model}: {len(tree.modules)} modules, {n_params:,} parameters "
             f"({time.perf_counter() - t_build:.2f} s); compiling the recipe")
    plan = resolve_recipe(recipe, tree, options.mesh)
    finding: list[str | None] = []  # computed once, at the first divergence
    # read off the model once, at the first divergence: attentions whose heads cannot be
    # divided, and the 16-bit computation the reference does (it re-runs the forward)
    seen: list[tuple[dict[str, ForwardHazard], HalfPrecision | None]] = []
    if "validate" in options.modes and "experts_implementation" not in config:
        note = _run_experts_batched(model, plan, config)
        if note is not None:
            notes.append(note)
    world = 1
    for d in plan.mesh:
        world *= d.size
    batch = options.batch
    if plan.pipeline is not None:
        batch, batch_note = pipeline_batch(batch, plan.pipeline.microbatches)
        if batch_note is not None:
            notes.append(batch_note)
    with parent_deadline(options.timeout_s, "making the sample batch",
                         "--inputs hangs or is too slow for this check"):
        sample = make_sample(model, options.model, batch=batch, seq=options.seq,
                             seed=options.seed, inputs=options.inputs)
    atol, rtol = _tolerances(model, options)
    reference_params = {n: p.detach().clone()
                        for n, p in model.named_parameters(remove_duplicate=False)}
    fingerprint = weights_fingerprint(model)
    t_built = time.perf_counter()
    progress(f"plan compiled: {len(plan.boundaries)} boundaries, {len(plan.params)} parameters, "
             f"world size {world}")

    steps = f" and {options.steps} SGD step(s)" if options.steps else ""
    progress(f"reference: one forward/backward{steps} in this process ({sample.description})")
    tracer = Tracer(model, plan.boundaries, view=lambda v, p: (v.detach().clone(), ""))
    slow_step = "the model's forward or backward hangs or is too slow for this check"
    try:
        with parent_deadline(options.timeout_s, "the reference step", slow_step):
            if plan.pipeline is not None:
                reference = pipeline_reference(model, plan, sample, steps=options.steps,
                                               lr=SGD_LR)
            else:
                reference = run_step(
                    model, sample, tracer, steps=options.steps, lr=SGD_LR,
                    full_grads=lambda: {n: p.grad.detach().clone()
                                        for n, p in model.named_parameters(remove_duplicate=False)
                                        if p.grad is not None},
                    full_params=lambda: {n: p.detach().clone()
                                         for n, p in model.named_parameters(remove_duplicate=False)},
                    view_output=lambda t: t.detach().clone())
    except StepFailed as failed:
        msg = (f"{options.model} fails in a single process, without any plan "
               f"({failed.trace.failure.phase if failed.trace.failure else 'step'}): {failed}")
        raise CheckError(msg) from None
    t_ref = time.perf_counter()
    values = "stage boundary values" if plan.pipeline is not None else "boundary values"
    progress(f"reference: {len(reference.events)} {values} recorded, loss "
             f"{reference.loss:.6g} ({t_ref - t_built:.2f} s)")

    backend = options.backend or default_backend(world)
    pipelined = plan.pipeline is not None
    rank_body = pipeline_rank if pipelined else check_rank
    results: list[ModeResult] = []
    for mode in options.modes:
        progress(f"mode {mode}: launching {world} ranks ({backend})")
        side_dir = tempfile.mkdtemp(prefix="hyperrecipe-check-")
        job = RankJob(spec=options.model, config=config, seed=options.seed,
                      plan_json=plan.to_json(), mode=mode, sample=sample, steps=options.steps,
                      lr=SGD_LR, fingerprint=fingerprint, side_dir=side_dir)
        t0 = time.perf_counter()
        try:
            payloads = run_ranks(rank_body, world, job, backend=backend,
                                 timeout_s=options.timeout_s,
                                 on_progress=_launch_progress(mode, world, progress))
            traces = [Trace.from_payload(p) for p in payloads]
            rank_ids = tuple(range(world))
            choices = tuple((str(f), str(w), str(st), str(why))
                            for f, w, st, why in payloads[0].get("wrapper_choices", ()))
        except RankFailedError as exc:
            path = side_file(side_dir, mode, exc.rank) if exc.rank is not None else ""
            if not path or not os.path.exists(path):
                elapsed = time.perf_counter() - t0
                results.append(ModeResult(mode=mode, comparison=None, suggestion=None,
                                          timings={"launch_s": elapsed}, error=str(exc)))
                progress(f"mode {mode}: ERROR ({elapsed:.2f} s)")
                continue
            assert exc.rank is not None
            traces = [Trace.from_payload(torch.load(path, weights_only=True))]
            rank_ids = (exc.rank,)
            choices = ()
            progress(f"mode {mode}: rank {exc.rank} raised in its step; all ranks stopped")
        finally:
            shutil.rmtree(side_dir, ignore_errors=True)
        t1 = time.perf_counter()
        progress(f"mode {mode}: comparing with the reference")
        cmp = compare_mode(mode, reference, traces, atol=atol, rtol=rtol, rank_ids=rank_ids,
                           held_in_part=pipelined)
        if not cmp.agree and not finding and not pipelined:
            finding.append(_verification_finding(model, plan, options.inputs))
            with parent_deadline(options.timeout_s, "re-running the reference forward", slow_step):
                seen.append((forward_hazards(model), half_precision_seen(model, sample)))
        ctx = DiagnosisContext(plan=plan, tree=tree, reference_params=reference_params,
                               mode=mode, rank_ids=rank_ids,
                               verification=finding[0] if finding else None,
                               hazards=seen[0][0] if seen else {},
                               half_precision=seen[0][1] if seen else None)
        suggestion = None if cmp.agree or pipelined else suggest(cmp, reference, traces, ctx,
                                                   atol=atol, rtol=rtol)
        t2 = time.perf_counter()
        timings = {"launch_s": t1 - t0, "compare_s": t2 - t1}
        for key, value in traces[0].timings.items():
            timings[f"rank{rank_ids[0]}_{key}"] = value
        results.append(ModeResult(mode=mode, comparison=cmp, suggestion=suggestion,
                                  timings=timings, wrapper_choices=choices))
        progress(f"mode {mode}: {'agree' if cmp.agree else 'DIVERGED'} ({t1 - t0:.2f} s)")

    t_end = time.perf_counter()
    return CheckReport(
        recipe=plan.recipe, source=str(options.recipe), recipe_files=plan.recipe_files, model=options.model,
        mesh=plan.mesh_shape, world_size=world, backend=backend, seed=options.seed,
        sample=sample.description, steps=options.steps, atol=atol, rtol=rtol,
        loss=reference.loss, boundaries=len(plan.boundaries), modes=tuple(results),
        timings={"build_s": t_built - t_start, "reference_s": t_ref - t_built,
                 "total_s": t_end - t_start},
        notes=tuple(notes), pipelined=pipelined)
