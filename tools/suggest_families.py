"""Run ``hyperrecipe suggest`` over every transformers family whose config carries a
``base_model_tp_plan``, at tp=2, and count verified / narrowed / refused.

The families are not hand-picked: every model type in transformers' ``CONFIG_MAPPING`` whose
config class has a non-empty ``base_model_tp_plan``, in sorted order (``--only`` picks some).
Each is built from a tiny config derived from the family's defaults
(:func:`hyperrecipe.integrations.hf_tiny.tiny_config`: hidden 64, 2 layers, 4 heads of 16,
vocab 128, 4 experts, ...) and :func:`hyperrecipe.suggest.suggest_recipe` is run with
verification (``check`` in both modes against one process). A family is

- **verified**: check agreed, nothing the plan shards was given up;
- **narrowed**: check agreed after some rules were left replicated (each listed with why);
- **refused**: no recipe (no plan entry translates, every rule narrowed away, the model is not a
  causal LM or fails in one process; the reason is listed).

Every verified or narrowed recipe is written under ``--out`` and checked again from the file
(``--recheck``), as a user would. Results go to a JSON file as they come (a run cut short by
``--budget-s`` reports what it reached) and a Markdown summary is printed for
docs/benchmarks.md.

Usage::

    python tools/suggest_families.py [--only llama qwen2] [--budget-s 1800] [--recheck]
                                     [--out /tmp/suggest-families] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def families_with_a_plan() -> list[str]:
    """Every model type whose config class declares a tensor-parallel plan."""
    from transformers import CONFIG_MAPPING

    out = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a family whose optional dependency is missing
            continue
        if getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def _one(model_type: str, out_dir: Path, recheck: bool) -> dict[str, Any]:
    from hyperrecipe.check.run import CheckOptions, run_check
    from hyperrecipe.errors import HyperrecipeError
    from hyperrecipe.integrations.hf_tiny import tiny_config
    from hyperrecipe.suggest import SuggestOptions, suggest_recipe

    t0 = time.perf_counter()
    row: dict[str, Any] = {"family": model_type}
    try:
        config = tiny_config(model_type)
        s = suggest_recipe(f"hf:{model_type}", {"tp": 2}, model_config=config,
                           options=SuggestOptions(timeout_s=120, max_attempts=6))
    except (HyperrecipeError, Exception) as exc:  # noqa: BLE001 - a family's own failure
        row.update(outcome="refused", why=" ".join(f"{type(exc).__name__}: {exc}".split())[:300],
                   seconds=time.perf_counter() - t0)
        return row
    # an entry for a module this config does not build, and the expert-parallel plan on a
    # mesh with no ep dim, give nothing up: they are reported, not counted as narrowing
    plan_gave_up = [n for n in s.narrowed if "matches no module" not in n.why
                    and "so the experts stay whole" not in n.why]
    row.update(
        attempts=len(s.attempts), sharded=s.sharded_fraction.get("tp", 0.0),
        narrowed=[f"{n.what}: {' '.join(n.why.split())[:200]}" for n in plan_gave_up],
        corrections=[c.what for c in s.corrections], seconds=time.perf_counter() - t0)
    if not s.verified:
        row.update(outcome="refused", why=s.reason)
        return row
    row["outcome"] = "narrowed" if plan_gave_up else "verified"
    path = out_dir / f"{model_type}.yaml"
    path.write_text(s.text, encoding="utf-8")
    if recheck:
        report = run_check(CheckOptions(recipe=str(path), model=f"hf:{model_type}",
                                        model_config=s.check_config, mesh={"tp": 2},
                                        timeout_s=120))
        row["recheck"] = report.agree
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="these model types only")
    p.add_argument("--budget-s", type=float, default=3600.0,
                   help="stop starting families after this many seconds")
    p.add_argument("--recheck", action="store_true", help="check each written file again")
    p.add_argument("--out", default="/tmp/suggest-families", help="folder for the recipes")
    p.add_argument("--json", default="/tmp/suggest-families.json", help="results file")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    families = families_with_a_plan()
    if args.only:
        families = [f for f in families if f in set(args.only)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, family in enumerate(families):
        if time.perf_counter() - start > args.budget_s:
            break
        row = _one(family, out_dir, args.recheck)
        rows.append(row)
        print(f"[{i + 1}/{len(families)} {time.perf_counter() - start:7.1f} s] {family}: "
              f"{row['outcome']} ({row['seconds']:.1f} s)"
              + (f" recheck={row['recheck']}" if "recheck" in row else "")
              + (f" -- {row['why']}" if row.get("why") else ""), flush=True)
        Path(args.json).write_text(json.dumps({"families": len(families), "rows": rows},
                                              indent=1), encoding="utf-8")
    counts = Counter(r["outcome"] for r in rows)
    print(f"\n{len(rows)} of {len(families)} families with a base_model_tp_plan reached in "
          f"{time.perf_counter() - start:.0f} s: verified {counts['verified']}, narrowed "
          f"{counts['narrowed']}, refused {counts['refused']}")
    print("\n| family | outcome | check runs | tp-sharded bytes | s | given up / why |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        detail = r.get("why") or "; ".join(r.get("narrowed", []))
        print(f"| {r['family']} | {r['outcome']} | {r.get('attempts', '-')} | "
              f"{r.get('sharded', 0.0):.0%} | {r['seconds']:.0f} | "
              f"{detail[:160].replace('|', '/')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
