"""Gathering a tensor-parallel model's full tensors (what export does), against its floor.

A transformers ``LlamaForCausalLM`` (hidden 1024, intermediate 4096, 2 layers, 16 heads,
vocab 16000; fp32, about 265 MB) applied with ``recipes/llama.yaml`` at tp=2 on 2 gloo ranks
started by :func:`hyperrecipe.check.launcher.run_ranks` (fork, one intra-op thread per rank).
Each round gathers every parameter's full tensor three ways, in rotated order:

``cat``
    The previous ``gather_full``: each shard all-gathered into a staging buffer, the blocks
    reassembled with ``torch.cat`` (reimplemented here, as it was).
``in_place``
    ``hyperrecipe.runtime.comm.sharding.gather_full`` now: each block gathered straight into its
    place in one preallocated full tensor (``runtime/comm/gather_into.py``).
``floor``
    One raw ``all_gather_into_tensor`` per shard into a preallocated flat buffer: the bytes moved,
    with nothing around them.
``to_writer``
    What an export does now: each sharded tensor sent to rank 0 alone, point to point in 8 MiB
    pieces, received into its place (``gather_to_writer``); the other rank keeps nothing.

A round's figure is the slower rank's; the summary gives medians (ms) and the ratios to the
floor.

Usage::

    python tools/bench_gather.py [--rounds 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 16000,
    "max_position_embeddings": 128,
}
WAYS = ("cat", "in_place", "floor", "to_writer")


def _worker(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply, compile_recipe
    from hyperrecipe.collective import CollectiveOp
    from hyperrecipe.model_tree import build_model
    from hyperrecipe.placement import Shard
    from hyperrecipe.runtime.comm.collectives import execute, group_for
    from hyperrecipe.runtime.comm.gather_into import gather_to_writer
    from hyperrecipe.runtime.comm.sharding import gather_full

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = compile_recipe(str(REPO / "recipes/llama.yaml"), build_model("hf:llama", CONFIG),
                          {"tp": world})
    torch.manual_seed(0)
    model = build_model("hf:llama", CONFIG, device="cpu")
    apply(model, plan, mesh)
    dims = plan.mesh_dims
    params = [(p, model.get_parameter(p.fqn).detach()) for p in plan.params if p.tied_to is None]
    g = group_for(mesh, "tp")

    def by_cat(p: Any, local: torch.Tensor) -> torch.Tensor:
        q = p.placement.get("tp")
        if not isinstance(q, Shard):
            return local.clone()
        d = q.dim % len(p.shape)
        sizes = [s // world for s in q.part_sizes(p.shape[d])]
        op = CollectiveOp(kind="all_gather", mesh_dim="tp", gather_dim=d)
        return torch.cat([execute(part.contiguous(), op, g.group, group_size=g.size,
                                  group_rank=g.rank) for part in torch.split(local, sizes, d)],
                         dim=d)

    def floor(p: Any, local: torch.Tensor) -> torch.Tensor:
        if tuple(local.shape) == p.shape:
            return local.clone()
        out = local.new_empty((world * local.numel(),))
        dist.all_gather_into_tensor(out, local.contiguous().view(-1), group=g.group)
        return out

    def in_place(p: Any, local: torch.Tensor) -> torch.Tensor:
        if tuple(local.shape) == p.shape:
            return local.clone()
        return gather_full(local, p.placement, p.shape, mesh, dims)

    def to_writer(p: Any, local: torch.Tensor) -> torch.Tensor | None:
        if tuple(local.shape) == p.shape:
            return local.clone()
        return gather_to_writer(local, p.placement, p.shape, mesh, dims, 0)

    fns = {"cat": by_cat, "in_place": in_place, "floor": floor, "to_writer": to_writer}
    for p, local in params:  # every way gives the same tensor (floor: the same bytes)
        whole = in_place(p, local)  # a collective: every rank, before the comparisons
        assert torch.equal(by_cat(p, local), whole), p.fqn
        written = to_writer(p, local)
        assert written is not None and (rank != 0 or torch.equal(written, whole)), p.fqn
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            dist.barrier()
            t0 = time.perf_counter()
            for p, local in params:
                fns[way](p, local)
            times[way].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from hyperrecipe.check.launcher import run_ranks

    results = run_ranks(_worker, 2, args.rounds, timeout_s=1800)
    per_round = {w: [max(v) for v in zip(*(r[w] for r in results))] for w in WAYS}
    med = {w: round(statistics.median(v), 2) for w, v in per_round.items()}
    summary = {"median_ms": med, "cat_over_floor": round(med["cat"] / med["floor"], 3),
               "in_place_over_floor": round(med["in_place"] / med["floor"], 3),
               "to_writer_over_floor": round(med["to_writer"] / med["floor"], 3)}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"config": CONFIG, "rounds": per_round, **summary},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
