"""Step time of torchtitan's Llama 3, Qwen3 or DeepSeek-V3 under hyperrecipe's plan and under
torchtitan's own TP.

One launch of ``--world`` ranks (gloo on CPU, NCCL when there are enough GPUs). Each rank
builds torchtitan's ``--model`` (``llama3``: ``Llama3Model``; ``qwen3``: dense ``Qwen3Model``;
``deepseek_v3``: ``DeepSeekV3Model``, one dense layer then MoE) twice from the same seed: once
parallelized by ``hyperrecipe.trainers.torchtitan.parallelize`` (the recipe it picks by class,
production mode) and once by torchtitan's own ``parallelize_llama`` / ``parallelize_qwen3`` /
``parallelize_deepseekv3`` (TP + sequence parallel + loss parallel, DTensor backend
``partial_dtensor``, fp32 parameters). Rounds alternate the two
(``--steps`` timed steps each, after ``--warmup``), so drift in the machine's load hits both. A
step is forward, torchtitan's summed cross entropy over the vocab shards divided by the token
count, backward, gradient clipping to norm 1 (``inst.clip_grad_norm_`` / torch's over
DTensors), AdamW and ``zero_grad``; its time is the slowest rank's. Both runs see the same
batches, so their losses should agree step by step with each other and with one process: to
rtol 1e-5, or for DeepSeek-V3 to 1e-3 (torchtitan's grouped experts compute in bf16, and each
tp rank rounds its partial sum: docs/training.md#torchtitan).

    python tools/bench_torchtitan.py --json OUT [--model qwen3 --world 2 --dim 256 --layers 4]

``OUT`` (``-`` for stdout) gets ``torchtitan_ms`` and ``hyperrecipe_ms`` (median step),
``ratio`` (hyperrecipe / torchtitan; the target is <= 1.0), ``losses_equal`` (every step's
loss within the model's rtol), ``max_loss_rel_diff``, each one's fastest and slowest step
(``*_min_max_ms``), each run's largest relative loss difference from the same steps in one
process (``hyperrecipe_vs_one_process``, ``torchtitan_vs_one_process``: the reference), every
loss and the arguments. Exits 1 when hyperrecipe's losses differ from one process's by more
than the model's rtol.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

LOSS_RTOL = {"llama3": 1e-5, "qwen3": 1e-5, "deepseek_v3": 1e-3}


def _parallel_dims(world: int) -> Any:
    import torch
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed.utils import set_spmd_backend

    if not torch.cuda.is_available():  # torchtitan falls back to "cuda" without accelerators
        titan_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")
    dims = titan_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1,
                                   world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _build(args: argparse.Namespace) -> Any:
    """``--model`` at the bench's size, from hyperrecipe.models.torchtitan."""
    from hyperrecipe.models import torchtitan as builders

    if args.model == "llama3":
        return builders.build_llama3(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                     n_kv_heads=args.kv_heads, vocab_size=args.vocab,
                                     max_seq_len=args.seq, multiple_of=args.dim)
    if args.model == "qwen3":
        return builders.build_qwen3(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                    n_kv_heads=args.kv_heads, head_dim=2 * args.dim // args.heads,
                                    hidden_dim=3 * args.dim, vocab_size=args.vocab,
                                    max_seq_len=args.seq)
    head = args.dim // args.heads
    return builders.build_deepseek_v3(
        dim=args.dim, n_layers=args.layers, n_heads=args.heads, kv_lora_rank=args.dim // 2,
        qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head,
        dense_hidden_dim=4 * args.dim, moe_hidden_dim=args.dim, num_experts=8, top_k=2,
        vocab_size=args.vocab, max_seq_len=args.seq)


def _titan_parallelize(model_name: str, config: Any) -> Any:
    """torchtitan's own parallelize function for ``model_name``, after setting the sharding
    config on ``config`` as its trainer does before building (sequence parallel, no ep)."""
    if model_name == "llama3":
        from torchtitan.models.llama3 import parallelize_llama
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=True)
        return parallelize_llama
    if model_name == "qwen3":
        from torchtitan.models.qwen3 import parallelize_qwen3
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=True, enable_ep=False)
        return parallelize_qwen3
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=False)
    return parallelize_deepseekv3


def _models(args: argparse.Namespace, world: int, device: Any) -> dict[str, Any]:
    import torch
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    from hyperrecipe.trainers.torchtitan import installation_of, parallelize

    def weights() -> Any:
        with device:
            model = _build(args)
        torch.manual_seed(0)
        model.init_states()
        return model

    ours = weights()  # before the mesh: torchtitan's model imports register what it needs
    dims = _parallel_dims(world)
    ours = parallelize(ours, parallel_dims=dims)
    inst = installation_of(ours)
    source = weights()
    config = source.config
    titan_parallelize = _titan_parallelize(args.model, config)
    with device:
        theirs = config.build()
    theirs.load_state_dict(source.state_dict())
    del source
    theirs = titan_parallelize(
        theirs, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(tensor_parallel_degree=world,
                                      spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(), ac_config=None, dump_folder="")
    if getattr(config, "enable_weight_tying", False):
        # torchtitan's TP distributes tok_embeddings.weight and lm_head.weight one by one,
        # which unties them; its Trainer ties them again in init_states (after to_empty), which
        # this bench, loading weights before the parallelize step, does not call: tie them as
        # init_states does (measured: left untied, each gets its part of the gradient and its
        # own AdamW update, and the losses leave one process's from the second step)
        theirs.tok_embeddings.weight = theirs.lm_head.weight
    return {
        "hyperrecipe": (ours, lambda: inst.clip_grad_norm_(1.0)),
        "torchtitan": (theirs, lambda: torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)),
    }


def _batches(args: argparse.Namespace, device: Any) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            for _ in range(4)]


def one_process_losses(args: argparse.Namespace, steps: int) -> list[float]:
    """The losses of ``steps`` of the same steps (model, seed, batches, clipping, AdamW) in one
    process: the reference both parallel runs are held to."""
    import torch

    from hyperrecipe.trainers.torchtitan import cross_entropy_loss

    model = _build(args)
    torch.manual_seed(0)
    model.init_states()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(args, torch.device("cpu"))
    losses = []
    for i in range(steps):
        tokens = batches[i % len(batches)]
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hyperrecipe.trainers.torchtitan import cross_entropy_loss

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    runs = _models(args, world, device)
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-3)
            for name, (model, _) in runs.items()}
    batches = _batches(args, device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}

    def step(name: str, i: int) -> float:
        model, clip = runs[name]
        tokens = batches[i % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        clip()
        opts[name].step()
        opts[name].zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
        losses[name].append(loss.item())
        return float(took.item())

    counter = dict.fromkeys(runs, 0)
    for name in runs:
        for _ in range(args.warmup):
            step(name, counter[name])
            counter[name] += 1
    for _ in range(args.rounds):
        for name in runs:
            for _ in range(args.steps):
                times[name].append(step(name, counter[name]))
                counter[name] += 1
    return {"times": times, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, metavar="OUT", help="output file, - for stdout")
    parser.add_argument("--model", choices=sorted(LOSS_RTOL), default="llama3")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and model")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from hyperrecipe.check.launcher import run_ranks

    result = run_ranks(_worker, args.world, args, timeout_s=1800)[0]
    ours, theirs = result["losses"]["hyperrecipe"], result["losses"]["torchtitan"]
    def max_rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))

    rel = max_rel(ours, theirs)
    reference = one_process_losses(args, len(ours))
    ours_ref, theirs_ref = max_rel(ours, reference), max_rel(theirs, reference)
    rtol = LOSS_RTOL[args.model]
    hr_ms = 1000 * statistics.median(result["times"]["hyperrecipe"])
    tt_ms = 1000 * statistics.median(result["times"]["torchtitan"])
    spread = {f"{name}_min_max_ms": [round(1000 * min(t), 3), round(1000 * max(t), 3)]
              for name, t in result["times"].items()}
    report = {"torchtitan_ms": round(tt_ms, 3), "hyperrecipe_ms": round(hr_ms, 3), **spread,
              "ratio": round(hr_ms / tt_ms, 3), "losses_equal": rel <= rtol,
              "max_loss_rel_diff": rel,
              "hyperrecipe_vs_one_process": ours_ref, "torchtitan_vs_one_process": theirs_ref,
              "losses": {"hyperrecipe": ours, "torchtitan": theirs, "one_process": reference},
              "args": vars(args)}
    text = json.dumps(report, indent=2, sort_keys=True)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")
        print(f"torchtitan {tt_ms:.1f} ms, hyperrecipe {hr_ms:.1f} ms per step "
              f"(ratio {hr_ms / tt_ms:.3f}); losses equal: {rel <= rtol} "
              f"(max rel diff {rel:.2e}); against one process: hyperrecipe {ours_ref:.2e}, "
              f"torchtitan {theirs_ref:.2e} -> {args.json}")
    return 0 if ours_ref <= rtol else 1


if __name__ == "__main__":
    sys.exit(main())
