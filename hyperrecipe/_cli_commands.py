"""Argument parsing and dispatch for ``compile``, ``explain``, ``schema``, ``check`` and
``suggest``.

Kept apart from :mod:`hyperrecipe.cli` so that ``hyperrecipe lint`` never pays for argparse
set-up of the torch-backed commands, and each command imports its parts only when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

from hyperrecipe.errors import HyperrecipeError

__all__ = ["MESH_SIZE_DIGITS", "parse_mesh", "run"]

MESH_SIZE_DIGITS = 9
"""Longest mesh size ``--mesh`` accepts, as for ``shard(D)`` and chunk sizes in recipes."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        if message.startswith("unrecognized arguments:"):  # `--model-confg`: name the option
            from hyperrecipe.errors import did_you_mean

            known = _option_strings(self)
            for word in message.split(":", 1)[1].split():
                if word.startswith("--") and word.split("=", 1)[0] not in known:
                    message += did_you_mean(word.split("=", 1)[0], known)
                    break
        print(f"hyperrecipe: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option of ``parser`` and its subcommands."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``tp=2,dp=4`` → ``{"tp": 2, "dp": 4}``.

    Raises:
        argparse.ArgumentTypeError: malformed.
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not name or not (size.isascii() and size.isdigit()):
            raise argparse.ArgumentTypeError(
                f"mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] with each SIZE a whole "
                f"number written in digits, e.g. tp=2,dp=4")
        if name in out:  # names compared stripped: `tp=2,tp =4` is tp twice, not tp=4
            raise argparse.ArgumentTypeError(f"mesh {text!r}: {name!r} given twice")
        if len(size.lstrip("0")) > MESH_SIZE_DIGITS:
            raise argparse.ArgumentTypeError(
                f"mesh {text!r}: size of {name!r} has more than {MESH_SIZE_DIGITS} digits")
        out[name] = int(size)
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
    if not 0 <= value < math.inf:  # --atol inf would make every comparison agree
        raise argparse.ArgumentTypeError(f"{text} is not a finite non-negative number")
    return value


MAX_TIMEOUT_S = 1e6
"""Longest ``--timeout`` (about 11 days); more overflows the alarm's time_t."""


def _seconds(text: str) -> float:
    value = _tolerance(text)
    if value == 0:
        raise argparse.ArgumentTypeError("the timeout must be positive")
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"the timeout must be at most {MAX_TIMEOUT_S:g} seconds")
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
                   help="pkg.module:factory, or hf:<model_type>[/<task>] (with --model-config; "
                        "task: causal-lm (default), base, sequence-classification, "
                        "seq2seq-lm, image-classification, ...: docs/guide.md#model-classes)")
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
                        "models check makes no batch for (it makes token ids, decoder ids for "
                        "an encoder-decoder, pixel values for a vision model)")
    k.add_argument("--timeout", type=_seconds, default=300.0, metavar="S",
                   help="seconds allowed for each step in this process (building the model, "
                        "the sample batch, the reference step) and for each mode's launch "
                        "(default 300)")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    _add_trust(k)


_SUGGEST_DESCRIPTION = (
    "Propose a recipe for a transformers model from its own tensor-parallel plan "
    "(base_model_tp_plan) or, where it declares none (and for any nn.Module given as "
    "pkg.module:factory), from its structure (column-wise "
    "projections from the hidden size and a row-wise one back, in each repeated block), with "
    "the regions, vocab-parallel embedding and gradient reductions "
    "our format needs, and prove it: the recipe is checked in production and validate mode "
    "against one process on a tiny config of the same structure, and a rule that fails is "
    "narrowed (its modules left replicated) until both modes agree. Writes the recipe (-o, or "
    "stdout) with a comment per rule on where it came from, and a summary: the share of "
    "parameter bytes sharded, the collectives per step, what was narrowed and why. With pp in "
    "the mesh (pp=2, pp=2,tp=2) the recipe gets a pipeline section over the model's list of "
    "repeated blocks (transformers' base_model_pp_plan, else its structure), 1F1B, checked at "
    "that mesh with the rules (a pipeline that check does not pass is left out). A recipe "
    "that check did not pass is never written without --unverified. Exit 0 with a verified "
    "recipe, 1 when none could be verified, 2 on errors.")


def _add_suggest(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("suggest", help="suggest a recipe from the model's own plan, verified",
                       description=_SUGGEST_DESCRIPTION)
    s.add_argument("--model", required=True,
                   help="hf:<model_type>, or pkg.module:factory for a model of your own "
                        "(docs/bring-your-own-model.md)")
    s.add_argument("--model-config",
                   help="JSON file or inline JSON of config fields (the model the recipe is for)")
    s.add_argument("--mesh", required=True, type=parse_mesh,
                   help="e.g. tp=2, pp=2 (pipeline stages), pp=2,tp=2")
    s.add_argument("--microbatches", type=_positive, default=None, metavar="N",
                   help="with pp: the pipeline's microbatches per step (default 2 x pp)")
    s.add_argument("-o", "--output", help="write the recipe here (default: stdout)")
    s.add_argument("--unverified", action="store_true",
                   help="do not run check: write the translated recipe as it is, marked "
                        "NOT verified")
    s.add_argument("--check-config", metavar="JSON",
                   help="config the check builds (default: --model-config when small, the "
                        "family's shipped tiny config, or the given config with sizes shrunk)")
    s.add_argument("--no-embedding", action="store_true",
                   help="leave the input embedding replicated when the plan does not shard it")
    s.add_argument("--no-reduce-reached", action="store_true",
                   help="do not all-reduce the gradients of replicated parameters inside a "
                        "region (learnable activation scalars, per-head norms) that the plan "
                        "leaves out")
    s.add_argument("--no-sequence-parallel", action="store_true",
                   help="do not shard the residual stream on the sequence between blocks")
    s.add_argument("--no-structure", action="store_true",
                   help="do not read a projection pair off the model's structure for blocks "
                        "the plan names nothing of")
    s.add_argument("--no-loss-parallel", action="store_true",
                   help="do not keep the logits sharded on the vocab for the model's own loss")
    s.add_argument("--inputs", metavar="PKG.MOD:FN",
                   help="make_inputs(model, batch=, seq=, generator=) -> (args, kwargs), for "
                        "models the check makes no batch for (as check --inputs)")
    s.add_argument("--max-attempts", type=_positive, default=6, metavar="N",
                   help="check runs at most, each narrowing one failing rule (default 6)")
    s.add_argument("--timeout", type=_seconds, default=300.0, metavar="S",
                   help="seconds allowed for each step of each check (default 300)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-code", action="store_true",
                   help="import code the recipe names (inner wrappers, adapter targets) from any "
                        "module; without it only built-in, already imported and entry-point-"
                        "declared code is (docs/security.md)")
    p.add_argument("--trust", action="append", default=[], metavar="MODULE",
                   help="trust this module and its submodules (repeatable)")


def _apply_trust(args: argparse.Namespace) -> None:
    """The opt-in goes through the environment, so the ranks ``check`` launches inherit it."""
    import os

    from hyperrecipe.refs import TRUST_ENV

    if args.trust_code:
        os.environ[TRUST_ENV] = "1"
    elif args.trust:
        before = os.environ.get(TRUST_ENV, "")
        os.environ[TRUST_ENV] = ",".join(p for p in (before, *args.trust) if p)


def _version() -> str:
    import platform

    from hyperrecipe import __version__

    return f"hyperrecipe {__version__} (Python {platform.python_version()})"


_COMPILE_DESCRIPTION = (
    "Load a recipe (YAML or TOML), build the model on the meta device (no weights, no memory), "
    "resolve the recipe against it and the mesh shape, and print a summary of the plan: each "
    "rule's matches, the placements, the collectives per step and the memory per rank. -o writes "
    "the plan JSON for `hyperrecipe explain` and for apply() in a trainer; --explain says which "
    "recipe lines decided a module or parameter. The plan is then verified: one training step "
    "(forward, the model's own loss, backward) in production and validate mode on fake tensors "
    "under torch's fake process group, in this process, so that a plan that would train wrong in "
    "a way shapes and placements show is refused at its recipe line (--no-verify skips it, at "
    "your own risk; apply() then verifies first; docs/verification.md). Nothing runs on a "
    "device. Exit 0 on success, 2 on errors (recipe errors name file:line:col and the rule).")
_EXPLAIN_DESCRIPTION = (
    "Say why each parameter and boundary whose FQN matches the pattern was placed as it is, from "
    "a plan saved with `hyperrecipe compile -o`: its placements, local and global shapes, and "
    "the recipe file, line and rule of every decision. The model is not built. Exit 0, or 2 when "
    "the plan does not load or the pattern matches nothing (the nearest FQNs are listed).")
_SCHEMA_DESCRIPTION = (
    "Print the JSON Schema (draft-07) of the recipe format on stdout, for editors and "
    "validators: completion of keys and built-in styles, the placement grammar, descriptions "
    "on hover. recipes/recipe.schema.json is the same schema, checked in for the "
    "`# yaml-language-server: $schema=` line of the shipped recipes (docs/editor.md). The schema "
    "checks a file's shape; `hyperrecipe lint` and `compile` check the rest.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hyperrecipe", description="Declarative model-parallel recipes for PyTorch.")
    p.add_argument("--version", action="version", version=_version(),
                   help="print hyperrecipe's version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("compile", help="resolve a recipe against a model and mesh into a plan",
                       description=_COMPILE_DESCRIPTION)
    c.add_argument("recipe", help="recipe file (.yaml/.toml) or shipped recipe name")
    c.add_argument("--model", required=True,
                   help="pkg.module:factory, or hf:<model_type>[/<task>] (with --model-config; "
                        "task: causal-lm (default), base, sequence-classification, "
                        "seq2seq-lm, image-classification, ...: docs/guide.md#model-classes)")
    c.add_argument("--model-config", help="JSON file or inline JSON of config fields")
    c.add_argument("--mesh", required=True, type=parse_mesh, help="e.g. tp=2 or dp=2,tp=4")
    c.add_argument("-o", "--output", help="write the plan JSON here")
    c.add_argument("--format", choices=("text", "json"), default="text",
                   help="text summary (default) or the plan JSON on stdout")
    c.add_argument("--explain", metavar="FQN_GLOB",
                   help="say which rules decided each matching parameter/boundary and why")
    c.add_argument("--no-verify", action="store_true",
                   help="skip the verification step: the plan is written unverified, at your own "
                        "risk, and apply() verifies it first")
    c.add_argument("--inputs", metavar="PKG.MOD:FN",
                   help="make_inputs(model, batch=, seq=, generator=) -> (args, kwargs), for "
                        "models verification makes no batch for (as check --inputs)")
    _add_trust(c)
    e = sub.add_parser("explain", help="explain decisions recorded in a saved plan",
                       description=_EXPLAIN_DESCRIPTION)
    e.add_argument("plan", help="plan JSON written by compile -o")
    e.add_argument("fqn", help="FQN pattern (same syntax as recipe `match`)")
    sub.add_parser("schema", help="print the recipe format's JSON Schema",
                   description=_SCHEMA_DESCRIPTION)
    sub.add_parser("lint", help="lint Python and recipe files (see `hyperrecipe lint --help`)",
                   description="Lint Python files for forward assignments outside the rewriter "
                               "and recipe files against the recipe format; run "
                               "`hyperrecipe lint --help` for its options.")
    _add_check(sub)
    _add_simulate(sub)
    _add_suggest(sub)
    return p


_SIMULATE_DESCRIPTION = (
    "A dry run at real scale on this machine: compile the recipe, build the model on the meta "
    "device, and apply the plan once per rank under torch's fake process group (no "
    "communication, no memory), then report what each rank holds (parameter, gradient and AdamW "
    "optimizer bytes) and the collectives of one training step from the plan's manifest; with "
    "--seq-len, also one traced step of that many tokens: activation bytes per token and every "
    "collective with its bytes, inner wrappers' included. A pipelined plan is not applied: "
    "it is reported per stage and per pipeline rank (parameters, gradients, AdamW state, the "
    "activations its schedule keeps in flight, measured with --seq-len, and each rank's "
    "bubble). Exit 0, or 2 on errors (the recipe, the model, or an apply that would fail on the cluster).")


def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("simulate", help="dry-run a recipe at real size: memory and collectives "
                                        "per rank", description=_SIMULATE_DESCRIPTION)
    s.add_argument("recipe", help="recipe file (.yaml/.toml) or shipped recipe name")
    s.add_argument("--model", required=True,
                   help="pkg.module:factory, or hf:<model_type> (with --model-config)")
    s.add_argument("--model-config", help="JSON file or inline JSON of config fields")
    s.add_argument("--mesh", required=True, type=parse_mesh, help="e.g. tp=8 or dp=8,tp=8")
    s.add_argument("--mode", choices=("production", "validate"), default="production",
                   help="the apply mode to simulate (default production)")
    s.add_argument("--ranks", type=_rank_list, metavar="R[,R...]",
                   help="simulate only these ranks (default every rank)")
    s.add_argument("--seq-len", type=int, metavar="N",
                   help="trace one training step of one N-token sequence: activation bytes per "
                        "token and each collective's bytes; for a pipelined plan, the sequence "
                        "length of each microbatch whose activations are measured")
    s.add_argument("--batch", type=int, metavar="N",
                   help="pipelined plans only: the global batch in sequences, split into the "
                        "plan's microbatches (default one sequence per microbatch)")
    s.add_argument("--format", choices=("text", "json"), default="text",
                   help="a table (default) or a JSON object on stdout")
    _add_trust(s)


def _rank_list(text: str) -> list[int]:
    return [_non_negative(part.strip()) for part in text.split(",")]


def run(argv: Sequence[str], *, started: float | None = None, end_process: bool = False) -> int:
    """Parse ``argv`` and run the command.

    Args:
        argv: the arguments after ``hyperrecipe``.
        started: ``time.perf_counter()`` when the command started; ``check`` counts its progress
            times and its total from it (default: now).
        end_process: end the process with ``os._exit`` as soon as the command has printed its
            result (stdout and stderr flushed, every file it wrote closed), skipping the
            interpreter's teardown of torch and transformers: on a loaded 2-core machine that
            teardown took 3-18 s after ``check``'s verdict or ``compile``'s summary
            (docs/benchmarks.md). Only the process's own entry point passes ``True``.
    """
    t0 = time.perf_counter() if started is None else started
    args = _parser().parse_args(list(argv))
    try:
        code = _dispatch(args, t0)
    except BrokenPipeError:
        if not end_process:
            raise
        # the reader went away (`hyperrecipe compile ... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    if end_process:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError):  # a closed pipe (| head) is not our error
                stream.flush()
        os._exit(code)
    return code


def _dispatch(args: argparse.Namespace, started: float) -> int:
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
            _apply_trust(args)
            return _compile(args)
        if args.command == "check":
            _apply_trust(args)
            return _check(args, started)
        if args.command == "simulate":
            _apply_trust(args)
            return _simulate(args)
        if args.command == "suggest":
            return _suggest(args, started)
    except HyperrecipeError as exc:
        print(f"hyperrecipe: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # --explain with no match, and similar user errors
        print(f"hyperrecipe: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _compile(args: argparse.Namespace) -> int:
    from hyperrecipe.model_tree import build_model, default_config_note, shipped_tiny_config, snapshot
    from hyperrecipe.plan_report import explain, summary
    from hyperrecipe.recipe import load_recipe
    from hyperrecipe.resolve import resolve_recipe

    recipe = load_recipe(args.recipe)
    t0 = time.perf_counter()
    model = build_model(args.model, args.model_config)
    if args.model.startswith("hf:") and args.model_config is None:
        note = default_config_note(args.model, model, tiny_config=shipped_tiny_config(args.model))
        print(f"hyperrecipe: note: {note}", file=sys.stderr)
    tree = snapshot(model)
    t1 = time.perf_counter()
    plan = resolve_recipe(recipe, tree, args.mesh)
    t2 = time.perf_counter()
    if not args.no_verify:
        from hyperrecipe.verify import verify_plan

        plan = verify_plan(model, plan, inputs=args.inputs)
    t3 = time.perf_counter()
    if args.output:
        try:
            plan.save(args.output)
        except OSError as exc:  # a missing folder, a directory, a full disk: the user's to fix
            msg = f"cannot write the plan to {args.output}: {exc.strerror or exc}"
            print(f"hyperrecipe: error: {msg}", file=sys.stderr)
            return 2
    if args.format == "json":
        sys.stdout.write(plan.to_json())
        return 0
    if args.explain:
        print(explain(plan, args.explain), end="")
        return 0
    print(summary(plan), end="")
    print(_verification_line(plan, t3 - t2))
    print(f"model built on meta in {t1 - t0:.2f} s ({len(tree.modules)} modules); resolved in "
          f"{(t2 - t1) * 1000:.1f} ms" + (f"; plan written to {args.output}" if args.output else ""))
    return 0


def _verification_line(plan: object, seconds: float) -> str:
    from hyperrecipe.plan import Plan

    assert isinstance(plan, Plan)
    record = plan.verification
    if record is None:
        return "verification: skipped (--no-verify): apply() verifies the plan first"
    if not record.modes:
        return "verification: no step ran: " + "; ".join(record.notes)
    text = (f"verified: one training step in {' and '.join(record.modes)} mode on fake tensors "
            f"(rank {', '.join(map(str, record.ranks))}; {record.inputs}) in {seconds:.2f} s")
    return "\n".join([text, *(f"  note: {n}" for n in record.notes)])


def _check(args: argparse.Namespace, started: float) -> int:
    say = _quiet if args.quiet else _progress("check", started)
    # The first line comes before torch is imported: that import alone takes seconds.
    say(f"checking {args.recipe} on {_mesh_text(args.mesh)}: importing torch")
    from hyperrecipe.check.report import render_text, report_json
    from hyperrecipe.check.run import CheckOptions, Mode, run_check

    modes: tuple[Mode, ...] = (("production", "validate") if args.mode == "both"
                               else (args.mode,))
    options = CheckOptions(
        recipe=args.recipe, model=args.model, model_config=args.model_config, mesh=args.mesh,
        modes=modes, steps=args.steps, atol=args.atol, rtol=args.rtol, seed=args.seed,
        batch=args.batch, seq=args.seq, inputs=args.inputs, timeout_s=args.timeout)
    try:
        report = run_check(options, on_progress=say, started=started)
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


def _simulate(args: argparse.Namespace) -> int:
    from hyperrecipe.api import compile_recipe
    from hyperrecipe.model_tree import build_model
    from hyperrecipe.simulate import render_table, simulate

    model = build_model(args.model, args.model_config)
    plan = compile_recipe(args.recipe, model, args.mesh)
    sim = simulate(model, plan, ranks=args.ranks, mode=args.mode, seq_len=args.seq_len,
                   batch=args.batch)
    if args.format == "json":
        print(json.dumps(sim.to_json(), indent=2))
    else:
        print(render_table(sim), end="")
    return 0


def _suggest(args: argparse.Namespace, started: float) -> int:
    say = _quiet if args.quiet else _progress("suggest", started)
    say(f"suggesting a recipe for {args.model} on {_mesh_text(args.mesh)}: importing torch")
    from hyperrecipe.suggest import SuggestOptions, TranslateOptions, suggest_recipe
    from hyperrecipe.suggest.render import write_recipe

    options = SuggestOptions(
        translate=TranslateOptions(embedding=not args.no_embedding,
                                   reduce_reached=not args.no_reduce_reached,
                                   loss_parallel=not args.no_loss_parallel,
                                   sequence_parallel=not args.no_sequence_parallel,
                                   structure=not args.no_structure),
        verify=not args.unverified, max_attempts=args.max_attempts, timeout_s=args.timeout,
        check_config=args.check_config, inputs=args.inputs, microbatches=args.microbatches)
    result = suggest_recipe(args.model, args.mesh, model_config=args.model_config,
                            options=options, on_progress=say)
    if options.verify and not result.verified:
        print(result.summary(), end="", file=sys.stderr)
        print("hyperrecipe: error: no verified recipe, so none was written; --unverified "
              "writes the translation unchecked", file=sys.stderr)
        return 1
    if args.output:
        try:
            write_recipe(args.output, result.text)
        except OSError as exc:
            print(f"hyperrecipe: error: cannot write the recipe to {args.output}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 2
        print(result.summary(), end="")
        print(f"recipe written to {args.output} ({result.seconds:.1f} s)")
    else:
        sys.stdout.write(result.text)
        print(result.summary(), end="", file=sys.stderr)
    return 0


def _quiet(message: str) -> None:
    del message


def _progress(command: str, started: float) -> Callable[[str], None]:
    """A long command's progress lines on stderr, each with the seconds since it started."""

    def say(message: str) -> None:
        print(f"hyperrecipe {command} [{time.perf_counter() - started:6.1f} s] {message}",
              file=sys.stderr, flush=True)

    return say


def _mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())
