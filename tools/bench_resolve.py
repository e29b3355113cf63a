"""Time ``resolve_recipe`` on Llama-shaped models with 70B widths, from 8 to 160 layers.

Each model is a transformers ``LlamaForCausalLM`` (hidden 8192, intermediate 28672, 64 heads,
8 KV heads, vocab 128256) built on the meta device, so no memory is allocated. Only
``resolve_recipe(load_recipe("recipes/llama.yaml"), tree, {"tp": 8})`` is timed: building the
model and taking its snapshot are timed apart and reported, not counted. Each layer count gets
one warm-up resolve, then ``--repeats`` timed ones; the median and the minimum are reported.
The output is a Markdown table (paste it into ``docs/benchmarks.md``); ``--json`` also writes
the figures and the environment to a file.

Usage::

    python tools/bench_resolve.py [--repeats 7] [--layers 8 32 80 160] [--json OUT]
                                  [--profile 80]

``--profile L`` runs one more resolve of the L-layer model under ``cProfile`` and prints the
functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from hyperrecipe.model_tree import ModelTree, build_model, snapshot
from hyperrecipe.plan import Plan
from hyperrecipe.recipe import Recipe, load_recipe
from hyperrecipe.resolve import resolve_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama.yaml"
MESH: dict[str, int] = {"tp": 8}
LAYER_COUNTS = (8, 32, 80, 160)
LLAMA_70B_WIDTHS: dict[str, Any] = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
TARGET_80_MS = 100.0
TARGET_RATIO = 2.2


@attrs.frozen(kw_only=True)
class Figures:
    """What one layer count measured."""

    layers: int
    modules: int
    param_tensors: int
    param_elements: int
    boundaries: int
    manifest_entries: int
    build_s: float
    snapshot_s: float
    resolve_ms: tuple[float, ...]
    resolve_cpu_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.resolve_ms)

    @property
    def min_ms(self) -> float:
        return min(self.resolve_ms)

    @property
    def cpu_median_ms(self) -> float:
        return statistics.median(self.resolve_cpu_ms)


def warm_up_imports() -> None:
    """Build a one-layer model once so the first measured build does not pay for importing
    transformers' Llama code."""
    build_model("hf:llama", {"hidden_size": 64, "intermediate_size": 128,
                             "num_attention_heads": 4, "num_key_value_heads": 2,
                             "vocab_size": 128, "num_hidden_layers": 1})


def build_tree(layers: int) -> tuple[ModelTree, float, float]:
    """The snapshot of a 70B-wide Llama with ``layers`` layers, and the build/snapshot seconds."""
    t0 = time.perf_counter()
    model = build_model("hf:llama", {**LLAMA_70B_WIDTHS, "num_hidden_layers": layers})
    t1 = time.perf_counter()
    tree = snapshot(model)
    t2 = time.perf_counter()
    return tree, t1 - t0, t2 - t1


def time_resolve(recipe: Recipe, tree: ModelTree,
                 repeats: int) -> tuple[Plan, tuple[float, ...], tuple[float, ...]]:
    """One warm-up resolve, then ``repeats`` timed ones: wall and CPU milliseconds.

    The CPU time (``time.process_time``) leaves out time spent waiting for a core, so it is the
    steadier figure on a shared machine; resolving is single-threaded, so on an idle machine the
    two agree.
    """
    plan = resolve_recipe(recipe, tree, MESH)
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        resolve_recipe(recipe, tree, MESH)
        wall.append((time.perf_counter() - t0) * 1000.0)
        cpu.append((time.process_time() - c0) * 1000.0)
    return plan, tuple(wall), tuple(cpu)


def measure(recipe: Recipe, layers: int, repeats: int) -> tuple[Figures, ModelTree]:
    tree, build_s, snapshot_s = build_tree(layers)
    plan, wall, cpu = time_resolve(recipe, tree, repeats)
    params = list(tree.params())
    figures = Figures(
        layers=layers,
        modules=len(tree.modules),
        param_tensors=len(params),
        param_elements=sum(p.numel for p in params if p.tied_to is None),
        boundaries=len(plan.boundaries),
        manifest_entries=len(plan.manifest),
        build_s=build_s,
        snapshot_s=snapshot_s,
        resolve_ms=wall,
        resolve_cpu_ms=cpu,
    )
    return figures, tree


def profile_resolve(recipe: Recipe, tree: ModelTree, top: int = 15) -> str:
    """``cProfile`` of one resolve, the ``top`` functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    resolve_recipe(recipe, tree, MESH)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue()


def environment() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": str(transformers.__version__),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def ratio(by_layers: dict[int, Figures], hi: int, lo: int, *, cpu: bool = False) -> float | None:
    """Median resolve time of ``hi`` layers over that of ``lo`` layers (wall, or CPU)."""
    if hi in by_layers and lo in by_layers:
        a, b = by_layers[hi], by_layers[lo]
        return a.cpu_median_ms / b.cpu_median_ms if cpu else a.median_ms / b.median_ms
    return None


def markdown(figures: Sequence[Figures], env: dict[str, Any], repeats: int) -> str:
    lines = [
        f"{env['date']}; {env['cpus']} CPU cores ({env['machine']}), 1-min load average "
        f"{env['load_average_1min']} at start; Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}; mesh tp=8; {repeats} resolves after one warm-up.",
        "",
        "| layers | modules | param tensors | params | boundaries | build on meta (s) "
        "| snapshot (ms) | resolve median (ms) | resolve min (ms) | resolve CPU median (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in figures:
        lines.append(
            f"| {f.layers} | {f.modules} | {f.param_tensors} | {f.param_elements / 1e9:.2f} B "
            f"| {f.boundaries} | {f.build_s:.2f} | {f.snapshot_s * 1000:.0f} "
            f"| {f.median_ms:.1f} | {f.min_ms:.1f} | {f.cpu_median_ms:.1f} |"
        )
    by_layers = {f.layers: f for f in figures}
    r = ratio(by_layers, 160, 80)
    lines.append("")
    if 80 in by_layers:
        f80 = by_layers[80]
        ok = f80.median_ms <= TARGET_80_MS
        lines.append(f"- 80 layers: {f80.median_ms:.1f} ms wall median, {f80.cpu_median_ms:.1f} ms "
                     f"CPU median (target <= {TARGET_80_MS:.0f} ms): {'met' if ok else 'MISSED'}")
    if r is not None:
        rc = ratio(by_layers, 160, 80, cpu=True)
        lines.append(f"- 160/80 ratio: {r:.2f} wall, {rc:.2f} CPU (target <= {TARGET_RATIO}): "
                     f"{'met' if r <= TARGET_RATIO else 'MISSED'}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed resolves per model")
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYER_COUNTS))
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON here")
    parser.add_argument("--profile", type=int, metavar="LAYERS",
                        help="print a cProfile of one resolve of this layer count")
    ns = parser.parse_args(argv)
    if ns.repeats < 1:
        parser.error("--repeats must be at least 1")
    recipe = load_recipe(RECIPE)
    env = environment()
    warm_up_imports()
    figures: list[Figures] = []
    profile_text = ""
    for layers in ns.layers:
        f, tree = measure(recipe, layers, ns.repeats)
        figures.append(f)
        print(f"{layers} layers: resolve median {f.median_ms:.1f} ms "
              f"(build {f.build_s:.1f} s, snapshot {f.snapshot_s * 1000:.0f} ms)",
              file=sys.stderr)
        if ns.profile == layers:
            profile_text = profile_resolve(recipe, tree)
        del tree
    print(markdown(figures, env, ns.repeats), end="")
    if profile_text:
        print(f"\ncProfile of one resolve, {ns.profile} layers:\n")
        print(profile_text, end="")
    if ns.json:
        by_layers = {f.layers: f for f in figures}
        payload = {
            "environment": env,
            "recipe": "recipes/llama.yaml",
            "mesh": MESH,
            "widths": LLAMA_70B_WIDTHS,
            "repeats": ns.repeats,
            "results": [
                {**attrs.asdict(f), "resolve_ms": list(f.resolve_ms),
                 "resolve_cpu_ms": list(f.resolve_cpu_ms), "resolve_ms_median": f.median_ms,
                 "resolve_ms_min": f.min_ms, "resolve_cpu_ms_median": f.cpu_median_ms}
                for f in figures
            ],
            "ratio_160_80": ratio(by_layers, 160, 80),
            "ratio_160_80_cpu": ratio(by_layers, 160, 80, cpu=True),
            "targets": {"resolve_ms_80": TARGET_80_MS, "ratio_160_80": TARGET_RATIO},
        }
        Path(ns.json).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
