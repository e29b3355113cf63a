"""Verification at compile: one training step of a plan, in both modes, on fake tensors.

A plan that resolves can still train wrong: a replicated parameter whose gradient comes back
partial where the plan reduces none, a sharded parameter that a module outside every boundary
reads as if it were whole, a declared layout that does not arrive, a shape production mode
cannot run, heads split from a shard otherwise than from the whole, a sum over a sharded dim
production never completes. Shapes and placements show each of these before the first real step, so
``compile`` runs one: forward, the model's own loss and backward, in production and in
validate mode, on a meta copy of the model under torch's fake process group (or, in a job
that already has a process group, on its own mesh, every rank together). A failure
becomes a :class:`~hyperrecipe.errors.RecipeError` at the recipe line responsible.

What fake tensors cannot show (values, 16-bit computation inside an fp32 model, data-dependent
routing) stays ``hyperrecipe check``'s job; docs/verification.md draws the line.

Modules:

- :mod:`~hyperrecipe.verify.sample`: the seeded model, the sample batch and the model's own
  loss (``hyperrecipe check`` runs its reference step on the same sample);
- :mod:`~hyperrecipe.verify.static`: the findings the plan alone shows (a sharded parameter
  outside every boundary, through a tie too);
- :mod:`~hyperrecipe.verify.step`: one training step of one rank in one mode, and the module
  that was running when it failed;
- :mod:`~hyperrecipe.verify.trace`: what the model's own code computes in each mode, for the
  mistakes neither mode fails on (a shard split into heads otherwise than the whole, a partial
  value summed inside a module where production has no collective);
- :mod:`~hyperrecipe.verify.findings`: a failure turned into a located ``RecipeError``, or into
  a note when fake tensors cannot run the op (data-dependent);
- :mod:`~hyperrecipe.verify.attention`: the CPU's attention kernel on the meta device too, so
  validate mode checks the ops a CPU run dispatches;
- :mod:`~hyperrecipe.verify.known_zeros`: zeros known by construction answered on the meta
  device (``bool(t.any())`` of a tensor made zeros and not written since), so validate mode
  takes a recurrence's initial state as replicated and runs on through the scan;
- :mod:`~hyperrecipe.verify.isolate`: the world the step runs in (the fake process group, or
  the job's own);
- :mod:`~hyperrecipe.verify.run`: :func:`verify_plan`, the order of the above and the record
  the plan keeps (:class:`~hyperrecipe.plan.PlanVerification`).

What does not live here: the sharding itself (:mod:`hyperrecipe.runtime`), the comparison of
values with one process (:mod:`hyperrecipe.check`).
"""

from hyperrecipe.verify.run import needs_verification, verify_plan

__all__ = ["needs_verification", "verify_plan"]
