"""Our own training loop as docs/training.md writes it ("The order", "FSDP2 on a dp dim"), as a
script for ``torchrun``: build on meta, compile ``recipes/llama-dp.yaml`` for dp=2 x tp=world/2,
apply in production mode, ``load_weights``, ``fully_shard`` per block and on the root over
``dp``, AdamW with ``inst.clip_grad_norm_``, a DCP checkpoint every ``SAVE_EVERY`` steps and
``save_pretrained`` at the end, every rank leaving together.

The data is the same on every launch: the global batch of step ``s`` is 4 sequences of 16
random tokens seeded by ``s``, each dp rank training on its half. Global rank 0 prints one JSON
line per step (the loss averaged over dp, at full precision, and the clipped norm) and one
``{"launch": ...}`` line naming the torchrun launch it ran in (``GROUP_RANK``, the node rank
the rendezvous gave it).

Usage: ``torchrun --nproc-per-node 4 tests/support/own_loop.py WEIGHTS OUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

import hyperrecipe
from hyperrecipe.runtime import leave_together

RECIPE = Path(__file__).resolve().parents[2] / "recipes/llama-dp.yaml"
STEPS, SAVE_EVERY, ROWS, SEQ, LR, MAX_NORM = 4, 2, 4, 16, 1e-2, 1.0


def main(weights: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    shape = {"dp": 2, "tp": dist.get_world_size() // 2}
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    config = AutoConfig.from_pretrained(weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = hyperrecipe.compile_recipe(str(RECIPE), model, shape)
    inst = hyperrecipe.apply(model, plan, mesh, mode="production")
    inst.state.load_weights(weights)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(json.dumps({"launch": int(os.environ.get("GROUP_RANK", "0"))}), flush=True)
    for step in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (ROWS, SEQ),
                            generator=torch.Generator().manual_seed(step))
        mine = ids.chunk(shape["dp"])[dp_rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        norm = inst.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        if rank0:
            print(json.dumps({"step": step + 1, "loss": float(mean) / shape["dp"],
                              "grad_norm": float(norm)}), flush=True)
        if (step + 1) % SAVE_EVERY == 0:
            inst.state.save_checkpoint(Path(out) / f"step-{step + 1}", opt)
    inst.state.save_pretrained(Path(out) / "final")
    leave_together(inst, "own_loop.py")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
