"""A complete data x tensor parallel trainer on hyperrecipe, for ``torchrun`` (docs/training.md).

Build on meta, apply a plan, load a Hugging Face checkpoint shard by shard, optionally FSDP2 over
a ``dp`` mesh dim, train with AdamW under a warmup + cosine learning rate, with gradient
accumulation and optional bf16 autocast (gradients clipped by the norm of the full gradients,
``Installation.clip_grad_norm_``), checkpoint with DCP every N steps, resume from the newest
checkpoint (on any tp size), export consolidated safetensors at the end.

    torchrun --nproc-per-node 2 tools/train.py --weights path/to/hf-checkpoint \\
        --data corpus.txt --out runs/demo --steps 20 --save-every 10

Recipes: ``--recipe`` defaults to the shipped ``llama`` (tp only) and, with ``--dp`` above 1, to
the shipped ``llama-dp`` (``recipes/llama-dp.yaml``: ``llama`` on a ``[dp, tp]`` mesh); a recipe
of your own for ``--dp`` must declare ``mesh: [dp, tp]``.

Data: ``--data FILE`` tokenises a text file with the checkpoint folder's ``tokenizer.json``
(transformers' tokenizer) where there is one, and otherwise byte by byte (token = byte value
modulo the vocabulary size: exact for ASCII text at a vocabulary of 128 or for any text at 256 or
more, a demo stand-in for a real tokenizer otherwise), packs the tokens into ``--seq-len``
sequences and hands out the global batch of step s as sequences ``s*B .. s*B+B-1`` (modulo the
file's count), B = micro-batch x grad-accum x dp. Without ``--data``, random tokens seeded by
the step. Either way a batch is a function of the step alone, so a resumed run, or one on another
mesh, sees the data of an uninterrupted one and its losses can be compared line by line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import hyperrecipe

TP_RECIPE = "llama"
DP_TP_RECIPE = "llama-dp"
"""Shipped recipes (``recipes/NAME.yaml``) used when ``--recipe`` is not given."""

SYNTHETIC_SEED = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Without --recipe: '{TP_RECIPE}' at --dp 1, '{DP_TP_RECIPE}' "
               f"(recipes/{DP_TP_RECIPE}.yaml, mesh [dp, tp]) at --dp > 1.")
    parser.add_argument("--recipe", default=None,
                        help=f"recipe file or shipped name (default: {TP_RECIPE}, or "
                             f"{DP_TP_RECIPE} with --dp > 1; with --dp it must declare dp)")
    parser.add_argument("--weights", required=True, help="HF checkpoint folder (safetensors)")
    parser.add_argument("--out", required=True, help="checkpoints (step-N/) and the export (final/)")
    parser.add_argument("--data", default=None,
                        help="text file to train on (default: random tokens seeded by step)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=2,
                        help="sequences per forward on each dp rank")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (loss scaled by 1/N)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of the schedule")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps, as a preempted job would (the schedule "
                             "still spans --steps; no export)")
    parser.add_argument("--save-every", type=int, default=10, help="DCP checkpoint every N steps")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel size: FSDP2 over a dp mesh dim; tp = world / dp")
    parser.add_argument("--mode", default="production", choices=["production", "validate"])
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--min-lr", type=float, default=None,
                        help="learning rate at the end of the cosine (default: lr / 10)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="linear warmup from lr / warmup to lr, then cosine decay")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clip the full gradients' 2-norm to this (0: no clipping)")
    parser.add_argument("--bf16", action="store_true",
                        help="forward under torch.autocast(bfloat16); weights and AdamW stay fp32")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per step on stdout instead of a progress line")
    args = parser.parse_args(argv)
    for name in ("seq_len", "micro_batch", "grad_accum", "steps", "save_every", "dp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        parser.error(f"--stop-after must be between 1 and --steps ({args.steps}), "
                     f"got {args.stop_after}")
    if args.recipe is None:
        args.recipe = DP_TP_RECIPE if args.dp > 1 else TP_RECIPE
    mesh_dims = hyperrecipe.load_recipe(args.recipe).mesh
    if args.dp > 1 and "dp" not in mesh_dims:
        parser.error(f"--dp {args.dp} needs a recipe whose mesh declares dp; {args.recipe} "
                     f"declares {list(mesh_dims)}. Use --recipe {DP_TP_RECIPE} (the shipped "
                     f"llama on [dp, tp]) or add dp to your recipe's mesh: [dp, tp].")
    if set(mesh_dims) - {"dp", "tp"}:
        parser.error(f"tools/train.py builds a mesh of dp and tp only; {args.recipe} declares "
                     f"{list(mesh_dims)}")
    return args


# -- data ------------------------------------------------------------------------------------


def tokenize(path: Path, weights: Path, vocab: int) -> tuple[torch.Tensor, str]:
    """The file's tokens, and which tokenisation made them.

    The checkpoint's own tokenizer when it ships one, so the model sees the ids it was trained
    on; otherwise bytes folded into the vocabulary (no tokenizer is downloaded: runs are
    offline). Ids outside the model's vocabulary are refused: an embedding lookup past its end
    is an index error on one rank and silently another row on a vocab shard.
    """
    if (weights / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(weights)
        ids = torch.tensor(tokenizer(path.read_text(encoding="utf-8"),
                                     add_special_tokens=False)["input_ids"], dtype=torch.long)
        how = f"tokenizer.json ({type(tokenizer).__name__})"
    else:
        raw = path.read_bytes()
        ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() % vocab if raw else (
            torch.zeros(0, dtype=torch.long))
        how = f"bytes modulo vocab {vocab}"
    if ids.numel() and int(ids.max()) >= vocab:
        msg = (f"{path}: the tokenizer in {weights} produced id {int(ids.max())}, but the model's "
               f"vocab_size is {vocab}; use the tokenizer the checkpoint was trained with")
        raise SystemExit(msg)
    return ids, how


class Batches:
    """The global batch of each optimizer step, a function of the step alone.

    ``global_batch(step)`` has ``grad_accum x dp x micro_batch`` sequences; micro-batch m of
    dp rank d is its block ``[m, d]``. Every split of the same global batch trains on the same
    sequences, so runs at any dp, tp and accumulation agree with one process over the batch.
    """

    def __init__(self, tokens: torch.Tensor | None, *, vocab: int, seq_len: int,
                 micro_batch: int, grad_accum: int, dp: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len
        self.shape = (grad_accum, dp, micro_batch)
        self.rows = grad_accum * dp * micro_batch
        self.packed = None
        if tokens is not None:
            count = tokens.numel() // seq_len
            if count == 0:
                msg = (f"--data holds {tokens.numel()} tokens, fewer than one --seq-len "
                       f"({seq_len}) sequence")
                raise SystemExit(msg)
            self.packed = tokens[:count * seq_len].view(count, seq_len)

    def global_batch(self, step: int) -> torch.Tensor:
        if self.packed is None:
            g = torch.Generator().manual_seed(SYNTHETIC_SEED + step)
            return torch.randint(0, self.vocab, (self.rows, self.seq_len), generator=g)
        index = (step * self.rows + torch.arange(self.rows)) % self.packed.shape[0]
        return self.packed[index]

    def micro_batches(self, step: int, dp_rank: int) -> Iterator[torch.Tensor]:
        blocks = self.global_batch(step).view(*self.shape, self.seq_len)
        for m in range(self.shape[0]):
            yield blocks[m, dp_rank]


# -- schedule, checkpoints, progress ------------------------------------------------------------


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``lr`` to ``min_lr`` at ``steps``.

    A function of the step, not scheduler state: a resumed run continues the curve without
    anything to checkpoint.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _committed(folder: Path) -> bool:
    """Whether ``inst.save_checkpoint`` finished writing ``folder`` (its commit record says so):
    a save killed halfway leaves ``writing``, and resuming skips it for the one before."""
    try:
        record = json.loads((folder / "hyperrecipe.commit.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("state") == "committed"


def newest_checkpoint(out: Path) -> tuple[int, Path] | None:
    steps = sorted((int(p.name.split("-")[1]), p) for p in out.glob("step-*")
                   if p.name.split("-")[1].isdigit() and _committed(p))
    return steps[-1] if steps else None


def progress_line(rec: dict[str, Any], steps: int) -> str:
    done = round(20 * (rec["step"] + 1) / steps)
    return (f"step {rec['step'] + 1:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (20 - done)}]"
            f" loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  lr {rec['lr']:.2e}"
            f"  {rec['tokens_per_s']:,.0f} tok/s")


# -- the run ----------------------------------------------------------------------------------


def build_mesh(args: argparse.Namespace, device: str) -> tuple[DeviceMesh, dict[str, int]]:
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    sizes = {"dp": args.dp, "tp": world // args.dp}
    shape = {d: sizes[d] for d in hyperrecipe.load_recipe(args.recipe).mesh}
    return init_device_mesh(device, tuple(shape.values()), mesh_dim_names=tuple(shape)), shape


def train(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    mesh, shape = build_mesh(args, device)
    rank0 = dist.get_rank() == 0

    # 1. Build on meta: no rank ever holds the whole model.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    # 2. Compile (cheap: a pure function of recipe, model structure and mesh) and apply.
    plan = hyperrecipe.compile_recipe(args.recipe, model, shape)
    inst = hyperrecipe.apply(model, plan, mesh, mode=args.mode)

    # 3. Weights: each rank reads only its slices (not when resuming: the checkpoint has them).
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
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            foreach=False if inst.mode == "validate" else None)

    # 5. Resume from the newest DCP checkpoint (saved on any tp size).
    start = 0
    if resume is not None:
        start, folder = resume
        inst.load_checkpoint(folder, opt)  # dcp.load, reading the folder as data

    tokens, how = (None, "synthetic (random tokens seeded by step)")
    if args.data is not None:
        tokens, how = tokenize(Path(args.data), Path(args.weights), config.vocab_size)
    batches = Batches(tokens, vocab=config.vocab_size, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, grad_accum=args.grad_accum, dp=args.dp)
    if rank0:
        print(f"train.py: recipe {args.recipe}, mesh {shape}, mode {args.mode}, data {how}"
              + (f" ({tokens.numel()} tokens, {tokens.numel() // args.seq_len} sequences)"
                 if tokens is not None else "")
              + f", global batch {batches.rows} x {args.seq_len} tokens", file=sys.stderr,
              flush=True)

    dp_rank = mesh.get_local_rank("dp") if args.dp > 1 else 0
    dp_group = mesh["dp"].get_group() if args.dp > 1 else None
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if args.bf16
                else contextlib.nullcontext())
    stop = args.steps if args.stop_after is None else args.stop_after
    records = []
    for step in range(start, stop):
        began = time.perf_counter()
        lr = lr_at(step, lr=args.lr, min_lr=min_lr, warmup=args.warmup_steps, steps=args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for ids in batches.micro_batches(step, dp_rank):
            ids = ids.to(device)
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            # Equal token counts per micro-batch (packed, every label valid): the mean of the
            # micro-batch means is the global batch's mean, as one process computes it.
            (loss / args.grad_accum).backward()
            loss_sum += loss.detach().float()
        # The installation's own call: it knows every shard's layout (torch's clip_grad_norm_
        # gets the same norm only through hyperrecipe's guard, runtime/grads/torch_clip_guard).
        norm = (inst.clip_grad_norm_(args.max_grad_norm) if args.max_grad_norm > 0
                else inst.grad_norm())
        opt.step()
        opt.zero_grad()
        mean_loss = loss_sum / args.grad_accum
        if dp_group is not None:  # each dp rank saw its part: the global batch's loss
            dist.all_reduce(mean_loss, group=dp_group)
            mean_loss /= args.dp
        loss_value = float(mean_loss)  # waits for the step (a device sync on CUDA)
        seconds = time.perf_counter() - began
        rec = {"step": step, "loss": round(loss_value, 6), "grad_norm": round(float(norm), 6),
               "lr": lr, "tokens_per_s": round(batches.rows * args.seq_len / seconds, 1)}
        records.append(rec)
        if rank0:
            print(json.dumps(rec) if args.json else progress_line(rec, args.steps), flush=True)
        if (step + 1) % args.save_every == 0:
            # 6. Checkpoint: every shard (or FSDP's piece of it) stored once, reshardable.
            # Committed last, so a save that dies halfway is refused on resume.
            inst.save_checkpoint(out / f"step-{step + 1}", opt)

    # 7. Export for from_pretrained (every rank gathers, rank 0 writes).
    if stop == args.steps:
        inst.save_pretrained(out / "final")
    # 8. Every rank leaves together (through the store, bounded), so no rank's gloo workers are
    # still dropping a finished collective when its interpreter shuts down (docs/training.md).
    inst.leave_together("tools/train.py")
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Train; returns the per-step records (rank 0 prints them). Uses the default process group
    when one is initialised (tests run ranks in-process), else starts one as torchrun expects."""
    args = parse_args(argv)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return train(args, device)
    finally:
        if owned:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
