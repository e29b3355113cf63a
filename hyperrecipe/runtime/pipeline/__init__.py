"""Pipeline parallelism at run time: one rank's stages of a plan's ``pipeline`` section, run by
a :mod:`torch.distributed.pipelining` schedule.

- ``run``: the trainer's seam, :func:`build_pipeline` and the :class:`Pipeline` handle (step,
  parameters, the global gradient norm, restore).
- ``stages``: which modules a stage owns, the skeleton copies for a rank's further stages, the
  stage module torch runs.
- ``placeholder``: another stage's module as this stage sees it (meta shapes, zeros, loud
  misuse); ``boundary``: the entry and exit forwards of a stage's first and last layer.
- ``schedule``: the plan's schedule name as a torch schedule; ``grads``: ties across stages and
  the norm.
- ``beside``: pipeline beside tensor parallel, each stage model applied with the plan's stage
  view (``apply`` handed in by the runtime's front) and its agreement scoped to the stage's
  ranks.
- ``state``: ``pipe.state``, the union of the stage models' state fronts.

This room imports ``preflight`` (the agreement scope) and ``state`` (shared DCP and export
code), never the runtime's top. What does not live here: deciding the split or the stage ranks
(the resolver writes them into the plan; this package reads them, never recomputes them), the
torch-free schedule simulator (:mod:`hyperrecipe.pipeline.schedule`) and stage view
(:mod:`hyperrecipe.pipeline.view`), and any direct ``forward`` assignment (the rewriter installs
the stage edges and the placeholders).
"""

from hyperrecipe.runtime.pipeline.run import Pipeline, build_pipeline
from hyperrecipe.runtime.pipeline.stages import LossFn

__all__ = ["LossFn", "Pipeline", "build_pipeline"]
