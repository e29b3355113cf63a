"""accelerate in your own loop over a model with an applied plan.

``Accelerator.prepare`` assumes every rank holds the whole model: on several processes it wraps
``DistributedDataParallel`` over the world (refused by the DDP guard: it would average different
shards), splits batches over every rank (ranks of one model replica must see the same batch),
steps an LR scheduler once per process, gathers metrics over every rank, and ``save_state``
writes rank 0's shards. accelerate's own tensor-parallel route
(``ParallelismConfig(tp_size=...)``) builds its mesh on accelerators and wants a model that
transformers sharded. :class:`HyperrecipeAccelerator` is an ``Accelerator`` that, for the model
handed to ``prepare(..., installation=inst)``, meets each of these where accelerate decides it:

- ``prepare_model``: accelerate prepares autocast only (no ``to()``, no wrap, as the
  Hugging Face Trainer asks for a model that owns its placement), then DDP over the plan's data
  dim only (:mod:`~hyperrecipe.trainers.trainer_mesh`), or none;
- ``prepare_data_loader``: accelerate's own splitting, over the data dim only, and a prepared
  scheduler steps once per data rank (accelerate steps it once per process);
  ``gather_for_metrics`` gathers over the data dim only;
- ``clip_grad_norm_`` over the model's parameters: :meth:`Installation.clip_grad_norm_` (the
  full norm, as one process clips; accelerate's own call reaches hyperrecipe's guard on torch's
  norm and is right too, this skips the detour);
- ``save_state`` / ``load_state``: accelerate's state (schedulers, samplers, RNG, the step,
  custom objects) as accelerate writes it, the model and its optimizers as DCP in
  ``hyperrecipe-dcp/`` (:meth:`TrainingState.save_checkpoint`), so ``load_state`` resumes on any
  mesh; ``save_model`` writes consolidated safetensors (:meth:`TrainingState.save_pretrained`).

Settings that cannot be right here are refused by name (:class:`TrainerSetupError`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from torch import nn

from hyperrecipe.errors import TrainerSetupError
from hyperrecipe.trainers.trainer_mesh import (
    DataParallel,
    data_parallel_of,
    gather_over_data_dim,
    refuse_pipeline,
)

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.runtime import Installation

__all__ = ["DCP_FOLDER", "HyperrecipeAccelerator"]

DCP_FOLDER = "hyperrecipe-dcp"
"""The folder inside a ``save_state`` folder holding the model and its optimizers for DCP."""

_NAME = "HyperrecipeAccelerator"


class HyperrecipeAccelerator(Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` for a model with an applied plan (call on every rank).

    Construct it as an ``Accelerator`` (it starts the process group as accelerate does), apply
    the plan, then hand the installation to ``prepare``. Everything not prepared with an
    installation is prepared as ``Accelerator`` prepares it.

    Example::

        accelerator = HyperrecipeAccelerator(cpu=True)
        inst = hyperrecipe.apply(model, plan, mesh)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader,
                                                       installation=inst)
        ...
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the plan's full norm
        accelerator.save_state("ckpt")          # accelerator.load_state("ckpt"): any tp size
    """

    installation: Installation | None = None
    data_parallel: DataParallel | None = None
    _models: list[Any]
    _optimizers: list[Any]

    def prepare(self, *args: Any, device_placement: list[bool] | None = None,
                installation: Installation | None = None) -> Any:
        """``Accelerator.prepare``; with ``installation``, its model (which must be among
        ``args`` or prepared before) is prepared as the module docstring says.

        Raises:
            TrainerSetupError: a second, different installation; ``args`` hold a model other
                than the installation's beside it, or an optimizer holding parameters that are
                not the model's (built before apply); a setting that cannot be right on shards
                (DeepSpeed, FSDP, Megatron-LM, XLA, a ``ParallelismConfig``, ``torch.compile``
                through accelerate, fp16 mixed precision, ``dispatch_batches=True``); the mesh
                has several data dims or does not span the world.
        """
        if installation is not None:
            refuse_pipeline(installation, trainer=_NAME)
            self._attach(installation, args)
        return super().prepare(*args, device_placement=device_placement)

    def _attach(self, inst: Installation, args: tuple[Any, ...]) -> None:
        if self.installation is not None and self.installation is not inst:
            msg = (f"{_NAME}: prepare() was given a second installation; one accelerator "
                   "prepares one applied model")
            raise TrainerSetupError(msg)
        others = [a for a in args if isinstance(a, nn.Module) and a is not inst.model]
        if others:
            msg = (f"{_NAME}: prepare(..., installation=inst) got a model other than the one "
                   f"the installation was applied to ({type(others[0]).__name__}); prepare "
                   "other models in a call of their own")
            raise TrainerSetupError(msg)
        mine = {id(p) for p in inst.model.parameters()}
        for opt in (a for a in args if isinstance(a, torch.optim.Optimizer)):
            stale = sum(id(p) not in mine for g in opt.param_groups for p in g["params"])
            if stale:
                msg = (f"{_NAME}: {type(opt).__name__} holds {stale} parameters that are not "
                       "the applied model's; apply replaces the parameters with this rank's "
                       "shards, so an optimizer built before apply would step the old ones "
                       "and train nothing: build the optimizer after hyperrecipe.apply")
                raise TrainerSetupError(msg)
        _refuse_unsupported(self)
        data_parallel = data_parallel_of(inst, trainer=_NAME)
        if self.installation is None:  # what was prepared so far, stock accelerate prepared
            _refuse_prepared_before(self, data_parallel)
        self.data_parallel = data_parallel
        self.installation = inst

    def _applied(self, model: nn.Module) -> bool:
        inst = self.installation
        return inst is not None and self.unwrap_model(model, keep_torch_compile=False) \
            is inst.model

    # -- wrapping and batches over the data dim only ---------------------------------------

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """The applied model: autocast as accelerate prepares it, not moved (apply placed the
        shards), then DDP over the data dim only."""
        if not self._applied(model):
            return super().prepare_model(model, device_placement, evaluation_mode)
        prepared = super().prepare_model(model, device_placement=False, evaluation_mode=True)
        assert self.data_parallel is not None and self.installation is not None
        group = self.data_parallel.group
        if evaluation_mode or group is None:
            return prepared
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        # the plan's bucketed gradients are left to the plan (hyperrecipe.runtime.data_parallel)
        from hyperrecipe.runtime import data_parallel

        wrapped = data_parallel(self.installation, group, module=prepared, **kwargs)
        if self.ddp_handler is not None:  # its comm_hook, as accelerate registers it
            self.ddp_handler.register_comm_hook(wrapped)
        self._models[self._models.index(prepared)] = wrapped
        return wrapped

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader[Any],
                            device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's splitting over the ranks that hold the same shards; the ranks of one
        model replica get the same batches."""
        dp = self.data_parallel
        if dp is None or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement,
                                               slice_fn_for_dispatch)
        from accelerate.data_loader import prepare_data_loader

        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=dp.size, process_index=dp.rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None
            else device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=False,
            # one stream of batches at one data rank, as in one process: no padding
            even_batches=self.even_batches and dp.size > 1,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate steps a scheduler once per process and step (each process's batches
        add up to the step's); here the batches add up over the data dim only."""
        prepared = super().prepare_scheduler(scheduler)
        dp = self.data_parallel
        if dp is None or type(prepared) is not AcceleratedScheduler:
            return prepared
        ours = _DataDimScheduler(prepared.scheduler, prepared.optimizers,
                                 step_with_optimizer=prepared.step_with_optimizer,
                                 split_batches=prepared.split_batches, data_size=dp.size)
        self._schedulers[self._schedulers.index(prepared)] = ours
        return ours

    def _warn_of_schedules_sized_by_every_process(self) -> None:
        """Once, where it can tell: a prepared schedule whose length is readable
        (:func:`_schedule_length`) and that the run stepped exactly a model-parallel factor
        short of its end, as a schedule sized by ``accelerator.num_processes`` is (transformers'
        no_trainer examples given ``--max_train_steps``). A schedule sized right, or one whose
        length cannot be read, says nothing (``prepare`` warned at every tp > 1 before)."""
        dp = self.data_parallel
        if dp is None or dp.model_parallel == 1 or getattr(self, "_schedule_warned", False):
            return
        for ours in self._schedulers:
            if not isinstance(ours, _DataDimScheduler) or not ours.step_with_optimizer:
                continue
            total = _schedule_length(ours.scheduler)
            stepped = int(getattr(ours.scheduler, "last_epoch", 0))
            if total is None or not 0 < stepped < total:
                continue
            if abs(total - stepped * dp.model_parallel) >= dp.model_parallel * dp.size:
                continue
            import warnings

            self._schedule_warned = True
            warnings.warn(
                f"{_NAME}: this LR schedule ({type(ours.scheduler).__name__}) spans {total} "
                f"steps and the run stepped it {stepped} times, once per data rank ({dp.size}) "
                f"per optimizer step: it was sized by accelerator.num_processes "
                f"({dp.size * dp.model_parallel}), as transformers' no_trainer examples size it "
                f"given --max_train_steps, and stopped {100 * stepped // total}% along. The "
                f"{dp.model_parallel} model-parallel ranks of a replica share its batches: size "
                f"the schedule as optimizer steps x {dp.size}",
                UserWarning, stacklevel=3)
            return

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Over the data dim only (accelerate gathers over the world, where the model-parallel
        ranks hold copies of each batch), the padding of the last batch dropped.

        Raises:
            TrainerSetupError: ``use_gather_object=True``.
        """
        dp = self.data_parallel
        if dp is None:
            return super().gather_for_metrics(input_data, use_gather_object)
        if use_gather_object:
            msg = (f"{_NAME}: gather_for_metrics(use_gather_object=True) is not supported on an "
                   "applied plan; gather tensors")
            raise TrainerSetupError(msg)
        return gather_over_data_dim(input_data, dp, self.gradient_state)

    # -- clipping --------------------------------------------------------------------------

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Over the applied model's parameters: :meth:`Installation.clip_grad_norm_`, the norm
        of the full gradients as one process clips. Anything else: accelerate's, which norms
        with torch's ``get_total_norm`` (hyperrecipe supplies the full norm of a subset of the
        model's gradients and refuses a mixture with other tensors by name)."""
        params = list(parameters)
        inst = self.installation
        if inst is not None and {id(p) for p in params} == {id(p) for p in
                                                            inst.model.parameters()}:
            self.unscale_gradients()
            return inst.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(params, max_norm, norm_type)  # type: ignore[no-any-return]

    # -- checkpoints -----------------------------------------------------------------------

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """accelerate's state as accelerate writes it, less the applied model and its
        optimizers, which go to ``<folder>/hyperrecipe-dcp`` as DCP (every rank writes its
        shards once; reshardable)."""
        if self.installation is None:
            return str(super().save_state(output_dir, safe_serialization,
                                          **save_model_func_kwargs))
        with self._without_applied() as (_, optimizer):
            location = str(super().save_state(output_dir, safe_serialization,
                                              **save_model_func_kwargs))
        assert self.installation is not None
        self.installation.state.save_checkpoint(os.path.join(location, DCP_FOLDER), optimizer)
        return location

    def load_state(self, input_dir: str | None = None, **load_model_func_kwargs: Any) -> None:
        """accelerate's state as accelerate reads it; the model and its optimizers from
        ``<folder>/hyperrecipe-dcp`` on any mesh (each rank reads its slices).

        Raises:
            TrainerSetupError: the folder has no ``hyperrecipe-dcp/`` (not written by
                :class:`HyperrecipeAccelerator`).
        """
        if self.installation is None:
            super().load_state(input_dir, **load_model_func_kwargs)
            return
        read: list[str] = []

        def remember(models: list[Any], folder: str) -> None:
            read.append(folder)

        handle = self.register_load_state_pre_hook(remember)
        try:
            with self._without_applied() as (_, optimizer):
                super().load_state(input_dir, **load_model_func_kwargs)
        finally:
            handle.remove()
        folder = os.path.join(read[0], DCP_FOLDER)
        if not os.path.isdir(folder):
            msg = (f"{_NAME}: {read[0]} has no {DCP_FOLDER}/ folder (the model and optimizer "
                   f"state); it was not written by {_NAME}.save_state. Load its weights with "
                   "installation.state.load_weights()")
            raise TrainerSetupError(msg)
        assert self.installation is not None
        self.installation.state.load_checkpoint(folder, optimizer)

    @contextmanager
    def _without_applied(self) -> Iterator[tuple[Any, torch.optim.Optimizer | None]]:
        """Hide the applied model and its optimizer from accelerate's lists while accelerate
        saves or loads the rest (it would write rank 0's shards, or read them on every rank)."""
        inst = self.installation
        assert inst is not None
        mine = {id(p) for p in inst.model.parameters()}
        models, optimizers = self._models, self._optimizers
        held = [o for o in optimizers
                if any(id(p) in mine for g in _inner(o).param_groups for p in g["params"])]
        if len(held) > 1:
            msg = (f"{_NAME}: {len(held)} optimizers hold the applied model's parameters; "
                   "save_state writes one with the model: use one optimizer with param groups")
            raise TrainerSetupError(msg)
        self._models = [m for m in models if not self._applied(m)]
        self._optimizers = [o for o in optimizers if o not in held]
        try:
            yield inst.model, (_inner(held[0]) if held else None)
        finally:
            self._models, self._optimizers = models, optimizers

    def end_training(self) -> None:
        """accelerate's ``end_training`` (trackers, then the process group torn down), once
        every rank got here: rank 0 may still be writing files only it writes, and a group
        torn down under a peer was seen to abort a rank at interpreter exit
        (:func:`hyperrecipe.runtime.leave_together`)."""
        from hyperrecipe.runtime import leave_together

        self._warn_of_schedules_sized_by_every_process()
        if self.installation is not None:
            leave_together(self.installation, f"{_NAME}.end_training")
        super().end_training()

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """The applied model's consolidated weights as safetensors that ``from_pretrained``
        loads (every rank takes part, rank 0 writes); other models as accelerate saves them."""
        if not self._applied(model):
            super().save_model(model, save_directory, max_shard_size, safe_serialization)
            return
        assert self.installation is not None
        self.installation.state.save_pretrained(save_directory)


def _refuse_prepared_before(accelerator: Any, dp: DataParallel) -> None:
    """Data loaders and schedulers that stock accelerate prepared before the installation
    arrived: a loader was split over every process, so the model-parallel ranks of one replica
    took different batches and the plan's collectives summed partial results of different
    inputs (tiny Llama at tp=2: each rank saw half the data, and the two reported different
    losses); a scheduler steps once per process. Refused, naming the order that works.

    Raises:
        TrainerSetupError: such a loader or scheduler exists and ranks share batches.
    """
    if dp.model_parallel == 1:
        return
    early = [f"{len(accelerator._dataloaders)} data loader(s)"] if accelerator._dataloaders \
        else []
    early += [f"{len(accelerator._schedulers)} LR scheduler(s)"] if accelerator._schedulers \
        else []
    if early:
        msg = (f"{_NAME}: {' and '.join(early)} were prepared before prepare(..., "
               f"installation=inst): accelerate split them over all {dp.size * dp.model_parallel} "
               f"processes, but the {dp.model_parallel} model-parallel ranks of a replica must "
               f"see the same batches. Prepare the model with its installation first, or all "
               f"together: accelerator.prepare(model, optimizer, loader, scheduler, "
               f"installation=inst)")
        raise TrainerSetupError(msg)


class _DataDimScheduler(AcceleratedScheduler):  # type: ignore[misc]
    """``AcceleratedScheduler`` that steps once per data rank, not once per process: the
    model-parallel ranks of a replica see the same batches."""

    def __init__(self, *args: Any, data_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_size = data_size

    def step(self, *args: Any, **kwargs: Any) -> None:
        if (not self.step_with_optimizer or self.split_batches
                or not self.gradient_state.sync_gradients):
            super().step(*args, **kwargs)
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.data_size):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycle without drop_last
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)


def _schedule_length(scheduler: Any) -> int | None:
    """How many steps an LR schedule spans, where it says: ``OneCycleLR.total_steps``,
    ``CosineAnnealingLR.T_max``, ``total_iters`` (``LinearLR``, ``ConstantLR``,
    ``PolynomialLR``), or the ``num_training_steps`` of a ``LambdaLR`` built by transformers'
    ``get_scheduler`` (a ``functools.partial``); otherwise ``None``."""
    for name in ("total_steps", "T_max", "total_iters"):
        value = getattr(scheduler, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    for function in getattr(scheduler, "lr_lambdas", ()):
        value = getattr(function, "keywords", {}).get("num_training_steps")
        if isinstance(value, int):
            return value
    return None


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` holds the torch optimizer the hooks know."""
    inner = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(inner, torch.optim.Optimizer)
    return inner


def _refuse_unsupported(accelerator: Accelerator) -> None:
    """Settings whose wrapping, batches, scaling or saving would bypass the seams above."""
    from accelerate.utils import DistributedType, DynamoBackend

    kind = accelerator.distributed_type
    dynamo = accelerator.state.dynamo_plugin
    refusals = {
        "DeepSpeed": (kind == DistributedType.DEEPSPEED,
                      "DeepSpeed wraps and partitions the model itself"),
        "FSDP": (kind == DistributedType.FSDP,
                 "accelerate's FSDP would shard the shards over the world; call fully_shard on "
                 "the data dim after apply instead (docs/training.md)"),
        "Megatron-LM": (kind == DistributedType.MEGATRON_LM, "Megatron-LM parallelizes itself"),
        "XLA": (kind == DistributedType.XLA, "untested on XLA"),
        "parallelism_config": (accelerator.parallelism_config is not None,
                               "the plan is the parallelism; accelerate's mesh would be another"),
        "torch.compile (dynamo_backend)": (
            dynamo is not None and dynamo.backend != DynamoBackend.NO,
            "compile after apply, on the model (docs/training.md)"),
        "fp16 mixed precision": (
            accelerator.mixed_precision == "fp16",
            "not tested through accelerate here (torch's GradScaler itself agrees on skipped "
            "steps across the mesh while the installation lives: docs/training.md); use bf16"),
        "dispatch_batches=True": (bool(accelerator.dispatch_batches),
                                  "rank 0 would slice each batch over every rank"),
    }
    for name, (bad, why) in refusals.items():
        if bad:
            msg = f"{_NAME}: {name} is not supported on an applied plan: {why}"
            raise TrainerSetupError(msg)
