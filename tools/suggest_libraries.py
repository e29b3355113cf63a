"""``hyperrecipe suggest`` on models from libraries outside transformers, each re-checked from
the written file in both modes, as a user would.

The models are the libraries' own classes built small (``tools/library_models.py``):
x-transformers, litgpt and vit-pytorch. None of them is a dependency of hyperrecipe; a
library that is not installed is reported ``not installed`` and skipped (install with
``pip install --no-deps x-transformers loguru einx torch-einops-utils litgpt vit-pytorch``;
vit-pytorch's ViT is loaded from its own file, since the package's ``__init__`` imports
torchvision). A model is

- **sharded**: ``suggest`` wrote a recipe, ``check`` agreed with one process in both modes, and
  so did the written file checked again (the share of parameter bytes on ``tp`` says how much);
- **refused**: no recipe, with ``suggest``'s reason.

Usage::

    python tools/suggest_libraries.py [--only xt_decoder litgpt_llama] [--out /tmp/libs]

Results are printed as a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))
sys.path.insert(0, str(TOOLS))

#: name -> (the factory in library_models, the library it needs, the inputs it takes)
CASES: dict[str, tuple[str, str, str | None]] = {
    "xt_decoder": ("library_models:xt_decoder", "x_transformers", None),
    "xt_encoder": ("library_models:xt_encoder", "x_transformers", None),
    "litgpt_llama": ("library_models:litgpt_llama", "litgpt", None),
    "litgpt_pythia": ("library_models:litgpt_pythia", "litgpt", None),
    "vitp_vit": ("library_models:vitp_vit", "vit_pytorch", "library_models:pixels"),
}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def run_one(name: str, out: Path) -> dict[str, object]:
    from hyperrecipe.check.run import CheckOptions, run_check
    from hyperrecipe.errors import HyperrecipeError
    from hyperrecipe.suggest import SuggestOptions, suggest_recipe

    model, package, inputs = CASES[name]
    if not _installed(package):
        return {"model": name, "verdict": "not installed", "detail": package}
    t0 = time.perf_counter()
    try:
        s = suggest_recipe(model, {"tp": 2}, options=SuggestOptions(inputs=inputs))
    except HyperrecipeError as e:
        return {"model": name, "verdict": "refused", "detail": str(e).split("\n")[0],
                "seconds": time.perf_counter() - t0}
    path = out / f"{name}.yaml"
    path.write_text(s.text)
    again = run_check(CheckOptions(recipe=str(path), model=model, mesh={"tp": 2},
                                   inputs=inputs))
    sharded = sorted({r.match for r in s.rules
                      if dict(r.fields).get("style") or dict(r.fields).get("params")})
    return {"model": name, "verdict": "sharded" if s.verified and again.agree else "not verified",
            "share": s.sharded_fraction.get("tp", 0.0), "sharded": sharded,
            "narrowed": [f"{n.what}: {n.why}" for n in s.narrowed],
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--out", type=Path, default=Path("/tmp/suggest-libraries"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only:
        row = run_one(name, args.out)
        print(f"{name}: {row['verdict']}", file=sys.stderr, flush=True)
        rows.append(row)
    print("| model | verdict | parameter bytes on tp | left replicated, and why |")
    print("| --- | --- | ---: | --- |")
    for r in rows:
        share = f"{100 * float(r['share']):.1f}%" if "share" in r else ""
        why = "; ".join(r.get("narrowed", [])) or r.get("detail", "")  # type: ignore[arg-type]
        print(f"| {r['model']} | {r['verdict']} | {share} | {' '.join(str(why).split())[:300]} |")
    return 0 if all(r["verdict"] in ("sharded", "not installed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
