"""What the first training forward's checks cost: the same batch and the same dropout across
each model-parallel group (``hyperrecipe/runtime/preflight/first_forward.py``).

The check runs once per installation, at the first forward in training mode: it digests the
model's tensor inputs (``batches.input_digests``), exchanges one fixed-size row per rank in one
all-gather over the world and judges the table. This tool measures it three ways, on tiny Llama
(``recipes/models/tiny-llama.json``, ``max_position_embeddings`` raised to the sequence) at
tp=2 on 2 gloo ranks (``run_ranks``: fork, one intra-op thread each):

``first_forward_ms`` / ``first_forward_unchecked_ms``
    A fresh installation's first training forward (``input_ids``, ``attention_mask``,
    ``labels``), with the check and with its hook removed before the call, interleaved by
    rounds; a forward's time is the slower rank's, the figure the median over rounds; ``*_cpu_ms``
    is the rank's main-thread CPU time (``time.thread_time``, median over both ranks), which
    leaves out waiting for the peer or the scheduler: the steadier figure on a loaded machine.
``digest_ms`` / ``exchange_ms``
    The check's two parts timed directly in each rank (medians): digesting this batch, and the
    bounded all-gather of the rows.
``digest_large_ms``
    In one process: the digest of inputs larger than a language-model batch, where the
    strided sample starts (``WHOLE_ELEMENTS``).

Bytes: each rank sends ``ROW_BYTES`` and receives ``world x ROW_BYTES``, whatever the batch.

Usage::

    python tools/bench_first_forward.py [--rounds 5] [--batch 8] [--seq 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank: int, world: int, rounds: int, batch: int, seq: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.model_tree import build_model
    from hyperrecipe.runtime.preflight.agreement import exchange_rows
    from hyperrecipe.runtime.preflight.batches import input_digests
    from hyperrecipe.runtime.preflight.first_forward import ROW_BYTES

    config = {**json.loads((ROOT / "recipes/models/tiny-llama.json").read_text()),
              "max_position_embeddings": seq}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, config["vocab_size"], (batch, seq),
                        generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    plan = hyperrecipe.compile_recipe(str(ROOT / "recipes/llama.yaml"),
                                      build_model("hf:llama", config, device="meta"),
                                      {"tp": world})

    def first_forward(checked: bool) -> tuple[float, float]:
        torch.manual_seed(0)
        model = build_model("hf:llama", config, device="cpu")
        inst = hyperrecipe.apply(model, plan, mesh)
        model.train()
        if not checked:
            for key, hook in list(model._forward_pre_hooks.items()):
                if getattr(hook, "__name__", "") == "check_first_training_forward":
                    del model._forward_pre_hooks[key]
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        model(**inputs)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        inst.restore()
        return elapsed, cpu

    times: dict[str, list[Any]] = {"checked": [], "unchecked": [], "digest": [],
                                   "exchange": []}
    for r in range(rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        for checked in order:
            times["checked" if checked else "unchecked"].append(first_forward(checked))
        t0 = time.perf_counter()
        input_digests(torch.nn.Module(), (), inputs)
        times["digest"].append(time.perf_counter() - t0)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        exchange_rows([0] * (ROW_BYTES // 8), "the benchmark's exchange", 60.0)
        times["exchange"].append(time.perf_counter() - t0)
    return times


def _large_digests() -> dict[str, float]:
    import torch

    from hyperrecipe.runtime.preflight.batches import input_digests

    cases = {"ids_8x4096_int64": torch.randint(0, 32000, (8, 4096)),
             "pixels_8x3x224x224_fp32": torch.randn(8, 3, 224, 224),
             "pixels_64x3x224x224_fp32": torch.randn(64, 3, 224, 224)}
    out: dict[str, float] = {}
    for name, value in cases.items():
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            input_digests(torch.nn.Module(), (), {"x": value})
            runs.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(runs) * 1e3, 3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from hyperrecipe.check.launcher import run_ranks
    from hyperrecipe.runtime.preflight.first_forward import ROW_BYTES

    world = 2
    ranks = run_ranks(_worker, world, args.rounds, args.batch, args.seq, timeout_s=900)
    slower = {k: [max(r[k][i][0] for r in ranks) for i in range(args.rounds)]
              for k in ("checked", "unchecked")}
    median = {k: statistics.median(v) * 1e3 for k, v in slower.items()}
    cpu = {k: statistics.median(t[1] for r in ranks for t in r[k]) * 1e3
           for k in ("checked", "unchecked")}
    parts = {k: statistics.median(t for r in ranks for t in r[k]) * 1e3
             for k in ("digest", "exchange")}
    figures: dict[str, Any] = {
        "first_forward_ms": round(median["checked"], 2),
        "first_forward_unchecked_ms": round(median["unchecked"], 2),
        "difference_ms": round(median["checked"] - median["unchecked"], 2),
        "first_forward_cpu_ms": round(cpu["checked"], 2),
        "first_forward_unchecked_cpu_ms": round(cpu["unchecked"], 2),
        "difference_cpu_ms": round(cpu["checked"] - cpu["unchecked"], 2),
        "digest_ms": round(parts["digest"], 3),
        "exchange_ms": round(parts["exchange"], 3),
        "bytes_sent_per_rank": ROW_BYTES,
        "bytes_received_per_rank": world * ROW_BYTES,
        "batch": f"{args.batch}x{args.seq}",
        "rounds": args.rounds,
        "digest_large_ms": _large_digests(),
    }
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    else:
        for k, v in figures.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
