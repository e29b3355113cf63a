"""TRL's ``SFTTrainer`` over a model with an applied plan.

TRL's trainers subclass ``transformers.Trainer``, so :class:`HyperrecipeTrainerMixin` puts the
Trainer's seams right for them (DDP over the data dim only, batches, clipping, checkpoints). One
thing more: ``SFTTrainer`` patches the model with a fused LM head (``trl.trainer.utils.
add_fused_lm_head``) that runs the backbone and then multiplies by ``get_output_embeddings().
weight`` itself, outside the module's forward and so outside the plan's ``lm_head`` boundary.
On production shards that weight is this rank's vocab slice: the loss is scored over a part of
the vocabulary (measured at tp=2 on tiny Llama: 4.147 where one process has 4.841), silently.
TRL gathers a DTensor weight itself (``full_tensor()``), which is why validate mode was right.
:class:`HyperrecipeSFTTrainer` hands TRL's head, for the duration of ``compute_loss``, the full
weight as DTensor gathers it from the shards: forward an all-gather, backward this rank's slice
of the gradient (every model-parallel rank computes the same loss).

What does not live here: the Trainer's seams (:mod:`~hyperrecipe.integrations.hf_trainer`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from trl.trainer.sft_trainer import SFTTrainer

from hyperrecipe.errors import TrainerSetupError
from hyperrecipe.integrations.hf_trainer import HyperrecipeTrainerMixin
from hyperrecipe.placement import parse_dtensor

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime.installation import Installation

__all__ = ["HyperrecipeSFTTrainer", "full_output_embeddings"]


class HyperrecipeSFTTrainer(HyperrecipeTrainerMixin, SFTTrainer):  # type: ignore[misc,unused-ignore]
    """``trl.SFTTrainer`` for a model with an applied plan (call on every rank); arguments as
    ``SFTTrainer`` plus ``installation=``, refusals as :class:`HyperrecipeTrainerMixin`.

    Example::

        inst = hyperrecipe.apply(model, plan, mesh)
        trainer = HyperrecipeSFTTrainer(model=model, installation=inst, args=SFTConfig(...),
                                        train_dataset=data, processing_class=tokenizer)
        trainer.train()
    """

    handles_fused_lm_head = True

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        with full_output_embeddings(self.installation):
            return super().compute_loss(  # type: ignore[no-untyped-call]
                model, inputs, return_outputs, num_items_in_batch)


class _FullHead:
    """What TRL's fused head reads of ``get_output_embeddings()``: ``weight`` and ``bias``."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight = weight
        self.bias = bias


@contextmanager
def full_output_embeddings(inst: Installation) -> Iterator[None]:
    """While inside, ``model.get_output_embeddings()`` returns an object whose ``weight`` is
    the full output weight, gathered from this rank's shard each time it is asked for (with
    autograd: its gradient arrives at the shard). The module itself, and the model's own
    forward through the plan's boundary, are untouched. Nothing changes where the weight is
    already whole (replicated) or a DTensor (validate mode: TRL gathers it itself).

    Raises:
        TrainerSetupError: the output weight's placement has no DTensor form (fused parts).
    """
    model = inst.model
    head: Any = getattr(model, "get_output_embeddings")()  # noqa: B009 (a transformers method)
    weight = getattr(head, "weight", None)
    owner = _param_plan_of(inst, model, weight)
    if owner is None or owner.placement.is_replicate or inst.mode.parameters_are_dtensors:
        yield
        return
    if not owner.dtensor or owner.no_dtensor is not None:
        msg = (f"HyperrecipeSFTTrainer: the output embedding {owner.fqn} is placed "
               f"{owner.placement}, which has no DTensor form ({owner.no_dtensor}); TRL's fused "
               "LM head needs it gathered: keep it replicated or shard(0)")
        raise TrainerSetupError(msg)
    placements = parse_dtensor(owner.dtensor).torch_placements()

    def gathered() -> _FullHead:
        from torch.distributed.tensor import DTensor

        local = head.weight
        full = DTensor.from_local(local, inst.mesh, placements, run_check=False).full_tensor()
        return _FullHead(full, getattr(head, "bias", None))

    # an instance attribute shadows the class's method for TRL's lookup, and goes on exit
    vars(model)["get_output_embeddings"] = gathered
    try:
        yield
    finally:
        vars(model).pop("get_output_embeddings", None)


def _param_plan_of(inst: Installation, model: nn.Module, weight: Any) -> Any:
    """The plan entry of the parameter ``weight`` is (through a tie, its owner's)."""
    if weight is None:
        return None
    by_fqn = {p.fqn: p for p in inst.plan.params}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is weight and name in by_fqn:
            entry = by_fqn[name]
            return by_fqn.get(entry.tied_to, entry) if entry.tied_to else entry
    return None
