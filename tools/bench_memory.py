"""Per-rank peak memory of getting weights onto a tensor-parallel model.

Three ways, each in fresh gloo ranks (fork), on one Llama checkpoint written by
``save_pretrained`` (safetensors, several files):

- ``meta``: build on the meta device, ``hyperrecipe.apply``, ``TrainingState.load_weights``;
- ``materialized``: the full model built in memory on every rank, then ``apply``;
- ``parallelize_module``: the same full model through PyTorch's ``parallelize_module`` with a
  column/row-wise plan (the reference the issue names).

The plan is compiled before the baseline, as a trainer loads a compiled plan. Peak *anonymous* RSS (``RssAnon`` in ``/proc/self/status``, sampled every 2 ms by a thread) is
what the process allocated itself; file pages of the mmapped safetensors are the page cache's
and are left out. Each rank reports its peak above the baseline taken after imports and the
process group, and the ideal: the bytes of this rank's shards.

    python tools/bench_memory.py --hidden 2048 --layers 8 --vocab 32000 --world 2 [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from peak_rss import PeakRss, rss_anon  # tools/peak_rss.py: tools/ is sys.path[0]

ROOT = Path(__file__).resolve().parents[1]

LLAMA = str(ROOT / "recipes/llama.yaml")


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    """The Llama config of ``--hidden``, ``--layers`` and ``--vocab`` (bench_reload uses it)."""
    return {"hidden_size": args.hidden, "intermediate_size": args.hidden * 4,
            "num_hidden_layers": args.layers, "num_attention_heads": max(args.hidden // 64, 2),
            "num_key_value_heads": max(args.hidden // 64, 2), "vocab_size": args.vocab,
            "max_position_embeddings": 128, "tie_word_embeddings": False}


def write_checkpoint(cfg: dict[str, Any], folder: str) -> int:
    """Save a seeded Llama of ``cfg`` into ``folder`` (``save_pretrained``, 200 MB files);
    returns its parameter bytes."""
    from hyperrecipe.model_tree import build_model

    torch.manual_seed(0)
    model = build_model("hf:llama", cfg, device="cpu")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size="200MB")
    return full


def _worker(rank: int, world: int, how: str, cfg: dict[str, Any], folder: str) -> dict[str, int]:
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.model_tree import build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # The plan is compiled ahead (a trainer load_plan()s it); compiling is not what is measured.
    plan = hyperrecipe.compile_recipe(LLAMA, build_model("hf:llama", cfg, device="meta"),
                                      {"tp": world})
    gc.collect()
    base = rss_anon()
    peak = PeakRss(0.002)
    if how == "meta":
        model = build_model("hf:llama", cfg, device="meta")
        inst = hyperrecipe.apply(model, plan, mesh, mode="production")
        inst.state.load_weights(folder)
    else:
        # A model materialized in process memory (as a trainer that builds, then loads, has
        # it): from_pretrained would leave the weights in mmapped file pages, which RssAnon
        # does not count.
        torch.manual_seed(0)
        model = build_model("hf:llama", cfg, device="cpu")
        gc.collect()
        built = rss_anon()
        during = PeakRss(0.002)  # what sharding adds on top of the materialized model
        if how == "materialized":
            hyperrecipe.apply(model, plan, mesh, mode="production")
        else:
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            layer_plan = {"self_attn.q_proj": ColwiseParallel(),
                          "self_attn.k_proj": ColwiseParallel(),
                          "self_attn.v_proj": ColwiseParallel(),
                          "self_attn.o_proj": RowwiseParallel(),
                          "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                          "mlp.down_proj": RowwiseParallel()}
            for layer in model.model.layers:
                parallelize_module(layer, mesh, layer_plan)
            parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(
                input_layouts=torch.distributed.tensor.Replicate()), "lm_head": ColwiseParallel()})
    gc.collect()
    top = peak.stop()
    over_built = during.stop() - built if how != "meta" else 0
    shard = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        shard += local.numel() * local.element_size()
    return {"peak": top - base, "shard": shard, "after": rss_anon() - base, "base": base,
            "over_built": over_built}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from hyperrecipe.check.launcher import run_ranks

    cfg = llama_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        full = write_checkpoint(cfg, tmp)
        results: dict[str, Any] = {"full_bytes": full, "world": args.world, "config": cfg}
        for how in ("meta", "materialized", "parallelize_module"):
            ranks = run_ranks(_worker, args.world, how, cfg, tmp, timeout_s=1800)
            results[how] = max(ranks, key=lambda r: r["peak"])
    meta, mat, pm = results["meta"], results["materialized"], results["parallelize_module"]
    results["meta_over_ideal"] = meta["peak"] / meta["shard"]
    results["meta_total_over_ideal"] = (meta["base"] + meta["peak"]) / (meta["base"] + meta["shard"])
    results["materialized_over_parallelize_module"] = mat["peak"] / pm["peak"]
    results["sharding_over_built"] = {"materialized": mat["over_built"],
                                      "parallelize_module": pm["over_built"]}
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    mib = 2**20
    print(f"model {full / mib:.0f} MiB fp32, world {args.world}; per-rank peak RssAnon above "
          f"the post-import baseline (worst rank):")
    for how in ("meta", "materialized", "parallelize_module"):
        r = results[how]
        print(f"  {how:19s} peak {r['peak'] / mib:8.1f} MiB   shard {r['shard'] / mib:8.1f} MiB"
              f"   after {r['after'] / mib:8.1f} MiB")
    print(f"  meta: (baseline + peak) / (baseline + ideal shard): "
          f"{results['meta_total_over_ideal']:.2f}  (target <= 1.15); peak above baseline / "
          f"shard: {results['meta_over_ideal']:.2f}")
    print(f"  materialized / parallelize_module: "
          f"{results['materialized_over_parallelize_module']:.2f}  (target <= 1.0)")
    print(f"  peak above the built model while sharding it: apply "
          f"{mat['over_built'] / mib:.1f} MiB, parallelize_module {pm['over_built'] / mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
