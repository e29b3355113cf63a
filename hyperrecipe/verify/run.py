"""``verify_plan``: the plan-only findings, then one step per mode, then the record.

Ranks: every parameter's local shape and every boundary's layouts are the same on every rank
(shards are even: the resolver checks divisibility), so one rank's step stands for all: rank 0
runs under the fake process group; in a job every rank of the plan's mesh runs its own, and the
record says so on every rank alike (the plan's bytes do not depend on the rank that compiled
it). What differs between ranks is values (offsets of a vocab shard, a causal mask's offset
under context parallelism), which fake tensors do not have anyway.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
from torch import nn

from hyperrecipe.errors import ModelSpecError, UsageError
from hyperrecipe.plan import Plan, PlanVerification, compute_fingerprint
from hyperrecipe.verify.findings import (Failure, data_dependent, partial_reduced_error,
                                        recipe_error_for, reshape_error)
from hyperrecipe.verify.isolate import verification_world
from hyperrecipe.verify.trace import StepTrace, diverging
from hyperrecipe.verify.static import refuse_sharded_outside_boundaries

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MODES", "library_versions", "needs_verification", "verify_plan"]

MODES = ("production", "validate")
"""Both modes run: production shows the shapes its local shards and precompiled collectives
cannot run; validate shows placements (a partial gradient nobody reduces, a layout that does
not arrive) that production's plain tensors cannot."""


def library_versions() -> tuple[str, str | None]:
    """torch's version, and transformers' where it is installed (the record's key)."""
    import importlib.metadata

    import torch

    try:
        transformers: str | None = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    return str(torch.__version__), transformers


def needs_verification(plan: Plan, model_digest: str | None = None) -> bool:
    """Whether ``plan`` carries no verification record that holds here: none, or one made with
    another torch or transformers, or for another model structure."""
    record = plan.verification
    if record is None:
        return True
    torch_version, transformers = library_versions()
    digest = plan.model_digest if model_digest is None else model_digest
    return (record.torch, record.transformers, record.model_digest) != (
        torch_version, transformers, digest)


def _steps(model: nn.Module, plan: Plan, sample: Any, modes: Sequence[str],
           mesh: DeviceMesh | None, traces: dict[str, StepTrace]
           ) -> tuple[Failure | None, list[Failure | None], tuple[int, ...]]:
    """One step per mode (each recording what the model's code computes into ``traces``), the ranks of
    the plan's mesh that ran them, and, only when a mode met a raw error (not a refusal of
    ours), the reference step: the model without any plan, in one process."""
    import torch.distributed as dist

    from hyperrecipe.verify.step import run_reference, run_step

    out: list[Failure | None] = []
    # what torch and the model warn about on fake tensors (DTensor's dropout on a cpu mesh, a
    # config's defaults) concerns this copy, not the user's run: not printed at compile
    with warnings.catch_warnings(), verification_world(plan, mesh) as world:
        warnings.simplefilter("ignore")
        ran = (0,) if dist.get_backend() == "fake" else tuple(range(world.size()))
        for mode in modes:
            traces[mode] = StepTrace()
            failure = run_step(model, plan, mode, world, sample, traces[mode])
            # the step's copy holds cycles (hooks, installation): collected now, so the
            # runtime's shared tables keep nothing of it, nor of its process group
            gc.collect()
            out.append(failure)
            if failure is not None and failure.project_error and mode != "validate":
                break  # the finding is enough; the other mode would only repeat it
    if not any(f is not None and not f.project_error for f in out):
        return None, out, ran
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_reference(model, sample), out, ran


def _where(failure: Failure) -> str:
    return f" in {failure.modules[0]}" if failure.modules else ""


def _own_lookup(plan: Plan, failure: Failure) -> str | None:
    """The vocab-parallel boundary whose output validate mode found in another layout than
    declared. Production mode does not run such a module's forward as written: it runs the
    plan's masked lookup, whose output is partial by construction. Validate mode runs the
    module's own forward on DTensors, which may compute the lookup otherwise (an embedding
    subclass with a padding row, torchtitan's ``Embedding`` taking its weight apart with
    ``to_local()``): a limit of validate mode, not a finding about the recipe."""
    if failure.error_type != "PlacementMismatchError" or failure.named is None:
        return None
    lookups = {b.fqn for b in plan.boundaries if b.vocab_parallel is not None}
    return failure.named if failure.named in lookups else None


def _verify_pipelined(model: nn.Module, plan: Plan, *, inputs: str | None,
                      modes: Sequence[str], mesh: DeviceMesh | None) -> Plan:
    """A pipelined plan's step is verified as its stages apply it: every stage's share at
    once (the whole model), with the pipeline dim at size 1 (it shards nothing). The split
    itself runs nothing shapes could show wrong; ``check`` compares the pipelined step with
    one process."""
    pipe = plan.pipeline
    assert pipe is not None
    flat = tuple(attrs.evolve(d, size=1) if d.name == pipe.mesh_dim else d for d in plan.mesh)
    whole = attrs.evolve(plan, pipeline=None, mesh=flat,
                         fingerprint=compute_fingerprint(plan.recipe_digest, plan.model_digest,
                                                         flat)).sealed()
    if mesh is not None:
        msg = ("verify a pipelined plan at compile (hyperrecipe.compile_recipe), not in a job: "
               "its stages run on different ranks")
        raise UsageError(msg)
    verified = verify_plan(model, whole, inputs=inputs, modes=modes)
    assert verified.verification is not None
    others = "x".join(f"{d.name}={d.size}" for d in flat if d.name != pipe.mesh_dim)
    note = (f"verified as the pipeline's stages apply it: the whole model"
            f"{' over ' + others if others else ''}, the {pipe.mesh_dim} dim at size 1")
    record = attrs.evolve(verified.verification,
                          notes=(*verified.verification.notes, note))
    return attrs.evolve(plan, verification=record).sealed()


def verify_plan(model: nn.Module, plan: Plan, *, inputs: str | None = None,
                modes: Sequence[str] = MODES, mesh: DeviceMesh | None = None) -> Plan:
    """Run one training step of ``plan`` on fake tensors in each of ``modes`` and return the
    plan with its :class:`~hyperrecipe.plan.PlanVerification` record (sealed again).

    Args:
        model: the model the plan was compiled for, built on the meta device (a real one is
            copied to meta: no values are read).
        plan: the resolved plan.
        inputs: ``pkg.module:make_inputs`` for a model that takes neither token ids nor pixel
            values (called as ``check --inputs`` calls it).
        modes: the modes to run (both by default).
        mesh: the job's mesh, when ``apply`` verifies in a job (every rank verifies together);
            without it, a fake process group's mesh, or one over the job's group.

    Raises:
        RecipeError: the step refuses the plan, at the recipe line responsible.
    """
    from hyperrecipe.verify.step import float_grouped_experts, step_sample, uses_own_loss

    if plan.pipeline is not None:
        return _verify_pipelined(model, plan, inputs=inputs, modes=modes, mesh=mesh)
    refuse_sharded_outside_boundaries(plan)
    torch_version, transformers = library_versions()
    try:
        sample = step_sample(model, plan, inputs)
    except ModelSpecError as exc:
        note = (f"no step ran: {exc} (verification feeds what `check` feeds; pass "
                f"inputs='pkg.module:make_inputs', `--inputs` on the command line)")
        record = PlanVerification(torch=torch_version, transformers=transformers,
                                  model_digest=plan.model_digest, modes=(), ranks=(),
                                  inputs="none", notes=(note,))
        return attrs.evolve(plan, verification=record).sealed()
    traces: dict[str, StepTrace] = {}
    reference, results, ranks = _steps(model, plan, sample, tuple(modes), mesh, traces)
    notes: list[str] = []
    if float_grouped_experts(model):
        notes.append("fused experts ran through experts_implementation='batched_mm' (the same "
                     "shapes; grouped_mm's meta kernel takes bf16 only)")
    if reference is not None:
        notes.append(f"the model itself, without the plan, cannot run its step on fake tensors"
                     f"{_where(reference)} ({reference.phase}: {reference.error_type}: "
                     f"{reference.message[:160]}): a raw error of a mode there is no finding; "
                     f"the rest is `check`'s to verify")
    ran: list[str] = []
    for mode, failure in zip(modes, results, strict=False):
        ran.append(mode)
        if failure is None:
            continue
        if failure.phase == "apply" and failure.error is not None:
            raise failure.error  # apply's own refusal: the same as at apply, only earlier
        lookup = _own_lookup(plan, failure) if mode == "validate" else None
        if lookup is not None:
            notes.append(f"validate mode computed {lookup}'s lookup its own way, where "
                         f"production runs the plan's masked lookup into this rank's rows "
                         f"({failure.message[:160]}); the lookup is `check`'s to compare")
        elif not data_dependent(failure) and (failure.project_error or reference is None):
            raise recipe_error_for(plan, failure)
        elif reference is None:
            notes.append(f"{mode} mode stopped at an op that needs values{_where(failure)} "
                         f"({failure.phase}: {failure.message[:160]}); what follows it is "
                         f"`check`'s to verify")
    failed = dict(zip(modes, results, strict=False))
    if {"production", "validate"} <= traces.keys() and failed.get("production") is None:
        split = diverging(traces["production"], traces["validate"])
        if split is not None:
            raise reshape_error(plan, *split)
    reduced = traces["validate"].reduced if "validate" in traces else None
    if reduced is not None:
        raise partial_reduced_error(plan, reduced)
    loss = "the model's own loss" if uses_own_loss(model, sample) else (
        "mean of squares of the first output")
    record = PlanVerification(torch=torch_version, transformers=transformers,
                              model_digest=plan.model_digest, modes=tuple(ran), ranks=ranks,
                              inputs=f"{sample.description}, {loss}", notes=tuple(notes))
    return attrs.evolve(plan, verification=record).sealed()
