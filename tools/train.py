"""A complete data x tensor parallel trainer on hyperrecipe, for ``torchrun`` (docs/training.md).

Build on meta, apply a plan, load a Hugging Face checkpoint shard by shard, optionally FSDP2 over
a ``dp`` mesh dim, train with AdamW under a warmup + cosine learning rate, with gradient
accumulation and optional bf16 autocast (gradients clipped by the norm of the full gradients,
``Installation.clip_grad_norm_``), checkpoint with DCP every N steps, resume from the newest
checkpoint (on any tp size), export consolidated safetensors at the end.

    torchrun --nproc-per-node 2 tools/train.py --weights path/to/hf-checkpoint \\
        --data corpus.txt --out runs/demo --steps 20 --save-every 10

Recipes: ``--recipe auto`` (the default) picks the shipped recipe named after the checkpoint's
``config.model_type`` (``recipes/qwen3.yaml`` for a Qwen3 checkpoint) and, with ``--dp`` above 1,
its ``[dp, tp]`` variant (``recipes/llama-dp.yaml``); a family no shipped recipe covers is
refused by name, pointing to ``hyperrecipe suggest``. A recipe of your own for ``--dp`` must
declare ``mesh: [dp, tp]``.

Pipeline parallel: ``--pp N`` on N processes trains a recipe with a ``pipeline`` section
(``--recipe auto``: the shipped ``<model_type>-pp``, ``recipes/llama-pp.yaml``) through
:func:`hyperrecipe.runtime.build_pipeline`: built on meta, each rank reads only its
stages' tensors from the checkpoint, ``pipe.step`` per micro-batch (the schedule splits it into
the recipe's microbatches), gradients divided by ``--grad-accum``, ``pipe.clip_grad_norm_`` (the
whole model's norm), AdamW over ``pipe.parameters()``. No checkpoints or export at ``--pp`` yet.

Evaluation: ``--eval-fraction F`` holds the last F of the packed sequences out of training and
evaluates the model's mean loss over them every ``--eval-every`` steps and after the last one.

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
from hyperrecipe.runtime import fully_shard_data_parallel, is_committed

AUTO = "auto"
DP_SUFFIX = "-dp"
PP_SUFFIX = "-pp"
"""``--recipe auto``: the shipped ``recipes/<model_type>.yaml``, or at ``--dp`` > 1
``recipes/<model_type>-dp.yaml`` (its ``[dp, tp]`` variant), at ``--pp`` > 1
``recipes/<model_type>-pp.yaml`` (its pipeline variant)."""

SYNTHETIC_SEED = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="--recipe auto: the shipped recipe named after the checkpoint's "
               "config.model_type (recipes/qwen3.yaml for Qwen3), at --dp > 1 its "
               "<model_type>-dp variant (recipes/llama-dp.yaml, mesh [dp, tp]); another family "
               "is refused, naming hyperrecipe suggest.")
    parser.add_argument("--recipe", default=AUTO,
                        help="recipe file or shipped name, or auto (default): the shipped "
                             "recipe for the checkpoint's model_type (with --dp it must "
                             "declare dp)")
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
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel size (the world size): a recipe with a pipeline "
                             "section, through build_pipeline (checkpoints and export through "
                             "pipe.state)")
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
    parser.add_argument("--eval-fraction", type=float, default=0.0,
                        help="hold the last fraction of --data's sequences out of training and "
                             "evaluate on them (default 0: no evaluation)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluate after every N steps and after the last "
                             "(default: --save-every)")
    args = parser.parse_args(argv)
    if args.eval_every is None:
        args.eval_every = args.save_every
    if not 0.0 <= args.eval_fraction < 1.0:
        parser.error(f"--eval-fraction must be at least 0 and below 1, got {args.eval_fraction}")
    if args.eval_fraction > 0 and args.data is None:
        parser.error("--eval-fraction holds out sequences of --data; give --data FILE")
    for name in ("seq_len", "micro_batch", "grad_accum", "steps", "save_every", "dp",
                 "eval_every", "pp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        parser.error(f"--stop-after must be between 1 and --steps ({args.steps}), "
                     f"got {args.stop_after}")
    if args.pp > 1:
        unsupported = [flag for flag, asked in (
            (f"--dp {args.dp}", args.dp > 1), (f"--mode {args.mode}", args.mode != "production"),
            ("--bf16", args.bf16), (f"--eval-fraction {args.eval_fraction}",
                                    args.eval_fraction > 0)) if asked]
        if unsupported:
            parser.error(f"--pp {args.pp} trains a pipeline alone, in fp32 production mode, "
                         f"without evaluation; drop {', '.join(unsupported)}")
        if args.recipe == AUTO:
            args.recipe = auto_recipe(Path(args.weights), 1, parser, suffix=PP_SUFFIX)
        recipe = hyperrecipe.load_recipe(args.recipe)
        if recipe.pipeline is None or tuple(recipe.mesh) != (recipe.pipeline.mesh_dim,):
            parser.error(f"--pp {args.pp} needs a recipe with a pipeline section over a mesh of "
                         f"the pipeline dim alone; {args.recipe} declares mesh "
                         f"{list(recipe.mesh)} and "
                         + ("no pipeline section" if recipe.pipeline is None else
                            f"a pipeline over {recipe.pipeline.mesh_dim!r}")
                         + " (the shipped llama-pp is one)")
        return args
    if args.recipe == AUTO:
        args.recipe = auto_recipe(Path(args.weights), args.dp, parser)
    loaded = hyperrecipe.load_recipe(args.recipe)
    if loaded.pipeline is not None:
        parser.error(f"{args.recipe} has a pipeline section: train it with --pp N (N processes)")
    mesh_dims = loaded.mesh
    if args.dp > 1 and "dp" not in mesh_dims:
        variant = f"{args.recipe}{DP_SUFFIX}"
        shipped = variant in shipped_recipes()
        parser.error(f"--dp {args.dp} needs a recipe whose mesh declares dp; {args.recipe} "
                     f"declares {list(mesh_dims)}. "
                     + (f"Use --recipe {variant} (the shipped {args.recipe} on [dp, tp]) or "
                        if shipped else "")
                     + "add dp to your recipe's mesh: [dp, tp].")
    if set(mesh_dims) - {"dp", "tp"}:
        parser.error(f"tools/train.py builds a mesh of dp and tp only; {args.recipe} declares "
                     f"{list(mesh_dims)}")
    return args


def shipped_recipes() -> list[str]:
    """The names of the shipped recipes (``recipes/NAME.yaml``)."""
    from hyperrecipe.shipped import shipped_dir

    return sorted(p.stem for p in shipped_dir().glob("*.yaml"))


def auto_recipe(weights: Path, dp: int, parser: argparse.ArgumentParser, *,
                suffix: str = DP_SUFFIX) -> str:
    """The shipped recipe for the checkpoint's ``config.model_type``: ``<model_type>``, or at
    ``dp`` > 1 ``<model_type>-dp``. A recipe of another family compiles on many models (their
    trees share FQNs) and trains them wrong (Llama's on Qwen3 leaves the q/k norms' partial
    gradients unreduced), so a family without its own shipped recipe is refused."""
    config = weights / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        parser.error(f"--recipe auto reads the model_type of {config}: {exc}; give --weights a "
                     "Hugging Face checkpoint folder, or --recipe")
    shipped = shipped_recipes()
    families = [n for n in shipped if "-" not in n]
    if not isinstance(model_type, str) or model_type not in families:
        parser.error(f"--recipe auto: no shipped recipe covers model_type {model_type!r} "
                     f"({config}); shipped families: {', '.join(families)}. Let "
                     f"`hyperrecipe suggest --model hf:{model_type} --model-config {config} "
                     f"--mesh tp=N -o {model_type}.yaml` propose one (it keeps only what its "
                     f"check verified), then pass --recipe {model_type}.yaml")
    if suffix == PP_SUFFIX:
        variant = f"{model_type}{PP_SUFFIX}"
        if variant not in shipped:
            parser.error(f"--recipe auto at --pp: no shipped recipe pipelines {model_type} "
                         f"(shipped: {', '.join(n for n in shipped if n.endswith(PP_SUFFIX))}); "
                         f"write one with a pipeline section, as recipes/llama-pp.yaml does, "
                         f"and pass --recipe")
        return variant
    if dp == 1:
        return model_type
    variant = f"{model_type}{DP_SUFFIX}"
    if variant not in shipped:
        parser.error(f"--recipe auto at --dp {dp}: no shipped recipe covers {model_type} on a "
                     f"[dp, tp] mesh (shipped: {', '.join(n for n in shipped if n.endswith(DP_SUFFIX))}"
                     f"); write one that extends {model_type} with mesh: [dp, tp], as "
                     f"recipes/llama-dp.yaml does, and pass --recipe")
    return variant


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
                 micro_batch: int, grad_accum: int, dp: int,
                 eval_fraction: float = 0.0) -> None:
        self.vocab, self.seq_len = vocab, seq_len
        self.shape = (grad_accum, dp, micro_batch)
        self.rows = grad_accum * dp * micro_batch
        self.micro_batch, self.dp = micro_batch, dp
        self.packed = None
        self.held_out: torch.Tensor | None = None
        if tokens is not None:
            count = tokens.numel() // seq_len
            if count == 0:
                msg = (f"--data holds {tokens.numel()} tokens, fewer than one --seq-len "
                       f"({seq_len}) sequence")
                raise SystemExit(msg)
            packed = tokens[:count * seq_len].view(count, seq_len)
            held = math.ceil(eval_fraction * count) if eval_fraction > 0 else 0
            if held >= count:
                msg = (f"--eval-fraction {eval_fraction} holds out all {count} sequences of "
                       f"--data; nothing is left to train on")
                raise SystemExit(msg)
            self.packed = packed[:count - held]
            self.held_out = packed[count - held:] if held else None

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

    def eval_micro_batches(self, dp_rank: int) -> Iterator[torch.Tensor | None]:
        """The held-out sequences in blocks of ``micro_batch``, block i to dp rank i mod dp.
        Every dp rank yields the same number of items (``None`` where it has no block left):
        FSDP2 gathers parameters in each forward, so every dp rank must run as many."""
        assert self.held_out is not None
        blocks = [self.held_out[i:i + self.micro_batch]
                  for i in range(0, self.held_out.shape[0], self.micro_batch)]
        rounds = math.ceil(len(blocks) / self.dp)
        for r in range(rounds):
            index = r * self.dp + dp_rank
            yield blocks[index] if index < len(blocks) else None


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


def newest_checkpoint(out: Path) -> tuple[int, Path] | None:
    steps = sorted((int(p.name.split("-")[1]), p) for p in out.glob("step-*")
                   if p.name.split("-")[1].isdigit() and is_committed(p))
    return steps[-1] if steps else None


def progress_line(rec: dict[str, Any], steps: int) -> str:
    """``rec["step"]`` counts optimizer steps done (1 after the first), as the ``--json``
    records, ``--stop-after`` and the ``step-N`` checkpoints do."""
    width = len(str(steps))
    if "eval_loss" in rec:
        return (f"eval {rec['step']:>{width}}/{steps} loss {rec['eval_loss']:.4f} "
                f"({rec['eval_sequences']} held-out sequences)")
    done = round(20 * rec["step"] / steps)
    return (f"step {rec['step']:>{width}}/{steps} [{'#' * done}{'.' * (20 - done)}]"
            f" loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  lr {rec['lr']:.2e}"
            f"  {rec['tokens_per_s']:,.0f} tok/s")


def evaluate(model: torch.nn.Module, batches: Batches, *, dp_rank: int, dp_group: Any,
             device: str, autocast: Any) -> float:
    """The model's mean loss over every held-out token, as one process computes it over the
    held-out sequences at once (every label of a packed sequence is valid, so each sequence
    counts ``seq_len - 1`` tokens): each dp rank sums loss × tokens over its blocks, the sums
    are all-reduced over dp."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss x tokens, tokens
    first: torch.Tensor | None = None
    try:
        with torch.no_grad():
            for ids in batches.eval_micro_batches(dp_rank):
                assert batches.held_out is not None
                run = ids if ids is not None else batches.held_out[:1]
                first = run if first is None else first
                run = run.to(device)
                with autocast:
                    loss = model(input_ids=run, labels=run).loss
                if ids is not None:  # a rank without a block ran the forward for FSDP only
                    tokens = ids.shape[0] * (ids.shape[1] - 1)
                    totals[0] += float(loss) * tokens
                    totals[1] += tokens
    finally:
        model.train()
        # FSDP2 leaves the root's parameters gathered after a forward without backward (its
        # reshard runs after backward): put the shards back before the optimizer or a
        # checkpoint looks at them
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    if dp_group is not None:
        dist.all_reduce(totals, group=dp_group)
    return float(totals[0] / totals[1])


# -- the run ----------------------------------------------------------------------------------


def build_mesh(args: argparse.Namespace, device: str) -> tuple[DeviceMesh, dict[str, int]]:
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    sizes = {"dp": args.dp, "tp": world // args.dp}
    shape = {d: sizes[d] for d in hyperrecipe.load_recipe(args.recipe).mesh}
    return init_device_mesh(device, tuple(shape.values()), mesh_dim_names=tuple(shape)), shape


def train_pipelined(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """``--pp N``: docs/training.md's loop for a pipeline (build on meta, compile,
    ``build_pipeline``, load this rank's stages, AdamW over ``pipe.parameters()``, per
    micro-batch ``pipe.step``, clip, step)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hyperrecipe.runtime import build_pipeline

    world = dist.get_world_size()
    if world != args.pp:
        raise SystemExit(f"--pp {args.pp} needs {args.pp} processes; the world has {world}")
    torch.manual_seed(0)
    recipe = hyperrecipe.load_recipe(args.recipe)
    assert recipe.pipeline is not None
    shape = {recipe.pipeline.mesh_dim: args.pp}
    mesh = init_device_mesh(device, (args.pp,), mesh_dim_names=tuple(shape))
    rank0 = dist.get_rank() == 0

    # 1. Build on meta; 2. compile (the plan holds the split); 3. this rank's stages.
    config = AutoConfig.from_pretrained(args.weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = hyperrecipe.compile_recipe(args.recipe, model, shape)
    assert plan.pipeline is not None
    if args.micro_batch % plan.pipeline.microbatches:
        raise SystemExit(f"--micro-batch {args.micro_batch}: {args.recipe}'s schedule cuts each "
                         f"micro-batch into {plan.pipeline.microbatches} microbatches; give a "
                         f"multiple of {plan.pipeline.microbatches}")
    pipe = build_pipeline(model, plan, mesh)
    # 4. Weights: each rank reads only its stages' tensors (not when resuming: the checkpoint
    # has them).
    out = Path(args.out)
    resume = newest_checkpoint(out)
    if resume is None:
        pipe.state.load_weights(args.weights)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start = 0
    if resume is not None:  # 5. saved at any pp size (or unpipelined)
        start, folder = resume
        pipe.state.load_checkpoint(folder, opt)

    tokens, how = (None, "synthetic (random tokens seeded by step)")
    if args.data is not None:
        tokens, how = tokenize(Path(args.data), Path(args.weights), config.vocab_size)
    batches = Batches(tokens, vocab=config.vocab_size, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, grad_accum=args.grad_accum, dp=1)
    if rank0:
        print(f"train.py: recipe {args.recipe} (model_type {config.model_type}), mesh {shape}, "
              f"pipeline {plan.pipeline.schedule} x {plan.pipeline.microbatches} microbatches, "
              f"stages {[(s.start, s.stop) for s in plan.pipeline.stages]}, data {how}, global "
              f"batch {batches.rows} x {args.seq_len} tokens",
              file=sys.stderr, flush=True)
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    stop = args.steps if args.stop_after is None else args.stop_after
    records = []
    for step in range(start, stop):
        began = time.perf_counter()
        lr = lr_at(step, lr=args.lr, min_lr=min_lr, warmup=args.warmup_steps, steps=args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for ids in batches.micro_batches(step, 0):
            ids = ids.to(device)
            # the micro-batch's mean loss on every rank; gradients accumulate across steps
            loss_sum += pipe.step(input_ids=ids, labels=ids)
        # pipe.step takes no loss scale: dividing the accumulated gradients by N is the same
        # as backward of loss / N (packed data: every micro-batch has as many label tokens)
        if args.grad_accum > 1:
            for p in pipe.parameters():
                if p.grad is not None:
                    p.grad.div_(args.grad_accum)
        norm = pipe.clip_grad_norm_(args.max_grad_norm if args.max_grad_norm > 0
                                    else float("inf"))
        opt.step()
        opt.zero_grad()
        loss_value = float(loss_sum / args.grad_accum)
        seconds = time.perf_counter() - began
        rec = {"step": step + 1, "loss": round(loss_value, 6),
               "grad_norm": round(float(norm), 6), "lr": lr,
               "tokens_per_s": round(batches.rows * args.seq_len / seconds, 1)}
        records.append(rec)
        if rank0:  # every rank has the loss; one line per step
            print(json.dumps(rec) if args.json else progress_line(rec, args.steps), flush=True)
        if (step + 1) % args.save_every == 0:  # 6. each rank writes its stages; committed last
            pipe.state.save_checkpoint(out / f"step-{step + 1}", opt)
    if stop == args.steps:  # 7. one transformers checkpoint of the whole model
        pipe.state.save_pretrained(out / "final")
    dist.barrier()  # every rank leaves together
    return records


def train(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    if args.pp > 1:
        return train_pipelined(args, device)
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
        inst.state.load_weights(args.weights)

    # 4. Optional FSDP2 over dp, after apply: per decoder layer and on the root, the
    # parameters the plan's gradient buckets reduce (sequence-parallel norms, Qwen3's q/k
    # norms) left to the buckets, which also average them over dp.
    if args.dp > 1:
        fully_shard_data_parallel(inst, mesh["dp"], model.model.layers)

    # Validate mode keeps replicated parameters outside boundaries plain next to its DTensors,
    # which torch's multi-tensor kernels (the default on CUDA) refuse: one tensor at a time.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            foreach=False if inst.mode == "validate" else None)

    # 5. Resume from the newest DCP checkpoint (saved on any tp size).
    start = 0
    if resume is not None:
        start, folder = resume
        inst.state.load_checkpoint(folder, opt)  # dcp.load, reading the folder as data

    tokens, how = (None, "synthetic (random tokens seeded by step)")
    if args.data is not None:
        tokens, how = tokenize(Path(args.data), Path(args.weights), config.vocab_size)
    batches = Batches(tokens, vocab=config.vocab_size, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, grad_accum=args.grad_accum, dp=args.dp,
                      eval_fraction=args.eval_fraction)
    if rank0:
        held = batches.held_out.shape[0] if batches.held_out is not None else 0
        print(f"train.py: recipe {args.recipe} (model_type {config.model_type}), mesh {shape}, "
              f"mode {args.mode}, data {how}"
              + (f" ({tokens.numel()} tokens, {tokens.numel() // args.seq_len} sequences"
                 + (f", {held} held out for evaluation" if held else "") + ")"
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
        # numbered by optimizer steps done, as the progress line, --stop-after and step-N
        rec = {"step": step + 1, "loss": round(loss_value, 6),
               "grad_norm": round(float(norm), 6), "lr": lr,
               "tokens_per_s": round(batches.rows * args.seq_len / seconds, 1)}
        records.append(rec)
        if rank0:
            print(json.dumps(rec) if args.json else progress_line(rec, args.steps), flush=True)
        if batches.held_out is not None and ((step + 1) % args.eval_every == 0
                                             or step + 1 == stop):
            evaluated: dict[str, Any] = {
                "step": step + 1, "eval_loss": round(evaluate(
                    model, batches, dp_rank=dp_rank, dp_group=dp_group, device=device,
                    autocast=autocast), 6), "eval_sequences": int(batches.held_out.shape[0])}
            records.append(evaluated)
            if rank0:
                print(json.dumps(evaluated) if args.json
                      else progress_line(evaluated, args.steps), flush=True)
        if (step + 1) % args.save_every == 0:
            # 6. Checkpoint: every shard (or FSDP's piece of it) stored once, reshardable.
            # Committed last, so a save that dies halfway is refused on resume.
            inst.state.save_checkpoint(out / f"step-{step + 1}", opt)

    # 7. Export for from_pretrained (every rank gathers, rank 0 writes).
    if stop == args.steps:
        inst.state.save_pretrained(out / "final")
    # 8. Every rank leaves together (through the store, bounded), so no rank's gloo workers are
    # still dropping a finished collective when its interpreter shuts down (docs/training.md).
    from hyperrecipe.runtime import leave_together

    leave_together(inst, "tools/train.py")
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
