"""What validate mode's checks cost per step, against production, on tiny Llama at tp=2.

Validate mode adds, on top of DTensor's own dispatch, per-call checks that production does not
run: every declared placement compared at each boundary, the input-use walk of each boundary's
graph (``runtime/forward/input_grads.py``), a dispatch mode on every backward node a boundary
made (``backward_scope.py``), and the check of replicated parameters outside every boundary
(``outside_params.py``: a forward hook on each module owning one, walking the autograd graph).
This tool times one forward+backward step of the same model, weights and batch four ways, on 2
gloo ranks (``run_ranks``: fork, one intra-op thread each), interleaved by rounds:

``production`` / ``validate``
    ``recipes/llama.yaml`` (tensor parallel: the norms are replicated parameters outside every
    boundary, so the outside-parameters check walks the stream between blocks).
``validate_unwatched``
    The same validate run with the outside-parameters hooks not installed: the difference to
    ``validate`` is their cost.
``sp_validate``
    ``recipes/llama-sp.yaml`` in validate mode (every norm is a boundary: nothing to watch).

Model: ``recipes/models/tiny-llama.json`` with the model's own defaults (sdpa attention), batch
2 x 32 ids (seed 1), loss the model's ``labels=`` loss. A step's time is the slower rank's;
figures are medians over ``rounds x steps`` timed steps after ``warmup`` steps; ``*_cpu_ms`` is
the rank's main-thread CPU time per step (``time.thread_time``, median over both ranks), which
leaves out waiting for the peer or the scheduler: the steadier figure on a loaded machine.

Usage::

    python tools/bench_validate_hooks.py [--rounds 5] [--steps 3] [--warmup 2] [--json]
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
VARIANTS = {"production": ("recipes/llama.yaml", "production", True),
            "validate": ("recipes/llama.yaml", "validate", True),
            "validate_unwatched": ("recipes/llama.yaml", "validate", False),
            "sp_validate": ("recipes/llama-sp.yaml", "validate", True)}


def _worker(rank: int, world: int, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.model_tree import build_model
    from hyperrecipe.runtime import mode as modes

    config = json.loads((ROOT / "recipes/models/tiny-llama.json").read_text())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, config["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    built: dict[str, Any] = {}
    watch = type(modes.VALIDATE).watch_outside_boundaries
    for name, (recipe, mode, watched) in VARIANTS.items():
        torch.manual_seed(0)
        model = build_model("hf:llama", config, device="cpu")
        plan = hyperrecipe.compile_recipe(str(ROOT / recipe), build_model(
            "hf:llama", config, device="meta"), {"tp": world})
        if not watched:
            type(modes.VALIDATE).watch_outside_boundaries = (  # type: ignore[method-assign]
                lambda self, model, plan, mesh: [])
        try:
            built[name] = (model, hyperrecipe.apply(model, plan, mesh, mode=mode))
        finally:
            type(modes.VALIDATE).watch_outside_boundaries = watch  # type: ignore[method-assign]

    def step(model: Any) -> tuple[float, float]:
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        model(input_ids=ids, labels=ids).loss.backward()
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        model.zero_grad(set_to_none=True)
        return elapsed, cpu

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for name, (model, _) in built.items():
        for _ in range(warmup):
            step(model)
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].extend(step(built[name][0]) for _ in range(steps))
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from hyperrecipe.check.launcher import run_ranks

    ranks = run_ranks(_worker, 2, args.rounds, args.steps, args.warmup, timeout_s=600)
    median = {name: statistics.median(max(r[name][i][0] for r in ranks)
                                       for i in range(len(ranks[0][name])))
              for name in VARIANTS}
    cpu = {name: statistics.median(t[1] for r in ranks for t in r[name]) for name in VARIANTS}
    figures = {**{f"{k}_ms": round(v * 1e3, 2) for k, v in median.items()},
               **{f"{k}_cpu_ms": round(v * 1e3, 2) for k, v in cpu.items()},
               "validate_over_production": round(median["validate"] / median["production"], 2),
               "validate_over_production_cpu": round(cpu["validate"] / cpu["production"], 2),
               "watch_cost_ms": round((median["validate"] - median["validate_unwatched"]) * 1e3, 2),
               "watch_cost_cpu_ms": round((cpu["validate"] - cpu["validate_unwatched"]) * 1e3, 2),
               "steps_per_variant": args.rounds * args.steps}
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    else:
        for k, v in figures.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
