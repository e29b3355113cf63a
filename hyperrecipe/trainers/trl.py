"""TRL's ``SFTTrainer`` and ``DPOTrainer`` over a model with an applied plan.

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
:class:`HyperrecipeDPOTrainer` does the same for ``DPOTrainer``, whose policy
log-probabilities go through that head in ``compute_loss``. A separate ``ref_model`` must be a
plain model
(whole on every rank, frozen): an applied one's head would read its own vocab slice, and it is
refused by name.

What does not live here: the Trainer's seams (:mod:`~hyperrecipe.trainers.hf_trainer`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.sft_trainer import SFTTrainer

from hyperrecipe.errors import TrainerSetupError
from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainerMixin
from hyperrecipe.placement import parse_dtensor

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime import Installation

__all__ = ["HyperrecipeDPOTrainer", "HyperrecipeSFTTrainer", "full_output_embeddings"]


def _count_each_batch_once(trainer: Any) -> None:
    """TRL's SFT and DPO trainers add to ``num_tokens`` (every log line) the batch's token
    count gathered over the world, divided by ``_tp_size``, which they read from accelerate's
    ``ParallelismConfig`` (none here: 1). Every model-parallel rank of an applied plan holds a
    copy of the batch, so it is the ranks that share one (``num_tokens`` measured 190 at tp=2
    against 95 in one process). Their other gathered metrics are means of copies or ratios of
    sums, which copies leave as they are."""
    if not hasattr(trainer, "_tp_size"):
        msg = (f"{type(trainer).__name__}: this TRL version has no _tp_size (the divisor of its "
               "gathered token counts); its num_tokens would count each batch once per "
               "model-parallel rank. Use the TRL version in hyperrecipe's 'trainers' extra")
        raise TrainerSetupError(msg)
    trainer._tp_size = trainer.data_parallel.model_parallel


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _count_each_batch_once(self)

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        with full_output_embeddings(self.installation):
            return super().compute_loss(  # type: ignore[no-untyped-call]
                model, inputs, return_outputs, num_items_in_batch)


class HyperrecipeDPOTrainer(HyperrecipeTrainerMixin, DPOTrainer):  # type: ignore[misc,unused-ignore]
    """``trl.DPOTrainer`` for a model with an applied plan (call on every rank); arguments as
    ``DPOTrainer`` plus ``installation=``, refusals as :class:`HyperrecipeTrainerMixin`.

    The reference model is ``ref_model=`` given as a plain model (the whole frozen model on
    every rank), or a copy of the policy with the same plan applied, with its installation as
    ``ref_installation=``: its fused head gets its gathered output weight as the policy's does.
    A plain ``ref_model`` with the policy's parameter names and shapes gets the policy's plan
    applied here, in place (on the policy's mesh, in its mode), so that it too is scored by
    the policy's own program and holds only its shards: at equal weights (step 1) its
    log-probabilities equal the policy's bit for bit, as in one process, where a whole
    reference differs by rounding (1e-7: the row-parallel sums), which TRL's
    ``rewards/accuracies`` (``chosen > rejected``) counted as 0.5 instead of one process's 0.0.
    A plain reference of another architecture, and any plain reference with
    ``precompute_ref_log_probs=True`` (TRL scores it once, before training, over batches split
    over every rank, which a sharded reference cannot run), stays whole.

    Raises:
        TrainerSetupError: ``ref_model`` is a model with an applied plan and no
            ``ref_installation`` (its fused head would score its own vocab slice in production
            mode), or with ``precompute_ref_log_probs``; ``sync_ref_model``; no ``ref_model`` with
            ``precompute_ref_log_probs=True`` (TRL would score the reference with the applied
            policy over batches it split over every rank, so the model-parallel ranks of a
            replica would run one forward on different batches).

    Example::

        inst = hyperrecipe.apply(model, plan, mesh)
        trainer = HyperrecipeDPOTrainer(model=model, ref_model=frozen_copy, installation=inst,
                                        args=DPOConfig(...), train_dataset=pairs,
                                        processing_class=tokenizer)
        trainer.train()
    """

    handles_fused_lm_head = True

    def __init__(self, *args: Any, ref_installation: Installation | None = None,
                 **kwargs: Any) -> None:
        ref = kwargs.get("ref_model")
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if ref_installation is not None and ref is not ref_installation.model:
            msg = ("HyperrecipeDPOTrainer: ref_installation= must be the installation of "
                   f"ref_model (got ref_model {type(ref).__name__}, the installation's model "
                   f"{type(ref_installation.model).__name__})")
            raise TrainerSetupError(msg)
        if isinstance(ref, nn.Module) and _applied(ref) and ref_installation is None:
            msg = (f"HyperrecipeDPOTrainer: ref_model ({type(ref).__name__}) has an applied "
                   "plan; TRL's fused LM head would multiply by its output weight outside the "
                   "plan's lm_head boundary, this rank's vocab slice in production mode. Pass "
                   "its installation too (ref_installation=), or the reference as a plain "
                   "model (whole and frozen on every rank)")
            raise TrainerSetupError(msg)
        if ref_installation is not None and getattr(config, "precompute_ref_log_probs", False):
            msg = ("HyperrecipeDPOTrainer: precompute_ref_log_probs=True with an applied "
                   "ref_model: TRL scores it over batches split over every rank (the "
                   "model-parallel ranks of a replica must share each batch) after hashing its "
                   "DTensor state dict; score it during training (the default) or pass a plain "
                   "ref_model")
            raise TrainerSetupError(msg)
        if getattr(config, "sync_ref_model", False):
            msg = ("HyperrecipeDPOTrainer: sync_ref_model=True mixes the policy's parameters "
                   "into the reference's one by one, which is untested on an applied plan (a "
                   "plain reference is whole, the policy's parameters are shards); leave it off")
            raise TrainerSetupError(msg)
        if ref is None and getattr(config, "precompute_ref_log_probs", False):
            msg = ("HyperrecipeDPOTrainer: precompute_ref_log_probs=True without a ref_model "
                   "scores the reference with the applied policy over batches TRL splits over "
                   "every rank (and hashes its state dict, whose shards are DTensors: TRL fails "
                   "there with '.numpy() is not supported for tensor subclasses'); the "
                   "model-parallel ranks of a replica must run each forward on one batch. Pass "
                   "ref_model= a plain copy of the initial model (whole and frozen on every "
                   "rank), with or without precompute_ref_log_probs")
            raise TrainerSetupError(msg)
        policy = kwargs.get("installation")
        if (ref_installation is None and isinstance(ref, nn.Module) and policy is not None
                and not getattr(config, "precompute_ref_log_probs", False)
                and _fits_plan(ref, policy.plan)):
            ref_installation = _score_by_the_policy_s_program(ref, policy)
        self.ref_installation = ref_installation
        super().__init__(*args, **kwargs)
        _count_each_batch_once(self)

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        with full_output_embeddings(self.installation), self._full_reference_head():
            return super().compute_loss(  # type: ignore[no-untyped-call]
                model, inputs, return_outputs, num_items_in_batch)

    def compute_ref_log_probs(self, model: nn.Module, inputs: Any) -> Any:
        with full_output_embeddings(self.installation), self._full_reference_head():
            return super().compute_ref_log_probs(model, inputs)  # type: ignore[no-untyped-call]

    @contextmanager
    def _full_reference_head(self) -> Iterator[None]:
        if self.ref_installation is None:
            yield
            return
        with full_output_embeddings(self.ref_installation):
            yield


def _fits_plan(ref: nn.Module, plan: Any) -> bool:
    """Whether ``ref`` has the parameters the policy's plan was compiled for: the same names
    and shapes (the same architecture and size), so that plan applies to it."""
    have = {name: tuple(p.shape) for name, p in ref.named_parameters(remove_duplicate=False)}
    want = {p.fqn: tuple(p.shape) for p in plan.params}
    return have == want


def _score_by_the_policy_s_program(ref: nn.Module, policy: Installation) -> Installation:
    """Apply the policy's plan to a plain ``ref_model`` (in place, on the policy's mesh and
    mode) so that the reference is scored by the policy's program. A whole reference is
    scored by another program than the sharded policy: the row-parallel layers' partial
    products are summed over ranks, in another order than one matmul sums them, and the
    hidden states differ by rounding (measured 1.5e-8 after the first tiny-Llama block, 8e-7
    after the second, at tp=2; the embedding and the column-parallel outputs are equal bit for
    bit). At equal weights (DPO's step 1) one process's policy and reference log-probabilities
    are equal bit for bit; with a whole reference at tp=2 they were 1e-7 apart, and TRL's
    ``rewards/accuracies`` (``chosen > rejected``) counted that rounding as 0.5 for one
    process's 0.0. Under the same plan they are equal again. Each rank then holds the
    reference's shards only."""
    from hyperrecipe.runtime import apply

    return apply(ref, policy.plan, policy.mesh, mode=policy.mode)


def _applied(model: nn.Module) -> bool:
    """Whether a plan was applied to ``model`` (its boundaries carry the rewriter's
    companion attribute)."""
    return any("_hyperrecipe_boundary" in vars(m) for m in model.modules())

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
