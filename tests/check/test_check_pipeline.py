"""``hyperrecipe check`` of pipelined plans (``--mesh pp=2``): every stage boundary's hidden
states, the loss and every gradient against one process, in both modes, on real gloo ranks.

Tolerances are check's fp32 defaults (atol 1e-5, rtol 1e-4). The models run with their defaults
(tiny configs from ``recipes/models``, 4 layers where a schedule runs 2 stages per rank). The toy
models of :mod:`tests.support.pipeline_check_models` break the pipeline's contract without any
error from the runtime; check must name the first divergent stage boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.check.report import render_text
from hyperrecipe.check.run import CheckOptions, CheckReport, run_check
from tests.support.recipe_text import to_yaml

ROOT = Path(__file__).resolve().parents[2]
TOY = "tests.support.pipeline_check_models:toy_lm"
LAYERS = {"gpt2": "transformer.h"}


def tiny(family: str, layers: int) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((ROOT / f"recipes/models/tiny-{family}.json").read_text())
    config["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
    return config


def recipe(tmp_path: Path, layers: str, schedule: str, microbatches: int = 4) -> str:
    pipeline: dict[str, Any] = {"layers": layers, "schedule": schedule,
                                "microbatches": microbatches}
    if schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
        pipeline["stages_per_rank"] = 2
    path = tmp_path / f"pp-{schedule}.yaml"
    path.write_text(to_yaml({"recipe": f"pp-{schedule}", "version": 1, "mesh": ["pp"],
                             "pipeline": pipeline, "rules": []}))
    return str(path)


def worst(report: CheckReport) -> str:
    """One line of measured errors per mode, for the failure message and -s runs."""
    out = []
    for m in report.modes:
        c = m.comparison
        assert c is not None, m.error
        g = c.worst_gradient
        out.append(f"{m.mode}: {c.events_compared} stage values, loss "
                   f"{c.output.diff.max_abs if c.output else None:.3g}, worst gradient "
                   f"{g.name if g else None} {g.diff.max_abs if g else None:.3g}")
    return "; ".join(out)


def test_shipped_llama_pp_recipe_agrees_with_one_process_in_both_modes_with_sgd_steps() -> None:
    report = run_check(CheckOptions(recipe=str(ROOT / "recipes/llama-pp.yaml"), model="hf:llama",
                                    model_config=str(ROOT / "recipes/models/tiny-llama.json"),
                                    mesh={"pp": 2}, steps=1))
    text = render_text(report)
    assert report.exit_code == 0, text
    assert [m.mode for m in report.modes] == ["production", "validate"]
    # batch 2 is rounded up to the recipe's 4 microbatches; 1 boundary x 4 microbatches x
    # (send, receive)
    assert "sample batch 4 rows instead of 2" in text
    for m in report.modes:
        c = m.comparison
        assert c is not None and c.events_compared == 8
        assert len(c.gradients) == 21 and len(c.params_after) == 21
    assert "8 stage boundary values, loss max abs" in text


CASES = [("llama", s) for s in ("GPipe", "Interleaved1F1B", "ZBVZeroBubble")] + [
    ("gpt2", s) for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")] + [
    ("qwen3", "1F1B"), ("qwen3", "ZBVZeroBubble"),
    ("mixtral", "1F1B"), ("mixtral", "Interleaved1F1B")]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "schedule"), CASES)
def test_pipelined_model_agrees_with_one_process_per_schedule(tmp_path: Path, family: str,
                                                              schedule: str) -> None:
    report = run_check(CheckOptions(
        recipe=recipe(tmp_path, LAYERS.get(family, "model.layers"), schedule),
        model=f"hf:{family}", model_config=tiny(family, 4), mesh={"pp": 2}, batch=4))
    assert report.exit_code == 0, render_text(report)
    stages = 4 if schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 2
    for m in report.modes:
        assert m.comparison is not None
        assert m.comparison.events_compared == (stages - 1) * 4 * 2, worst(report)
    if family == "gpt2":  # the tied embedding: its gradient on both of its names, summed
        names = {g.name for g in report.modes[0].comparison.gradients}  # type: ignore[union-attr]
        assert {"transformer.wte.weight", "lm_head.weight"} <= names
    print(f"{family} {schedule}: {worst(report)}")


def toy_check(tmp_path: Path, **config: bool) -> CheckReport:
    return run_check(CheckOptions(recipe=recipe(tmp_path, "layers", "GPipe", microbatches=2),
                                  model=TOY, model_config=config, mesh={"pp": 2}))


@pytest.mark.slow
def test_the_toy_agrees_when_it_keeps_the_pipeline_contract(tmp_path: Path) -> None:
    assert toy_check(tmp_path).exit_code == 0


def test_a_value_carried_past_the_stage_boundary_is_refused_by_the_runtime_and_named(
        tmp_path: Path) -> None:
    """The toy adds its embeddings back after every layer in its own loop (``h = layer(h) +
    x0``): on stage 1 ``x0`` comes from stage 0's embedding, which is a placeholder there. The
    runtime refuses the use by name (it was a silent divergence only check could see) and check
    names the stage."""
    report = toy_check(tmp_path, skip_embeddings=True)
    text = render_text(report)
    assert report.exit_code == 1, text
    for m in report.modes:
        c = m.comparison
        assert c is not None and c.first is not None
        assert (c.first.fqn, c.first.rank) == ("stage 1", 1)
    head = ("DIVERGED  first divergent boundary: stage 1 (raised in forward and backward, rank "
            "1)")
    assert head in text
    assert head in (ROOT / "docs/verification.md").read_text()  # the page's example
    assert ("StageBoundaryError: pipeline stage 1: the model's forward computes add inside this "
            "stage's layers from a value another stage's module produced") in text


@pytest.mark.slow
def test_a_layer_mixing_the_batch_rows_is_named_at_the_stage_that_sends(tmp_path: Path) -> None:
    report = toy_check(tmp_path, batch_centered=True)
    text = render_text(report)
    assert report.exit_code == 1, text
    first = report.modes[0].comparison.first  # type: ignore[union-attr]
    assert first is not None
    assert (first.fqn, first.what, first.rank) == ("stage 0 -> 1", "layers.0 output, microbatch 0", 0)
    assert "a layer that mixes the batch's rows" in text


@pytest.mark.slow  # four ranks, both modes (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pp2_tp2_agrees_with_one_process_in_both_modes_with_sgd_steps(
        tmp_path: Path, family: str) -> None:
    """The shipped tensor-parallel recipe extended with a pipeline: each stage's boundary, the
    loss, every full gradient and the parameters after a step, at pp=2 x tp=2."""
    path = tmp_path / f"{family}-pp-tp.yaml"
    path.write_text(to_yaml({"recipe": f"{family}-pp-tp", "version": 1, "mesh": ["pp", "tp"],
                             "extends": str(ROOT / f"recipes/{family}.yaml"),
                             "pipeline": {"layers": LAYERS.get(family, "model.layers"),
                                          "schedule": "1F1B", "microbatches": 4},
                             "rules": []}))
    report = run_check(CheckOptions(recipe=str(path), model=f"hf:{family}",
                                    model_config=str(ROOT / f"recipes/models/tiny-{family}.json"),
                                    mesh={"pp": 2, "tp": 2}, steps=1))
    text = render_text(report)
    assert report.exit_code == 0, text
    assert [m.mode for m in report.modes] == ["production", "validate"], text
    for m in report.modes:
        c = m.comparison
        assert c is not None and c.events_compared == 8, worst(report)
        assert c.params_after, text
