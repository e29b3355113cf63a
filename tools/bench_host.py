"""Host overhead of a production step: hyperrecipe against hand-written Megatron, compute negligible.

A transformers ``LlamaForCausalLM`` so small that the step is almost all Python and dispatch
(hidden 64, 8 layers, 4 heads, 4 KV heads, intermediate 128, vocab 256; fp32, eager attention;
batch 2 x 16 token ids), on 2 gloo ranks started by
:func:`hyperrecipe.check.launcher.run_ranks` (fork, one intra-op thread per rank), two ways:

``production``
    ``hyperrecipe.apply(model, compile_recipe("recipes/llama.yaml", ...), mesh)``.
``handwritten``
    ``tools/bench_runtime.py``'s Megatron-style step: the same weights swapped for local shards
    and Megatron's ``f`` / ``g`` put around each block by module hooks; the same collectives.

Both first run ``--warmup`` untimed steps (their first losses must agree within rtol 1e-4), then
``--rounds`` rounds, alternating which goes first, of ``--steps`` steps each, with
``time.thread_time`` (the rank's main thread: Python, dispatch and kernels, not the time spent
waiting for the peer) and ``time.perf_counter`` around each forward+backward. A step's figure is
the larger rank's; the summary gives medians and ``production / handwritten``.

``--baseline REV`` measures a git revision's ``hyperrecipe`` in the same launch of this tool:
``git archive REV hyperrecipe`` is unpacked into a temporary folder and the ranks are launched
``--launches`` times per tree, alternating baseline and working tree (each launch in its own
``python`` with that tree first on ``PYTHONPATH``), so both see the same machine load.
Each launch also times one Megatron ``f`` and ``g`` pair alone, on a ``[2, 16, 64]`` tensor
(the block boundary's all-reduces: hyperrecipe's ``bind_transition`` against the hand-written
autograd Functions), chained ``--transition-chain`` pairs deep, forward and backward, in CPU time
per transition, the minimum over ``--transition-repeats`` repeats, on one gloo rank (a group of
one: gloo's own work without a peer to wait for): the host cost per call without the step's
compute or the peer, which a loaded machine disturbs far less than the step's median.
``--profile`` counts, with ``cProfile`` on rank 0, the calls into ``hyperrecipe`` code in one
production step and their own time. ``--compile`` wraps both models the same way, after apply
and after the hand-written hooks, in ``torch.compile(model)`` (default backend: inductor), so
the warm-up steps compile them (the first losses still must agree) and the timed steps run the
compiled code; the summary then records ``"compile": true``. ``--tensor-guards-only`` (with
``--compile``) keeps only dynamo's ``TENSOR_MATCH`` guards of both compiled models (torch's
``guard_filter_fn`` option; unsafe outside a benchmark: a changed Python object would not
recompile), which isolates what guard evaluation costs each model per step. With
``--compile`` each launch also reports, per model, rank 0's guard counts (``guards``: the
guard tree's lines, its leaf guards, and how many of those are ``LAMBDA_GUARD`` s, evaluated
in Python): figures the machine's load does not move. Which model is built and compiled first
is ``--built-first``: in ``torch.profiler`` runs the graphs of the model built first ran 7-18 %
slower, whichever it was (docs/benchmarks.md), so by default (``alternate``) the launches take
turns, production first in the even ones, and each launch records ``built_first``. The summary
gives, per tree, the median of the launches' ratios, and with several launches their mean with
its standard error (``cpu_mean``, ``cpu_sem``) and the median per build order
(``by_built_first``).

Usage::

    python tools/bench_host.py [--baseline REV] [--launches 2] [--rounds 30] [--steps 10]
                               [--warmup 3] [--profile]
                               [--compile [--tensor-guards-only]]
                               [--built-first {alternate,production,handwritten}]
                               [--json OUT] [--transition-repeats 20] [--transition-chain 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "attn_implementation": "eager",
}
BATCH, SEQ = 2, 16
WORLD = 2
TARGET = 1.02
IMPLS = ("production", "handwritten")


def _tensor_guards_only(entries: list[Any]) -> list[bool]:
    return [e.guard_type == "TENSOR_MATCH" for e in entries]


def _guard_counts(model: Any) -> dict[str, int] | None:
    """What dynamo re-checks before each call of a compiled model, read off the guard tree of
    its first compiled frame (the model's own ``forward``): tree lines, leaf guards and, of
    those, ``LAMBDA_GUARD`` s (evaluated in Python, not C++). Both models share that frame's
    code, so each has a cache entry on it: call this right after the model's own warm-up
    steps, when dynamo (which moves the entry a call hits to the front) lists its entry first.
    Deterministic, unlike the time they take; ``None`` where this torch keeps them elsewhere."""
    import re

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    orig = getattr(model, "_orig_mod", model)
    try:
        entries = _debug_get_cache_entry_list(type(orig).forward.__code__)
        tree = str(entries[0].guard_manager)
    except (AttributeError, IndexError, TypeError):
        return None
    leaves = re.findall(r"\+- (?!\w*GuardManager)([A-Z_]+):", tree)
    return {"tree_lines": len(tree.splitlines()), "guards": len(leaves),
            "lambda_guards": leaves.count("LAMBDA_GUARD")}


def _worker(rank: int, world: int, rounds: int, steps: int, warmup: int,
            profile: bool, compiled: bool = False,
            tensor_guards_only: bool = False, handwritten_first: bool = False) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(REPO / "tools"))
    import bench_runtime as br

    from hyperrecipe import apply, compile_recipe
    from hyperrecipe.model_tree import build_model

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    plan = compile_recipe(str(REPO / "recipes/llama.yaml"),
                          build_model("hf:llama", CONFIG), {"tp": world})
    models: dict[str, Any] = {}
    keep: list[Any] = []
    losses: dict[str, float] = {}
    guards: dict[str, dict[str, int] | None] = {}
    for name in (IMPLS[::-1] if handwritten_first else IMPLS):
        model = br.build_llama(CONFIG)
        if name == "production":
            keep.append(apply(model, plan, mesh))
        else:
            keep.extend(br.megatron_parallelize(model, rank, world))
        if compiled:
            options: dict[str, str | int | bool | Callable[..., Any]] | None = (
                {"guard_filter_fn": _tensor_guards_only} if tensor_guards_only else None)
            model = cast(Any, torch.compile(model, options=options))
        for i in range(warmup):
            loss = float(br.step_loss(model, ids))
            if i == 0:
                losses[name] = loss
            model.zero_grad(set_to_none=True)
        models[name] = model
        if compiled:
            guards[name] = _guard_counts(model)
    cpu: dict[str, list[float]] = {n: [] for n in IMPLS}
    wall: dict[str, list[float]] = {n: [] for n in IMPLS}
    for r in range(rounds):
        for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            model = models[name]
            gc.collect()
            dist.barrier()
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                t0, c0 = time.perf_counter(), time.thread_time()
                br.step_loss(model, ids)
                cpu[name].append((time.thread_time() - c0) * 1e3)
                wall[name].append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {"cpu": cpu, "wall": wall, "losses": losses, "guards": guards}
    if profile:
        out["profile"] = _profile_calls(models["production"], ids, br.step_loss)
    return out


def _transition_cost(rank: int, world: int, repeats: int, chain: int) -> dict[str, float]:
    """CPU microseconds per transition of a chain of Megatron ``f``/``g`` pairs, forward and
    backward: hyperrecipe's bound transitions against the hand-written Functions (a rank
    worker; run on a world of one)."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(REPO / "tools"))
    import bench_runtime as br

    from hyperrecipe.collective import IDENTITY, CollectiveOp
    from hyperrecipe.runtime.comm.collectives import bind_transition, group_for

    tp = group_for(init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), "tp")
    reduce = CollectiveOp(kind="all_reduce", mesh_dim="tp")
    ours = (bind_transition(IDENTITY, reduce, tp.group, group_size=tp.size, group_rank=tp.rank),
            bind_transition(reduce, IDENTITY, tp.group, group_size=tp.size, group_rank=tp.rank))
    pairs = {"production": ours, "handwritten": (br.copy_to_parallel, br.reduce_from_parallel)}
    x = torch.randn(BATCH, SEQ, CONFIG["hidden_size"], requires_grad=True)
    best = {name: float("inf") for name in pairs}
    for r in range(repeats):
        for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            f, g = pairs[name]
            gc.collect()
            dist.barrier()
            c0 = time.thread_time()
            y = x
            for _ in range(chain):
                y = g(f(y))
            y.sum().backward()
            best[name] = min(best[name], (time.thread_time() - c0) / (2 * chain) * 1e6)
            x.grad = None
    return best


def _profile_calls(model: Any, ids: Any, step: Any) -> dict[str, Any]:
    """Calls into hyperrecipe's own code in one production step, and their own time."""
    import cProfile
    import pstats

    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    step(model, ids)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    ours = {f"{Path(f).name}:{line}:{fn}": (calls, tt) for (f, line, fn), (_, calls, tt, _, _)
            in stats.items() if "/hyperrecipe/" in f}
    top = sorted(ours.items(), key=lambda kv: -kv[1][1])[:12]
    return {"calls": sum(c for c, _ in ours.values()),
            "own_ms": round(sum(t for _, t in ours.values()) * 1e3, 3),
            "top": [(k, c, round(t * 1e3, 3)) for k, (c, t) in top]}


def _launch_here(args: argparse.Namespace) -> dict[str, Any]:
    """One launch of the ranks with whatever ``hyperrecipe`` this interpreter imports."""
    import hyperrecipe
    from hyperrecipe.check.launcher import run_ranks

    results = run_ranks(_worker, WORLD, args.rounds, args.steps, args.warmup, args.profile,
                        args.compile, args.tensor_guards_only, args.handwritten_first,
                        timeout_s=1800)
    (alone,) = run_ranks(_transition_cost, 1, args.transition_repeats, args.transition_chain,
                         timeout_s=600)
    summary: dict[str, Any] = {"hyperrecipe": str(Path(hyperrecipe.__file__).parent),
                               "compile": bool(args.compile),
                               "tensor_guards_only": bool(args.tensor_guards_only),
                               "built_first": IMPLS[1] if args.handwritten_first else IMPLS[0]}
    for metric in ("cpu", "wall"):
        per_step = {n: [max(vals) for vals in zip(*(r[metric][n] for r in results))]
                    for n in IMPLS}
        med = {n: statistics.median(v) for n, v in per_step.items()}
        summary[metric] = {**{n: round(m, 4) for n, m in med.items()},
                           "ratio": round(med["production"] / med["handwritten"], 4)}
    per_transition = {n: round(alone[n], 3) for n in IMPLS}
    summary["transition_us"] = {**per_transition, "ratio": round(
        per_transition["production"] / per_transition["handwritten"], 4)}
    losses = [r["losses"] for r in results]
    summary["losses_agree"] = all(
        abs(l["production"] - l["handwritten"]) <= 1e-4 * abs(l["handwritten"]) for l in losses)
    if args.compile:
        summary["guards"] = results[0]["guards"]
    if args.profile:
        summary["profile"] = results[0]["profile"]
    return summary


def alternate_launches(baseline: str | None, launches: int,
                       launch: Callable[[Path | None], dict[str, Any]],
                       shown: Callable[[dict[str, Any]], Any]) -> dict[str, list[dict[str, Any]]]:
    """``launches`` launches of the working tree's ``hyperrecipe`` and, with ``baseline``, as
    many of that git revision's (unpacked with ``git archive``), alternating which goes first,
    so both trees see the same load on a shared machine. ``launch(tree)`` runs one (``None``:
    the working tree); ``shown(result)`` is what each prints. Results per tree: ``current``
    and ``baseline``. Shared with ``tools/bench_export.py``."""
    runs: dict[str, list[dict[str, Any]]] = {"current": []}
    with tempfile.TemporaryDirectory() as tmp:
        base: Path | None = None
        if baseline:
            runs["baseline"] = []
            base = Path(tmp)
            archive = subprocess.run(["git", "archive", baseline, "hyperrecipe"], cwd=REPO,
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for i in range(launches):
            order = ["baseline", "current"] if i % 2 == 0 else ["current", "baseline"]
            for which in order:
                if which in runs:
                    result = launch(base if which == "baseline" else None)
                    runs[which].append(result)
                    print(f"{which}: {json.dumps(shown(result))}", flush=True)
    return runs


def _launch_tree(tree: Path | None, args: argparse.Namespace,
                 handwritten_first: bool) -> dict[str, Any]:
    """One launch in a fresh interpreter with ``tree``'s hyperrecipe first (``None``: this
    checkout's)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--one-launch", "--json", out.name,
               "--rounds", str(args.rounds), "--steps", str(args.steps),
               "--warmup", str(args.warmup),
               "--transition-repeats", str(args.transition_repeats),
               "--transition-chain", str(args.transition_chain)] + (["--profile"] if args.profile else []) + (
                   ["--compile"] if args.compile else []) + (
                   ["--tensor-guards-only"] if args.tensor_guards_only else []) + (
                   ["--handwritten-first"] if handwritten_first else [])
        env = dict(os.environ)
        paths = [str(tree)] if tree is not None else []
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO)])
        subprocess.run(cmd, env=env, check=True, cwd=REPO)
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def _summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One tree's launches: the median of their ratios per metric and, for the CPU ratio, the
    mean with its standard error and the median per build order."""
    out: dict[str, Any] = {m: round(statistics.median(r[m]["ratio"] for r in results), 4)
                           for m in ("cpu", "wall", "transition_us")}
    cpu = [r["cpu"]["ratio"] for r in results]
    if len(cpu) > 1:
        out["cpu_mean"] = round(statistics.fmean(cpu), 4)
        out["cpu_sem"] = round(statistics.stdev(cpu) / len(cpu) ** 0.5, 4)
        out["by_built_first"] = {
            first: {"launches": len(vals), "cpu": round(statistics.median(vals), 4)}
            for first in IMPLS
            if (vals := [r["cpu"]["ratio"] for r in results if r["built_first"] == first])}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision")
    parser.add_argument("--launches", type=int, default=2, help="launches per tree")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile both models (the same way) before the warm-up")
    parser.add_argument("--transition-repeats", type=int, default=20,
                        help="repeats of the f/g chain timed alone (its minimum is reported)")
    parser.add_argument("--transition-chain", type=int, default=50,
                        help="f/g pairs in that chain")
    parser.add_argument("--tensor-guards-only", action="store_true",
                        help="with --compile: keep only dynamo's tensor guards (diagnosis: "
                             "what guard evaluation costs each model)")
    parser.add_argument("--built-first", choices=("alternate", *IMPLS), default="alternate",
                        help="which model is built (and compiled) first; alternate: the "
                             "launches take turns, production first")
    parser.add_argument("--handwritten-first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tensor_guards_only and not args.compile:
        parser.error("--tensor-guards-only needs --compile")
    if args.one_launch:
        result = _launch_here(args)
        if args.json:
            args.json.write_text(json.dumps(result))
        return 0
    launched: dict[Path | None, int] = {}

    def launch(tree: Path | None) -> dict[str, Any]:
        n = launched[tree] = launched.get(tree, -1) + 1
        first = args.built_first if args.built_first != "alternate" else IMPLS[n % 2]
        return _launch_tree(tree, args, handwritten_first=first == "handwritten")

    runs = alternate_launches(args.baseline, args.launches, launch, lambda result: result)
    summary: dict[str, Any] = {which: _summarize(rs) for which, rs in runs.items()}
    if "baseline" in runs:  # the same f/g chain, this tree's against the baseline's
        summary["transition_us_current_over_baseline"] = round(
            statistics.median(r["transition_us"]["production"] for r in runs["current"])
            / statistics.median(r["transition_us"]["production"] for r in runs["baseline"]), 4)
    print(f"production / handwritten (median over launches; target <= {TARGET}): "
          f"{json.dumps(summary)}")
    if args.json:
        args.json.write_text(json.dumps({"config": CONFIG, "batch": [BATCH, SEQ],
                                         "compile": bool(args.compile),
                                         "tensor_guards_only": bool(args.tensor_guards_only),
                                         "baseline": args.baseline, "runs": runs,
                                         "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
