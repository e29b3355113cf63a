"""Measure what one ``run_ranks`` launch costs with ``fork`` and with ``spawn``.

Each launch runs a function that does one all-reduce, so the figure is start-up, rendezvous,
one collective and teardown. The first launch of each method is reported apart (warm-up), the
rest as median and range. Results go to stdout as a Markdown table (paste into docs/launcher.md).

Usage::

    python tools/bench_launch.py [--repeats 5] [--world-sizes 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hyperrecipe.check.launcher import StartMethod, run_ranks


def one_all_reduce(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def time_launch(world_size: int, start_method: StartMethod) -> float:
    start = time.perf_counter()
    run_ranks(one_all_reduce, world_size, start_method=start_method, timeout_s=300.0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ns = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads in the parent")
    print()
    print("| start method | world size | first launch (s) | median (s) | min-max (s) |")
    print("|---|---|---|---|---|")
    methods: tuple[StartMethod, ...] = ("fork", "spawn")
    for method in methods:
        for ws in ns.world_sizes:
            first = time_launch(ws, method)
            rest = [time_launch(ws, method) for _ in range(ns.repeats)]
            print(
                f"| {method} | {ws} | {first:.2f} | {statistics.median(rest):.2f} | "
                f"{min(rest):.2f}-{max(rest):.2f} |"
            )


if __name__ == "__main__":
    main()
