"""What verification at compile costs: the step per shipped tiny model, and a 70B-shaped Llama.

For each shipped recipe (with its tiny config from recipes/models/) the recipe is compiled
twice in this process, resolved only (``verify=False``) and verified, after one warm-up
compile of each (imports and first-call caches are not the step's). Then a Llama of Llama 3
70B's shape (80 layers, hidden 8192, 64 heads, 8 KV heads, vocab 128256, bf16) is built on
the meta device and compiled with recipes/llama-sp.yaml at tp=8, verified, timed whole
(build, resolve, verify). Figures go in docs/benchmarks.md; nothing here asserts a time.

    python tools/bench_verify.py [--only RECIPE] [--skip-70b] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
             "torch_dtype": "bfloat16"}


def _time(fn: object, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-70b", action="store_true")
    parser.add_argument("--only", metavar="RECIPE", help="one shipped recipe (its file's stem)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from hyperrecipe import compile_recipe, load_recipe
    from hyperrecipe.model_tree import build_model

    rows = []
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        family = path.stem.split("-")[0]
        if family == "torchtitan" or args.only not in (None, path.stem):
            continue
        recipe = load_recipe(path)
        model = build_model(f"hf:{family}", str(ROOT / "recipes/models" / f"tiny-{family}.json"))
        mesh = {d: 2 for d in recipe.mesh}
        compile_recipe(recipe, model, mesh)  # warm-up: imports, first-call caches
        resolved = _time(lambda: compile_recipe(recipe, model, mesh, verify=False), args.repeat)
        verified = _time(lambda: compile_recipe(recipe, model, mesh), args.repeat)
        rows.append({"recipe": path.stem, "mesh": mesh, "resolve_s": round(resolved, 3),
                     "verify_s": round(verified - resolved, 3)})
        if not args.json:
            print(f"{path.stem:<16} {','.join(f'{k}={v}' for k, v in mesh.items()):<10} "
                  f"resolve {resolved:6.3f} s   verification adds {verified - resolved:6.3f} s",
                  flush=True)
    out: dict[str, object] = {"tiny": rows}
    if not args.skip_70b:
        t0 = time.perf_counter()
        model = build_model("hf:llama", LLAMA_70B)
        t1 = time.perf_counter()
        plan = compile_recipe(ROOT / "recipes/llama-sp.yaml", model, {"tp": 8})
        t2 = time.perf_counter()
        assert plan.verification is not None and plan.verification.modes
        out["llama_70b_tp8"] = {"build_s": round(t1 - t0, 2), "compile_and_verify_s":
                                round(t2 - t1, 2), "modes": list(plan.verification.modes)}
        if not args.json:
            print(f"llama 70B shape, llama-sp tp=8: built on meta in {t1 - t0:.2f} s, compiled "
                  f"and verified ({' and '.join(plan.verification.modes)}) in {t2 - t1:.2f} s")
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
