"""PyTorch Lightning over a model with an applied plan: :class:`HyperrecipeStrategy`.

Lightning's ``ModelParallelStrategy`` leaves parallelizing to ``configure_model`` and does the
rest itself; over production shards (plain tensors that differ per rank) two of its steps are
wrong or refused:

- ``gradient_clip_val`` (norm) reaches ``Precision.clip_grad_by_norm``, which calls
  ``torch.nn.utils.clip_grad_norm_`` on each rank's shards: alone that is each rank's own
  norm (hyperrecipe's guard, :mod:`hyperrecipe.runtime.grads.torch_clip_guard`, now hands it
  the full norm while the installation lives). Here the strategy's precision plugin clips by
  norm with :meth:`Installation.clip_grad_norm_` (the full norm, as one process), however it is
  reached (``gradient_clip_val``, a ``configure_gradient_clipping`` that calls
  ``self.clip_gradients``, manual optimization); clipping by value is elementwise and left to
  Lightning.
- ``Trainer.fit(ckpt_path=...)`` refuses a checkpoint unless the model holds DTensor
  parameters ("Could not find a distributed model in the provided checkpoint state"). Saving
  already works (``get_model_state_dict`` of an applied model hands out DTensors with the
  plan's placements); loading here goes through the same torch APIs without that check, so a
  checkpoint resumes at the same or at another tp size.

- Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` (the per-parameter
  norms users log in ``on_before_optimizer_step``) reads ``p.grad.norm()``: on production shards
  each rank's shard's norm (a total measured 2.938 and 2.509 on the two ranks at tp=2 where one process has 3.864), and a
  plain function gives the strategy no seam. :func:`grad_norm` here takes the same arguments
  and returns the same keys with the plan's norms (:meth:`Installation.grad_norms`); import it
  instead of Lightning's.

Lightning's mesh has dims ``data_parallel`` and ``tensor_parallel``; the strategy builds the
recipe's mesh (``dp``, ``tp`` by default) with the same rank layout, so its distributed sampler
(split over ``data_parallel``) and the plan agree. With ``data_parallel_size > 1``
``fully_shard`` goes on ``dp`` after apply, which averages gradients over it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from hyperrecipe._files import open_regular
from hyperrecipe.errors import TrainerSetupError
from hyperrecipe.trainers.trainer_mesh import PIPELINE_ROUTE

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from hyperrecipe.recipe.schema import Recipe
    from hyperrecipe.runtime import Installation

__all__ = ["HyperrecipeStrategy", "grad_norm"]

_METADATA = "meta.pt"  # lightning.fabric.strategies.model_parallel._METADATA_FILENAME


class HyperrecipeStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose ``configure_model`` applies a hyperrecipe plan.

    Args:
        tensor_parallel_size: ranks per model replica (``"auto"``: every process of the node).
        data_parallel_size: model replicas (``"auto"``: the number of nodes); above 1 the
            recipe's mesh is ``[dp, tp]``.
        mode: ``"production"`` or ``"validate"``, as :func:`hyperrecipe.apply`.
        mesh_dims: the recipe's names for Lightning's ``data_parallel`` and
            ``tensor_parallel`` dims.
        **kwargs: as ``ModelParallelStrategy`` (``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``).

    Example::

        class LitLlama(L.LightningModule):
            def configure_model(self):
                self.inst = self.trainer.strategy.apply(self.model, "recipes/llama.yaml")
                self.inst.state.load_weights(ckpt_dir)

        L.Trainer(strategy=HyperrecipeStrategy(tensor_parallel_size=2), devices=2,
                  gradient_clip_val=1.0).fit(LitLlama(), loader)
    """

    def __init__(self, tensor_parallel_size: int | Literal["auto"] = "auto",
                 data_parallel_size: int | Literal["auto"] = 1, *,
                 mode: str = "production", mesh_dims: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size, **kwargs)
        self._mode = mode
        self._names = dict(mesh_dims or {"data_parallel": "dp", "tensor_parallel": "tp"})
        self.installation: Installation | None = None

    def apply(self, module: nn.Module, recipe: str | os.PathLike[str] | Recipe, *,
              fully_shard_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
              ) -> Installation:
        """Compile ``recipe`` for ``module`` on this strategy's mesh and apply it (call from
        ``LightningModule.configure_model``, on every rank). ``module`` may be on the meta
        device; then load its weights with the returned installation's ``load_weights``.

        With ``data_parallel_size > 1`` the recipe's mesh is ``[dp, tp]`` and ``fully_shard``
        goes on the ``dp`` dim after apply (FSDP2 averages gradients over it, as Lightning's
        strategy expects of ``configure_model``): on each module ``fully_shard_modules(module)``
        yields (innermost first, e.g. the decoder layers), then on ``module``."""
        from torch.distributed.device_mesh import init_device_mesh

        from hyperrecipe.api import compile_recipe, load_recipe
        from hyperrecipe.runtime import apply

        if self.installation is not None:
            msg = ("HyperrecipeStrategy.apply: a plan is already applied through this strategy "
                   "(configure_model ran twice?); one model per strategy")
            raise TrainerSetupError(msg)
        loaded = load_recipe(recipe) if isinstance(recipe, (str, os.PathLike)) else recipe
        if loaded.pipeline is not None:
            msg = (f"HyperrecipeStrategy.apply: recipe {loaded.name!r} has a pipeline section "
                   f"(schedule {loaded.pipeline.schedule}); Lightning's model-parallel strategy "
                   f"runs the whole model on every rank, not a pipeline schedule. Pipeline "
                   f"parallelism is not supported through Lightning: {PIPELINE_ROUTE}")
            raise TrainerSetupError(msg)
        dp_name, tp_name = self._names["data_parallel"], self._names["tensor_parallel"]
        dp = self.device_mesh["data_parallel"].size()
        tp = self.device_mesh["tensor_parallel"].size()
        wanted = (dp_name, tp_name) if dp > 1 else (tp_name,)
        if tuple(loaded.mesh) != wanted:
            msg = (f"HyperrecipeStrategy.apply: the recipe's mesh is {list(loaded.mesh)}; at "
                   f"data_parallel_size={dp} it must be {list(wanted)} (mesh_dims= renames "
                   f"Lightning's dims; a dp x tp recipe extends the tp one with mesh: "
                   f"[{dp_name}, {tp_name}])")
            raise TrainerSetupError(msg)
        shape = {dp_name: dp, tp_name: tp} if dp > 1 else {tp_name: tp}
        # Lightning's own mesh is (data_parallel, tensor_parallel) in rank order; this one has
        # the same layout under the recipe's names, so its sampler and the plan agree.
        mesh = init_device_mesh(self.root_device.type, tuple(shape.values()),
                                mesh_dim_names=tuple(shape))
        plan = compile_recipe(loaded, module, shape)
        inst = apply(module, plan, mesh, mode=self._mode)  # type: ignore[arg-type]
        if dp > 1:
            from torch.distributed.fsdp import fully_shard

            for inner in (fully_shard_modules(module) if fully_shard_modules else ()):
                fully_shard(inner, mesh=mesh[dp_name])
            fully_shard(module, mesh=mesh[dp_name])
        self.installation = inst
        return inst

    def teardown(self) -> None:
        """Lightning's teardown, once every rank got here (rank 0 may still be writing files
        only it writes; :func:`hyperrecipe.runtime.leave_together`)."""
        from hyperrecipe.runtime import leave_together

        if self.installation is not None:
            leave_together(self.installation, "HyperrecipeStrategy.teardown")
        super().teardown()

    def setup(self, trainer: pl.Trainer) -> None:
        if self.installation is None:
            msg = ("HyperrecipeStrategy: no plan was applied; call "
                   "self.trainer.strategy.apply(module, recipe) in the LightningModule's "
                   "configure_model()")
            raise TrainerSetupError(msg)
        self.precision_plugin = _clipping_by_plan(self.precision_plugin, self.installation)
        super().setup(trainer)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's own sharded load (``get_model_state_dict`` → ``dcp.load`` →
        ``load_state_dict``, the same for each optimizer) without its check that parameters
        are DTensors: the plan's state-dict hooks hand out DTensors for the shards, so DCP
        reshards to this mesh. The folder is read through hyperrecipe's trusted reader (its
        ``.metadata`` through an allow-list, not ``pickle``). Returns the metadata Lightning
        saved beside (loops, epoch)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        from hyperrecipe.runtime import trusted_reader

        path = Path(self.broadcast(checkpoint_path))
        if not (path / _METADATA).is_file():
            msg = (f"HyperrecipeStrategy: {path} is not a sharded Lightning checkpoint (no "
                   f"{_METADATA}); save with save_distributed_checkpoint=True (the default)")
            raise TrainerSetupError(msg)
        assert self.model is not None
        model_state = {"state_dict": get_model_state_dict(self.model)}
        # read as data: torch's own reader unpickles .metadata (a checkpoint could run code)
        dcp_load(model_state, storage_reader=trusted_reader(path))
        self.model.load_state_dict(model_state["state_dict"])
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp_load(optimizer_state, storage_reader=trusted_reader(path))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key])
        # not blocking, checked on the descriptor: a FIFO swapped in is refused, not waited on
        with os.fdopen(open_regular(path / _METADATA), "rb") as stream:
            metadata: dict[str, Any] = torch.load(stream, weights_only=(
                True if weights_only is None else weights_only))
        return metadata


def _clipping_by_plan(plugin: Precision, installation: Installation) -> Precision:
    """A copy of the trainer's precision plugin whose clipping by norm goes through the
    installation (a subclass of the plugin's own class, with its state). Lightning's
    mixed-precision plugins unscale before they reach ``clip_grad_by_norm``, so this sees the
    gradients one process would clip."""
    base = type(plugin)
    if getattr(base, "_hyperrecipe_clipping", False):
        return plugin

    def clip_grad_by_norm(self: Any, optimizer: torch.optim.Optimizer,
                          clip_val: float) -> None:
        installation.clip_grad_norm_(float(clip_val))

    cls = type(f"PlanClipping{base.__name__}", (base,),
               {"clip_grad_by_norm": clip_grad_by_norm, "_hyperrecipe_clipping": True,
                "__doc__": f"{base.__name__}, clipping by norm with the plan's full norm."})
    copy: Precision = object.__new__(cls)
    for name, value in vars(plugin).items():  # its state (plain attributes, no forward)
        setattr(copy, name, value)
    return copy


def grad_norm(module: nn.Module, norm_type: float | int | str,
              group_separator: str = "/") -> dict[str, torch.Tensor]:
    """``lightning.pytorch.utilities.grad_norm`` for a module trained under
    :class:`HyperrecipeStrategy`: each parameter's gradient norm and their total, with the same
    keys (``grad_{p}_norm/{name}``, ``grad_{p}_norm_total``), valued as one process values them
    on the whole model (:meth:`Installation.grad_norms`; a collective: call on every rank, as
    in ``on_before_optimizer_step``). Without a plan applied it is Lightning's own.

    Example::

        from hyperrecipe.trainers.lightning import grad_norm

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, norm_type=2))

    Raises:
        TrainerSetupError: ``module`` holds an applied plan's parameters but is not trained
            under :class:`HyperrecipeStrategy` (the plan's installation is not known here).
    """
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    inst = strategy.installation if isinstance(strategy, HyperrecipeStrategy) else None
    if inst is None:
        if any("_hyperrecipe_boundary" in vars(m) for m in module.modules()):
            msg = ("grad_norm: this module holds a model with an applied plan outside "
                   "HyperrecipeStrategy, so each parameter's norm would be this rank's "
                   "shard's; train it under HyperrecipeStrategy, or call "
                   "installation.grad_norms() on every rank")
            raise TrainerSetupError(msg)
        stock: dict[str, torch.Tensor] = lightning_grad_norm(  # tensors, typed float there
            module, norm_type, group_separator)  # type: ignore[assignment]
        return stock
    p = float(norm_type)
    if p <= 0:
        msg = f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {p}"
        raise ValueError(msg)
    planned = inst.grad_norms(p)
    fqn_of = {id(param): fqn for fqn, param in inst.model.named_parameters(remove_duplicate=False)}
    owner = {q.fqn: q.tied_to or q.fqn for q in inst.plan.params}
    norms: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        fqn = fqn_of.get(id(param))
        if fqn is None:  # a parameter beside the applied model: whole on every rank
            norms[f"grad_{p}_norm{group_separator}{name}"] = param.grad.data.norm(p)
        else:
            norms[f"grad_{p}_norm{group_separator}{name}"] = planned[owner.get(fqn, fqn)]
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.tensor(list(norms.values())).norm(p)
    return norms
