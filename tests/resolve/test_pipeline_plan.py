"""The pipeline split at compile: which layers and modules each stage owns, the schedule's
stage placement, ties across stages, and every refusal at its ``pipeline`` line.

Real tiny transformers configs (Llama, GPT-2 with tied embeddings, Mixtral, Qwen3) built on the
meta device; recipes written here. Refusals are asserted in full, file and line included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model
from hyperrecipe.plan import Plan
from hyperrecipe.plan_report import explain, summary
from tests.support.recipe_text import locate, resolve_only

ROOT = Path(__file__).resolve().parents[2]


def tiny(family: str, **overrides: Any) -> Any:
    cfg = json.loads((ROOT / f"recipes/models/tiny-{family}.json").read_text())
    return build_model(f"hf:{family}", {**cfg, **overrides})


def recipe(tmp_path: Path, body: str, mesh: str = "[pp]") -> Path:
    path = tmp_path / "pp.yaml"
    path.write_text(f"recipe: pp\nversion: 1\nmesh: {mesh}\npipeline:\n{body}rules: []\n",
                    encoding="utf-8")
    return path


def refusal(path: Path, model: Any, mesh: dict[str, int]) -> str:
    with pytest.raises(RecipeError) as err:
        resolve_only(str(path), model, mesh)
    return str(err.value)


LLAMA = "  layers: model.layers\n  schedule: 1F1B\n  microbatches: 4\n"


def test_llama_stages_own_contiguous_layers_and_the_outer_modules_by_registration_order(
        tmp_path: Path) -> None:
    plan = resolve_only(str(recipe(tmp_path, LLAMA)), tiny("llama", num_hidden_layers=4),
                        {"pp": 2})
    pipe = plan.pipeline
    assert pipe is not None
    assert (pipe.first, pipe.last) == (("model.embed_tokens",), ("model.norm", "lm_head"))
    assert [(s.index, s.rank, s.start, s.stop, s.modules) for s in pipe.stages] == [
        (0, 0, 0, 2, ("model.embed_tokens",)), (1, 1, 2, 4, ("model.norm", "lm_head"))]
    every = [f for s in pipe.stages for f in s.params]
    assert sorted(every) == sorted(p.fqn for p in plan.params)  # each parameter exactly once
    assert pipe.tied == ()
    assert Plan.from_json(plan.to_json()) == plan
    assert "pipeline over pp: 1F1B, 4 microbatches, 2 stages (1 per rank)" in summary(plan)
    assert "pipeline stage 1 (rank 1 on pp) owns lm_head.weight" in explain(plan, "lm_head")


def test_a_plan_without_a_pipeline_dim_larger_than_one_has_no_pipeline_and_the_same_json(
        tmp_path: Path) -> None:
    model = tiny("llama")
    with_section = resolve_only(str(recipe(tmp_path, LLAMA)), model, {"pp": 1})
    assert with_section.pipeline is None
    assert '"pipeline"' not in with_section.to_json()


def test_gpt2_tied_embedding_and_head_on_different_stages_are_recorded(tmp_path: Path) -> None:
    body = "  layers: transformer.h\n  schedule: Interleaved1F1B\n  microbatches: 4\n"
    plan = resolve_only(str(recipe(tmp_path, body)), tiny("gpt2", n_layer=4), {"pp": 2})
    pipe = plan.pipeline
    assert pipe is not None and pipe.stages_per_rank == 2
    assert [s.rank for s in pipe.stages] == [0, 1, 0, 1]
    (tie,) = pipe.tied
    assert tie.params == ("transformer.wte.weight", "lm_head.weight") and tie.stages == (0, 3)
    assert "lm_head.weight" in pipe.stages[3].params
    assert "transformer.wte.weight" in pipe.stages[0].params


def test_v_schedules_put_the_first_and_last_stage_on_rank_zero(tmp_path: Path) -> None:
    body = "  layers: model.layers\n  schedule: ZBVZeroBubble\n  microbatches: 4\n"
    plan = resolve_only(str(recipe(tmp_path, body)), tiny("llama", num_hidden_layers=4),
                        {"pp": 2})
    assert plan.pipeline is not None
    assert [s.rank for s in plan.pipeline.stages] == [0, 1, 1, 0]


def test_balanced_split_moves_layers_off_the_stage_that_holds_a_large_embedding(
        tmp_path: Path) -> None:
    # vocab 4096 x hidden 64: the embedding outweighs two layers, so stage 0 gets fewer
    model = tiny("llama", num_hidden_layers=6, vocab_size=4096, tie_word_embeddings=True)
    plan = resolve_only(str(recipe(tmp_path, LLAMA)), model, {"pp": 2})
    assert plan.pipeline is not None
    first, last = plan.pipeline.stages
    assert first.stop < 3, plan.pipeline.split
    assert abs(first.param_bytes - last.param_bytes) < max(first.param_bytes,
                                                         last.param_bytes) / 2


def test_explicit_split_and_first_last_overrides(tmp_path: Path) -> None:
    body = LLAMA + "  split: [3]\n  last: [model.norm, lm_head]\n"
    plan = resolve_only(str(recipe(tmp_path, body)), tiny("llama", num_hidden_layers=4),
                        {"pp": 2})
    assert plan.pipeline is not None
    assert [(s.start, s.stop) for s in plan.pipeline.stages] == [(0, 3), (3, 4)]
    assert plan.pipeline.split == "recipe: [3]"


@pytest.mark.parametrize("body, mesh, needle, expected", [
    ("  layers: model.layer\n  schedule: 1F1B\n  microbatches: 4\n", {"pp": 2}, "layers:",
     "pipeline layers 'model.layer' is not a module of the model; did you mean "
     "'model.layers'? @ $.pipeline.layers; the model's nn.ModuleLists: model.layers"),
    ("  layers: model.norm\n  schedule: 1F1B\n  microbatches: 4\n", {"pp": 2}, "layers:",
     "pipeline layers 'model.norm' is a LlamaRMSNorm, not a non-empty nn.ModuleList; stages "
     "split a list of repeated blocks @ $.pipeline.layers; the model's nn.ModuleLists: "
     "model.layers"),
    ("  layers: model.layers\n  schedule: 1f1b_interleaved\n  microbatches: 4\n", {"pp": 2},
     "schedule:", None),
    ("  layers: model.layers\n  schedule: GPipe\n  microbatches: 4\n  stages_per_rank: 2\n",
     {"pp": 2}, "stages_per_rank:",
     "pipeline schedule GPipe runs exactly 1 stage(s) per rank; declared stages_per_rank: 2 "
     "@ $.pipeline.stages_per_rank; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble take "
     "2 or more; ZBVZeroBubble and DualPipeV exactly 2; GPipe and 1F1B one"),
    ("  layers: model.layers\n  schedule: 1F1B\n  microbatches: 4\n", {"pp": 4}, "layers:",
     "pipeline: 4 ranks x 1 stages per rank = 4 stages, but model.layers holds 2 layers; "
     "every stage needs at least one @ $.pipeline.layers; declared: pp=4, stages_per_rank=1; "
     "required: at most 2 stages"),
    ("  layers: model.layers\n  schedule: 1F1B\n  microbatches: 4\n  split: even\n",
     {"pp": 2}, "split:", None),
    ("  layers: model.layers\n  schedule: 1F1B\n  microbatches: 4\n  split: [5]\n", {"pp": 2},
     "5]", "pipeline split: stage 1 starts at layer 5, but model.layers holds 2 layers @ "
     "$.pipeline.split[0]"),
    ("  layers: model.layers\n  schedule: 1F1B\n  microbatches: 4\n  first: [model.layers.0]\n",
     {"pp": 2}, "model.layers.0",
     "pipeline first: 'model.layers.0' is inside model.layers, which the stages split @ "
     "$.pipeline.first[0]; units outside model.layers: model.embed_tokens, model.norm, "
     "lm_head"),
])
def test_refusals_name_the_pipeline_line(tmp_path: Path, body: str, mesh: dict[str, int],
                                         needle: str, expected: str | None) -> None:
    path = recipe(tmp_path, body)
    layers = 3 if "even" in body else 2
    message = refusal(path, tiny("llama", num_hidden_layers=layers), mesh)
    line, col = locate(path.read_text(), needle)
    assert message.startswith(f"{path}:{line}:")
    if expected is not None:
        assert message.split(": ", 1)[1] == expected
    else:
        assert "pipeline" in message


def test_unknown_schedule_suggests_the_nearest(tmp_path: Path) -> None:
    body = "  layers: model.layers\n  schedule: Interleaved1f1b\n  microbatches: 4\n"
    plan = resolve_only(str(recipe(tmp_path, body)), tiny("llama", num_hidden_layers=4),
                        {"pp": 2})
    assert plan.pipeline is not None and plan.pipeline.schedule == "Interleaved1F1B"
    body = "  layers: model.layers\n  schedule: Interleaved1F2B\n  microbatches: 4\n"
    message = refusal(recipe(tmp_path, body), tiny("llama"), {"pp": 2})
    assert "did you mean 'Interleaved1F1B'?" in message
    assert "schedules: GPipe, 1F1B, Interleaved1F1B, LoopedBFS" in message


def test_pipeline_beside_tensor_parallel_compiles_and_counts_a_rank_s_stage_shards(
        tmp_path: Path) -> None:
    path = tmp_path / "pp-tp.yaml"
    path.write_text("recipe: pp-tp\nversion: 1\nmesh: [pp, tp]\nextends: llama\npipeline:\n"
                    + LLAMA + "rules: []\n", encoding="utf-8")
    plan = resolve_only(str(path), tiny("llama", num_hidden_layers=4), {"pp": 2, "tp": 2})
    assert plan.pipeline is not None and plan.model_parallel_dims == ("pp", "tp")
    text = summary(plan)
    stage0 = plan.pipeline.stages[0]
    local = sum(p.local_shape[0] * (p.local_shape[1] if len(p.local_shape) > 1 else 1) * 4
                for p in plan.params if p.fqn in stage0.params)
    assert f"({local / 1024:.1f} KiB per rank)" in text


def test_pipeline_beside_a_data_parallel_dim_is_refused_by_name(tmp_path: Path) -> None:
    path = recipe(tmp_path, LLAMA, mesh="[dp, pp]")
    message = refusal(path, tiny("llama"), {"pp": 2, "dp": 2})
    assert message == (
        f"{path}:5:3: pipeline over pp beside the data-parallel dim(s) dp=2 is not supported "
        "yet: the pipeline runtime does not reduce stage gradients over data-parallel ranks @ "
        "$.pipeline; compile with dp=1; pipeline beside tensor parallel (dims the rules place "
        "parameters over) is supported")


def test_a_boundary_around_the_whole_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pp.yaml"
    path.write_text("recipe: pp\nversion: 1\nmesh: [pp, tp]\npipeline:\n" + LLAMA
                    + "rules:\n  - match: model\n    boundary: true\n", encoding="utf-8")
    message = refusal(path, tiny("llama"), {"pp": 2, "tp": 1})
    assert "pipeline: boundary 'model' spans modules of several stages" in message
    assert message.startswith(f"{path}:5:")


def test_pipeline_mesh_dim_must_be_declared(tmp_path: Path) -> None:
    path = tmp_path / "pp.yaml"
    path.write_text("recipe: pp\nversion: 1\nmesh: [tp]\npipeline:\n" + LLAMA + "rules: []\n")
    with pytest.raises(RecipeError) as err:
        resolve_only(str(path), tiny("llama"), {"tp": 1})
    assert str(err.value) == (
        f"{path}:5:3: pipeline mesh dim 'pp' is not declared in mesh @ $.pipeline; declared: "
        "[tp]; add 'pp' to mesh")


def test_the_pipeline_page_shows_the_shipped_recipe_and_what_compile_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    import yaml

    from hyperrecipe.cli import main

    page = (ROOT / "docs/pipeline.md").read_text(encoding="utf-8")
    shown = re.search(r"```yaml\n# shipped as recipes/llama-pp.yaml\n(.*?)```", page, re.S)
    assert shown is not None
    shipped = yaml.safe_load((ROOT / "recipes/llama-pp.yaml").read_text(encoding="utf-8"))
    assert yaml.safe_load(shown.group(1)) == shipped
    code = main(["compile", "llama-pp", "--model", "hf:llama", "--model-config",
                 str(ROOT / "recipes/models/tiny-llama.json"), "--mesh", "pp=2",
                 "-o", str(tmp_path / "plan.json")])
    assert code == 0
    printed = capsys.readouterr().out
    text = re.search(r"```text\n(pipeline over .*?)```", page, re.S)
    assert text is not None
    for line in text.group(1).splitlines():
        assert line in printed.splitlines(), line


def test_sequence_parallel_s_entry_on_the_first_layer_is_refused_as_a_stage_edge(
        tmp_path: Path) -> None:
    path = tmp_path / "sp-pp.yaml"
    path.write_text("recipe: sp-pp\nversion: 1\nmesh: [pp, tp]\nextends: llama-sp\npipeline:\n"
                    + LLAMA + "rules: []\n", encoding="utf-8")
    message = refusal(path, tiny("llama", num_hidden_layers=4), {"pp": 2, "tp": 2})
    assert message == (
        f"{path}:6:3: pipeline: boundary 'model.layers.0' is the first or last layer of stage 0, "
        "where the pipeline installs the stage's edge; a stage edge cannot be a boundary yet @ "
        "$.pipeline.split; the first layer always starts stage 0: a recipe whose boundary sits "
        "on it (sequence parallel's entry) cannot be pipelined yet; pipeline a recipe without it "
        "(plain tensor parallel)")
