"""Prove a suggestion with ``check`` in both modes, narrowing what fails, a bounded number of times.

Each attempt writes the rules as a recipe file and runs :func:`hyperrecipe.check.run.run_check`
on it (the same code as ``hyperrecipe check``: the recipe compiled against the model, then
production and validate mode on local ranks, compared with one process). When it does not
agree, the failure is attributed to one rule: a compile error names its rule index; a divergent
boundary, a rank's error message or a divergent gradient names a module (and, where nothing
beyond the plan is left to give up, the message of an error raised in backward does), and the
rule that places that module — or the innermost region around it — is blamed. A blamed rule that goes
beyond the source plan is given up alone; otherwise its whole group (a region and its
projections, an embedding and its tied ``lm_head``) is, so that module stays replicated. What
was given up, and why, is recorded. Nothing here decides a placement of its own.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import ModuleInfo
from hyperrecipe.recipe.patterns import compile_pattern
from hyperrecipe.suggest.gathered import gather_instead
from hyperrecipe.suggest.render import merge_rules
from hyperrecipe.suggest.rules import Narrowed, SuggestedRule
from hyperrecipe.suggest.sequence import GATHERED_GROUP, SEQUENCE_GROUP, nested_region
from hyperrecipe.suggest.unplaced import token_local_unplaced

__all__ = ["Attempt", "Verified", "verify_rules"]


@attrs.frozen(kw_only=True)
class Attempt:
    """One check of the rules: its verdict in one line, and how long it took."""

    rules: int
    verdict: str
    seconds: float


@attrs.frozen(kw_only=True)
class Verified:
    """The outcome: the rules left, whether ``check`` agreed on them, what was given up."""

    rules: tuple[SuggestedRule, ...]
    agree: bool
    narrowed: tuple[Narrowed, ...]
    attempts: tuple[Attempt, ...]
    reason: str = ""


def _shards(rules: Sequence[SuggestedRule]) -> bool:
    for rule in rules:
        fields = dict(rule.fields)
        if fields.get("style") not in (None, "replicate") or "shard" in str(fields.get("params")):
            return True
    return False


def _owner(fqn: str, rules: Sequence[SuggestedRule]) -> tuple[SuggestedRule | None, bool]:
    """The rule to blame for ``fqn`` (a module or a parameter): the rule matching it or its
    module exactly, else the one matching its innermost ancestor. The flag says exact."""
    parts = fqn.split(".")
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        found = [r for r in rules if compile_pattern(r.match).fullmatch(prefix)]
        if found:  # an addition beyond the plan is suspected before the plan's own rule
            return next((r for r in found if r.deeper), found[0]), depth >= len(parts) - 1
    return None, False


_FQN = re.compile(r"[A-Za-z_][\w]*(?:\.[\w]+)+")


def _blame(report: Any, rules: Sequence[SuggestedRule]) -> tuple[str, str] | None:
    """``(fqn, why)`` for the first failure of the report that names a module of the model."""
    for mode in report.modes:
        if mode.error is not None:
            first_line = str(mode.error).strip().splitlines()[0]
            for token in _FQN.findall(str(mode.error)):
                if _owner(token, rules)[0] is not None:
                    return token, f"{mode.mode} mode could not run: {first_line}"
            continue
        cmp = mode.comparison
        if cmp is None or cmp.agree:
            continue
        if cmp.first is not None and cmp.first.fqn not in ("", "<output>"):
            return cmp.first.fqn, (f"{mode.mode} mode diverged at {cmp.first.fqn} "
                                   f"({cmp.first.what}): {cmp.first.detail}")
        bad = cmp.diverged_gradients or cmp.diverged_params
        if bad:
            # errors flow backward: the last one in forward order is the source; of those a
            # suggested rule places (a final norm no rule touches is downstream of the cause)
            placed = [d for d in bad if _owner(d.name, rules)[0] is not None]
            last = (placed or bad)[-1]
            return last.name, (f"{mode.mode} mode: the gradient of {last.name} differs from one "
                               f"process (max abs {last.diff.max_abs})")
    return None


def _first_failure(report: Any) -> str:
    """``": <mode> mode ..."``: the report's first error or divergence in one line, for a
    reason where no rule is blamed (a pipeline's stage boundary names no module a rule places)."""
    for mode in report.modes:
        if mode.error is not None:
            return f": {mode.mode} mode could not run: {str(mode.error).strip().splitlines()[0]}"
        cmp = mode.comparison
        if cmp is None or cmp.agree:
            continue
        if cmp.first is not None:
            return (f": {mode.mode} mode diverged at {cmp.first.fqn or '<output>'} "
                    f"({cmp.first.what}): {cmp.first.detail}")
        bad = cmp.diverged_gradients or cmp.diverged_params
        if bad:
            return (f": {mode.mode} mode: the gradient of {bad[-1].name} differs from one "
                    f"process (max abs {bad[-1].diff.max_abs})")
    return ""


def _blame_named(report: Any, rules: Sequence[SuggestedRule]) -> tuple[str, str] | None:
    """``(fqn, why)`` for a failure raised outside every boundary (``<backward>``: validate
    mode's gradient check) whose message names a module a rule places. Asked only where
    :func:`_blame` found nothing and no addition beyond the plan is left to give up: the
    module named is then narrowed instead of refusing the whole suggestion."""
    for mode in report.modes:
        cmp = mode.comparison
        if cmp is None or cmp.agree or cmp.first is None or not cmp.first.fqn.startswith("<"):
            continue
        for token in _FQN.findall(str(cmp.first.detail)):
            if _owner(token, rules)[0] is not None:
                return token, f"{mode.mode} mode raised in {cmp.first.fqn}: {cmp.first.detail}"
    return None


def _orphan(rule: SuggestedRule) -> SuggestedRule | None:
    """A refinement (sequence parallelism, the loss) whose base rule was given up, so the module
    is replicated now. The head's sequence gather becomes a boundary of its own around the
    replicated head (its weight a replicated DTensor in validate mode, the logits whole);
    anything else (a region's layouts, a reduce-scatter, the loss on shards) goes with its base,
    and a region's takes its whole group with it (see :func:`_give_up`)."""
    fields = dict(rule.fields)
    if "in_dst" not in fields or "out_src" in fields or fields.get("loss_parallel"):
        return None
    fields.update(boundary=True, out_src={0: "replicate"}, params={"weight": "replicate"})
    return attrs.evolve(rule, fields=tuple(fields.items()),
                        sources=(*rule.sources, "(around a head left replicated)"))


FOR_THE_BLOCK = " (so that the token-local block around it runs on this rank's tokens)"
"""How a region given up for sequence parallelism's sake is named; it comes back when sequence
parallelism is given up after all."""


def _groups(rules: Sequence[SuggestedRule], culprit: SuggestedRule, why: str) -> set[str]:
    """The groups given up for ``culprit``. A region nested in a token-local block goes with the
    layouts that let it gather the block's tokens, and those with it: when they fail (a block
    that flattens its tokens before calling it, where no layout says which rank holds which
    token), or when the block fails naming it, the region is left replicated and the block runs
    on this rank's tokens whole. Sequence parallelism takes every such layout with it."""
    region = nested_region(culprit.group)
    if region is not None:
        return {culprit.group, region}
    nested = {r.group for r in rules if nested_region(r.group) is not None}
    if culprit.group == GATHERED_GROUP:  # without it the block would run on this rank's tokens
        return {GATHERED_GROUP, SEQUENCE_GROUP} | nested
    if culprit.group != SEQUENCE_GROUP:
        return {culprit.group}
    if dict(culprit.fields).get("local_region"):
        named = {r.group for r in rules if r.group in nested
                 and any(compile_pattern(r.match).fullmatch(t) for t in _FQN.findall(why))}
        if named:
            return named | {nested_region(g) or g for g in named}
    return {culprit.group, GATHERED_GROUP} | nested


def _give_up(rules: Sequence[SuggestedRule], culprit: SuggestedRule, exact: bool,
             why: str = "") -> tuple[list[SuggestedRule], str]:
    """Drop the culprit's group (:func:`_groups`); a gradient reduction beyond the plan goes
    alone, and only when it is the failing module's own rule. Refinements of what was dropped
    follow it."""
    if culprit.deeper and "reduce_grads" in dict(culprit.fields) and exact:
        return [r for r in rules if r is not culprit], culprit.match
    groups = _groups(rules, culprit, why)
    dropped = {r.match for r in rules if r.group in groups}
    kept = [r for r in rules if r.group not in groups]
    bases = {r.match for r in kept if not r.deeper}
    orphans = [r for r in kept if r.deeper and r.match in dropped and r.match not in bases]
    lost = {r.group for r in orphans if "out_src" in dict(r.fields)}  # a region's layouts
    out: list[SuggestedRule] = []
    for rule in kept:
        if rule.group in lost:
            continue
        if rule in orphans:
            replaced = _orphan(rule)
            if replaced is not None:
                out.append(replaced)
            continue
        out.append(rule)
    present = {r.group for r in rules}
    named = _outermost(sorted(g for g in groups if nested_region(g) is None and g in present)
                       or [culprit.group])
    if SEQUENCE_GROUP not in groups and len(groups) > len(named):
        named = [g + FOR_THE_BLOCK for g in named]
    return out, " and ".join(named) + "".join(f" (and {g}, which depends on it)"
                                              for g in sorted(lost - groups))


def _outermost(groups: Sequence[str]) -> list[str]:
    """``groups`` without those that name a part of another (``sequence parallelism: blocks
    computed replicated ...`` beside ``sequence parallelism``), so that the text says each
    thing given up once."""
    return [g for g in groups if not any(g.startswith(h + ":") for h in groups if h != g)]


def _refused_at_compile(path: str, meta: Any, mesh: Mapping[str, int],
                        inputs: str | None = None) -> None:
    """Compile the attempt as ``hyperrecipe compile`` will, verification included. Run after
    ``check`` agreed (a divergence narrows by what ``check`` measured, which knows more ways
    out, such as gathering a region instead of giving it up): a suggestion ``compile`` refuses
    is then narrowed like one that does not resolve, so none is written that compile refuses.

    Raises:
        RecipeError: the attempt does not compile, or its verification step refuses it.
    """
    from hyperrecipe.api import compile_recipe

    compile_recipe(path, meta, dict(mesh), inputs=inputs)


def verify_rules(rules: Sequence[SuggestedRule], render: Callable[[Sequence[SuggestedRule]], str],
                 *, model: str, check_config: Mapping[str, Any], mesh: Mapping[str, int],
                 max_attempts: int, timeout_s: float,
                 progress: Callable[[str], None],
                 modules: Sequence[ModuleInfo] = (), inputs: str | None = None,
                 pipelined: bool = False) -> Verified:
    """Check ``rules`` and narrow them until ``check`` agrees, at most ``max_attempts`` times.

    Args:
        rules: the suggested rules.
        render: the recipe text of a list of rules.
        model: the model spec (``hf:llama``).
        check_config: the (tiny) config the check builds.
        mesh: mesh dim -> size.
        max_attempts: checks at most.
        timeout_s: per check step (``hyperrecipe check --timeout``).
        progress: one line per step.
        modules: the checked model's modules (parents first): a module no rule places that
            the check names is then taken into sequence parallelism (:mod:`.unplaced`).
        inputs: ``pkg.module:make_inputs`` for the check's batch (``check --inputs``).
        pipelined: the rendered recipe has a ``pipeline`` section, which is checked too: rules
            that shard nothing (``pp`` alone, or every tensor-parallel rule given up) are then
            still worth a check.
    """
    from hyperrecipe.check.run import CheckOptions, run_check
    from hyperrecipe.model_tree import build_model

    meta = build_model(model, dict(check_config))  # what `hyperrecipe compile` verifies on
    current = list(rules)
    narrowed: list[Narrowed] = []
    attempts: list[Attempt] = []
    held: list[tuple[list[SuggestedRule], Narrowed]] = []  # given up for sequence parallelism

    def narrow(culprit: SuggestedRule, exact: bool, why: str, blame: str = "") -> str:
        nonlocal current
        before = current
        current, what = _give_up(current, culprit, exact, blame)
        record = Narrowed(what=what, why=why)
        narrowed.append(record)
        if what.endswith(FOR_THE_BLOCK):
            held.append(([r for r in before if r not in current
                          and nested_region(r.group) is None], record))
        elif what.startswith(SEQUENCE_GROUP):
            for back, note in held:  # what sequence parallelism needed given up comes back
                current = sorted([*current, *back], key=lambda r: r.order)
                narrowed.remove(note)
            held.clear()
        return what
    with tempfile.TemporaryDirectory(prefix="hyperrecipe-suggest-") as tmp:
        path = os.path.join(tmp, "suggested.yaml")
        for attempt in range(1, max_attempts + 1):
            if not pipelined and not _shards(current):
                return Verified(rules=tuple(current), agree=False, narrowed=tuple(narrowed),
                                attempts=tuple(attempts),
                                reason="every rule that shards something was given up")
            with open(path, "w", encoding="utf-8") as f:
                f.write(render(current))
            progress(f"check {attempt}/{max_attempts}: {len(current)} rules, both modes")
            t0 = time.perf_counter()
            options = CheckOptions(recipe=path, model=model, model_config=dict(check_config),
                                   mesh=dict(mesh), timeout_s=timeout_s, inputs=inputs)
            try:
                report = run_check(options)
                if report.agree:  # what check agrees on must also compile as compile will
                    _refused_at_compile(path, meta, mesh, inputs)
            except RecipeError as exc:
                seconds = time.perf_counter() - t0
                if exc.rule_index is None or not 0 <= exc.rule_index < len(merge_rules(current)):
                    attempts.append(Attempt(rules=len(current), verdict="compile error",
                                            seconds=seconds))
                    return Verified(rules=tuple(current), agree=False, narrowed=tuple(narrowed),
                                    attempts=tuple(attempts),
                                    reason=f"the suggestion does not compile: {exc.problem}")
                parts = merge_rules(current)[exc.rule_index][1]  # the rule as written
                failing = next((r for r in parts if r.deeper), parts[0])
                what = narrow(failing, True, f"does not compile: {exc.problem}")
                attempts.append(Attempt(rules=len(current), verdict=f"compile error at {what}",
                                        seconds=seconds))
                progress(f"check {attempt}: compile error in rule {exc.rule_index} "
                         f"({failing.match}); narrowing {what}")
                continue
            seconds = time.perf_counter() - t0
            if report.agree:
                attempts.append(Attempt(rules=len(current), verdict="both modes agree",
                                        seconds=seconds))
                progress(f"check {attempt}: both modes agree with one process ({seconds:.1f} s)")
                return Verified(rules=tuple(current), agree=True, narrowed=tuple(narrowed),
                                attempts=tuple(attempts))
            blamed = _blame(report, current)
            culprit, exact = _owner(blamed[0], current) if blamed else (None, False)
            if culprit is None and not any(r.deeper for r in current):
                blamed = _blame_named(report, current) or blamed
                culprit, exact = _owner(blamed[0], current) if blamed else (None, False)
            added = (token_local_unplaced(blamed[0], current, modules)
                     if blamed is not None and culprit is None else None)
            if blamed is not None and added is not None and added.match not in {
                    r.match for r in current}:
                current = [*current, added]  # see unplaced: taken into sequence parallelism
                attempts.append(Attempt(rules=len(current), verdict=f"diverged at {blamed[0]}",
                                        seconds=seconds))
                progress(f"check {attempt}: diverged at {blamed[0]}, which no rule places "
                         f"({seconds:.1f} s); running {added.match} on this rank's tokens")
                continue
            if blamed is None or culprit is None:
                deeper = [r for r in current if r.deeper]
                verdict = "diverged, no module to blame"
                attempts.append(Attempt(rules=len(current), verdict=verdict, seconds=seconds))
                if not deeper:
                    return Verified(rules=tuple(current), agree=False, narrowed=tuple(narrowed),
                                    attempts=tuple(attempts), reason=(
                                        "check diverged and no suggested rule could be blamed"
                                        + _first_failure(report)))
                if any(r.group == SEQUENCE_GROUP for r in current):
                    # the addition that changes every block's layout goes first, alone: the
                    # others (the loss on vocab shards, reductions) are kept where it was it
                    what = narrow(next(r for r in current if r.group == SEQUENCE_GROUP), False,
                                  "check diverged with no module to blame; sequence "
                                  "parallelism given up first")
                    progress(f"check {attempt}: diverged; giving up {what}")
                    continue
                current = [r for r in current if not r.deeper]
                narrowed += [Narrowed(what=r.match, why="check diverged with no module to blame; "
                                      "every addition beyond the source plan given up")
                             for r in deeper]
                progress(f"check {attempt}: diverged; giving up the additions beyond the plan")
                continue
            instead = gather_instead(current, culprit) if culprit.group == SEQUENCE_GROUP else None
            if instead is not None:  # the region's sharding, not the sequence's: see gathered
                current, own, what = instead
                record = Narrowed(what=what, why=blamed[1])
                narrowed.append(record)
                held.append((own, record))
                attempts.append(Attempt(rules=len(current), verdict=f"diverged at {blamed[0]}",
                                        seconds=seconds))
                progress(f"check {attempt}: diverged at {blamed[0]} ({seconds:.1f} s); "
                         f"computing {what}")
                continue
            what = narrow(culprit, exact, blamed[1], blamed[1])
            attempts.append(Attempt(rules=len(current), verdict=f"diverged at {blamed[0]}",
                                    seconds=seconds))
            progress(f"check {attempt}: diverged at {blamed[0]} ({seconds:.1f} s); "
                     f"narrowing {what} (left replicated)")
    return Verified(rules=tuple(current), agree=False, narrowed=tuple(narrowed),
                    attempts=tuple(attempts),
                    reason=f"check still disagreed after {max_attempts} attempts")
