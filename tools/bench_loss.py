"""Per-rank peak memory of one training step: the loss on vocab shards vs gathered logits.

Tiny-config Llama (sizes as arguments; default vocab 32000) under sequence + tensor
parallelism on ``--world`` gloo ranks (fork), one step ``model(input_ids,
labels=labels).loss.backward()`` in production mode, with two recipes that differ only in
``lm_head``:

- ``gathered``: ``recipes/llama-sp.yaml`` (lm_head all-gathers ``[batch, seq, vocab]`` logits on
  every rank; transformers' ``ForCausalLMLoss`` runs on them);
- ``shards``: ``recipes/llama-sp-loss.yaml`` (``loss_parallel``: the logits stay
  ``[batch, seq, vocab / world]`` and the model's loss runs on the shards).

Memory is peak *anonymous* RSS (``RssAnon`` of ``/proc/self/status``, sampled every 1 ms by a
thread) above the baseline taken after ``apply`` and a warm-up step, so parameters, their
gradients and the allocator's start-up are in neither figure. glibc is told to serve every
allocation of 64 KiB or more with ``mmap`` (``mallopt``), so a freed tensor leaves the RSS at
once and the samples follow the live tensors rather than the heap's high-water mark. Each
figure is the largest rank's; every rank measures ``--repeat`` steps and keeps its smallest
peak (sampling can only miss a peak, never invent one).

    python tools/bench_loss.py --vocab 32000 --hidden 256 --layers 2 --batch 4 --seq 512 [--json]

JSON keys: ``loss_shards_peak_bytes``, ``loss_gathered_peak_bytes``, ``ratio`` (shards /
gathered; the target is <= 0.6), ``logits_bytes`` (one full fp32 ``[batch, seq, vocab]``), and
the arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path
from typing import Any

from peak_rss import PeakRss, rss_anon  # tools/peak_rss.py: tools/ is sys.path[0]

ROOT = Path(__file__).resolve().parents[1]

RECIPES = {"gathered": "recipes/llama-sp.yaml", "shards": "recipes/llama-sp-loss.yaml"}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = json.loads((ROOT / "recipes/models/tiny-llama.json").read_text())
    cfg.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
               num_hidden_layers=args.layers, vocab_size=args.vocab,
               max_position_embeddings=max(args.seq, 128))
    return dict(cfg)


def _worker(rank: int, world: int, how: str, cfg: dict[str, Any], batch: int, seq: int,
            repeat: int) -> dict[str, int]:
    import torch

    from hyperrecipe import apply, compile_recipe
    from hyperrecipe.model_tree import build_model
    from torch.distributed.device_mesh import init_device_mesh

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024)
    torch.manual_seed(0)
    model = build_model("hf:llama", cfg)
    plan = compile_recipe(str(ROOT / RECIPES[how]), build_model("hf:llama", cfg, device="meta"),
                          {"tp": world})
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply(model, plan, mesh, mode="production")
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator()
                        .manual_seed(1))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # warm-up: gradients exist from here on, and lazily built state is built
    peaks = []
    for _ in range(repeat):
        base = rss_anon()
        peak = PeakRss(0.001)
        step()
        peaks.append(peak.stop() - base)
    return {"peak": min(peaks)}


def measure_loss_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Both paths' per-rank peaks (the JSON keys above); ``args`` holds the sizes as
    :func:`main` parses them (``vocab``, ``hidden``, ``layers``, ``batch``, ``seq``, ``world``,
    ``repeat``). ``tools/bench_runtime.py`` can call it to report the same keys."""
    from hyperrecipe.check.launcher import run_ranks

    cfg = _config(args)
    peaks = {}
    for how in ("gathered", "shards"):
        ranks = run_ranks(_worker, args.world, how, cfg, args.batch, args.seq, args.repeat,
                          timeout_s=1200)
        peaks[how] = max(r["peak"] for r in ranks)
    return {
        "loss_shards_peak_bytes": peaks["shards"],
        "loss_gathered_peak_bytes": peaks["gathered"],
        "ratio": peaks["shards"] / peaks["gathered"],
        "logits_bytes": args.batch * args.seq * args.vocab * 4,
        **{k: getattr(args, k) for k in ("vocab", "hidden", "layers", "batch", "seq", "world")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    result = measure_loss_memory(args)
    peaks = {"shards": result["loss_shards_peak_bytes"],
             "gathered": result["loss_gathered_peak_bytes"]}
    logits = result["logits_bytes"]
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    mib = 1024 * 1024
    print(f"llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch "
          f"{args.batch} x seq {args.seq}, tp={args.world} (gloo, production); full fp32 logits "
          f"{logits / mib:.0f} MiB")
    print(f"  per-rank peak of one step above the applied model: gathered "
          f"{peaks['gathered'] / mib:.0f} MiB, loss on shards {peaks['shards'] / mib:.0f} MiB "
          f"(ratio {result['ratio']:.2f}; target <= 0.6)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
