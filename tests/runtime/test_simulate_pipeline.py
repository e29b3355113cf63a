"""The dry run of a pipelined plan (:mod:`hyperrecipe.simulate_pipeline`).

Each rank's parameter bytes must be its stages' in the plan and the real model's for those
FQNs; its bubble the schedule's; its activations the per-microbatch bytes of its stages times
what the schedule keeps in flight; and the per-microbatch bytes measured on meta exactly what
the same measurement finds on a real CPU model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe import compile_recipe
from hyperrecipe.cli import main
from hyperrecipe.errors import UsageError
from hyperrecipe.pipeline.schedule import bubble_fraction, schedule_actions, simulate_timeline
from hyperrecipe.simulate import ADAMW_STATE_BYTES, render_table, simulate
from hyperrecipe.simulate_pipeline import measure_stage_activations
from tests.support.runtime_harness import ROOT, llama

SEQ = 16


def _recipe(tmp_path: Path, schedule: str, microbatches: int, per_rank: int | None = None,
            name: str = "llama-pp") -> str:
    extra = f"\n  stages_per_rank: {per_rank}" if per_rank is not None else ""
    path = tmp_path / f"{name}-{schedule}.yaml"
    path.write_text(f"recipe: {name}\nversion: 1\nmesh: [pp]\npipeline:\n  layers: model.layers\n"
                    f"  schedule: {schedule}{extra}\n  microbatches: {microbatches}\nrules: []\n")
    return str(path)


def test_each_ranks_parameter_bytes_are_its_stages_and_the_real_models(tmp_path: Path) -> None:
    model = llama("meta")
    plan = compile_recipe(_recipe(tmp_path, "1F1B", 4), model, {"pp": 2})
    assert plan.pipeline is not None
    sim = simulate(model, plan, seq_len=SEQ)
    assert sim.ranks == () and sim.pipeline is not None
    real = dict(llama().named_parameters(remove_duplicate=False))
    for row in sim.pipeline.ranks:
        stages = plan.pipeline.stages_of_rank(row.rank)
        assert row.stages == tuple(s.index for s in stages)
        assert row.parameters == sum(s.param_bytes for s in stages)
        fqns = [f for s in stages for f in s.params]
        assert row.parameters == sum(real[f].numel() * real[f].element_size() for f in fqns)
        assert row.gradients == row.parameters  # every parameter trains, fp32
        assert row.optimizer == row.parameters // 4 * ADAMW_STATE_BYTES


def test_bubble_is_the_schedules(tmp_path: Path) -> None:
    model = llama("meta")
    plan = compile_recipe(_recipe(tmp_path, "1F1B", 4), model, {"pp": 2})
    report = simulate(model, plan).pipeline
    assert report is not None
    assert report.mean_bubble == bubble_fraction("1F1B", 2, 4)
    assert tuple(r.bubble for r in report.ranks) == simulate_timeline(
        schedule_actions("1F1B", 2, 4)).bubble


@pytest.mark.parametrize(("schedule", "held"), [("GPipe", lambda pp, m: m),
                                                ("1F1B", lambda pp, m: min(pp, m))])
def test_rank0_holds_the_microbatches_its_schedule_keeps_in_flight(
        tmp_path: Path, schedule: str, held: Any) -> None:
    model = llama("meta")
    microbatches = 4
    plan = compile_recipe(_recipe(tmp_path, schedule, microbatches), model, {"pp": 2})
    report = simulate(model, plan, seq_len=SEQ, batch=2 * microbatches).pipeline
    assert report is not None and report.microbatch_size == 2
    per_micro = report.stages[0].activations_per_microbatch
    assert per_micro is not None and per_micro > 0
    assert report.ranks[0].peak_in_flight == held(2, microbatches)
    assert report.ranks[0].activations == held(2, microbatches) * per_micro
    if schedule == "GPipe":  # every rank runs every forward before its backwards
        for rank, stage in zip(report.ranks, report.stages, strict=True):
            assert rank.activations == microbatches * stage.activations_per_microbatch


def test_activations_measured_on_meta_are_a_real_cpu_forwards(tmp_path: Path) -> None:
    """The same measurement on a real model (CPU picks the fused attention kernel the meta
    run is made to run), compared exactly, stage by stage."""
    plan = compile_recipe(_recipe(tmp_path, "1F1B", 4), llama("meta"), {"pp": 2})
    assert plan.pipeline is not None
    on_meta = measure_stage_activations(llama("meta"), plan.pipeline, batch=2, seq_len=SEQ)
    on_cpu = measure_stage_activations(llama(), plan.pipeline, batch=2, seq_len=SEQ)
    assert on_meta == on_cpu
    assert all(b > 0 for b in on_meta)


def test_batch_must_split_into_the_microbatches(tmp_path: Path) -> None:
    model = llama("meta")
    plan = compile_recipe(_recipe(tmp_path, "1F1B", 4), model, {"pp": 2})
    with pytest.raises(UsageError, match=r"Declared: batch=6; required: a positive multiple of 4"):
        simulate(model, plan, seq_len=SEQ, batch=6)
    unpiped = compile_recipe(str(ROOT / "recipes/llama.yaml"), model, {"tp": 2})
    with pytest.raises(UsageError, match="has no pipeline section"):
        simulate(model, unpiped, batch=4)


def test_cli_reports_a_pipelined_plan_per_stage_and_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", _recipe(tmp_path, "1F1B", 4), "--model", "hf:llama", "--model-config",
            str(ROOT / "recipes/models/tiny-llama.json"), "--mesh", "pp=2", "--seq-len",
            str(SEQ)]
    assert main([*args, "--format", "json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    pipe = out["pipeline"]
    assert out["ranks"] == [] and [r["rank"] for r in pipe["ranks"]] == [0, 1]
    assert pipe["mean_bubble"] == bubble_fraction("1F1B", 2, 4)
    rank0 = pipe["ranks"][0]
    assert rank0["total_bytes"] == sum(rank0[k] for k in ("parameters", "gradients",
                                                          "optimizer", "activations"))
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "1F1B, 4 microbatches" in text and "mean bubble 20.0%" in text


LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
             "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


@pytest.mark.slow  # a 70B Llama on meta, two 80-layer forwards of 4096 tokens (~15 s)
def test_a_70b_llama_at_pp8_with_32_microbatches(tmp_path: Path) -> None:
    """docs/pipeline.md "Pipeline: simulate at 70B": 1F1B waits 17.9 % of the step,
    Interleaved1F1B (2 stages per rank) 9.9 %; a rank holds its own stages only."""
    from hyperrecipe.model_tree import build_model

    model = build_model("hf:llama", LLAMA_70B)
    for schedule, per_rank, bubble in (("1F1B", None, "17.9%"),
                                       ("Interleaved1F1B", 2, "9.9%")):
        plan = compile_recipe(_recipe(tmp_path, schedule, 32, per_rank, "llama-70b-pp"), model,
                              {"pp": 8})
        sim = simulate(model, plan, seq_len=4096)
        assert sim.pipeline is not None
        report = sim.pipeline
        assert f"{report.mean_bubble:.1%}" == bubble
        assert report.mean_bubble == bubble_fraction(schedule, 8, 32, per_rank)
        largest = max(s.parameters for s in report.stages)
        assert max(r.parameters for r in report.ranks) <= report.stages_per_rank * largest
        if report.stages_per_rank == 1:
            assert max(r.parameters for r in report.ranks) == largest
        total = sum(p.numel() * p.element_size()
                    for p in model.parameters())  # nothing tied in Llama 70B
        assert sum(r.parameters for r in report.ranks) == total
        assert f"mean bubble {bubble}" in render_table(sim)


@pytest.mark.slow  # a 70B Llama on meta and one 80-layer forward of 4096 tokens (~10 s)
def test_a_70b_llama_at_pp8_tp8_counts_each_ranks_shards_of_its_stages(tmp_path: Path) -> None:
    """The done-when of issue 38: simulate of a 70B-shaped Llama at pp=8, tp=8 reports the
    bubble; each rank holds a tp-th of its stage, and the activations say they are unsharded."""
    from hyperrecipe.model_tree import build_model

    model = build_model("hf:llama", LLAMA_70B)
    recipe = tmp_path / "llama-70b-pp-tp.yaml"
    recipe.write_text("recipe: llama-70b-pp-tp\nversion: 1\nmesh: [pp, tp]\nextends: llama\n"
                      "pipeline:\n  layers: model.layers\n  schedule: 1F1B\n  microbatches: 32\n"
                      "rules: []\n")
    plan = compile_recipe(str(recipe), model, {"pp": 8, "tp": 8})
    sim = simulate(model, plan, seq_len=4096)
    report = sim.pipeline
    assert report is not None
    assert f"{report.mean_bubble:.1%}" == "17.9%"
    local = {p.fqn: math.prod(p.local_shape) * 2 for p in plan.params}  # bf16
    assert plan.pipeline is not None
    for stage, row in zip(plan.pipeline.stages, report.stages, strict=True):
        assert row.parameters == sum(local[f] for f in stage.params)
        assert row.parameters * 7 < stage.param_bytes  # a tp-th of the stage (replicated norms)
    assert "without the sharding over tp=8: an upper bound per rank" in render_table(sim)
