"""A reload against a first load: ``Installation.load_weights`` into a model that already
holds weights (a resume, a weight swap) against the first load after a meta ``apply``.

In fresh gloo ranks (fork), on one Llama checkpoint written by ``save_pretrained``
(safetensors, several files): each run builds the model on the meta device, applies the plan,
times the first ``load_weights``, then times ``load_weights`` of the same folder again, with
the peak anonymous RSS (``RssAnon``, sampled every 1 ms by a thread; the mmapped files' pages
are the page cache's and are left out) above what the process held just before that call.
The floor beside them is ``safe_open(...).get_slice`` of the rank's rows of every tensor,
copied into a preallocated tensor. Medians of ``--runs`` runs, one launch.

    python tools/bench_reload.py --hidden 1024 --layers 4 --vocab 32000 --world 2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from peak_rss import PeakRss, rss_anon  # tools/peak_rss.py: tools/ is sys.path[0]

ROOT = Path(__file__).resolve().parents[1]

LLAMA = str(ROOT / "recipes/llama.yaml")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden, "intermediate_size": args.hidden * 4,
            "num_hidden_layers": args.layers, "num_attention_heads": max(args.hidden // 64, 2),
            "num_key_value_heads": max(args.hidden // 64, 2), "vocab_size": args.vocab,
            "max_position_embeddings": 128, "tie_word_embeddings": False}


def _timed(fn: Any) -> tuple[float, int]:
    """Seconds ``fn()`` took and the peak RssAnon above the level before it."""
    import gc

    gc.collect()
    base = rss_anon()
    peak = PeakRss(0.001)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, peak.stop() - base


def _floor(folder: str, rank: int, world: int) -> None:
    """Each tensor's rows of this rank (all of a 1-D one) through ``get_slice``, copied in."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                shape = sl.get_shape()
                rows = shape[0] // world if len(shape) > 1 else shape[0]
                start = rank * rows if len(shape) > 1 else 0
                out = torch.empty([rows, *shape[1:]])
                out.copy_(sl[start:start + rows])


def _worker(rank: int, world: int, cfg: dict[str, Any], folder: str,
            runs: int) -> dict[str, Any]:
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.model_tree import build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = hyperrecipe.compile_recipe(LLAMA, build_model("hf:llama", cfg, device="meta"),
                                      {"tp": world})
    first: list[float] = []
    again: list[float] = []
    floor: list[float] = []
    first_peak: list[int] = []
    again_peak: list[int] = []
    shard = 0
    for _ in range(runs):
        model = build_model("hf:llama", cfg, device="meta")
        inst = hyperrecipe.apply(model, plan, mesh, mode="production")
        shard = max(shard, max((p.to_local() if hasattr(p, "to_local") else p).nbytes
                               for p in model.parameters()))
        torch.distributed.barrier()
        seconds, peak = _timed(lambda: inst.load_weights(folder))
        first.append(seconds)
        first_peak.append(peak)
        torch.distributed.barrier()
        seconds, peak = _timed(lambda: inst.load_weights(folder))
        again.append(seconds)
        again_peak.append(peak)
        torch.distributed.barrier()
        floor.append(_timed(lambda: _floor(folder, rank, world))[0])
        del model, inst
        gc.collect()
    return {"first_s": statistics.median(first), "reload_s": statistics.median(again),
            "floor_s": statistics.median(floor), "first_peak": statistics.median(first_peak),
            "reload_peak": statistics.median(again_peak), "largest_shard": shard,
            "reload_over_first": statistics.median(a / f for a, f in zip(again, first,
                                                                        strict=True))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from hyperrecipe.check.launcher import run_ranks
    from hyperrecipe.model_tree import build_model

    cfg = _config(args)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = build_model("hf:llama", cfg, device="cpu")
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size="200MB")
        del model
        ranks = run_ranks(_worker, args.world, cfg, tmp, args.runs, timeout_s=1800)
    worst = max(ranks, key=lambda r: r["reload_over_first"])
    results: dict[str, Any] = {"full_bytes": full, "world": args.world, "runs": args.runs,
                               "config": cfg, "ranks": ranks,
                               "reload_over_first": worst["reload_over_first"],
                               "reload_peak_over_largest_shard":
                                   max(r["reload_peak"] / r["largest_shard"] for r in ranks)}
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    mib = 2**20
    print(f"model {full / mib:.0f} MiB fp32, world {args.world}, medians of {args.runs} runs:")
    for rank, r in enumerate(ranks):
        print(f"  rank {rank}: first load {r['first_s']:.3f} s (peak +{r['first_peak'] / mib:.1f}"
              f" MiB), reload {r['reload_s']:.3f} s (peak +{r['reload_peak'] / mib:.1f} MiB), "
              f"get_slice floor {r['floor_s']:.3f} s; largest shard "
              f"{r['largest_shard'] / mib:.1f} MiB")
    print(f"  reload / first load: {results['reload_over_first']:.2f} (target <= 1.2); "
          f"reload peak / largest shard: {results['reload_peak_over_largest_shard']:.2f} "
          f"(target <= 1.0)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
