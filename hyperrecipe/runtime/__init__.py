"""The runtime: applying a plan to a live model on every rank.

The top of this package is the seam a trainer sees: ``install`` (``apply``: checks, parameter
sharding, head counts, boundaries, inner wrappers and adapters, all in one rewriter
transaction), ``installation`` (the ``Installation`` handle: model, plan, mode, mesh, gradients,
``restore``, and ``inst.state``, the training state's front; plus ``data_parallel``, ``fully_shard_data_parallel`` and
``leave_together``, the trainer glue that needs an installation) and ``mode`` (the ``Mode`` object ``apply`` chooses once, production or validate).
Below it, one room per trade; each room's ``__init__`` says what it owns and what it does not:

- ``preflight/``: what ``apply`` checks before touching the model (plan fit, rank agreement,
  the supported torch), and what the ranks check once at the first training forward (the same
  batch and the same dropout across each model-parallel group).
- ``comm/``: production collectives with their autograd duals, shard math, DTensor's strided
  shards.
- ``forward/``: the boundary wrapper body both modes share and what it calls per call
  (arguments, layouts, validate scope, marshalling, local kernels).
- ``features/``: adapters, inner wrappers, context parallel, local regions, expert parallel,
  the loss on vocab shards.
- ``grads/``: gradient buckets, the norm of the full gradients and clipping, the DDP guard,
  validate mode's optimizer-kernel refusal.
- ``pipeline/``: pipeline parallelism, one rank's stages of a plan's ``pipeline`` section run by
  a torch schedule (``build_pipeline``, ``Pipeline``); beside tensor parallel each stage model
  is applied, with ``apply`` handed in by this front's ``build_pipeline`` (the room imports
  ``preflight`` and ``state`` only, so it never imports the top back).
- ``state/``: the front ``inst.state`` (``TrainingState``), live parameters, loading weights,
  DCP state dicts and hooks, export, the integrity records of state files, materializing
  after a meta apply.

Everything above the runtime (``check``, ``verify``, ``simulate``, the trainers, ``api``)
imports from this package's front only, the names in ``__all__`` (tests/test_layering.py keeps
it so).

Imports point down this list's dependency order: ``comm`` and ``preflight`` import no other
room; ``forward`` imports ``comm``; ``features`` imports ``forward`` and ``comm``; ``state``
imports ``comm`` and ``preflight`` (its rank agreements live in ``preflight/agreement.py``);
``grads`` imports ``comm`` and ``state``'s ``LiveParams`` (tests/test_layering.py keeps it so).
Third-party knowledge (transformers' key conversions) lives in :mod:`hyperrecipe.models`.

What does not live here: resolving recipes or re-deciding anything the plan records (the
enclosing boundary of a parameter, its DTensor placement, the vocab-parallel lookup, the
expert-parallel kernel: the runtime reads them), wrapper declarations (the torch-free registry
in :mod:`hyperrecipe.wrappers`), and any direct assignment of ``forward`` (only
:mod:`hyperrecipe.rewriter` does that). Compiling a recipe imports no module of this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hyperrecipe.plan import Plan
from hyperrecipe.runtime.comm.collectives import count_collectives, group_for
from hyperrecipe.runtime.comm.sharding import gather_full, local_shard
from hyperrecipe.runtime.features.local_region import runs_on_local_tensors
from hyperrecipe.runtime.features.vocab_loss import (
    VocabShardedLogits,
    plain_vocab_slice,
    vocab_parallel_cross_entropy,
)
from hyperrecipe.runtime.forward.arguments import declared_argument, get_output
from hyperrecipe.runtime.install import apply
from hyperrecipe.runtime.installation import (
    Installation,
    data_parallel,
    fully_shard_data_parallel,
    leave_together,
)
from hyperrecipe.runtime.mode import PRODUCTION, VALIDATE, Mode, ModeName, as_mode
from hyperrecipe.runtime.pipeline import LossFn, Pipeline
from hyperrecipe.runtime.pipeline import build_pipeline as _build_pipeline
from hyperrecipe.runtime.state.dcp_reader import trusted_reader
from hyperrecipe.runtime.state.front import StatusRow, TrainingState
from hyperrecipe.runtime.state.integrity import is_committed
from hyperrecipe.runtime.state.materialize import shards_on_meta

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh



def build_pipeline(model: nn.Module, plan: Plan, mesh: DeviceMesh, *,
                   mode: ModeName = "production", loss_fn: LossFn | None = None) -> Pipeline:
    """Make ``model`` this rank's share of the plan's pipeline; beside tensor parallel each stage
    model is applied with its share of the plan in ``mode``. See
    :func:`hyperrecipe.runtime.pipeline.build_pipeline` for the arguments, what it returns and
    raises; this is that function with :func:`apply` handed in."""
    return _build_pipeline(model, plan, mesh, mode=mode, loss_fn=loss_fn, apply_fn=apply)


__all__ = [
    # what a trainer uses
    "PRODUCTION", "VALIDATE", "Installation", "Mode", "ModeName", "StatusRow", "TrainingState",
    "apply", "as_mode", "data_parallel", "fully_shard_data_parallel", "is_committed",
    "leave_together", "vocab_parallel_cross_entropy", "Pipeline", "build_pipeline",
    "VocabShardedLogits", "trusted_reader",
    # what the tools above the runtime read (check, verify, simulate, the trainers' own
    # initializers): shard math, the mesh dim groups, a boundary's declared values
    "count_collectives", "declared_argument", "gather_full", "get_output", "group_for",
    "local_shard", "plain_vocab_slice", "runs_on_local_tensors", "shards_on_meta",
]
