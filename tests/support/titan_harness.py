"""Ranks for tests/trainers/test_torchtitan.py: torchtitan's Llama 3 trained under hyperrecipe's plan,
under torchtitan's own ``parallelize_llama``, and in one process, from the same seed and data.

Every run draws its weights in one process's order (``torch.manual_seed(SEED)`` then
``init_states`` on the full model), so all three start from the same values. torchtitan's own
run uses its classic DTensor backend (``spmd_backend="partial_dtensor"``; its default
``spmd_types`` backend has no CPU path through its FSDP wrapper at 0.3) with fp32 parameters
(its FSDP wrapper, applied even at dp=1, would otherwise cast to bf16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

SEED = 0
LR = 1e-2
MAX_NORM = 1.0
VOCAB = 256


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


#: Tiny torchtitan models by name: the builder in hyperrecipe.models.torchtitan and its
#: arguments besides the vocabulary.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("build_llama3", {}),
    "qwen3": ("build_qwen3", {}),
    "deepseek_v3": ("build_deepseek_v3", {}),  # q_lora_rank=0: wq, as its debugmodel
    "deepseek_v3_q_lora": ("build_deepseek_v3", {"q_lora_rank": 16}),  # wq_a, q_norm, wq_b
}


def materialized(model_name: str = "llama3") -> nn.Module:
    """``model_name``'s tiny torchtitan model (:data:`MODELS`) with the weights one process
    draws."""
    from hyperrecipe.models import torchtitan as builders

    builder, kwargs = MODELS[model_name]
    model: nn.Module = getattr(builders, builder)(vocab_size=VOCAB, **kwargs)
    torch.manual_seed(SEED)
    model.init_states()  # type: ignore[operator]
    return model


def parallel_dims(tp: int) -> Any:
    """torchtitan's ``ParallelDims`` for ``tp`` CPU ranks, mesh built, its DTensor backend set.

    torchtitan picks its device type once, at import, falling back to ``"cuda"`` when no
    accelerator is present; the CPU gloo ranks here name ``"cpu"`` instead.
    """
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed.utils import set_spmd_backend

    titan_dims.device_type = "cpu"  # type: ignore[attr-defined]
    set_spmd_backend("partial_dtensor")  # what torchtitan's trainer sets from its config
    dims = titan_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1,
                                   world_size=tp, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def loss_of(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from hyperrecipe.trainers.torchtitan import cross_entropy_loss

    return cross_entropy_loss(model(tokens), labels) / labels.numel()


def one_process(steps: int, model_name: str = "llama3") -> dict[str, Any]:
    """Losses of ``steps`` AdamW steps with clipping, and the first step's gradients."""
    model = materialized(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens, labels = batch()
    losses, grads = [], {}
    for step in range(steps):
        loss = loss_of(model, tokens, labels)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def hyperrecipe_run(rank: int, world: int, steps: int, clip: str = "installation",
                    model_name: str = "llama3") -> dict[str, Any]:
    """The plan as torchtitan's parallelize step; losses and the first step's full grads.
    ``clip``: ``installation`` (``inst.clip_grad_norm_``) or ``torchtitan`` (its Trainer's
    ``dist_utils.clip_grad_norm_``, torch's norm underneath)."""
    from hyperrecipe.trainers.torchtitan import installation_of, parallelize

    training = None
    if clip == "torchtitan":
        from torchtitan.config import TrainingConfig

        training = TrainingConfig()  # its default max_norm, 1.0
    model = parallelize(materialized(model_name), parallel_dims=parallel_dims(world),
                        training=training)
    inst = installation_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens, labels = batch()
    losses, grads = [], {}
    for step in range(steps):
        loss = loss_of(model, tokens, labels)
        loss.backward()
        if step == 0:
            grads = inst.full_grads()
        if clip == "torchtitan":
            from torchtitan.distributed import utils as dist_utils

            dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        else:
            inst.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def torchtitan_run(rank: int, world: int, steps: int) -> dict[str, Any]:
    """torchtitan's own ``parallelize_llama`` (TP + SP + loss parallel) on the same model."""
    from torch.distributed.tensor import DTensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    weights = materialized()
    config: Any = weights.config
    set_llama3_sharding_config(config, enable_sp=True)  # what its trainer does before build
    model = config.build()
    model.load_state_dict(weights.state_dict())
    model = parallelize_llama(
        model, parallel_dims=parallel_dims(world),  # type: ignore[arg-type]
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(tensor_parallel_degree=world,
                                      spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(), ac_config=None, dump_folder="")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens, labels = batch()
    losses, grads = [], {}
    for step in range(steps):
        loss = loss_of(model, tokens, labels)
        loss.backward()
        if step == 0:
            # clone: full_tensor() of a replicated grad is its storage, which clipping scales
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        full = loss.full_tensor() if isinstance(loss, DTensor) else loss
        losses.append(full.item())
    return {"losses": losses, "grads": grads}


def checkpoint_run(rank: int, world: int, folder: str, save_after: int | None,
                   steps: int) -> list[float]:
    """``steps`` steps under the plan; save a DCP checkpoint after ``save_after`` of them, or
    (``save_after=None``) resume from ``folder`` first."""
    import torch.distributed.checkpoint as dcp

    from hyperrecipe.trainers.torchtitan import installation_of, parallelize_llama

    model = parallelize_llama(materialized(), parallel_dims=parallel_dims(world))
    inst = installation_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if save_after is None:
        state = inst.state.state_dict(opt)
        dcp.load(state, checkpoint_id=folder)
        inst.state.load_state_dict(state, opt)
    tokens, labels = batch()
    losses = []
    for step in range(steps):
        loss = loss_of(model, tokens, labels)
        loss.backward()
        inst.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save_after is not None and step + 1 == save_after:
            dcp.save(inst.state.state_dict(opt), checkpoint_id=str(Path(folder)))
    return losses


def meta_trainer_order(rank: int, world: int, steps: int, model_name: str = "llama3"
                       ) -> dict[str, Any]:
    """torchtitan's Trainer's order: build on meta, parallelize, ``to_empty``,
    ``init_weights`` (seeded as one process seeds its ``init_states``), then train."""
    from torchtitan.components.loss import cross_entropy_loss as stock_loss

    from hyperrecipe.errors import LossParallelError
    from hyperrecipe.models import torchtitan as builders
    from hyperrecipe.trainers.torchtitan import installation_of, parallelize

    builder, kwargs = MODELS[model_name]
    with torch.device("meta"):
        model = getattr(builders, builder)(vocab_size=VOCAB, **kwargs)
    model = parallelize(model, parallel_dims=parallel_dims(world))
    inst = installation_of(model)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # type: ignore[operator]
    unset = [r.error for r in inst.state.status() if r.state == "unset"]
    tokens, labels = batch()
    refused = ""
    try:
        stock_loss(model(tokens), labels)
    except LossParallelError as exc:
        refused = str(exc)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, tokens, labels)
        loss.backward()
        inst.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "unset": unset, "refused": refused}


def dp_tp_run(rank: int, world: int, steps: int, on_meta: bool = False,
              save_to: str | None = None) -> dict[str, Any]:
    """dp=2 x tp=2: FSDP2 over torchtitan's ``fsdp`` dim after the plan; each dp rank trains on
    its half of the batch. Returns the dp-mean losses and the first step's full gradients.

    ``on_meta``: in torchtitan's Trainer's order (meta, parallelize, ``to_empty``,
    ``init_weights`` seeded as one process seeds ``init_states``) instead of from weights.
    ``save_to``: a DCP checkpoint (``inst.state.state_dict(opt)``) written there after the last step."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig, TrainingConfig

    from hyperrecipe.models.torchtitan import build_llama3

    from hyperrecipe.trainers.torchtitan import (
        installation_of,
        parallelize_llama,
    )

    parallel_dims(1)  # device type and DTensor backend, as for the other runs
    dims = titan_dims.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=world // 2, pp=1, ep=1,
                                   world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    if on_meta:
        with torch.device("meta"):
            model = build_llama3(vocab_size=VOCAB)
    else:
        model = materialized()
    model = parallelize_llama(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32", max_norm=float("inf")),
        parallelism=ParallelismConfig(tensor_parallel_degree=world // 2,
                                      data_parallel_shard_degree=2,
                                      enable_sequence_parallel=False,
                                      spmd_backend="partial_dtensor"))
    inst = installation_of(model)
    if on_meta:
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        with torch.no_grad():
            model.init_weights(buffer_device=None)  # type: ignore[operator]
    fsdp = dims.get_mesh("fsdp")
    dp = fsdp.get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens, labels = batch()
    losses, grads = [], {}
    for step in range(steps):
        loss = loss_of(model, tokens[dp:dp + 1], labels[dp:dp + 1])
        loss.backward()
        if step == 0:
            grads = inst.full_grads()
        inst.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=fsdp.get_group())
        losses.append(mean.item() / fsdp.size())
    if save_to is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(inst.state.state_dict(opt), checkpoint_id=save_to)
    return {"losses": losses, "grads": grads}


def validate_mode_forward(rank: int, world: int) -> str:
    """torchtitan's Llama 3 under its shipped recipe applied in validate mode, one forward;
    what it raised (type and message), or ``"ran"``."""
    from hyperrecipe import apply, compile_recipe

    model = materialized()
    dims = parallel_dims(world)
    mesh = dims.get_optional_mesh("tp", include_singleton_axes=True)
    apply(model, compile_recipe("torchtitan-llama3", model, {"tp": world}), mesh, mode="validate")
    tokens, _ = batch()
    try:
        model(tokens)
    except Exception as exc:  # noqa: BLE001  (the test asserts which)
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def _adapter(model_name: str, config: Any) -> Any:
    if model_name == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        return Qwen3StateDictAdapter(config, None)
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    return DeepSeekV3StateDictAdapter(config, None)


def one_process_hf_state_dict(model_name: str) -> dict[str, torch.Tensor]:
    """torchtitan's own route on one process: ``model.state_dict()`` then its adapter."""
    model = materialized(model_name)
    converted: dict[str, torch.Tensor] = _adapter(model_name, model.config).to_hf(
        model.state_dict())
    return converted


def hf_export_run(rank: int, world: int, model_name: str) -> dict[str, torch.Tensor]:
    """``hf_state_dict`` of the model under its shipped recipe at ``world`` ranks."""
    from hyperrecipe.trainers.torchtitan import hf_state_dict, parallelize

    model = parallelize(materialized(model_name), parallel_dims=parallel_dims(world))
    return hf_state_dict(model, _adapter(model_name, model.config))
