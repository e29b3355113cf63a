"""One tensor-parallel rank's reads of a checkpoint, three ways, in one process.

The same blocks of a Llama checkpoint written by ``save_pretrained`` (safetensors), as rank 0
of tp=``--world`` holds them (rows of column-parallel weights and embeddings, columns of
``o_proj``/``down_proj``, 1-D tensors whole), copied into preallocated tensors:

- ``mmap``: a fresh private mapping per file, each block a view copied in (main's reader
  before issue 28's SIGBUS fix: a file shortened while mapped kills the process);
- ``preadv``: ``checkpoint_files.open_safetensors(...).read_into`` (positional reads straight
  into the destination; what ``load_weights`` does now);
- ``floor``: ``safe_open(...).get_slice(key)[block]`` copied in.

The three alternate round by round, so machine load hits them alike; medians (ms) per kind of
block and in all, one intra-op thread (as launcher ranks run).

    python tools/bench_reads.py --hidden 1024 --layers 4 --vocab 32000 --world 2 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_memory import llama_config, write_checkpoint  # tools/ is sys.path[0]

Block = tuple[Path, str, tuple[slice, ...], torch.Tensor, str]


def _blocks(folder: str, world: int) -> list[Block]:
    from hyperrecipe.runtime.state.checkpoint_files import open_safetensors

    out: list[Block] = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        handle = open_safetensors(path)
        for key in handle.keys():
            shape = handle.shape(key)
            if len(shape) == 1:
                block, kind = tuple(slice(0, n) for n in shape), "1-D"
            elif "o_proj" in key or "down_proj" in key:
                block, kind = (slice(0, shape[0]), slice(0, shape[1] // world)), "columns"
            else:
                block, kind = (slice(0, shape[0] // world), slice(0, shape[1])), "rows"
            dest = torch.ones([b.stop - b.start for b in block])
            out.append((path, key, block, dest, kind))
        handle.close()
    return out


def _mmap(blocks: list[Block]) -> None:
    from hyperrecipe.runtime.state.checkpoint_files import read_safetensors_header

    maps: dict[Path, tuple[Any, dict[str, Any]]] = {}
    for path, key, block, dest, _ in blocks:
        if path not in maps:
            with open(path, "rb") as handle:
                maps[path] = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY),
                              read_safetensors_header(path))
        mapping, entries = maps[path]
        dtype, shape, start = entries[key]
        numel = 1
        for n in shape:
            numel *= n
        full = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=start).view(shape)
        dest.copy_(full[block])
        del full


def _preadv(blocks: list[Block]) -> None:
    from hyperrecipe.runtime.state.checkpoint_files import Staging, open_safetensors

    staging = Staging()
    handles = {p: open_safetensors(p, staging) for p in {b[0] for b in blocks}}
    for path, key, block, dest, _ in blocks:
        handles[path].read_into(key, block, dest)
    for handle in handles.values():
        handle.close()


def _floor(blocks: list[Block]) -> None:
    from safetensors import safe_open

    handles = {p: safe_open(str(p), framework="pt") for p in {b[0] for b in blocks}}
    for path, key, block, dest, _ in blocks:
        dest.copy_(handles[path].get_slice(key)[block])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ways: dict[str, Callable[[list[Block]], None]] = {"mmap": _mmap, "preadv": _preadv,
                                                      "floor": _floor}
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(llama_config(args), tmp)
        every = _blocks(tmp, args.world)
        kinds = {"all": every, **{k: [b for b in every if b[4] == k]
                                  for k in ("rows", "columns", "1-D")}}
        times: dict[str, dict[str, list[float]]] = {k: {w: [] for w in ways} for k in kinds}
        for _ in range(args.rounds):
            for kind, blocks in kinds.items():
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn(blocks)
                    times[kind][way].append(time.perf_counter() - start)
        expected = {b[1]: b[3].clone() for b in every}
        _preadv(every)
        assert all(torch.equal(b[3], expected[b[1]]) for b in every), "preadv read other values"
    medians = {k: {w: 1e3 * statistics.median(v) for w, v in ws.items()}
               for k, ws in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    if args.json:
        print(json.dumps({"ms": medians, "load_average": load}, indent=1))
        return 0
    print(f"rank 0 of tp={args.world}, medians of {args.rounds} rounds (ms), load {load:.1f}:")
    for kind, m in medians.items():
        print(f"  {kind:8s} mmap {m['mmap']:8.1f}  preadv {m['preadv']:8.1f}  floor "
              f"{m['floor']:8.1f}  preadv/mmap {m['preadv'] / m['mmap']:.2f}  preadv/floor "
              f"{m['preadv'] / m['floor']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
