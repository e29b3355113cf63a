"""The body every rank of ``hyperrecipe check`` runs (under :func:`~hyperrecipe.check.launcher.run_ranks`).

A rank builds the model exactly as the reference did (same spec, config and seed, on the CPU),
checks that it got the reference's weights, moves it to its device, applies the plan in the
requested mode on a device mesh shaped like the plan's, and records the step with
:mod:`hyperrecipe.check.record`, viewing every boundary value whole
(:func:`~hyperrecipe.check.gather.full_view`). Gradients and parameters come from
:meth:`~hyperrecipe.runtime.Installation.full_grads` and ``full_state_dict()``.

If the step raises, the partial trace is saved to ``<side_dir>/<mode>-rank<r>.pt`` before the
exception propagates, so the launcher still stops every rank at once and the parent can still
say which boundary the failure happened in. Out-of-memory errors and ``NotImplementedError``
(an op DTensor has no sharding strategy for) are not saved: they mean the check cannot run, and
the parent reports them as errors.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any

import attrs
import torch

from hyperrecipe.check.record import StepFailed, Tracer, run_step
from hyperrecipe.verify.sample import Sample, build_seeded, weights_fingerprint
from hyperrecipe.errors import ModelSpecError

__all__ = ["RankJob", "check_rank", "side_file"]


@attrs.frozen(kw_only=True)
class RankJob:
    """Everything a rank needs; picklable (plain data, the plan as JSON)."""

    spec: str
    config: dict[str, Any] | None
    seed: int
    plan_json: str
    mode: str
    sample: Sample
    steps: int
    lr: float
    fingerprint: tuple[tuple[str, float, float], ...]
    side_dir: str


def side_file(side_dir: str, mode: str, rank: int) -> str:
    return os.path.join(side_dir, f"{mode}-rank{rank}.pt")


def _check_weights(job: RankJob, model: torch.nn.Module, rank: int) -> None:
    mine = weights_fingerprint(model)
    names_ok = [n for n, _, _ in mine] == [n for n, _, _ in job.fingerprint]
    for (name, s, a), (_, rs, ra) in zip(mine, job.fingerprint):
        if not names_ok or not (math.isclose(s, rs, rel_tol=1e-9, abs_tol=1e-12)
                                and math.isclose(a, ra, rel_tol=1e-9, abs_tol=1e-12)):
            what = f"parameter {name!r}" if names_ok else "its parameter names"
            msg = (f"rank {rank} built {job.spec!r} with seed {job.seed} but {what} differs from "
                   f"the reference's: the factory is not deterministic under torch.manual_seed, "
                   f"so no comparison would mean anything")
            raise ModelSpecError(msg)


def _to_cpu(value: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                            value)


def seeded_rank(job: RankJob, rank: int) -> tuple[torch.nn.Module, Any, Any, torch.device]:
    """This rank's model built as the reference was (its weights checked against the
    reference's) on the rank's device, the job's plan, and a mesh shaped like the plan's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.plan import Plan

    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    model = build_seeded(job.spec, job.config, job.seed)
    _check_weights(job, model, rank)
    model.to(device)
    plan = Plan.from_json(job.plan_json)
    mesh = init_device_mesh(device.type, tuple(d.size for d in plan.mesh),
                            mesh_dim_names=plan.mesh_dims)
    return model, plan, mesh, device


def check_rank(rank: int, world_size: int, job: RankJob) -> dict[str, Any]:
    """Run one mode's step on this rank; returns the trace as a payload (plain data)."""
    from torch.distributed.tensor import DTensor

    from hyperrecipe.check.gather import full_view
    from hyperrecipe.runtime import apply

    # torch 2.13 deprecates all_gather_into_tensor, which apply() still calls once per rank;
    # the warning would repeat in every rank of every mode
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated",
                            category=FutureWarning)
    t0 = time.perf_counter()
    model, plan, mesh, device = seeded_rank(job, rank)
    t1 = time.perf_counter()
    inst = apply(model, plan, mesh, mode=job.mode)  # type: ignore[arg-type]
    t2 = time.perf_counter()
    names = {p.fqn for p in plan.params}
    dims = plan.mesh_dims

    def view_output(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t.clone()

    def full_params() -> dict[str, torch.Tensor]:
        return {k: v for k, v in inst.state.full_state_dict().items() if k in names}

    tracer = Tracer(model, plan.boundaries, view=lambda v, p: full_view(v, p, mesh, dims))
    try:
        trace = run_step(model, job.sample.to(device), tracer, steps=job.steps, lr=job.lr,
                         full_grads=inst.full_grads, full_params=full_params,
                         view_output=view_output)
    except StepFailed as failed:
        cause = failed.__cause__
        assert cause is not None
        if isinstance(cause, (torch.OutOfMemoryError, NotImplementedError)):
            # the machine's limit, or an op DTensor cannot shard (ValidateUnsupportedError, a
            # NotImplementedError): the check cannot run, which says nothing about the plan
            raise cause from None
        payload = failed.trace.to_payload()
        payload["timings"].update(build_s=t1 - t0, apply_s=t2 - t1)
        torch.save(_to_cpu(payload), side_file(job.side_dir, job.mode, rank))
        raise cause from None
    payload = trace.to_payload()
    payload["timings"].update(build_s=t1 - t0, apply_s=t2 - t1)
    payload["wrapper_choices"] = [[c.fqn, c.wrapper, c.state, c.reason or ""]
                                  for c in inst.state.wrapper_choices]
    return payload
