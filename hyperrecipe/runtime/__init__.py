"""The runtime: applying a plan to a live model on every rank.

What lives here, one responsibility per module:

- ``install``: ``apply`` (checks, parameter sharding, head counts, boundaries, inner wrappers
  and adapters, all in one rewriter transaction) and ``installation``: the ``Installation``
  handle (status, full state dicts, gradient norms, restore).
- ``mode``: the ``Mode`` object ``apply`` chooses once (production or validate), the only code
  that knows which mode runs.
- ``boundary``: the wrapper body shared by both modes; ``arguments``: finding declared
  arguments and outputs; ``layouts``: the per-mode converters; ``validate_scope``: what a
  validate-mode compute runs under (a KV cache's first concatenation; boundaries called from
  local code); ``marshal``: moving values between DTensor and local tensors; ``compute``: the local kernels production needs;
  ``sharding``: shard layout math; ``collectives``: production collectives with their autograd
  duals, counted per step; ``grad_buckets``: the plan's gradient buckets, one flat collective
  each, run from post-accumulate-grad hooks in production.
- ``inner``: installing inner wrappers (fallback chains, hooks, the local-tensor edge);
  ``context_parallel``: the built-in attention wrappers (``cp_allgather_kv``, ``ulysses``).
- ``local_region``: boundaries whose forward runs on local tensors in both modes; ``experts``:
  the expert-parallel kernel such a region runs; ``token_dispatch``: its all-to-all token
  exchange when tokens are sharded; ``reach``: keeping every rank's backward in step when a
  region's code used nothing on one rank.
- ``adapters``: method and function adapters for third-party code.
- ``vocab_loss``: the loss on vocab shards (``loss_parallel``): the marked vocab-slice logits,
  the cross-entropy kernels (production: local shards, one all-gather; validate: DTensor),
  ``vocab_parallel_cross_entropy``, and the model's ``labels=`` loss on the shards.
- ``grad_norm``: the norm of the full gradients from the plan's placements (and a data-parallel
  wrapper's split), and clipping by it, equal to one process on every rank.
- ``state_hooks``: production's state-dict and optimizer hooks (local shards handed out as
  DTensors for DCP); ``optimizer_kernels``: validate mode's refusal, at ``optimizer.step()``,
  of torch's multi-tensor kernels over its mixed DTensor / plain parameters.
- ``agreement``: the ranks' fixed-size exchanges before and after installing (same plan, same
  mesh, every local check passed; the vote), each with a bounded wait.
- ``plan_fit``: an edited plan's names, shapes and shard dims checked against the model before
  anything is installed; ``ddp_guard``: refusing ``DistributedDataParallel`` over ranks that
  hold different shards; ``torch_support``: the oldest torch the runtime runs on, refused by
  name at apply.

What does not live here: resolving recipes or re-deciding anything the plan records (the
enclosing boundary of a parameter, its DTensor placement, the vocab-parallel lookup, the
expert-parallel kernel: the runtime reads them), wrapper declarations (the torch-free registry
in :mod:`hyperrecipe.wrappers`), and any direct assignment of ``forward`` (only
:mod:`hyperrecipe.rewriter` does that). Compiling a recipe imports no module of this package.
"""

from hyperrecipe.runtime.install import apply
from hyperrecipe.runtime.installation import Installation, StatusRow
from hyperrecipe.runtime.mode import PRODUCTION, VALIDATE, Mode

__all__ = ["PRODUCTION", "VALIDATE", "Installation", "Mode", "StatusRow", "apply"]
