"""Validate mode's check of replicated parameters outside every boundary
(``hyperrecipe/runtime/forward/outside_params.py``), on a real tiny Gemma 2 at ``tp=2``.

Gemma 2's sandwich norms over ``extends: llama-sp`` compute on the sequence-sharded stream
outside every boundary: production leaves their gradients partial without an error, and
validate mode used to compute the same partial gradients. Every run goes through ``check``
(one process as the reference, forward and every gradient, atol 1e-5 / rtol 1e-4 in fp32) with
the model's own defaults (transformers 5.25 builds Gemma 2 with eager attention: it has no
SDPA path).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hyperrecipe.check.diagnose import GRADIENT_REDUCTION_MISSING
from hyperrecipe.check.run import CheckOptions, CheckReport, ModeResult, run_check

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests/recipes/cookbook/models/tiny-gemma2.json"
NAIVE = ROOT / "tests/recipes/broken-gemma2-over-llama-sp.yaml"
FIXED = ROOT / "tests/recipes/gemma2-sp.yaml"
SANDWICH = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


def run(recipe: Path, modes: tuple[str, ...] = ("production", "validate")) -> CheckReport:
    return run_check(CheckOptions(recipe=str(recipe), model="hf:gemma2",
                                  model_config=str(CONFIG), mesh={"tp": 2}, modes=modes))


def mode(report: CheckReport, name: str) -> ModeResult:
    return next(m for m in report.modes if m.mode == name)


def test_validate_mode_refuses_gemma2_sandwich_norms_left_outside_llama_sp() -> None:
    report = run(NAIVE, ("validate",))
    failure = mode(report, "validate").comparison.failure
    assert report.exit_code == 1 and failure is not None and failure.phase == "forward"
    assert failure.module == "model.layers.1.pre_feedforward_layernorm"
    assert re.match(
        r"PlanMismatchError: model\.layers\.1\.pre_feedforward_layernorm: replicated parameter "
        r"model\.layers\.1\.pre_feedforward_layernorm\.weight lies outside every boundary and "
        r"computes on values sharded over tp: mul combines it with the local shard "
        r"model\.layers\.[01]\S* handed back as output 0 \(dim 1 sharded over tp\), so its "
        r"gradient comes back partial", failure.error), failure.error
    assert failure.error.endswith(
        "Declare model.layers.1.pre_feedforward_layernorm on the sharded stream: `style: "
        "sequence_parallel` on a rule matching it (for a norm: a boundary that takes and "
        "returns the stream sharded and reduces its gradient), or `reduce_grads: {weight: tp}` "
        "there"), failure.error


def test_production_leaves_the_sandwich_norms_gradients_partial_and_check_names_why() -> None:
    prod = mode(run(NAIVE, ("production",)), "production")
    c = prod.comparison
    assert not prod.agree and c.forward_agrees
    assert {g.name.split(".")[3] for g in c.diverged_gradients} == SANDWICH
    assert prod.suggestion is not None and prod.suggestion.cause == GRADIENT_REDUCTION_MISSING
    assert ("model.layers.1.pre_feedforward_layernorm (and 1 more) lies outside every boundary "
            "and computes on values sharded over tp") in prod.suggestion.evidence
    assert "`style: sequence_parallel` on its rule" in prod.suggestion.evidence


def test_gemma2_sp_with_the_sandwich_norms_sequence_parallel_agrees_in_both_modes() -> None:
    report = run(FIXED)
    assert report.exit_code == 0
    for m in report.modes:
        assert m.error is None and m.agree, (m.mode, m.comparison and m.comparison.first)
        assert not m.comparison.diverged_gradients
        assert len(m.comparison.gradients) == 25  # every parameter of the tiny model


def test_reduce_grads_on_a_norm_outside_every_boundary_is_applied_in_validate_mode(
        tmp_path: Path) -> None:
    """Production's buckets reduce a declared ``reduce_grads`` outside every boundary; validate
    mode used to leave those plain parameters' gradients partial (DTensor never sees them)."""
    recipe = tmp_path / "gemma2-reduce-grads.yaml"
    recipe.write_text(NAIVE.read_text(encoding="utf-8") + (
        "  - match: \"model.layers.*.{pre_feedforward_layernorm,post_feedforward_layernorm}\"\n"
        "    reduce_grads: {weight: tp}\n"), encoding="utf-8")
    report = run(recipe)
    for m in report.modes:
        assert m.error is None and m.agree, (m.mode, m.comparison and m.comparison.first)
        assert len(m.comparison.gradients) == 25


def test_reduce_grads_on_a_norm_that_sees_whole_values_is_refused_in_validate_mode(
        tmp_path: Path) -> None:
    """Tensor parallel only: the stream is replicated between boundaries, so a declared
    reduction of a norm's gradient counts it twice in production; validate mode refuses it."""
    recipe = tmp_path / "gemma2-tp-reduce-grads.yaml"
    recipe.write_text(
        "recipe: gemma2-tp-reduce-grads\nversion: 1\nmesh: [tp]\nextends: llama\nrules:\n"
        "  - match: model.embed_tokens\n    params: {weight: replicate}\n"
        "    out_src: {output: replicate}\n"
        "  - match: lm_head\n    params: {weight: replicate}\n    out_src: {output: replicate}\n"
        "  - match: model.layers.1.pre_feedforward_layernorm\n    reduce_grads: {weight: tp}\n",
        encoding="utf-8")
    report = run(recipe)
    prod, validate = mode(report, "production"), mode(report, "validate")
    assert not prod.agree and [g.name for g in prod.comparison.diverged_gradients] == [
        "model.layers.1.pre_feedforward_layernorm.weight"]
    failure = validate.comparison.failure
    assert failure is not None and failure.phase == "backward"
    assert failure.error == (
        "PlanMismatchError: model.layers.1.pre_feedforward_layernorm.weight: the plan "
        "all-reduces this replicated parameter's gradient over tp (reduce_grads), but "
        "model.layers.1.pre_feedforward_layernorm lies outside every boundary and computed on no "
        "value sharded over tp: its gradient is whole on every rank, and production mode would "
        "count it 2 times. Drop `reduce_grads: {weight: tp}` from "
        "model.layers.1.pre_feedforward_layernorm's rule"), failure.error
