"""Time hyperrecipe on the worst inputs of issue 16: each must end in seconds, most in a
located error.

Each case writes one hostile file (a billion-laughs YAML, 1000-deep nesting, a 10 MB
description, a 20,000-rule recipe, catastrophic regexes, a 1200-file ``extends`` chain, hostile
plan JSON) and times what ``hyperrecipe compile`` does with it: ``load_recipe`` and, when that
succeeds, ``resolve_recipe`` against the toy model of ``tests/support/toy_models.py`` at ``tp=2``. Each
case runs ``--repeats`` times; the slowest run is reported (worst case is the point). The output
is a Markdown table for docs/benchmarks.md; ``--json`` also writes the figures.

Usage::

    python tools/bench_worst_case.py [--repeats 3] [--json OUT] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The toy model is the checkout's documented example (docs/recipes.md compiles against
# ``tests.support.toy_models:make_toy`` from the repository root), not part of the package: put
# the root on the path on purpose, since running ``python tools/X.py`` puts only tools/ there.
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hyperrecipe.errors import HyperrecipeError  # noqa: E402
from hyperrecipe.model_tree import snapshot  # noqa: E402
from hyperrecipe.plan import Plan  # noqa: E402
from hyperrecipe.recipe import load_recipe  # noqa: E402
from hyperrecipe.recipe.patterns import compile_pattern  # noqa: E402
from hyperrecipe.resolve import resolve_recipe  # noqa: E402
from tests.support.toy_models import Toy  # noqa: E402

HEAD = "recipe: t\nversion: 1\nmesh: [tp]\n"


def _laughs() -> str:
    lines = [HEAD + "rules: []", "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


def _rules(n: int) -> str:
    body = "".join(f"  - match: layers.*.mlp.{'up' if i % 2 else 'down'}\n    note: rule {i}\n"
                   for i in range(n))
    return HEAD + "rules:\n" + body


def _extends_chain(folder: Path, n: int) -> Path:
    for i in range(n):
        extends = f"extends: r{i + 1}.yaml\n" if i + 1 < n else ""
        (folder / f"r{i}.yaml").write_text(HEAD + "rules: []\n" + extends)
    return folder / "r0.yaml"


def _regex(pattern: str) -> str:
    return HEAD + f"rules:\n  - match: '{pattern}'\n"


RECIPE_CASES: dict[str, Callable[[Path], Path]] = {}


def _case(name: str, suffix: str, text: Callable[[], str]) -> None:
    def write(folder: Path) -> Path:
        path = folder / f"{name}{suffix}"
        path.write_text(text(), encoding="utf-8")
        return path

    RECIPE_CASES[name] = write


_case("billion-laughs", ".yaml", _laughs)
_case("recursive-alias", ".yaml", lambda: HEAD + "rules: &r [*r]\n")
_case("yaml-1000-deep", ".yaml", lambda: HEAD + "rules: " + "[" * 1000 + "]" * 1000 + "\n")
_case("toml-1000-deep", ".toml", lambda: 'recipe = "t"\nversion = 1\nmesh = ["tp"]\nrules = '
      + "[" * 1000 + "]" * 1000 + "\n")
_case("10MB-description", ".yaml", lambda: HEAD + "rules:\n  - match: embed\n    boundary: false\n"
      "description: '" + "x" * 10_000_000 + "'\n")
_case("20000-rules", ".yaml", lambda: _rules(20_000))
_case("regex (.*)*Z", ".yaml", lambda: _regex("re:(layers|.*)*Z"))
_case("regex (a|a)*b", ".yaml", lambda: _regex("re:(l|.)*(l|.)*(l|.)*(l|.)*Q"))
_case("regex a{99999999999}", ".yaml", lambda: _regex("re:a{99999999999}"))
_case("300-deep braces", ".yaml", lambda: _regex("{a," * 300 + "b" + "}" * 300))
_case("glob *a*a*a*a*a*b", ".yaml", lambda: _regex("*" + "a*" * 12 + "Z"))
_case("5000-digit integer", ".yaml", lambda: "recipe: t\nversion: " + "9" * 5000
      + "\nmesh: [tp]\nrules: []\n")
RECIPE_CASES["1200-file extends chain"] = lambda folder: _extends_chain(folder, 1200)

MATCH_CASES: dict[str, str] = {  # matched against a 5,000-character name (Python's re: hours)
    # no literal suffix, so the prefix/suffix filter cannot answer: the automaton runs
    "match re:(.*)*(Z|Y), 5000-char FQN": "re:(.*)*(Z|Y)",
    "match re:(a|a)*(b|c), 5000-char FQN": "re:(a|a)*(b|c)",
    "match *a*a*a*a*a*a*a*a*{b,c}, 5000-char FQN": "*a*a*a*a*a*a*a*a*{b,c}",
}
MATCH_SUBJECT = "a" * 5000

def _toy_plan_with(field: str, value: Any) -> Callable[[], str]:
    """The toy model's plan at tp=2 (its JSON) with ``params[0][field]`` (or the top-level
    ``params`` when ``field`` is empty) replaced by ``value``."""
    def make() -> str:
        from hyperrecipe import compile_recipe

        with torch.device("meta"):
            model = Toy()
        raw = json.loads(compile_recipe(str(REPO / "tests/recipes/toy.yaml"), model,
                                        {"tp": 2}).to_json())
        if field:
            raw["params"][0][field] = value
        else:
            raw["params"] = value
        return json.dumps(raw)
    return make


PLAN_CASES: dict[str, str | Callable[[], str]] = {
    "plan 100000-deep JSON": "[" * 100_000 + "]" * 100_000,
    "plan 5000-digit integer": '{"format": ' + "9" * 5000 + "}",
    # issue 41: cattrs built an exception per character (160,000 characters: 24.7 s, 503 MB)
    "plan 2 MiB string for a list": _toy_plan_with("shape", "a" * (2 << 20)),
    "plan 100,000 objects missing fields": _toy_plan_with("", [{"fqn": "x"}] * 100_000),
}


Timing = tuple[float, float, str]  # wall s, CPU s, outcome


def _time_recipe(make: Callable[[Path], Path], tree: Any) -> Timing:
    with tempfile.TemporaryDirectory() as d:
        path = make(Path(d))
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            recipe = load_recipe(path)
            resolve_recipe(recipe, tree, {"tp": 2})
            outcome = "compiled"
        except HyperrecipeError as exc:
            outcome = f"{type(exc).__name__}: {str(exc).split(': ', 1)[-1][:70]}"
        return time.perf_counter() - t0, time.process_time() - c0, outcome


def _time_match(pattern: str) -> Timing:
    t0, c0 = time.perf_counter(), time.process_time()
    matched = compile_pattern(pattern).fullmatch(MATCH_SUBJECT)
    compile_pattern.cache_clear()
    return (time.perf_counter() - t0, time.process_time() - c0,
            "matches" if matched else "no match")


def _time_plan(text: str) -> Timing:
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        Plan.from_json(text)
        outcome = "loaded"
    except HyperrecipeError as exc:
        outcome = f"{type(exc).__name__}: {str(exc).split(': ', 1)[-1][:70]}"
    return time.perf_counter() - t0, time.process_time() - c0, outcome


def _row(name: str, runs: list[Timing]) -> dict[str, Any]:
    return {"case": name, "slowest_s": max(r[0] for r in runs),
            "slowest_cpu_s": max(r[1] for r in runs), "outcome": runs[0][2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    known = [*RECIPE_CASES, *MATCH_CASES, *PLAN_CASES]
    unknown = [name for name in args.only or () if name not in known]
    if unknown:
        parser.error(f"--only: no case named {unknown}; the cases are {known}")
    with torch.device("meta"):
        tree = snapshot(Toy())
    rows: list[dict[str, Any]] = []
    for name, make in RECIPE_CASES.items():
        if args.only and name not in args.only:
            continue
        rows.append(_row(name, [_time_recipe(make, tree) for _ in range(args.repeats)]))
    for name, pattern in MATCH_CASES.items():
        if args.only and name not in args.only:
            continue
        rows.append(_row(name, [_time_match(pattern) for _ in range(args.repeats)]))
    for name, case in PLAN_CASES.items():
        if args.only and name not in args.only:
            continue
        text = case() if callable(case) else case
        rows.append(_row(name, [_time_plan(text) for _ in range(args.repeats)]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{datetime.date.today()}; {os.cpu_count()} CPU cores ({platform.machine()}), 1-min "
          f"load {load:.1f}; Python {platform.python_version()}, torch {torch.__version__}; "
          f"slowest of {args.repeats}:\n")
    print("| input | slowest wall (s) | slowest CPU (s) | outcome |\n|---|---:|---:|---|")
    for r in rows:
        case, outcome = (r["case"].replace("|", "\\|"), r["outcome"].replace("|", "\\|"))
        print(f"| {case} | {r['slowest_s']:.2f} | {r['slowest_cpu_s']:.2f} | {outcome} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
