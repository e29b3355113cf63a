"""The full export at tp=2 against transformers' own one-process ``save_pretrained`` (issue 29).

A transformers ``LlamaForCausalLM`` built from a config (fp32; the default, hidden 2048,
intermediate 5632, 3 layers, vocab 32000, is about 1.1 GiB) on 2 gloo ranks started by
:func:`hyperrecipe.check.launcher.run_ranks` (fork, one intra-op thread per rank). Rank 0 also
builds the same model unapplied (same seed), the reference. Each round, in alternating order:

``transformers``
    ``reference.save_pretrained(folder)`` on rank 0 alone (safetensors, one file, no fsync:
    what a user of one process gets); rank 1 waits at a barrier.
``transformers+fsync``
    The same, then every file it wrote synced: the same bytes made durable, as the export makes
    them before it renames them into place.
``hyperrecipe``
    ``TrainingState.save_pretrained(folder)`` on both ranks: every tensor gathered (the next one
    while rank 0 writes the current one), hashed (xxh3_128) as it streams, synced, renamed
    into place, the manifest written last. The figure is the slower rank's.

With ``--components``, two more ways say what the export's safety costs (measurement only: the
export's own steps are swapped out inside the benchmark's processes for that way, and put back
after it):

``hyperrecipe-nosync``
    The export without its durability: no ``fsync`` of the files or the folder, no early
    writeback (``sync_file_range``); temporary names, renames and the manifest as always. Its
    ratio to ``transformers`` is the like-for-like one (neither makes the bytes durable).
``hyperrecipe-nohash``
    The export without its digest (every hash a no-op; the manifest records a dummy).

With ``--phases``, each rank also reports where its time went in the ``hyperrecipe`` way:
wall and thread CPU seconds inside each step of the export (median over rounds), and the
process's CPU (user + system) over the whole call, which shows whether a rank that waits
spins. Steps (each wrapped where the export calls it): ``enter`` (every rank entered),
``negotiate`` (direct writes agreed), ``write_runs`` (this rank's blocks into the file),
``report_written`` / ``wait_written`` (a peer tells the writer; the writer waits for it), ``write`` (a gathered tensor
written and hashed by the writer), ``small_write`` (a small one, on the hashing thread), ``hash_range`` (tensors hashed from the file),
``start_writeback``, ``fsync``, ``agree`` (the ranks' final agreement), ``replace_text`` (the
manifest), ``wait_next`` (the writer's main thread waiting for the next tensor).

Each way's process CPU (user + system, every thread, medians over rounds) is reported beside
its time as ``cpu_s``: rank 0's for transformers' ways, both ranks' together for the export's.
On a shared machine the wall times follow the load; the CPU an export spends does much less.

Before the rounds, the first export is checked against the reference tensor by tensor (equal
bytes). Each folder is deleted after its round, so the page cache and the disk hold one export
at a time. Medians over ``--rounds``; ``ratio`` is hyperrecipe / transformers (target <= 1.3),
``ratio_to_fsynced`` hyperrecipe / transformers+fsync.

``--baseline REV`` measures a git revision's ``hyperrecipe`` in the same run of the tool:
``git archive REV hyperrecipe`` is unpacked into a temporary folder and the ranks are launched
``--launches`` times per tree, alternating baseline and working tree (each launch a fresh
``python`` with that tree first on ``PYTHONPATH``), so both see the same machine load.

Usage::

    python tools/bench_export.py [--hidden 2048] [--layers 3] [--vocab 32000] [--rounds 3]
                                 [--baseline REV] [--launches 1] [--components] [--phases]
                                 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench_host import alternate_launches  # tools/ is sys.path[0]

REPO = Path(__file__).resolve().parents[1]
WAYS = ("transformers", "transformers+fsync", "hyperrecipe")
COMPONENTS = ("hyperrecipe-nosync", "hyperrecipe-nohash")
PHASES = {"every_rank_entered": "enter", "_negotiate": "negotiate", "write_runs": "write_runs",
          "send": "report_written", "wait_written": "wait_written", "_write": "write",
          "_hash_and_write": "small_write", "hash_range": "hash_range",
          "start_writeback": "start_writeback", "fsync": "fsync", "every_rank_failure": "agree",
          "replace_text": "replace_text", "commit_switch": "switch", "next": "wait_next"}


class _Patched:
    """Steps of the export swapped for one way (``--components``) or wrapped to time them
    (``--phases``), put back on leaving."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> _Patched:
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()


class _NoHash:
    def update(self, data: Any, /) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 32


def _os_with(**swapped: Any) -> Any:
    """The ``os`` module as the export sees it, with ``swapped`` functions."""

    class Os:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

    for name, fn in swapped.items():
        setattr(Os, name, staticmethod(fn))
    return Os()


def _patch_way(patched: _Patched, way: str) -> None:
    import hyperrecipe.runtime.state.export as export

    if way == "hyperrecipe-nosync":
        patched.set(export, "os", _os_with(fsync=lambda fd: None))
        patched.set(export, "start_writeback", lambda fd, offset, nbytes: None)
        if hasattr(export, "sync_folder"):  # an older tree (--baseline)
            patched.set(export, "sync_folder", lambda folder: None)
        else:
            import hyperrecipe.runtime.state.folder_switch as folder_switch

            patched.set(folder_switch, "sync_folder", lambda folder: None)
    elif way == "hyperrecipe-nohash":
        patched.set(export, "new_hasher", lambda algorithm: _NoHash())
        patched.set(export, "hash_range", lambda hasher, fd, mapping, start, end: None)


def _patch_phases(patched: _Patched, spent: dict[str, list[float]]) -> None:
    """Wrap each step in :data:`PHASES` to add its wall and thread CPU seconds to ``spent``."""
    import hyperrecipe.runtime.preflight.agreement as agreement
    import hyperrecipe.runtime.state.export as export

    def timed(name: str, fn: Any) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = spent.setdefault(name, [0.0, 0.0])
                entry[0] += time.perf_counter() - wall
                entry[1] += time.thread_time() - cpu
        return step

    for attr, name in PHASES.items():
        if not hasattr(export, attr) and attr not in ("every_rank_entered", "next", "send"):
            continue  # an older tree (--baseline) without this step
        if attr == "every_rank_entered":
            patched.set(agreement, attr, timed(name, getattr(agreement, attr)))
        elif attr == "next":
            patched.set(export._Gathers, attr, timed(name, export._Gathers.next))
        elif attr == "send" and hasattr(export, "Reports"):
            patched.set(export.Reports, attr, timed(name, export.Reports.send))
        elif attr not in ("fsync", "send"):
            patched.set(export, attr, timed(name, getattr(export, attr)))
    patched.set(export, "os", _os_with(fsync=timed("fsync", export.os.fsync)))


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden,
            "intermediate_size": args.intermediate or args.hidden * 11 // 4,
            "num_hidden_layers": args.layers, "num_attention_heads": max(args.hidden // 128, 2),
            "num_key_value_heads": max(args.hidden // 128, 2), "vocab_size": args.vocab,
            "max_position_embeddings": 128, "tie_word_embeddings": False}


def _worker(rank: int, world: int, cfg: dict[str, Any], rounds: int, root: str,
            components: bool = False, phases: bool = False) -> dict[str, Any]:
    import resource

    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply, compile_recipe
    from hyperrecipe.model_tree import build_model

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = compile_recipe(str(REPO / "recipes/llama.yaml"), build_model("hf:llama", cfg),
                          {"tp": world})
    reference: Any = None  # a transformers model: save_pretrained is not typed on nn.Module
    if rank == 0:
        torch.manual_seed(0)
        reference = build_model("hf:llama", cfg, device="cpu")
    torch.manual_seed(0)
    model = build_model("hf:llama", cfg, device="cpu")
    inst = apply(model, plan, mesh)
    model_bytes = sum(p.numel() * p.element_size() for p in
                      (reference.parameters() if reference is not None else []))

    first = Path(root) / "check"
    inst.state.save_pretrained(first)
    if reference is not None:  # the export holds the reference's tensors, byte for byte
        with safe_open(str(first / "model.safetensors"), framework="pt") as f:
            for name, value in reference.state_dict().items():
                assert torch.equal(f.get_tensor(name), value), name
        shutil.rmtree(first)
    dist.barrier()

    ways = WAYS + (COMPONENTS if components else ())
    times: dict[str, list[float]] = {w: [] for w in ways}
    steps: list[dict[str, list[float]]] = []
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            folder = Path(root) / f"{way}-{r}"
            spent: dict[str, list[float]] = {}
            dist.barrier()
            with _Patched() as patched:
                _patch_way(patched, way)
                if phases and way == "hyperrecipe":
                    _patch_phases(patched, spent)
                before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                if way.startswith("hyperrecipe"):
                    inst.state.save_pretrained(folder)
                elif reference is not None:
                    reference.save_pretrained(folder)
                    if way == "transformers+fsync":
                        for file in folder.iterdir():
                            with open(file, "rb") as handle:
                                os.fsync(handle.fileno())
                elapsed = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
            cpu[way].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            if way == "hyperrecipe":
                steps.append(spent)
            dist.barrier()
            if rank == 0:
                times[way].append(elapsed)
                shutil.rmtree(folder)
            elif way.startswith("hyperrecipe"):
                times[way].append(elapsed)
    return {"times": times, "model_bytes": model_bytes, "cpu_s": cpu, "steps": steps}


def _phases(result: dict[str, Any]) -> dict[str, Any]:
    """One rank's median wall and CPU seconds per step, and its process CPU per export."""
    names = sorted({n for spent in result["steps"] for n in spent})
    return {"cpu_s": round(statistics.median(result["cpu_s"]["hyperrecipe"]), 3),
            "steps": {n: {"wall_s": round(statistics.median(s.get(n, [0.0, 0.0])[0]
                                                            for s in result["steps"]), 3),
                          "cpu_s": round(statistics.median(s.get(n, [0.0, 0.0])[1]
                                                           for s in result["steps"]), 3)}
                      for n in names}}


def _launch_here(args: argparse.Namespace) -> dict[str, Any]:
    """One launch of the ranks with whatever ``hyperrecipe`` this interpreter imports."""
    from hyperrecipe.check.launcher import run_ranks

    cfg = _config(args)
    root = tempfile.mkdtemp(prefix="bench-export-", dir=args.dir)
    load = os.getloadavg()[0]
    try:
        results = run_ranks(_worker, 2, cfg, args.rounds, root, args.components, args.phases,
                            timeout_s=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_round = {w: [max(v) for v in zip(*(r["times"][w] for r in results))]
                 if w.startswith("hyperrecipe") else results[0]["times"][w]
                 for w in results[0]["times"]}
    med = {w: round(statistics.median(v), 3) for w, v in per_round.items()}
    out = {"model_bytes": results[0]["model_bytes"],
           "transformers_save_pretrained_s": med["transformers"],
           "transformers_save_pretrained_fsync_s": med["transformers+fsync"],
           "hyperrecipe_save_pretrained_s": med["hyperrecipe"],
           "ratio": round(med["hyperrecipe"] / med["transformers"], 3),
           "ratio_to_fsynced": round(med["hyperrecipe"] / med["transformers+fsync"], 3),
           "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
           "cpu_s": {w: round(statistics.median(
               [sum(v) for v in zip(*(r["cpu_s"][w] for r in results))]
               if w.startswith("hyperrecipe") else results[0]["cpu_s"][w]), 3)
               for w in results[0]["cpu_s"]},
           "rounds": per_round, "config": cfg}
    if args.components:
        out.update({"hyperrecipe_nosync_s": med["hyperrecipe-nosync"],
                    "hyperrecipe_nohash_s": med["hyperrecipe-nohash"],
                    "ratio_nosync": round(med["hyperrecipe-nosync"] / med["transformers"], 3),
                    "ratio_nohash": round(med["hyperrecipe-nohash"] / med["transformers"], 3)})
    if args.phases:
        out["phases"] = {f"rank{r}": _phases(res) for r, res in enumerate(results)}
    return out


def _launch_tree(tree: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """One launch in a fresh interpreter with ``tree``'s hyperrecipe first (``None``: this
    checkout's)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--one-launch", "--json", out.name,
               "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--rounds", str(args.rounds)]
        cmd += ["--intermediate", str(args.intermediate)] if args.intermediate else []
        cmd += ["--dir", args.dir] if args.dir else []
        cmd += ["--components"] if args.components else []
        cmd += ["--phases"] if args.phases else []
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*([str(tree)] if tree else []), str(REPO)])
        subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="default: 11/4 of hidden (5632 at 2048)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision")
    parser.add_argument("--launches", type=int, default=1, help="launches per tree")
    parser.add_argument("--components", action="store_true",
                        help="also the export without its fsyncs, and without its digest")
    parser.add_argument("--phases", action="store_true",
                        help="where each rank's time goes in the export (printed as JSON)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    keys = ("model_bytes", "transformers_save_pretrained_s",
            "transformers_save_pretrained_fsync_s", "hyperrecipe_save_pretrained_s", "ratio",
            "ratio_to_fsynced", "load_average", "cpu_s")
    if args.components:
        keys += ("hyperrecipe_nosync_s", "hyperrecipe_nohash_s", "ratio_nosync", "ratio_nohash")
    if args.one_launch or (not args.baseline and args.launches == 1):
        result = _launch_here(args)
        if not args.one_launch:
            print(json.dumps({k: result[k] for k in keys}))
            for rank, phases in result.get("phases", {}).items():
                print(f"{rank}: process CPU {phases['cpu_s']} s per export; wall / thread CPU "
                      "s per step: " + ", ".join(f"{n} {v['wall_s']} / {v['cpu_s']}"
                                                 for n, v in phases["steps"].items()))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    runs = alternate_launches(args.baseline, args.launches,
                              lambda tree: _launch_tree(tree, args),
                              lambda result: {k: result[k] for k in keys})
    summary = {which: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys[1:]
                       if k not in ("load_average", "cpu_s")}
               for which, rs in runs.items()}
    print(json.dumps({"baseline": args.baseline, "median_over_launches": summary}))
    if args.json:
        args.json.write_text(json.dumps({"baseline": args.baseline, "runs": runs,
                                         "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
