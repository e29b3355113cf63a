"""``hyperrecipe suggest``: a recipe proposed from the model's own parallel plans, and proven.

What lives here: reading what a model declares (transformers' ``tp_plan``, through
:mod:`hyperrecipe.models.hf_plans`) and translating it into rules with the regions our
format needs (``translate``), writing them with a comment per rule on its source (``render``),
and keeping only what ``check`` verified in both modes against one process, narrowing a failing
rule to replicated and saying why (``verify``). :func:`suggest_recipe` is the whole flow;
``hyperrecipe suggest`` is a thin layer over it. Beside those: ``rules`` (what a suggestion is
made of: the rules, and what was given up or corrected), ``structure`` (plan entries read off
the structure for a family that declares no plan, and for any ``nn.Module`` given as
``pkg.module:factory``), ``folding`` (which segments of a module's name are repetition
indices: ``0``, ``encoder_layer_3``, but not a ``Sequential``'s ``mlp.0``), ``sequence`` (sequence parallelism on top of
the translated regions), ``gathered`` (a region that fails under sequence parallelism computed
whole on the gathered sequence) and ``unplaced`` (a module no rule places, blamed under sequence
parallelism, run on this rank's tokens) and ``pipeline`` (on a mesh with ``pp``, the
``pipeline`` section: which ``nn.ModuleList`` the stages split). What does not: any placement
decision of its own at run time (the recipe goes through ``compile`` and ``check`` like a
hand-written one), the
check itself (:mod:`hyperrecipe.check`), knowledge of transformers by name
(:mod:`hyperrecipe.models`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from hyperrecipe.errors import RecipeError, SuggestError
from hyperrecipe.suggest.rules import Correction, Narrowed, SuggestedRule
from hyperrecipe.suggest.translate import EP_DIM, TranslateOptions
from hyperrecipe.suggest.verify import Attempt

__all__ = ["Correction", "Narrowed", "SuggestError", "SuggestOptions", "SuggestedRule",
           "Suggestion", "TranslateOptions", "suggest_recipe"]


@attrs.frozen(kw_only=True)
class SuggestOptions:
    """How to suggest.

    Attributes:
        translate: what to add beyond the source plan.
        verify: run ``check`` (both modes) and narrow until it agrees; ``False`` hands over an
            unverified recipe (``--unverified``).
        max_attempts: checks at most (each one builds the tiny model and runs both modes).
        timeout_s: per check step, as ``hyperrecipe check --timeout``.
        check_config: the config the check builds; default: the given config when it is small,
            the shipped tiny config of the family, or one derived from the given config with
            every size shrunk (:func:`hyperrecipe.models.hf_tiny.tiny_config`). A
            ``pkg.module:factory`` model is checked on the given config as it is (give a small
            one here where it is not).
        inputs: ``pkg.module:make_inputs`` for a model the check makes no batch for, as
            ``hyperrecipe check --inputs`` takes it (``make_inputs(model, batch=, seq=,
            generator=) -> (args, kwargs)``; images for a vision model of your own).
        microbatches: the pipeline's microbatch count on a mesh with ``pp`` (default
            ``2 * pp``).
    """

    translate: TranslateOptions = TranslateOptions()
    verify: bool = True
    max_attempts: int = 6
    timeout_s: float = 300.0
    check_config: str | Mapping[str, Any] | None = None
    inputs: str | None = None
    microbatches: int | None = None


@attrs.frozen(kw_only=True)
class Suggestion:
    """A suggested recipe and what is known about it.

    Attributes:
        text: the recipe file's text (with its comments).
        verified: ``check`` agreed in both modes on the rules in ``text``.
        rules: the rules in ``text``.
        narrowed: what was given up (left replicated) and why.
        corrections: where the source plan was wrong or incomplete.
        attempts: each check run.
        check_config: the config the check built.
        sharded_fraction: mesh dim -> fraction of the model's parameter bytes sharded on it
            (the model as configured, not the tiny one).
        collectives: expected collectives per step, forward and backward.
        reason: why ``verified`` is false (``""`` when it is true).
        seconds: the whole run.
        pipeline: on a mesh with ``pp``, the ``pipeline`` section in ``text`` in one line (the
            split list, its source, the stages); ``""`` when there is none (no ``pp``, or it
            was left out because check or compile refused it: ``reason`` says why).
    """

    model: str
    mesh: dict[str, int]
    text: str
    verified: bool
    rules: tuple[SuggestedRule, ...]
    narrowed: tuple[Narrowed, ...]
    corrections: tuple[Correction, ...]
    attempts: tuple[Attempt, ...]
    check_config: dict[str, Any]
    sharded_fraction: dict[str, float]
    collectives: tuple[int, int]
    reason: str
    seconds: float
    pipeline: str = ""

    def summary(self) -> str:
        """What a user reads after the recipe: verdict, shares, narrowings, corrections."""
        return "\n".join(_summary_lines(self)) + "\n"


_UNCHECKED = "not checked (--unverified): run `hyperrecipe check` on it before use"


def _one_line(text: str, limit: int = 240) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _summary_lines(s: Suggestion) -> list[str]:
    if s.verified:
        verdict = (f"verified: hyperrecipe check agreed in production and validate mode at "
                   f"{_mesh_text(s.mesh)} ({len(s.attempts)} check run(s))")
    else:
        verdict = f"NOT verified: {s.reason}"
    shares = ", ".join(f"{d} {f:.1%}" for d, f in s.sharded_fraction.items()) or "none"
    lines = [verdict,
             f"parameter bytes sharded: {shares}; collectives per step: {s.collectives[0]} "
             f"forward, {s.collectives[1]} backward"]
    if s.pipeline:
        lines.append(f"pipeline: {s.pipeline}")
    for n in s.narrowed:
        lines.append(f"narrowed: {n.what}: {_one_line(n.why)}")
    for c in s.corrections:
        lines.append(f"beyond the source plan: {_one_line(c.detail)}")
    return lines


def _check_config(model: str, model_config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    from hyperrecipe.models.hf_tiny import is_tiny, tiny_config
    from hyperrecipe.model_tree import load_model_config, shipped_tiny_config

    fields = load_model_config(model_config)
    if not model.startswith("hf:") or is_tiny(fields):
        return fields
    shipped = shipped_tiny_config(model) if model_config is None else None
    if shipped is not None:
        return load_model_config(shipped)
    return tiny_config(model[3:], fields)


def _ignore(message: str) -> None:
    del message


def _fractions(text: str, model: Any, mesh: Mapping[str, int]
               ) -> tuple[dict[str, float], tuple[int, int], str]:
    from hyperrecipe.model_tree import snapshot
    from hyperrecipe.placement import Shard
    from hyperrecipe.plan_report import plan_totals
    from hyperrecipe.recipe import load_recipe
    from hyperrecipe.resolve import resolve_recipe

    with tempfile.TemporaryDirectory(prefix="hyperrecipe-suggest-") as tmp:
        path = os.path.join(tmp, "suggested.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        plan = resolve_recipe(load_recipe(path), snapshot(model), dict(mesh))
    owned = [p for p in plan.params if p.tied_to is None]

    def nbytes(shape: tuple[int, ...]) -> int:
        n = 1
        for s in shape:
            n *= s
        return n

    total = sum(nbytes(p.shape) for p in owned) or 1
    pipe = plan.pipeline
    fractions = {d: sum(nbytes(p.shape) for p in owned if isinstance(p.placement.get(d), Shard))
                 / total for d in mesh if pipe is None or d != pipe.mesh_dim}
    totals = plan_totals(plan)
    stages = "" if pipe is None else (
        f"{pipe.layers} [{pipe.num_layers} layers] over {pipe.mesh_dim}={mesh[pipe.mesh_dim]} in "
        f"{len(pipe.stages)} stages ({', '.join(f'[{s.start}:{s.stop}]' for s in pipe.stages)}; "
        f"{pipe.split}), {pipe.schedule}, {pipe.microbatches} microbatches"
        + (f"; tied across stages: {', '.join(' = '.join(t.params) for t in pipe.tied)}"
           if pipe.tied else ""))
    return fractions, (totals.forward_collectives, totals.backward_collectives), stages


def _header(model: str, model_config: str | Mapping[str, Any] | None, mesh: Mapping[str, int],
            check_config: Mapping[str, Any], lines: list[str],
            source: str = "the model's own parallel plan", inputs: str | None = None
            ) -> list[str]:
    import json
    import shlex

    given = f" --model-config {shlex.quote(model_config)}" if isinstance(model_config, str) else ""
    if inputs is not None:  # check needs it too: the written recipe is checked with it
        given += f" --inputs {shlex.quote(inputs)}"
    return [f"Suggested by `hyperrecipe suggest --model {model}{given} --mesh "
            f"{_mesh_text(mesh)}` from {source}; the comment above each "
            f"rule says where it came from.",
            f"Checked on the config {json.dumps(dict(check_config), sort_keys=True)}",
            *lines]


def suggest_recipe(model: str, mesh: Mapping[str, int], *,
                   model_config: str | Mapping[str, Any] | None = None,
                   options: SuggestOptions | None = None,
                   on_progress: Callable[[str], None] | None = None) -> Suggestion:
    """Suggest a recipe for ``model`` on ``mesh`` and verify it (see the package doc).

    Args:
        model: ``hf:<model_type>``, or ``pkg.module:factory`` for a model of your own (called
            with the config fields as keyword arguments on the meta device, as ``compile`` and
            ``check`` call it; docs/bring-your-own-model.md).
        mesh: mesh dim -> size, e.g. ``{"tp": 2}``; with ``pp`` (``{"pp": 2}``,
            ``{"pp": 2, "tp": 2}``) the recipe gets a ``pipeline`` section over the model's
            list of repeated blocks (:mod:`hyperrecipe.suggest.pipeline`), checked at that mesh
            with the rules.
        model_config: the model's config (JSON file, inline JSON or mapping); the recipe is
            written for it, and checked on a tiny config of the same structure.
        options: see :class:`SuggestOptions`.
        on_progress: called with one line per step.

    Returns:
        The suggestion; ``verified`` says whether ``check`` agreed on it.

    Raises:
        SuggestError: the model declares no tensor-parallel plan, or no mesh dim is ``tp``,
            ``ep`` or ``pp``; on a mesh with ``pp``, the model has no list of repeated blocks
            or fewer of them than stages.
        ModelSpecError: the model cannot be built.

    Example::

        s = suggest_recipe("hf:llama", {"tp": 2}, model_config="recipes/models/tiny-llama.json")
        if s.verified:
            Path("llama.yaml").write_text(s.text)
    """
    from hyperrecipe.models.hf_plans import read_plans
    from hyperrecipe.model_tree import build_model, snapshot
    from hyperrecipe.suggest.pipeline import PP_DIM, called_before_the_layers, propose_pipeline
    from hyperrecipe.suggest.render import render_recipe
    from hyperrecipe.suggest.structure import (blocks_the_plan_leaves_out, read_structure,
                                               structural_entries)
    from hyperrecipe.suggest.translate import Translation, translate
    from hyperrecipe.suggest.verify import verify_rules

    opts = _for_the_model(model, options or SuggestOptions())
    progress = on_progress or _ignore
    t0 = time.perf_counter()
    dim = opts.translate.dim
    pp = mesh.get(PP_DIM, 1)
    shards = dim in mesh or EP_DIM in mesh
    if not shards and pp <= 1:
        msg = (f"suggest proposes tensor parallelism on the mesh dim {dim!r}, expert "
               f"parallelism on {EP_DIM!r} and pipeline stages on {PP_DIM!r}; the mesh "
               f"{_mesh_text(mesh)} has none of them: give --mesh {dim}=N (and {EP_DIM}=M for "
               f"MoE experts, {PP_DIM}=P for pipeline stages)")
        raise SuggestError(msg)
    check_config = (dict(_load(opts.check_config)) if opts.check_config is not None
                    else _check_config(model, model_config))
    progress(f"building {model} on the meta device (the check's config)")
    small = build_model(model, check_config)
    _refuse_large(model, small, check_config)
    proposal = propose_pipeline(small, model, pp, opts.microbatches) if pp > 1 else None
    pipe_notes: list[Narrowed] = []
    if proposal is not None:
        progress(f"pipeline over {PP_DIM}={pp}: {proposal.layers} [{proposal.num_layers} "
                 f"layers] from {proposal.source}")
        if dim in mesh and opts.translate.sequence_parallel:
            opts = attrs.evolve(opts, translate=attrs.evolve(opts.translate,
                                                             sequence_parallel=False))
            pipe_notes.append(Narrowed(
                what="sequence parallelism", why=(
                    f"not proposed beside a pipeline: its entry is a boundary on "
                    f"{proposal.layers}.0, the first stage's edge, and compile refuses a "
                    f"boundary on a stage edge (docs/pipeline.md)")))
    entries = read_plans(small) if shards else ()
    source = "the model's own parallel plan"
    if opts.translate.structure and dim in mesh and any(e.plan == "tp" for e in entries):
        extra = blocks_the_plan_leaves_out(entries, structural_entries(small))
        if extra:
            entries = (*entries, *extra)
            source += " and, for the blocks it leaves out, the model's structure"
    left_out: tuple[Narrowed, ...] = ()
    if shards and not any(e.plan == "tp" or (e.plan == "ep" and EP_DIM in mesh)
                          for e in entries):
        entries, left_out = read_structure(small) if dim in mesh else ((), ())
        source = "the model's structure (it declares no parallel plan)"
        if not entries:
            raise SuggestError(_nothing_to_shard(model, small, left_out))
    if shards:
        progress(f"read {len(entries)} plan entries from {source} of {type(small).__name__}")
        translation = translate(entries, snapshot(small), mesh, opts.translate)
        progress(f"translated into {len(translation.rules)} rules "
                 f"({len(translation.narrowed)} entries left replicated)")
    else:  # pipeline stages alone: nothing to shard, the pipeline section is the suggestion
        translation = Translation(rules=(), narrowed=(), corrections=())
    if proposal is not None:
        source = (f"{source}; the pipeline from {proposal.source}" if shards
                  else f"the pipeline: {proposal.source}")
    name = f"{_model_name(model)}-suggested"
    kinds = " and ".join(k for d, k in ((dim, "tensor"), (EP_DIM, "expert"), (PP_DIM, "pipeline"))
                         if d in mesh)
    mesh_dims = list(mesh)
    with_pipeline = proposal is not None

    def render(rules: Any, header: list[str] | None = None) -> str:
        section = proposal.fields() if proposal is not None and with_pipeline else None
        sources = [] if proposal is None else [
            f"layers: from {proposal.source}; split balanced by parameter bytes at compile",
            f"{proposal.schedule}, {proposal.microbatches} microbatches"
            + (" (--microbatches)" if opts.microbatches is not None else f" (2 x {PP_DIM})"),
            *(f"first: {m}: registered after {proposal.layers} but called before them (check)"
              for m in proposal.first)]
        return render_recipe(name, mesh_dims, rules, header=header or [],
                             description=f"Suggested {kinds} parallel {model}",
                             pipeline=section, pipeline_sources=sources)

    narrowed = [*left_out, *translation.narrowed, *pipe_notes]
    moved: list[Correction] = []  # modules the pipeline moves to its first stage
    if opts.verify:
        attempts: tuple[Attempt, ...] = ()
        while True:
            outcome = verify_rules(translation.rules, render, model=model,
                                   check_config=check_config, mesh=mesh,
                                   max_attempts=opts.max_attempts - len(attempts),
                                   timeout_s=opts.timeout_s, progress=progress,
                                   modules=snapshot(small).modules, inputs=opts.inputs,
                                   pipelined=proposal is not None)
            attempts = (*attempts, *outcome.attempts)
            early = (called_before_the_layers(outcome.reason, proposal)
                     if proposal is not None and not outcome.agree
                     and len(attempts) < opts.max_attempts else None)
            if proposal is None or early is None:
                break
            proposal = attrs.evolve(proposal, first=(*proposal.first, early))
            moved.append(Correction(what="pipeline.first", detail=(
                f"pipeline.first: {early}: registered after {proposal.layers}, so the last "
                f"stage's by default, but the model calls it before them (check: stage 0 "
                f"called it)")))
            progress(f"check: {early} is called before {proposal.layers}; moving it to "
                     f"pipeline.first")
        rules, agree, reason = outcome.rules, outcome.agree, outcome.reason
        if moved and not agree:
            reason += (f" (with {', '.join(proposal.first if proposal else ())} moved to "
                       f"pipeline.first, as earlier checks asked)")
        narrowed += outcome.narrowed
    else:
        rules, agree, attempts, reason = translation.rules, False, (), _UNCHECKED
    if proposal is not None and opts.verify and not agree:
        with_pipeline = False  # an unverified pipeline is not handed over, even unverified
        reason = (f"the pipeline over {PP_DIM}={pp} ({proposal.layers}) was not verified, so it "
                  f"is left out of the recipe: {reason}")
    progress(f"building {model} on the meta device (the given config) for the summary")
    pipeline_line = ""
    try:
        fractions, collectives, pipeline_line = _fractions(
            render(rules), build_model(model, model_config), mesh)
    except RecipeError as exc:  # the given config differs from the check's where it matters
        fractions, collectives = {}, (0, 0)
        if with_pipeline or proposal is None:  # else: why the pipeline was left out comes first
            reason = (f"the recipe check agreed on (tiny config) does not compile against the "
                      f"given config: {exc.problem}")
        agree = False  # a recipe that does not fit the user's model is not handed over
    kept = {r.match for r in rules}  # a correction whose rule was narrowed away says nothing
    corrections = (*(c for c in translation.corrections if c.what in kept),
                   *(moved if with_pipeline else ()))
    draft = Suggestion(model=model, mesh=dict(mesh), text="", verified=agree, rules=rules,
                       narrowed=tuple(narrowed), corrections=corrections,
                       attempts=attempts, check_config=check_config,
                       sharded_fraction=fractions, collectives=collectives, reason=reason,
                       seconds=time.perf_counter() - t0, pipeline=pipeline_line)
    text = render(rules, _header(model, model_config, mesh, check_config, _summary_lines(draft),
                                 source, opts.inputs))
    return attrs.evolve(draft, text=text, seconds=time.perf_counter() - t0)


def _for_the_model(model: str, opts: SuggestOptions) -> SuggestOptions:
    """No loss on vocab shards for a model of one's own: its forward hands the logits to its
    caller (there is no ``labels=`` loss of its own to run on the shards), and the caller's loss
    would get this rank's slice of the vocab."""
    if model.startswith("hf:") or not opts.translate.loss_parallel:
        return opts
    return attrs.evolve(opts, translate=attrs.evolve(opts.translate, loss_parallel=False))


def _model_name(model: str) -> str:
    """The recipe's name stem: ``llama`` for ``hf:llama``, the factory for ``pkg.mod:make_gpt``."""
    return model.removeprefix("hf:").rpartition(":")[2] or model


def _nothing_to_shard(model: str, meta: Any, left_out: Sequence[Narrowed]) -> str:
    """The refusal where neither a plan nor the structure gives a rule: what was read, and
    what was left out and why (so that the user knows what to change in the forward)."""
    from hyperrecipe.suggest.structure import WIDTH_FIELDS, hidden_size

    hidden = hidden_size(meta)
    read = (f"the blocks read a hidden size of {hidden}" if hidden is not None else
            f"no hidden size could be read (no projection width that most projections inside "
            f"repeated blocks read, nor an nn.Embedding or a config field "
            f"({', '.join(WIDTH_FIELDS)}) to break a tie)")
    msg = (f"{model} ({type(meta).__name__}) declares no tensor-parallel plan (transformers' "
           f"base_model_tp_plan / _tp_plan), and its structure shows no block of column-wise "
           f"projections from the hidden size and a row-wise one back to it ({read})")
    for n in left_out:
        msg += f"; {n.what} was left out: {n.why}"
    return msg + ": write the recipe by hand (docs/guide.md, docs/bring-your-own-model.md)"


MAX_CHECK_PARAMETERS = 20_000_000
"""Largest model ``suggest`` checks (built for real in this process and on every rank)."""


def _refuse_large(model: str, meta: Any, check_config: Mapping[str, Any]) -> None:
    """The check builds the model for real, several times: refuse a "tiny" config that is not
    (a size field the shrinking does not know, such as a per-layer embedding's vocabulary)."""
    sizes = sorted(((p.numel(), n) for n, p in meta.named_parameters()), reverse=True)
    total = sum(n for n, _ in sizes)
    if total <= MAX_CHECK_PARAMETERS:
        return
    largest = ", ".join(f"{name} ({n:,})" for n, name in sizes[:3])
    msg = (f"the config {model} would be checked on has {total:,} parameters, more than "
           f"{MAX_CHECK_PARAMETERS:,} (largest: {largest}); give a smaller one with "
           f"--check-config (the check config was {dict(check_config)})")
    raise SuggestError(msg)


def _load(config: str | Mapping[str, Any]) -> dict[str, Any]:
    from hyperrecipe.model_tree import load_model_config

    return load_model_config(config)

