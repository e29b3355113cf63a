"""Argument parsing and dispatch for ``compile``, ``explain`` and ``schema``.

Kept apart from :mod:`hyperrecipe.cli` so that ``hyperrecipe lint`` never pays for argparse
set-up of the torch-backed commands, and each command imports its parts only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hyperrecipe.errors import HyperrecipeError

__all__ = ["parse_mesh", "run"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"hyperrecipe: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_mesh(text: str) -> dict[str, int]:
    """``tp=2,dp=4`` → ``{"tp": 2, "dp": 4}``.

    Raises:
        argparse.ArgumentTypeError: malformed.
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not name or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. tp=2,dp=4")
        if name in out:
            raise argparse.ArgumentTypeError(f"mesh {text!r}: {name!r} given twice")
        out[name.strip()] = int(size)
    return out


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hyperrecipe", description="Declarative model-parallel recipes for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("compile", help="resolve a recipe against a model and mesh into a plan")
    c.add_argument("recipe", help="recipe file (.yaml/.toml) or shipped recipe name")
    c.add_argument("--model", required=True,
                   help="pkg.module:factory, or hf:<model_type> (with --model-config)")
    c.add_argument("--model-config", help="JSON file or inline JSON of config fields")
    c.add_argument("--mesh", required=True, type=parse_mesh, help="e.g. tp=2 or dp=2,tp=4")
    c.add_argument("-o", "--output", help="write the plan JSON here")
    c.add_argument("--format", choices=("text", "json"), default="text",
                   help="text summary (default) or the plan JSON on stdout")
    c.add_argument("--explain", metavar="FQN_GLOB",
                   help="say which rules decided each matching parameter/boundary and why")
    e = sub.add_parser("explain", help="explain decisions recorded in a saved plan")
    e.add_argument("plan", help="plan JSON written by compile -o")
    e.add_argument("fqn", help="FQN pattern (same syntax as recipe `match`)")
    sub.add_parser("schema", help="print the recipe format's JSON Schema")
    sub.add_parser("lint", help="lint Python and recipe files (see `hyperrecipe lint --help`)")
    return p


def run(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    try:
        if args.command == "schema":
            from hyperrecipe.recipe.jsonschema import recipe_json_schema

            print(json.dumps(recipe_json_schema(), indent=2, sort_keys=True))
            return 0
        if args.command == "explain":
            from hyperrecipe.plan import Plan
            from hyperrecipe.plan_report import explain

            print(explain(Plan.load(args.plan), args.fqn), end="")
            return 0
        if args.command == "compile":
            return _compile(args)
    except HyperrecipeError as exc:
        print(f"hyperrecipe: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # --explain with no match, and similar user errors
        print(f"hyperrecipe: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _compile(args: argparse.Namespace) -> int:
    import time

    from hyperrecipe.model_tree import build_model, snapshot
    from hyperrecipe.plan_report import explain, summary
    from hyperrecipe.recipe import load_recipe
    from hyperrecipe.resolve import resolve_recipe

    recipe = load_recipe(args.recipe)
    t0 = time.perf_counter()
    model = build_model(args.model, args.model_config)
    tree = snapshot(model)
    t1 = time.perf_counter()
    plan = resolve_recipe(recipe, tree, args.mesh)
    t2 = time.perf_counter()
    if args.output:
        plan.save(args.output)
    if args.format == "json":
        sys.stdout.write(plan.to_json())
        return 0
    if args.explain:
        print(explain(plan, args.explain), end="")
        return 0
    print(summary(plan), end="")
    print(f"model built on meta in {t1 - t0:.2f} s ({len(tree.modules)} modules); resolved in "
          f"{(t2 - t1) * 1000:.1f} ms" + (f"; plan written to {args.output}" if args.output else ""))
    return 0
