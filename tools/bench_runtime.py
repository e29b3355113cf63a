"""Time one fwd+bwd step of tensor-parallel Llama four ways, interleaved, in one launch.

The four implementations, on the same transformers ``LlamaForCausalLM`` (4 layers, hidden 256,
4 heads, 4 KV heads, intermediate 1024, vocab 1024; fp32, eager attention, ``use_cache=False``)
with the same weights (seed 0) and the same batch (4 x 64 token ids, seed 1), on 2 gloo ranks
started by :func:`hyperrecipe.check.launcher.run_ranks` (fork, one intra-op thread per rank):

``production``
    ``hyperrecipe.apply(model, compile_recipe("recipes/llama.yaml", ...), mesh)``: local shards,
    the collectives the resolver lowered (one backward all-reduce per attention/MLP block).
``validate``
    The same plan with ``mode="validate"`` (DTensor end to end, placements checked).
``parallelize_module``
    PyTorch's ``torch.distributed.tensor.parallel.parallelize_module`` with the plan a PyTorch
    user writes for this model: ``ColwiseParallel`` on q/k/v/gate/up, ``RowwiseParallel`` on
    o/down, ``RowwiseParallel(input_layouts=Replicate())`` on the embedding and
    ``ColwiseParallel(output_layouts=Replicate())`` on ``lm_head``.
``handwritten``
    Megatron-style tensor parallelism written here by hand: the same HF model with its weights
    swapped for local shards (vocab-parallel embedding, column-parallel q/k/v/gate/up/lm_head,
    row-parallel o/down) and Megatron's ``f`` (identity forward, all-reduce backward) and ``g``
    (all-reduce forward, identity backward) put around each attention and MLP block by
    ``torch.nn.Module`` forward pre-hooks and forward hooks (no forward is assigned). The
    embedding masks ids outside its rows and ``g``-reduces; ``lm_head`` takes ``f`` on its
    input and all-gathers its output (backward: this rank's slice). It issues exactly the
    collectives of the hyperrecipe plan, so the difference is the cost of the runtime.

``sp_production``
    Sequence parallelism: ``recipes/llama-sp.yaml`` applied in production mode (the residual
    stream sharded on the sequence between blocks; attention and MLP all-gather it on entry and
    reduce-scatter on exit; the norms' partial weight gradients all-reduced in one bucket).
``sp_loss_production``
    ``recipes/llama-sp-loss.yaml``: ``sp_production`` with the loss on vocab shards
    (``loss_parallel``): the logits are never all-gathered; the step computes the model's own
    ``labels=`` loss (the same shifted cross entropy as the others) on each rank's vocab slice.
``sp_torchtitan``
    The plan a PyTorch user following torchtitan's ``apply_tp`` writes for the same model and
    layouts, with ``parallelize_module``: ``SequenceParallel`` on every norm,
    ``PrepareModuleInput`` all-gathering the sequence into attention and MLP,
    ``ColwiseParallel`` on q/k/v/gate/up, ``RowwiseParallel(output_layouts=Shard(1))`` on o/down
    (reduce-scatter), and ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``
    on ``lm_head``. One collective per block boundary, like the recipe. DTensor leaves the
    norms' weight gradients ``Partial`` after backward (an optimizer step would reduce them on
    first touch, one all-reduce per parameter); the timed step reduces them right after
    backward, so both plans end the step with the same reduced gradients. Where torchtitan's own
    model shards the embedding's output (a reduce-scatter), Hugging Face's ``LlamaModel``
    derives positions, rotary tables and the mask from that output's shape, so here (as in the
    recipe) the embedding's output stays replicated (an all-reduce) and a ``PrepareModuleInput``
    on layer 0 slices the sequence (no traffic; backward all-gathers).

The loss is the cross-entropy of the logits against the ids shifted by one, the same for all.
Every implementation first runs ``--warmup`` untimed steps (the first step's loss on every rank
must agree across implementations within rtol 1e-4: ``losses_agree``). Then ``--rounds`` rounds;
round ``r`` runs the implementations in order rotated by ``r``, each for ``--steps`` steps after
a barrier, with ``time.perf_counter`` around each forward+backward and gradients set to ``None``
between steps (outside the timing). A step's time is the slower rank's; the figures are medians
over all timed steps, in milliseconds. ``--profile`` also profiles one production, one
handwritten, one sp_production and one sp_torchtitan step on rank 0 with ``torch.profiler`` and
prints the top operators.

**Peak memory of a step**: after the timed rounds each implementation runs more steps under
``torch.profiler`` with ``profile_memory=True``; the allocator's records (every allocation and
free of the process, in time order) give the highest amount allocated above what was allocated
when the step began: activations, gradients and collective buffers, not the weights held
before. Each rank takes the median of 3 such steps (single steps vary by about 1 MiB with the
order in which threads free buffers); the summary gives the larger rank's.

**Size sweep** (``--sizes 256 512 1024``): for each hidden size ``h`` (intermediate ``4h``,
``h / 64`` heads and KV heads, the other settings as above) a separate launch times
``sp_production`` against ``sp_torchtitan`` only, interleaved the same way, for
``--sweep-rounds`` rounds, with each one's peak step memory.

**Loss on vocab shards**: ``loss_shards_peak_bytes`` and ``loss_gathered_peak_bytes`` in the
JSON are ``tools/bench_loss.py``'s figures (its ``measure_loss_memory``, default sizes), run
last; ``--skip-loss-memory`` leaves them ``None``.

Usage::

    python tools/bench_runtime.py [--json OUT] [--rounds 20] [--steps 5] [--warmup 3]
                                  [--profile] [--sizes 256 512 1024] [--sweep-rounds 6]
                                  [--skip-loss-memory]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.model_tree import build_model
from hyperrecipe.plan import Plan

import bench_loss  # tools/bench_loss.py: tools/ is sys.path[0] when this script runs

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama.yaml"
SP_RECIPE = REPO / "recipes" / "llama-sp.yaml"
SP_LOSS_RECIPE = REPO / "recipes" / "llama-sp-loss.yaml"
WORLD = 2
CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 128,
    "attn_implementation": "eager",
}
BATCH, SEQ = 4, 64
IMPLS = ("production", "validate", "parallelize_module", "handwritten", "sp_production",
         "sp_loss_production", "sp_torchtitan")
SP_IMPLS = ("sp_production", "sp_torchtitan")
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-4  # of each parameter's largest gradient entry
TARGET_VS_HANDWRITTEN = 1.05
TARGET_VS_PARALLELIZE = 0.65
TARGET_SP_VS_TORCHTITAN = 1.0
MEMORY_STEPS = 3
"""Profiled steps per implementation for the peak step memory; the median is reported."""

Step = Callable[[], Tensor]


# ---------------------------------------------------------------------------------------------
# The model, the batch, the loss (the same for all four).


def sized_config(hidden: int) -> dict[str, Any]:
    """:data:`CONFIG` at another hidden size (intermediate ``4h``, ``h / 64`` heads)."""
    heads = max(hidden // 64, 2)
    return {**CONFIG, "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "num_attention_heads": heads, "num_key_value_heads": heads}


def build_llama(config: dict[str, Any] | None = None) -> nn.Module:
    torch.manual_seed(0)
    return build_model("hf:llama", config or CONFIG, device="cpu")


def token_ids(config: dict[str, Any] | None = None) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, int((config or CONFIG)["vocab_size"]), (BATCH, SEQ), generator=g)


def step_loss(model: nn.Module, ids: Tensor) -> Tensor:
    """Forward and backward of one step; returns the (detached) loss."""
    if getattr(model, "_bench_labels_loss", False):  # the loss on vocab shards
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    else:
        logits = model(input_ids=ids, use_cache=False).logits
        vocab = logits.shape[-1]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    torch.autograd.backward(loss)
    finish = getattr(model, "_bench_finish_grads", None)
    if finish is not None:
        finish()
    return loss.detach()


# ---------------------------------------------------------------------------------------------
# The hand-written Megatron-style implementation.


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim in forward; this rank's slice of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        ctx.world, ctx.rank = world, rank
        src = x.contiguous()
        out = src.new_empty((world, *src.shape))
        _all_gather_flat(out.view(-1), src.view(-1))
        return torch.cat(out.unbind(0), dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        mine: Tensor = grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous()
        return mine


# torch 2.13 names it ``all_gather_single`` and deprecates ``all_gather_into_tensor``.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def copy_to_parallel(x: Tensor) -> Tensor:
    out: Tensor = _CopyToParallel.apply(x)  # type: ignore[no-untyped-call]
    return out


def reduce_from_parallel(x: Tensor) -> Tensor:
    out: Tensor = _ReduceFromParallel.apply(x)  # type: ignore[no-untyped-call]
    return out


def gather_last_dim(x: Tensor) -> Tensor:
    out: Tensor = _GatherLastDim.apply(x)  # type: ignore[no-untyped-call]
    return out


def _shard_weight(linear: nn.Module, dim: int, rank: int, world: int) -> None:
    weight = linear._parameters["weight"]
    assert weight is not None
    local = weight.detach().chunk(world, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(local, requires_grad=weight.requires_grad)


def megatron_parallelize(model: nn.Module, rank: int, world: int) -> list[Any]:
    """Shard ``model``'s weights and hook ``f``/``g`` around its blocks; returns the hook handles.

    Remove the handles to take the hooks off again (the weights stay local shards).
    """
    handles: list[Any] = []
    inner: Any = model.model
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _shard_weight(lin, 0, rank, world)
        for lin in (attn.o_proj, mlp.down_proj):
            _shard_weight(lin, 1, rank, world)
        handles.append(attn.register_forward_pre_hook(_f_on_hidden_states, with_kwargs=True))
        handles.append(attn.register_forward_hook(_g_on_first_output))
        handles.append(mlp.register_forward_pre_hook(_f_on_first_arg))
        handles.append(mlp.register_forward_hook(_g_on_output))
    embed = inner.embed_tokens
    rows = int(embed.weight.shape[0]) // world
    _shard_weight(embed, 0, rank, world)
    start, stop = rank * rows, (rank + 1) * rows
    masks: list[Tensor] = []

    def embed_pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids = args[0]
        outside = (ids < start) | (ids >= stop)
        masks[:] = [outside]
        return (torch.where(outside, torch.zeros_like(ids), ids - start), *args[1:])

    def embed_post(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        return reduce_from_parallel(out.masked_fill(masks.pop().unsqueeze(-1), 0.0))

    handles.append(embed.register_forward_pre_hook(embed_pre))
    handles.append(embed.register_forward_hook(embed_post))
    lm_head: Any = getattr(model, "lm_head")
    _shard_weight(lm_head, 0, rank, world)
    handles.append(lm_head.register_forward_pre_hook(_f_on_first_arg))
    handles.append(lm_head.register_forward_hook(_gather_output))
    return handles


def _f_on_hidden_states(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = copy_to_parallel(kwargs["hidden_states"])
        return args, kwargs
    return (copy_to_parallel(args[0]), *args[1:]), kwargs


def _f_on_first_arg(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (copy_to_parallel(args[0]), *args[1:])


def _g_on_first_output(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    return (reduce_from_parallel(out[0]), *out[1:])


def _g_on_output(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
    return reduce_from_parallel(out)


def _gather_output(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
    return gather_last_dim(out)


# ---------------------------------------------------------------------------------------------
# PyTorch's parallelize_module.


def torch_tp_parallelize(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)


def torchtitan_sp_parallelize(model: nn.Module, mesh: Any) -> None:
    """Sequence parallelism the way torchtitan's ``apply_tp`` writes it, for HF Llama (module
    docstring, ``sp_torchtitan``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan: dict[str, ParallelStyle] = {
        # replicated output (LlamaModel reads its shape); layer 0 slices the sequence
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                             desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        # a local sequence shard out, so LlamaForCausalLM's slice of it stays local
        "model.norm": SequenceParallel(use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)


def _partial_grads_reducer(model: nn.Module) -> Callable[[], None]:
    """After backward, reduce the gradients DTensor left ``Partial`` (the ``SequenceParallel``
    norms' weights, which saw only their rank's tokens) to their parameters' placements, one
    all-reduce each: what an optimizer step or gradient clipping would otherwise do on its
    first touch. Part of the timed step, so both sequence-parallel plans finish a step with the
    same reduced gradients (production reduces them in its backward)."""
    from torch.distributed.tensor import DTensor, Partial

    params = [p for p in model.parameters() if isinstance(p, DTensor)]

    def finish() -> None:
        for p in params:
            grad = p.grad
            if isinstance(grad, DTensor) and any(isinstance(q, Partial) for q in grad.placements):
                p.grad = grad.redistribute(grad.device_mesh, p.placements)

    return finish


# ---------------------------------------------------------------------------------------------
# In each rank.


def _setup(name: str, rank: int, world: int, plans: dict[str, Plan], mesh: Any,
           config: dict[str, Any]) -> tuple[nn.Module, list[Any]]:
    model = build_llama(config)
    handles: list[Any] = []
    if name in ("production", "validate"):
        handles.append(apply(model, plans["tp"], mesh, mode=name))  # type: ignore[arg-type]
    elif name == "sp_production":
        handles.append(apply(model, plans["sp"], mesh, mode="production"))
    elif name == "sp_loss_production":
        handles.append(apply(model, plans["sp_loss"], mesh, mode="production"))
        model._bench_labels_loss = True  # type: ignore[assignment]
    elif name == "sp_torchtitan":
        torchtitan_sp_parallelize(model, mesh)
        model._bench_finish_grads = _partial_grads_reducer(model)  # type: ignore[assignment]
    elif name == "parallelize_module":
        torch_tp_parallelize(model, mesh)
    elif name == "handwritten":
        handles.extend(megatron_parallelize(model, rank, world))
    else:  # pragma: no cover
        raise ValueError(name)
    return model, handles


def _local_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient as this rank holds it (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        assert grad is not None, f"{name} has no gradient"
        if isinstance(grad, DTensor):
            # parallelize_module's embedding gradient comes back Replicate (full size) for a
            # Shard(0) weight: take this rank's rows, as an optimizer step would
            param = p.data
            if isinstance(param, DTensor) and grad.placements != param.placements:
                grad = grad.redistribute(grad.device_mesh, param.placements)
            grad = grad.to_local()
        out[name] = grad.detach().clone()
    return out


def _max_grad_diff(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    """The largest ``|g - g_ref| / max|g_ref|`` over the parameters (same names and shards)."""
    if set(grads) != set(reference):
        return float("inf")
    worst = 0.0
    for name, ref in reference.items():
        if grads[name].shape != ref.shape:
            return float("inf")
        scale = float(ref.abs().max()) or 1.0
        worst = max(worst, float((grads[name] - ref).abs().max()) / scale)
    return worst


def _timed_block(model: nn.Module, ids: Tensor, steps: int) -> tuple[list[float], list[float]]:
    """Wall time and this thread's CPU time of each of ``steps`` steps, in ms."""
    wall, cpu = [], []
    gc.collect()
    dist.barrier()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start, start_cpu = time.perf_counter(), time.thread_time()
        step_loss(model, ids)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
    model.zero_grad(set_to_none=True)
    return wall, cpu


def _profile_step(model: nn.Module, ids: Tensor, rank: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_loss(model, ids)
    model.zero_grad(set_to_none=True)
    if rank != 0:
        return ""
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return table


def _peak_step_bytes(model: nn.Module, ids: Tensor) -> int:
    """The most bytes allocated during one step above what was allocated when it began."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_loss(model, ids)
    model.zero_grad(set_to_none=True)
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def bench_worker(rank: int, world: int, plans: dict[str, Plan], rounds: int, steps: int,
                 warmup: int, profile: bool, impls: Sequence[str] = IMPLS,
                 config: dict[str, Any] | None = None) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated",
                            category=FutureWarning)
    from torch.distributed.device_mesh import init_device_mesh

    config = config or CONFIG
    impls = tuple(impls)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = token_ids(config)
    reference = build_llama(config)
    ref_loss = float(step_loss(reference, ids))
    del reference
    models: dict[str, nn.Module] = {}
    keep: dict[str, list[Any]] = {}
    first_loss: dict[str, float] = {}
    first_grads: dict[str, dict[str, Tensor]] = {}
    for name in impls:
        models[name], keep[name] = _setup(name, rank, world, plans, mesh, config)
        for i in range(warmup):
            loss = float(step_loss(models[name], ids))
            if i == 0:
                first_loss[name] = loss
                first_grads[name] = _local_grads(models[name])
            models[name].zero_grad(set_to_none=True)
    base = impls[0]  # production in the main run, sp_production in the sweep
    grad_diff = {name: _max_grad_diff(first_grads[name], first_grads[base])
                 for name in impls if name != base}
    del first_grads
    times: dict[str, list[list[float]]] = {name: [] for name in impls}
    cpu_times: dict[str, list[list[float]]] = {name: [] for name in impls}
    for r in range(rounds):
        order = impls[r % len(impls):] + impls[:r % len(impls)]
        for name in order:
            wall, cpu = _timed_block(models[name], ids, steps)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    peak_bytes = {name: int(statistics.median(_peak_step_bytes(models[name], ids)
                                              for _ in range(MEMORY_STEPS))) for name in impls}
    profiles = {}
    if profile:
        for name in ("production", "handwritten", *SP_IMPLS):
            if name in models:
                profiles[name] = _profile_step(models[name], ids, rank)
    for handle in keep.get("handwritten", ()):
        handle.remove()
    return {"times": times, "cpu_times": cpu_times, "losses": first_loss, "reference_loss": ref_loss,
            "grad_diff": grad_diff, "profiles": profiles, "peak_bytes": peak_bytes}


# ---------------------------------------------------------------------------------------------
# In the parent.


def _environment() -> dict[str, Any]:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "world_size": WORLD,
        "backend": "gloo",
        "threads_per_rank": 1,
        "commit": commit + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _slowest_rank(per_rank: Sequence[list[list[float]]]) -> list[list[float]]:
    """Per round and step, the slower rank's time."""
    return [[max(vals) for vals in zip(*blocks)] for blocks in zip(*per_rank)]


def _losses_agree(losses: Sequence[float]) -> bool:
    base = losses[0]
    return all(abs(x - base) <= LOSS_RTOL * abs(base) for x in losses)


def summarise(results: Sequence[dict[str, Any]], rounds: int, steps: int, warmup: int,
              wall_s: float, load: dict[str, list[float]]) -> dict[str, Any]:
    per_round: dict[str, list[list[float]]] = {
        name: _slowest_rank([res["times"][name] for res in results]) for name in IMPLS}
    flat = {name: [t for block in per_round[name] for t in block] for name in IMPLS}
    medians = {name: statistics.median(flat[name]) for name in IMPLS}
    cpu = {name: statistics.median(t for res in results for block in res["cpu_times"][name]
                                   for t in block) for name in IMPLS}
    losses = {name: [res["losses"][name] for res in results] for name in IMPLS}
    every = [x for name in IMPLS for x in losses[name]]
    reference = [res["reference_loss"] for res in results]
    grad_diff = {name: max(res["grad_diff"][name] for res in results)
                 for name in IMPLS if name != "production"}
    prod = medians["production"]
    ratios = {
        "production_vs_handwritten": prod / medians["handwritten"],
        "production_vs_parallelize_module": prod / medians["parallelize_module"],
        "parallelize_module_vs_handwritten":
            medians["parallelize_module"] / medians["handwritten"],
        "validate_vs_production": medians["validate"] / prod,
        "sp_production_vs_sp_torchtitan": medians["sp_production"] / medians["sp_torchtitan"],
        "sp_loss_production_vs_sp_torchtitan":
            medians["sp_loss_production"] / medians["sp_torchtitan"],
    }
    sp_met = ratios["sp_production_vs_sp_torchtitan"] <= TARGET_SP_VS_TORCHTITAN
    return {
        "production_ms": medians["production"],
        "validate_ms": medians["validate"],
        "parallelize_module_ms": medians["parallelize_module"],
        "handwritten_ms": medians["handwritten"],
        "sp_production_ms": medians["sp_production"],
        "sp_loss_production_ms": medians["sp_loss_production"],
        "sp_torchtitan_ms": medians["sp_torchtitan"],
        "peak_step_bytes": {name: max(res["peak_bytes"][name] for res in results)
                            for name in IMPLS},
        "losses_agree": _losses_agree(every),
        "losses": losses,
        "reference_loss": reference[0],
        "matches_single_process": _losses_agree([*every, *reference]),
        "grad_max_rel_diff_vs_production": grad_diff,
        "grads_agree": all(d <= GRAD_RTOL for d in grad_diff.values()),
        "ratios": ratios,
        "targets": {
            "production_vs_handwritten_max": TARGET_VS_HANDWRITTEN,
            "production_vs_parallelize_module_max": TARGET_VS_PARALLELIZE,
            "met": (ratios["production_vs_handwritten"] <= TARGET_VS_HANDWRITTEN
                    and ratios["production_vs_parallelize_module"] <= TARGET_VS_PARALLELIZE),
            "sp_production_vs_sp_torchtitan_max": TARGET_SP_VS_TORCHTITAN,
            "sp_met": sp_met,
        },
        "p25_ms": {name: statistics.quantiles(flat[name], n=4)[0] if len(flat[name]) > 1
                   else flat[name][0] for name in IMPLS},
        "min_ms": {name: min(flat[name]) for name in IMPLS},
        "cpu_ms": cpu,
        "cpu_ratios": {"production_vs_handwritten": cpu["production"] / cpu["handwritten"],
                       "production_vs_parallelize_module":
                           cpu["production"] / cpu["parallelize_module"],
                       "sp_production_vs_sp_torchtitan":
                           cpu["sp_production"] / cpu["sp_torchtitan"]},
        "round_medians_ms": {name: [statistics.median(b) for b in per_round[name]]
                             for name in IMPLS},
        "step_ms": per_round,
        "settings": {"rounds": rounds, "steps": steps, "warmup": warmup, "batch": BATCH,
                     "seq": SEQ, "model": {k: v for k, v in CONFIG.items()}, "dtype": "float32",
                     "recipe": str(RECIPE.relative_to(REPO)),
                     "sp_recipe": str(SP_RECIPE.relative_to(REPO))},
        "environment": _environment(),
        "wall_s": wall_s,
        "load_average": load,
    }


def markdown(summary: dict[str, Any]) -> str:
    m, r = summary, summary["ratios"]
    rounds = m["round_medians_ms"]
    lines = [
        "| implementation | median step (ms) | vs handwritten | round medians, min-max (ms) "
        "| fastest step (ms) | median CPU time (ms) | CPU vs handwritten | peak step memory (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in IMPLS:
        ms, cpu = m[f"{name}_ms"], m["cpu_ms"][name]
        lines.append(f"| {name} | {ms:.1f} | {ms / m['handwritten_ms']:.2f}x | "
                     f"{min(rounds[name]):.1f}-{max(rounds[name]):.1f} | "
                     f"{m['min_ms'][name]:.1f} | {cpu:.1f} | "
                     f"{cpu / m['cpu_ms']['handwritten']:.2f}x | "
                     f"{m['peak_step_bytes'][name] / 2**20:.1f} |")
    lines += [
        "",
        f"production / handwritten = {r['production_vs_handwritten']:.3f} "
        f"(target <= {TARGET_VS_HANDWRITTEN}); production / parallelize_module = "
        f"{r['production_vs_parallelize_module']:.3f} (target <= {TARGET_VS_PARALLELIZE}); "
        f"targets met: {m['targets']['met']}; losses agree: {m['losses_agree']} "
        f"(loss {m['reference_loss']:.6f}); local gradients agree with production: "
        f"{m['grads_agree']} (largest relative difference "
        f"{max(m['grad_max_rel_diff_vs_production'].values()):.1e})",
        "",
        f"sp_production / sp_torchtitan = {r['sp_production_vs_sp_torchtitan']:.3f} "
        f"(target <= {TARGET_SP_VS_TORCHTITAN}); met: {m['targets']['sp_met']}; by CPU time "
        f"{m['cpu_ratios']['sp_production_vs_sp_torchtitan']:.3f}; with the loss on vocab "
        f"shards, sp_loss_production / sp_torchtitan = "
        f"{r['sp_loss_production_vs_sp_torchtitan']:.3f}",
    ]
    return "\n".join(lines)


def summarise_sweep(hidden: int, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One size of the sweep: sp_production against sp_torchtitan."""
    per_round = {name: _slowest_rank([res["times"][name] for res in results]) for name in SP_IMPLS}
    flat = {name: [t for block in per_round[name] for t in block] for name in SP_IMPLS}
    med = {name: statistics.median(flat[name]) for name in SP_IMPLS}
    cpu = {name: statistics.median(t for res in results for block in res["cpu_times"][name]
                                   for t in block) for name in SP_IMPLS}
    losses = [res["losses"][name] for res in results for name in SP_IMPLS]
    return {
        "hidden": hidden,
        "sp_production_ms": med["sp_production"],
        "sp_torchtitan_ms": med["sp_torchtitan"],
        "ratio": med["sp_production"] / med["sp_torchtitan"],
        "min_ms": {name: min(flat[name]) for name in SP_IMPLS},
        "cpu_ms": cpu,
        "cpu_ratio": cpu["sp_production"] / cpu["sp_torchtitan"],
        "peak_step_bytes": {name: max(res["peak_bytes"][name] for res in results)
                            for name in SP_IMPLS},
        "losses_agree": _losses_agree(losses),
        "grad_max_rel_diff": max(res["grad_diff"]["sp_torchtitan"] for res in results),
        "met": med["sp_production"] / med["sp_torchtitan"] <= TARGET_SP_VS_TORCHTITAN,
    }


def sweep_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| hidden | sp_production median (ms) | sp_torchtitan median (ms) | ratio | fastest steps "
        "(ms) | CPU ratio | peak step memory, production / torchtitan (MiB) | losses agree |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        mins, peak = row["min_ms"], row["peak_step_bytes"]
        lines.append(
            f"| {row['hidden']} | {row['sp_production_ms']:.1f} | {row['sp_torchtitan_ms']:.1f} "
            f"| {row['ratio']:.3f} | {mins['sp_production']:.1f} / {mins['sp_torchtitan']:.1f} "
            f"| {row['cpu_ratio']:.3f} | {peak['sp_production'] / 2**20:.1f} / "
            f"{peak['sp_torchtitan'] / 2**20:.1f} | {row['losses_agree']} |")
    return "\n".join(lines)


def _plans(config: dict[str, Any]) -> dict[str, Plan]:
    model = build_model("hf:llama", config, device="meta")
    return {"tp": compile_recipe(str(RECIPE), model, {"tp": WORLD}),
            "sp": compile_recipe(str(SP_RECIPE), model, {"tp": WORLD}),
            "sp_loss": compile_recipe(str(SP_LOSS_RECIPE), model, {"tp": WORLD})}


def _loss_on_shards(skip: bool) -> dict[str, Any]:
    """``loss_shards_peak_bytes`` and ``loss_gathered_peak_bytes``: measured by
    ``tools/bench_loss.py`` (its ``measure_loss_memory`` at its default sizes: vocab 32000,
    batch 4 x 512 tokens) and carried into this tool's JSON. With ``--skip-loss-memory`` both
    are ``None``."""
    if skip:
        return {"loss_shards_peak_bytes": None, "loss_gathered_peak_bytes": None}
    args = argparse.Namespace(vocab=32000, hidden=256, layers=2, batch=4, seq=512, world=WORLD,
                              repeat=3)
    figures: dict[str, Any] = bench_loss.measure_loss_memory(args)
    return {"loss_shards_peak_bytes": figures["loss_shards_peak_bytes"],
            "loss_gathered_peak_bytes": figures["loss_gathered_peak_bytes"],
            "loss_memory": figures}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="profile one step of production, handwritten, sp_production and "
                             "sp_torchtitan on rank 0")
    parser.add_argument("--sizes", type=int, nargs="*", default=[],
                        help="hidden sizes of the sp_production vs sp_torchtitan sweep "
                             "(e.g. 256 512 1024)")
    parser.add_argument("--sweep-rounds", type=int, default=6)
    parser.add_argument("--skip-loss-memory", action="store_true",
                        help="leave out tools/bench_loss.py's loss-on-shards memory figures")
    ns = parser.parse_args(argv)
    if ns.rounds < 1 or ns.steps < 1 or ns.warmup < 1 or ns.sweep_rounds < 1:
        parser.error("--rounds, --steps, --warmup and --sweep-rounds must be at least 1")
    if any(h < 128 or h % 64 for h in ns.sizes):
        parser.error("--sizes: each hidden size must be a multiple of 64, at least 128")
    plans = _plans(CONFIG)
    load_before = list(os.getloadavg())
    start = time.perf_counter()
    results = run_ranks(bench_worker, WORLD, plans, ns.rounds, ns.steps, ns.warmup, ns.profile,
                        timeout_s=1800.0)
    load = {"before": load_before, "after": list(os.getloadavg())}
    summary = summarise(results, ns.rounds, ns.steps, ns.warmup, time.perf_counter() - start,
                        load)
    sweep = []
    for hidden in ns.sizes:
        config = sized_config(hidden)
        size_load = list(os.getloadavg())
        ranks = run_ranks(bench_worker, WORLD, _plans(config), ns.sweep_rounds, ns.steps,
                          ns.warmup, False, SP_IMPLS, config, timeout_s=1800.0)
        sweep.append({**summarise_sweep(hidden, ranks),
                      "load_average": {"before": size_load, "after": list(os.getloadavg())}})
    summary["sweep"] = sweep
    summary["settings"]["sweep_rounds"] = ns.sweep_rounds
    summary.update(_loss_on_shards(ns.skip_loss_memory))
    env = summary["environment"]
    print(f"torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, "
          f"{env['cpu_count']} CPUs, {WORLD} gloo ranks x 1 thread; {ns.rounds} rounds x "
          f"{ns.steps} steps; {summary['wall_s']:.0f} s")
    print()
    print(markdown(summary))
    if sweep:
        print()
        print(sweep_markdown(sweep))
    if summary["loss_shards_peak_bytes"] is not None:
        print(f"\nloss on vocab shards (tools/bench_loss.py): per-rank step peak "
              f"{summary['loss_shards_peak_bytes'] / 2**20:.0f} MiB, gathered logits "
              f"{summary['loss_gathered_peak_bytes'] / 2**20:.0f} MiB")
    for name, table in results[0]["profiles"].items():
        print(f"\n--- torch.profiler, one {name} step, rank 0 ---\n{table}")
    if ns.json is not None:
        ns.json.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    ok = summary["losses_agree"] and all(row["losses_agree"] for row in sweep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
