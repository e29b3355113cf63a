"""A reload against a first load: ``TrainingState.load_weights`` into a model that already
holds weights (a resume, a weight swap) against the first load after a meta ``apply``.

In fresh gloo ranks (fork), on one Llama checkpoint written by ``save_pretrained``
(safetensors, several files): each run builds the model on the meta device, applies the plan,
times the first ``load_weights``, then times ``load_weights`` of the same folder again, with
the peak anonymous RSS (``RssAnon``, sampled every 1 ms by a thread; the mmapped files' pages
are the page cache's and are left out) above what the process held just before that call.
The floor beside them is ``safe_open(...).get_slice`` of the rank's rows of every tensor,
copied into a preallocated tensor (issue 29's anchor for a first load). Medians of
``--runs`` runs, one launch.

With ``--manifest``, an export by ``save_pretrained`` is loaded with its manifest (each rank
hashes its share of the files first) and, alternated, the same files without it.

With ``--dcp`` the loads read a DCP folder of the same weights (``save_checkpoint`` at the
same tp) instead of the safetensors files (the floor stays safetensors' ``get_slice``).

With ``--header-entries N`` (issue 28: a header of 300,000 entries took 24 s), the same
checkpoint's ``model.safetensors`` gets N more (empty) entries: the CPU seconds of
``json.loads`` of its header alone, of the whole header check, and of one rank's refused
``load_weights`` (medians).

    python tools/bench_reload.py --hidden 1024 --layers 4 --vocab 32000 --world 2 --runs 3
    python tools/bench_reload.py --hidden 1024 --layers 4 --vocab 32000 --world 2 --runs 3 --dcp
    python tools/bench_reload.py --hidden 1024 --layers 4 --vocab 32000 --world 2 --runs 5 --manifest
    python tools/bench_reload.py --hidden 64 --layers 1 --vocab 128 --runs 3 --header-entries 300000
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
from torch import Tensor

from bench_memory import llama_config, write_checkpoint  # tools/ is sys.path[0]
from peak_rss import PeakRss, rss_anon  # tools/peak_rss.py: tools/ is sys.path[0]

ROOT = Path(__file__).resolve().parents[1]

LLAMA = str(ROOT / "recipes/llama.yaml")


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


def _floor_reads(folder: str, rank: int, world: int) -> list[tuple[Path, str, slice, Tensor]]:
    """Each tensor's rows of this rank (all of a 1-D one), with a preallocated tensor for them."""
    from safetensors import safe_open

    reads = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                rows = shape[0] // world if len(shape) > 1 else shape[0]
                start = rank * rows if len(shape) > 1 else 0
                reads.append((path, key, slice(start, start + rows),
                              torch.zeros([rows, *shape[1:]])))
    return reads


def _floor(reads: list[tuple[Path, str, slice, Tensor]]) -> None:
    """``safe_open(...).get_slice(key)[rows]`` copied into the preallocated tensors."""
    from safetensors import safe_open

    handles = {path: safe_open(str(path), framework="pt") for path in {r[0] for r in reads}}
    for path, key, rows, out in reads:
        out.copy_(handles[path].get_slice(key)[rows])


def _worker(rank: int, world: int, cfg: dict[str, Any], folder: str,
            runs: int, dcp: str | None = None) -> dict[str, Any]:
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.model_tree import build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = hyperrecipe.compile_recipe(LLAMA, build_model("hf:llama", cfg, device="meta"),
                                      {"tp": world})
    floor_folder = folder
    if dcp is not None:  # the same weights as a DCP folder (save_checkpoint at this tp)
        model = build_model("hf:llama", cfg, device="meta")
        inst = hyperrecipe.apply(model, plan, mesh, mode="production")
        inst.state.load_weights(folder)
        inst.state.save_checkpoint(dcp)
        folder = dcp
        del model, inst
        gc.collect()
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
        seconds, peak = _timed(lambda: inst.state.load_weights(folder))
        first.append(seconds)
        first_peak.append(peak)
        torch.distributed.barrier()
        seconds, peak = _timed(lambda: inst.state.load_weights(folder))
        again.append(seconds)
        again_peak.append(peak)
        torch.distributed.barrier()
        reads = _floor_reads(floor_folder, rank, world)
        floor.append(_timed(lambda: _floor(reads))[0])
        del model, inst, reads
        gc.collect()
    return {"first_s": statistics.median(first), "reload_s": statistics.median(again),
            "floor_s": statistics.median(floor), "first_peak": statistics.median(first_peak),
            "reload_peak": statistics.median(again_peak), "largest_shard": shard,
            "reload_over_first": statistics.median(a / f for a, f in zip(again, first,
                                                                        strict=True))}


def _manifest_worker(rank: int, world: int, cfg: dict[str, Any], folder: str, runs: int,
                     export: str) -> dict[str, float]:
    """``load_weights`` of one export by ``save_pretrained`` with its manifest (each rank
    hashes its share of the files before loading) and of the same files without it,
    alternated: the load side of the export's integrity."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.model_tree import build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = hyperrecipe.compile_recipe(LLAMA, build_model("hf:llama", cfg, device="meta"),
                                      {"tp": world})
    model = build_model("hf:llama", cfg, device="meta")
    inst = hyperrecipe.apply(model, plan, mesh, mode="production")
    inst.state.load_weights(folder)
    inst.state.save_pretrained(export)
    bare = export + "-bare"
    if rank == 0:  # the same files, hard-linked, without the manifest
        os.mkdir(bare)
        for f in Path(export).iterdir():
            if f.name != "hyperrecipe.manifest.json":
                os.link(f, Path(bare) / f.name)
    torch.distributed.barrier()
    verified: list[float] = []
    plain: list[float] = []
    for _ in range(runs):
        for source, out in ((export, verified), (bare, plain)):
            torch.distributed.barrier()
            start = time.perf_counter()
            inst.state.load_weights(source)
            out.append(time.perf_counter() - start)
    return {"verified_s": statistics.median(verified), "plain_s": statistics.median(plain),
            "ratio": statistics.median(v / p for v, p in zip(verified, plain, strict=True))}


def _add_entries(folder: Path, entries: int) -> Path:
    """``folder``'s single ``model.safetensors`` with ``entries`` more empty tensors."""
    import struct

    path = next(Path(folder).glob("*.safetensors"))
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    header.update({f"foreign.{i}.weight": {"dtype": "F32", "shape": [0],
                                           "data_offsets": [len(data), len(data)]}
                   for i in range(entries)})
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _refused_load_worker(rank: int, world: int, cfg: dict[str, Any], folder: str,
                         runs: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.errors import WeightLoadError
    from hyperrecipe.model_tree import build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = hyperrecipe.compile_recipe(LLAMA, build_model("hf:llama", cfg, device="meta"),
                                      {"tp": world})
    model = build_model("hf:llama", cfg, device="meta")
    inst = hyperrecipe.apply(model, plan, mesh, mode="production")
    seconds = []
    for _ in range(runs):
        start = time.process_time()
        try:
            inst.state.load_weights(folder)
        except WeightLoadError as exc:
            assert len(str(exc).splitlines()) < 60
        seconds.append(time.process_time() - start)
    return seconds


def _header_figures(args: argparse.Namespace, cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    from hyperrecipe.check.launcher import run_ranks
    from hyperrecipe.errors import WeightLoadError
    from hyperrecipe.runtime.state.checkpoint_files import read_safetensors_header

    path = _add_entries(Path(folder), args.header_entries)
    raw = path.read_bytes()
    text = raw[8:8 + int.from_bytes(raw[:8], "little")]
    json_s, check_s = [], []
    for _ in range(args.runs):
        start = time.process_time()
        json.loads(text)
        json_s.append(time.process_time() - start)
        start = time.process_time()
        try:
            read_safetensors_header(path)
        except WeightLoadError:  # more entries than MAX_HEADER_ENTRIES: refused unparsed
            pass
        check_s.append(time.process_time() - start)
    load_s = run_ranks(_refused_load_worker, 1, cfg, folder, args.runs, timeout_s=1800)[0]
    return {"entries": args.header_entries, "header_bytes": len(text),
            "json_loads_cpu_s": statistics.median(json_s),
            "header_check_cpu_s": statistics.median(check_s),
            "refused_load_cpu_s": statistics.median(load_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--header-entries", type=int, default=0)
    parser.add_argument("--manifest", action="store_true",
                        help="load an export with its manifest against the same files without")
    parser.add_argument("--dcp", action="store_true",
                        help="load a DCP folder (save_checkpoint of the same weights)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from hyperrecipe.check.launcher import run_ranks

    cfg = llama_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        full = write_checkpoint(cfg, tmp)
        if args.header_entries:
            figures = _header_figures(args, cfg, tmp)
            print(json.dumps(figures, indent=1) if args.json else
                  f"header of {figures['entries']} more entries ({figures['header_bytes']} "
                  f"bytes), CPU seconds, medians of {args.runs}: json.loads alone "
                  f"{figures['json_loads_cpu_s']:.3f}, the whole header check "
                  f"{figures['header_check_cpu_s']:.3f}, a refused load_weights "
                  f"{figures['refused_load_cpu_s']:.3f}")
            return 0
        if args.manifest:
            ranks = run_ranks(_manifest_worker, args.world, cfg, tmp, args.runs,
                              str(Path(tmp) / "export"), timeout_s=1800)
            for rank, r in enumerate(ranks):
                print(f"rank {rank}: load with the manifest verified {r['verified_s']:.3f} s, "
                      f"without {r['plain_s']:.3f} s, ratio {r['ratio']:.2f} (medians of "
                      f"{args.runs}, alternated)")
            return 0
        dcp = str(Path(tmp) / "dcp") if args.dcp else None
        ranks = run_ranks(_worker, args.world, cfg, tmp, args.runs, dcp, timeout_s=1800)
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
