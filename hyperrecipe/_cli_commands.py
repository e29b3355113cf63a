"""Argument parsing and dispatch for ``compile``, ``explain``, ``schema`` and ``check``.

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


def _count(text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
    return value


def _positive(text: str) -> int:
    return _count(text, minimum=1)


def _non_negative(text: str) -> int:
    return _count(text, minimum=0)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number")
    return value


def _seconds(text: str) -> float:
    value = _tolerance(text)
    if value == 0:
        raise argparse.ArgumentTypeError("the timeout must be positive")
    return value


def _add_check(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    k = sub.add_parser(
        "check", help="run a recipe on local ranks and compare with a single process",
        description="Apply a recipe on world-size local ranks (gloo on CPU, NCCL with a GPU per "
                    "rank), run one step with loss = mean of squares of the model's first "
                    "output, and compare every boundary's output, the final output and every "
                    "gradient with the same model in one process. Exit 0 when every mode "
                    "agrees, 1 when one diverges, 2 on errors.")
    k.add_argument("recipe", help="recipe file (.yaml/.toml) or shipped recipe name")
    k.add_argument("--model", required=True,
                   help="pkg.module:factory, or hf:<model_type> (with --model-config)")
    k.add_argument("--model-config", help="JSON file or inline JSON of config fields")
    k.add_argument("--mesh", required=True, type=parse_mesh,
                   help="e.g. tp=2 or dp=2,tp=2; the world size is the product")
    k.add_argument("--mode", choices=("production", "validate", "both"), default="both",
                   help="which apply mode(s) to check (default both)")
    k.add_argument("--steps", type=_non_negative, default=0, metavar="N",
                   help="also take N SGD steps (lr 1e-2) and compare the parameters after them")
    k.add_argument("--atol", type=_tolerance, help="absolute tolerance (default 1e-5; 1e-2 for "
                                                   "16-bit models)")
    k.add_argument("--rtol", type=_tolerance, help="relative tolerance (default 1e-4; 1e-2 for "
                                                   "16-bit models)")
    k.add_argument("--format", choices=("text", "json"), default="text",
                   help="text verdict (default) or a JSON object on stdout")
    k.add_argument("--seed", type=_non_negative, default=0,
                   help="seed of the model's initialisation and the sample batch (default 0)")
    k.add_argument("--batch", type=_positive, default=2, metavar="B",
                   help="rows of the sample batch (default 2)")
    k.add_argument("--seq", type=_positive, default=8, metavar="L",
                   help="tokens per row of the sample batch (default 8)")
    k.add_argument("--inputs", metavar="PKG.MOD:FN",
                   help="make_inputs(model, batch=, seq=, generator=) -> (args, kwargs), for "
                        "models that do not take token ids")
    k.add_argument("--timeout", type=_seconds, default=300.0, metavar="S",
                   help="seconds allowed per mode's launch (default 300)")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


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
    _add_check(sub)
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
        if args.command == "check":
            return _check(args)
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


def _check(args: argparse.Namespace) -> int:
    from hyperrecipe.check.report import render_text, report_json
    from hyperrecipe.check.run import CheckOptions, Mode, run_check

    modes: tuple[Mode, ...] = (("production", "validate") if args.mode == "both"
                               else (args.mode,))
    options = CheckOptions(
        recipe=args.recipe, model=args.model, model_config=args.model_config, mesh=args.mesh,
        modes=modes, steps=args.steps, atol=args.atol, rtol=args.rtol, seed=args.seed,
        batch=args.batch, seq=args.seq, inputs=args.inputs, timeout_s=args.timeout)

    def progress(message: str) -> None:
        print(f"hyperrecipe check: {message}", file=sys.stderr, flush=True)

    try:
        report = run_check(options, on_progress=None if args.quiet else progress)
    except HyperrecipeError as exc:
        if args.format == "json":
            print(json.dumps({"agree": False, "error": str(exc)}, indent=2))
        raise
    if args.format == "json":
        print(json.dumps(report_json(report), indent=2))
    else:
        print(render_text(report), end="")
    for failed in report.errors:  # after every mode's verdict is out
        print(f"hyperrecipe: error: mode {failed.mode}: {failed.error}", file=sys.stderr)
    return report.exit_code
