"""Multi-rank validation against a single-process reference.

This package runs a plan on real process groups and compares what every rank computes (forward
outputs and gradients) with the same model run in one process, reporting the first boundary that
diverges. One responsibility per module:

- :mod:`~hyperrecipe.check.launcher` starts the ranks (forked or spawned processes on one host,
  gloo on CPU, NCCL when there is a GPU per rank) and turns a failing or hanging rank into a
  :class:`~hyperrecipe.errors.RankFailedError`;
- :mod:`~hyperrecipe.check.record`: forward hooks that record boundary inputs and outputs in
  execution order, and the recorded step (gradients, SGD steps);
- :mod:`~hyperrecipe.check.gather`: whole tensors from a rank's local shards or DTensors;
- :mod:`~hyperrecipe.check.worker`: what each rank runs;
- :mod:`~hyperrecipe.check.pipeline`: a plan with a ``pipeline`` section: the reference and
  the rank body that record stage boundary values, the loss and the gradients each rank holds;
- :mod:`~hyperrecipe.check.compare`: tolerances, and the first divergent boundary;
- :mod:`~hyperrecipe.check.precision`: where the reference itself computes in 16 bits inside a
  float32 model (re-run under a dispatch mode at a divergence);
- :mod:`~hyperrecipe.check.diagnose`: likely causes, only where a known pattern is measured
  (the causes, then the patterns by topic: values, structure, gradients);
- :mod:`~hyperrecipe.check.run`: ``run_check``, the whole check; :mod:`~hyperrecipe.check.report`
  renders it as text or JSON (``hyperrecipe check`` is a thin layer over these two).

Everything here reads the plan; which boundary encloses a parameter comes from the plan's
``boundary`` field and the boundaries' ``parent`` chain, never from FQN prefixes. What does not
live here: applying a plan (``check`` calls :func:`hyperrecipe.runtime.apply` like any trainer)
the seeded model, the sample batch and the loss, which check shares with verification at
compile (:mod:`hyperrecipe.verify.sample`), and the exceptions it raises
(:mod:`hyperrecipe.errors`). Nothing here is used on a training hot
path, and importing this package imports nothing heavy: import the submodules you need.
"""
