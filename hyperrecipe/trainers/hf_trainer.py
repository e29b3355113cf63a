"""The Hugging Face ``Trainer`` over a model with an applied plan.

Run under ``torchrun`` (or any launch with a process group), the stock ``Trainer`` assumes every
rank holds the whole model: accelerate wraps it in ``DistributedDataParallel`` over the world
group (refused by the DDP guard: it would overwrite and average different shards), splits each
batch over every rank (tensor-parallel ranks must see the same batch), clips with
``torch.nn.utils.clip_grad_norm_`` (each rank's norm of its own shards: silently wrong on
production shards), and writes ``optimizer.pt`` and the weights from rank 0 alone (rank 0's
shards). :class:`HyperrecipeTrainer` meets each of these at the Trainer's own seams:

- the model "owns its placement and gradient reduction" (``is_distributed_loading_by_
  transformers``, the Trainer's flag for a model sharded at load time), so accelerate wraps
  nothing; data parallel is DDP over the plan's data dim only (``trainer_mesh``), or none;
- the sampler splits batches over the data dim only, and ``get_tp_size`` says how many ranks
  share a batch, which the Trainer uses for ``num_items_in_batch`` and the loss scale;
- ``max_grad_norm`` clips with :meth:`Installation.clip_grad_norm_`, and the logged
  ``grad_norm`` is :meth:`Installation.grad_norm` (both equal one process);
- the counters it logs (``num_input_tokens_seen`` and ``train_tokens_per_second``,
  ``total_flos``, ``evaluate()``'s steps per second) count each batch once, not once per
  model-parallel rank holding a copy of it;
- ``save_steps`` writes the weights with :meth:`TrainingState.save_pretrained` (consolidated:
  ``from_pretrained`` loads them) and model plus optimizer through DCP
  (:meth:`TrainingState.state_dict`), so ``resume_from_checkpoint`` resumes on any mesh.

Settings that cannot be right here are refused by name at construction (:class:`TrainerSetupError`).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Trainer

from hyperrecipe._files import open_regular
from hyperrecipe.errors import TrainerSetupError
from hyperrecipe.trainers.trainer_mesh import (
    DataParallel,
    data_parallel_of,
    gather_over_data_dim,
    refuse_pipeline,
)

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime import Installation

__all__ = ["DCP_FOLDER", "HyperrecipeTrainer", "HyperrecipeTrainerMixin"]

DCP_FOLDER = "hyperrecipe-dcp"
"""The folder inside each ``checkpoint-N`` holding model and optimizer state for DCP."""

_SCHEDULER = "scheduler.pt"

if TYPE_CHECKING:  # pragma: no cover
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class HyperrecipeTrainerMixin(_TrainerBase):
    """The seams of :class:`HyperrecipeTrainer`, for any subclass of ``transformers.Trainer``
    (TRL's trainers): put it first, ``class MyTrainer(HyperrecipeTrainerMixin, SFTTrainer)``,
    and construct with ``installation=`` as :class:`HyperrecipeTrainer`.

    Args:
        installation: what ``hyperrecipe.apply`` returned for ``model``.
        *args, **kwargs: as ``Trainer``; ``model`` must be the applied model itself.

    Raises:
        TrainerSetupError: ``model`` is not the installation's model; the mesh has several
            data dims or does not span the world; a setting that cannot be right on shards
            (DeepSpeed, FSDP through accelerate, ``nn.DataParallel`` over several GPUs in one
            process, ``save_safetensors=False``, ``torch.compile`` through the Trainer), or the
            model is on another device than the Trainer's (move it before ``apply``).

    Example::

        inst = hyperrecipe.apply(model, plan, mesh)
        inst.state.load_weights(ckpt_dir)
        trainer = HyperrecipeTrainer(model=model, installation=inst, args=TrainingArguments(
            output_dir="out", max_grad_norm=1.0, save_steps=100), train_dataset=data)
        trainer.train()                       # resume: trainer.train(resume_from_checkpoint=True)
    """

    def __init__(self, *args: Any, installation: Installation, **kwargs: Any) -> None:
        refuse_pipeline(installation, trainer=type(self).__name__)
        model = kwargs.get("model", args[0] if args else None)
        if model is not installation.model:
            msg = ("HyperrecipeTrainer: model= must be the model the installation was applied to "
                   f"(got {type(model).__name__}, applied to "
                   f"{type(installation.model).__name__}); wrappers go on after the Trainer")
            raise TrainerSetupError(msg)
        self.installation = installation
        self.data_parallel: DataParallel = data_parallel_of(installation,
                                                            trainer="HyperrecipeTrainer")
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        _refuse_unhandled_fused_head(self)
        # The Trainer's own seam for a model that owns placement and gradient reduction:
        # accelerate then prepares autocast only, and wraps nothing (transformers'
        # `_prepare_for_training`).
        self.is_distributed_loading_by_transformers = True
        self._dp_wrapped: nn.Module | None = None
        self._eval_counted: tuple[str, int | None] | None = None  # the last evaluation_loop's

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; then every rank waits for the others to finish it (rank 0
        writes the last checkpoint's own files alone), so a script that ends here tears the
        process group down on every rank together (:func:`hyperrecipe.runtime.leave_together`)."""
        from hyperrecipe.runtime import leave_together

        result = super().train(*args, **kwargs)
        leave_together(self.installation, f"{type(self).__name__}.train")
        return result

    # -- where the model lives ------------------------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The model stays where ``apply`` put it. The Trainer's ``model.to(args.device)``
        runs before it hears that the model owns its placement; in validate mode ``to``
        replaces every DTensor parameter's tensor (``torch.utils.swap_tensors``, which
        ``Module._apply`` uses for tensor subclasses), which is what left the embedding's
        gradient ``Replicate()`` under the Trainer before the runtime re-bound gradient hooks
        after moves. A model on another device is refused: move it before ``apply``."""
        wrong = sorted({str(p.device) for p in model.parameters()
                        if p.device.type != torch.device(device).type})
        if wrong:
            msg = (f"HyperrecipeTrainer: the model's parameters are on {wrong}, the Trainer's "
                   f"device is {device}; move the model to {device} before "
                   "hyperrecipe.apply (the Trainer does not move an applied model: apply placed "
                   "its shards, and the plan's process groups, on their devices)")
            raise TrainerSetupError(msg)

    # -- data parallel over the data dim only ----------------------------------------------

    def get_tp_size(self) -> int:
        """How many ranks see each batch: the Trainer divides ``num_items_in_batch`` (gathered
        over the world) and scales the loss by it."""
        if getattr(self, "_counting_locally", False):
            return 1
        return self.data_parallel.model_parallel

    def _get_num_items_in_batch(self, *args: Any, **kwargs: Any) -> Any:
        """With ``average_tokens_across_devices`` the Trainer gathers the count over the
        world, where each batch is counted once per rank that sees it: dividing by
        :meth:`get_tp_size` undoes that. Without it the count is this rank's own, which the
        Trainer still divides by ``get_tp_size()``: the loss came out tp times too large. So
        it counts as one rank."""
        if self.args.average_tokens_across_devices:
            return super()._get_num_items_in_batch(*args, **kwargs)
        self._counting_locally = True
        try:
            return super()._get_num_items_in_batch(*args, **kwargs)
        finally:
            self._counting_locally = False

    # -- the numbers the Trainer logs: each batch counted once -------------------------------

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """``include_num_input_tokens_seen``: the Trainer adds this batch's token count
        gathered over the world, where every model-parallel rank holds a copy of the batch
        (``num_input_tokens_seen`` and ``train_tokens_per_second`` measured 256 per step at
        tp=2 against 128 in one process). Each copy counts the same, so the world's sum
        divided by the ranks that share a batch is the data ranks' sum."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # type: ignore[no-untyped-call]
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self.data_parallel.model_parallel

    def floating_point_ops(self, inputs: dict[str, torch.Tensor | Any]) -> int:
        """``total_flos``: the Trainer counts ``6 · tokens · model.num_parameters()`` on each
        rank and sums over the world. On an applied plan each rank's count is of its own
        shards (replicated parameters once per rank) and the model-parallel ranks share one
        batch: here each rank counts the whole model's non-embedding parameters (the plan's
        global shapes) over its share of the batch, so the world's sum is one process's."""
        flos = super().floating_point_ops(inputs)
        local = self._local_parameter_count()
        if not flos or not local:
            return flos
        whole = _whole_parameter_count(self.installation)
        return flos * whole // (local * self.data_parallel.model_parallel)

    def _local_parameter_count(self) -> int:
        count = getattr(self.model, "num_parameters", None)
        return int(count(exclude_embeddings=True)) if callable(count) else 0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``evaluate()``'s ``eval_steps_per_second``: the Trainer counts its steps as the
        samples over ``eval_batch_size × world_size``, where only the data ranks see
        different batches (the steps came out tp times too few)."""
        seen = self._eval_counted
        if seen is not None:
            prefix, samples = seen
            key = f"{prefix}_steps_per_second"
            if key in logs and samples:
                batch = self.args.eval_batch_size
                stock = math.ceil(samples / (batch * self.args.world_size))
                right = math.ceil(samples / (batch * self.data_parallel.size))
                logs[key] = round(logs[key] * right / stock, 3)
                self._eval_counted = None
        super().log(logs, start_time)

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        if not training or self.data_parallel.group is None:
            return model
        if self._dp_wrapped is None:
            # DDP over the ranks that hold this rank's shards, with the plan's bucketed
            # gradients left to the plan (hyperrecipe.runtime.data_parallel)
            from hyperrecipe.runtime import data_parallel

            self._dp_wrapped = data_parallel(self.installation, self.data_parallel.group,
                                             module=model)
        return self._dp_wrapped

    def _sync_replicated_trainable_parameters(self, model: nn.Module) -> None:
        """The Trainer would broadcast plain parameters from rank 0 to the world and average
        their gradients over it: right for a model whose shards are DTensors, wrong for
        production shards (plain tensors that differ per rank). The plan reduces gradients
        itself, and DDP over the data dim averages them."""

    def get_train_dataloader(self) -> Any:
        return self._split_over_data_dim(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._split_over_data_dim(super().get_eval_dataloader(eval_dataset))

    def _split_over_data_dim(self, loader: Any) -> Any:
        """accelerate split the batches over every rank; here ranks that share a data index
        (the model-parallel ranks of one replica) get the same batches. Over several data
        ranks the last batch is padded as accelerate pads it under DDP."""
        if self.args.world_size == 1:
            return loader
        sampler = getattr(loader, "batch_sampler", None)
        if sampler is None or not hasattr(sampler, "num_processes"):
            msg = ("HyperrecipeTrainer: the train dataset is iterable (or its loader has no "
                   "batch sampler that accelerate split over the ranks); only map-style datasets "
                   "can be split over the data dim here. Use a map-style dataset "
                   "(datasets.Dataset, a list)")
            raise TrainerSetupError(msg)
        sampler.num_processes = self.data_parallel.size
        sampler.process_index = self.data_parallel.rank
        if self.data_parallel.size == 1:
            # One stream of batches, as in one process: no padding of the last batch with
            # samples from the start (accelerate pads so that processes get equal batches).
            sampler.even_batches = False
        return loader

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Metrics gathered over the data dim only: the Trainer gathers every prediction
        step's losses, logits and labels over the world, where the model-parallel ranks hold
        copies of one batch (with the last batch padded as well, eval_loss measured 4.815 at
        tp=2 against one process's 4.840: 7 samples in batches of 3). The Trainer resets
        ``gather_function`` after each loop, so it is set again before each."""
        self.gather_function = self._gather_over_data_dim
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        self._eval_counted = (prefix, output.num_samples)
        return output

    def _gather_over_data_dim(self, data: Any, use_gather_object: bool = False) -> Any:
        """``accelerator.gather_for_metrics`` over the ranks that see different batches."""
        if use_gather_object:
            msg = ("HyperrecipeTrainer: eval_use_gather_object=True is not supported on an "
                   "applied plan; gather tensors")
            raise TrainerSetupError(msg)
        return gather_over_data_dim(data, self.data_parallel, self.accelerator.gradient_state)

    # -- clipping and the logged norm ------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """``max_grad_norm``: the norm of the full gradients, as one process clips, taken
        after the loss scale (``fp16=True``) is taken off them, as accelerate's
        ``clip_grad_norm_`` does: clipping the scaled gradients shrank every step by the
        scale."""
        self.accelerator.unscale_gradients()
        return self.installation.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # no clipping (max_grad_norm 0): the norm of unscaled gradients
            self.accelerator.unscale_gradients()
            grad_norm = self.installation.grad_norm()
        return grad_norm

    # -- checkpoints -----------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        """Consolidated weights that ``from_pretrained`` loads, gathered one tensor at a time
        (every rank takes part, rank 0 writes); the rest as the Trainer saves it."""
        folder = str(output_dir if output_dir is not None else self.args.output_dir)
        if state_dict is not None:
            msg = ("HyperrecipeTrainer: saving a given state_dict is not supported on an applied "
                   "plan (its tensors are this rank's shards); call save_model() without one")
            raise TrainerSetupError(msg)
        self.installation.state.save_pretrained(folder)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)
        torch.save(self.args, os.path.join(folder, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Model and optimizer state as DCP (each shard stored once, reshardable) with the
        installation's commit record (a save that died halfway is refused at resume); the
        scheduler as the Trainer writes it."""
        self.installation.state.save_checkpoint(os.path.join(output_dir, DCP_FOLDER),
                                          _torch_optimizer(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        """Each rank reads its slices of the consolidated weights (any tp size)."""
        self.installation.state.load_weights(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: each rank reads its slices of the best checkpoint's
        consolidated weights (the Trainer would read whole tensors on every rank)."""
        best = self.state.best_model_checkpoint
        if best is not None:
            self.installation.state.load_weights(best)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, DCP_FOLDER)
        if not os.path.isdir(folder):
            msg = (f"HyperrecipeTrainer: {checkpoint} has no {DCP_FOLDER}/ folder (model and "
                   f"optimizer state); it was not written by HyperrecipeTrainer. Load its weights "
                   f"with installation.state.load_weights() and train without resume_from_checkpoint")
            raise TrainerSetupError(msg)
        # read as data (torch's dcp.load unpickles .metadata: a checkpoint could run code),
        # and refused if its commit record says it is half-written or written again
        self.installation.state.load_checkpoint(folder, _torch_optimizer(self.optimizer))
        scheduler = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            # not blocking, checked on the descriptor: a FIFO swapped in is refused, not waited on
            with os.fdopen(open_regular(scheduler), "rb") as stream:
                self.lr_scheduler.load_state_dict(torch.load(stream, weights_only=True))


class HyperrecipeTrainer(HyperrecipeTrainerMixin, Trainer):
    """``transformers.Trainer`` for a model with an applied plan (call on every rank); see
    :class:`HyperrecipeTrainerMixin` for the arguments and what is refused."""


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` holds the torch optimizer the hooks know."""
    inner = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(inner, torch.optim.Optimizer)
    return inner


def _whole_parameter_count(inst: Installation) -> int:
    """What ``PreTrainedModel.num_parameters(exclude_embeddings=True)`` counts on the whole
    model: each parameter (ties once) by its global shape in the plan."""
    model = inst.model
    shapes = {p.fqn: p.shape for p in inst.plan.params}
    embeddings = {f"{name}.weight" for name, module in model.named_modules()
                  if isinstance(module, nn.Embedding)}
    total = 0
    for name, param in model.named_parameters():
        if name in embeddings:
            continue
        shape = shapes.get(name)
        total += math.prod(shape) if shape is not None else param.numel()
    return total


def _refuse_unhandled_fused_head(trainer: Any) -> None:
    """TRL's trainers patch the model with a fused LM head that multiplies by the output
    weight outside the plan's ``lm_head`` boundary: on production shards, this rank's vocab
    slice only. ``hyperrecipe.trainers.trl`` hands it the full weight (SFT); any other
    trainer that patched it is refused."""
    patched = trainer.model.__dict__.get("forward")
    code = getattr(patched, "__code__", None)
    if code is None or "add_fused_lm_head" not in code.co_qualname:
        return
    if getattr(trainer, "handles_fused_lm_head", False):
        return
    if trainer.installation.mode.parameters_are_dtensors:
        return  # TRL gathers a DTensor weight itself
    msg = (f"HyperrecipeTrainer: {type(trainer).__name__} patched the model with TRL's fused LM "
           "head, which multiplies by the output weight outside the plan's lm_head boundary: "
           "on production shards it scores this rank's vocab slice only. Use "
           "hyperrecipe.trainers.trl.HyperrecipeSFTTrainer (SFT) or HyperrecipeDPOTrainer "
           "(DPO), or validate mode")
    raise TrainerSetupError(msg)


def _refuse_unsupported(trainer: Any) -> None:
    """Settings whose wrapping, clipping or saving would bypass the seams above."""
    args = trainer.args
    refusals = {
        "deepspeed": (trainer.is_deepspeed_enabled,
                      "DeepSpeed wraps and partitions the model itself"),
        "fsdp": (trainer.is_fsdp_enabled or bool(args.fsdp),
                 "accelerate's FSDP would shard the shards over the world; call fully_shard on "
                 "the data dim after apply instead (docs/training.md)"),
        "n_gpu": (args.n_gpu > 1, "nn.DataParallel copies the model to every GPU of one "
                  "process; launch one process per GPU"),
        "save_safetensors": (not getattr(args, "save_safetensors", True),
                             "the weights are written as safetensors"),
        "torch_compile": (bool(args.torch_compile),
                          "compile after apply, on the model (docs/training.md)"),
    }
    for name, (bad, why) in refusals.items():
        if bad:
            msg = f"HyperrecipeTrainer: {name} is not supported on an applied plan: {why}"
            raise TrainerSetupError(msg)
