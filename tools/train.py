"""A complete tensor-parallel trainer on hyperrecipe, for ``torchrun`` (docs/training.md).

Build on meta, apply a plan, load a Hugging Face checkpoint shard by shard, train with AdamW
(gradients clipped by the norm of the full gradients, ``Installation.clip_grad_norm_``),
checkpoint with DCP every N steps, resume from the newest checkpoint (on any tp size), export
consolidated safetensors at the end. Optionally FSDP2 over a ``dp`` mesh dim.

    torchrun --nproc-per-node 2 tools/train.py --recipe recipes/llama.yaml \\
        --weights path/to/hf-checkpoint --out runs/demo --steps 20 --save-every 10

Synthetic batches (seeded by step) stand in for a data loader, so a resumed run sees the same
data as an uninterrupted one; the losses it prints can be compared line by line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hyperrecipe


def batch(step: int, vocab: int, rows: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (rows, seq), generator=g)


def newest_checkpoint(out: Path) -> tuple[int, Path] | None:
    steps = sorted((int(p.name.split("-")[1]), p) for p in out.glob("step-*")
                   if (p / ".metadata").is_file())
    return steps[-1] if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/llama.yaml")
    parser.add_argument("--weights", required=True, help="HF checkpoint folder (safetensors)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--dp", type=int, default=1, help="FSDP2 over a dp mesh dim")
    parser.add_argument("--mode", default="production", choices=["production", "validate"])
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clip the full gradients' 2-norm to this (0: no clipping)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    torch.manual_seed(0)
    world = dist.get_world_size()
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    tp = world // args.dp
    shape = {"dp": args.dp, "tp": tp} if args.dp > 1 else {"tp": tp}
    mesh = init_device_mesh(device, tuple(shape.values()), mesh_dim_names=tuple(shape))

    # 1. Build on meta: no rank ever holds the whole model.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    # 2. Compile (cheap: a pure function of recipe, model structure and mesh) and apply.
    plan = hyperrecipe.compile_recipe(args.recipe, model, shape)
    inst = hyperrecipe.apply(model, plan, mesh, mode=args.mode)

    # 3. Weights: each rank reads only its slices.
    out = Path(args.out)
    resume = newest_checkpoint(out)
    if resume is None:
        inst.load_weights(args.weights)

    # 4. Optional FSDP2 over dp, after apply.
    if args.dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    # Validate mode keeps replicated parameters outside boundaries plain next to its DTensors,
    # which torch's multi-tensor kernels (the default on CUDA) refuse: one tensor at a time.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                            foreach=False if inst.mode == "validate" else None)

    # 5. Resume from the newest DCP checkpoint (saved on any tp size).
    start = 0
    if resume is not None:
        start, folder = resume
        inst.load_checkpoint(folder, opt)  # dcp.load, reading the folder as data

    dp_rank = mesh.get_local_rank("dp") if args.dp > 1 else 0
    for step in range(start, args.steps):
        ids = batch(step, config.vocab_size, 2 * args.dp, 16)[2 * dp_rank:2 * dp_rank + 2]
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        # Not torch.nn.utils.clip_grad_norm_(model.parameters(), ...): in production mode that
        # sees only this rank's shards, and every rank would clip by another coefficient.
        norm = (inst.clip_grad_norm_(args.max_grad_norm) if args.max_grad_norm > 0
                else inst.grad_norm())
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": round(float(loss.detach()), 6),
                              "grad_norm": round(float(norm), 6)}), flush=True)
        if (step + 1) % args.save_every == 0:
            # 6. Checkpoint: every shard (or FSDP's piece of it) stored once, reshardable.
            # Committed last, so a save that dies halfway is refused on resume.
            inst.save_checkpoint(out / f"step-{step + 1}", opt)

    # 7. Export for from_pretrained (every rank gathers, rank 0 writes).
    inst.save_pretrained(out / "final")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
