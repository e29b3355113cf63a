"""`hyperrecipe suggest --mesh pp=2` (and pp=2,tp=2): a ``pipeline`` section over the model's
list of repeated blocks, verified by check at that mesh in both modes, and written so that
check passes again from the file.

The end-to-end tests run the real check (gloo ranks, production and validate mode, each stage
boundary, the loss and every gradient compared with one process) on the shipped tiny configs;
the refusals build the model on the meta device only.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import SuggestError
from hyperrecipe.model_tree import build_model
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.pipeline import called_before_the_layers, propose_pipeline
from tests.support.runtime_harness import ROOT

PP2 = {"pp": 2}
LAYERS = {"llama": "model.layers", "qwen3": "model.layers", "gpt2": "transformer.h",
          "mixtral": "model.layers"}


def _config(family: str) -> str:
    return str(ROOT / "recipes/models" / f"tiny-{family}.json")


def _recheck(path: Path, family: str, mesh: dict[str, int]) -> None:
    """The written file, loaded again, passes check in both modes at the same mesh."""
    report = run_check(CheckOptions(recipe=str(path), model=f"hf:{family}",
                                    model_config=_config(family), mesh=mesh))
    assert report.pipelined and [m.mode for m in report.modes] == ["production", "validate"]
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]


@pytest.mark.slow  # launches ranks, twice per family (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "mixtral"])
def test_suggest_at_pp2_writes_a_pipeline_check_verifies_in_both_modes(
        family: str, tmp_path: Path) -> None:
    s = suggest_recipe(f"hf:{family}", PP2, model_config=_config(family))
    assert s.verified, s.summary()
    assert s.narrowed == () and s.rules == () and len(s.attempts) == 1
    layers = LAYERS[family]
    assert (f"pipeline:\n  layers: {layers}\n  schedule: \"1F1B\"\n  microbatches: 4\n\n"
            f"rules: []\n") in s.text
    assert "mesh: [pp]\n" in s.text
    source = ("the model's structure (its list of repeated blocks holding the most parameter "
              "bytes)" if family == "gpt2" else
              f"{ {'llama': 'Llama', 'qwen3': 'Qwen3', 'mixtral': 'Mixtral'}[family]}"
              f"Config.base_model_pp_plan['layers'] (inputs ['hidden_states', "
              f"'attention_mask'])")
    assert f"# layers: from {source}; split balanced by parameter bytes at compile\n" in s.text
    assert s.pipeline.startswith(f"{layers} [2 layers] over pp=2 in 2 stages ([0:1], [1:2]; "
                                 f"balanced by parameter bytes")
    # GPT-2's embedding and head are one tensor used on the first and the last stage
    assert s.pipeline.endswith("tied across stages: transformer.wte.weight = lm_head.weight"
                               if family == "gpt2" else "1F1B, 4 microbatches")
    path = tmp_path / f"{family}-pp.yaml"
    path.write_text(s.text)
    _recheck(path, family, PP2)


@pytest.mark.slow  # four ranks
def test_suggest_at_pp2_tp2_keeps_the_tp_rules_beside_the_pipeline(tmp_path: Path) -> None:
    mesh = {"pp": 2, "tp": 2}
    s = suggest_recipe("hf:llama", mesh, model_config=_config("llama"))
    assert s.verified, s.summary()
    assert "mesh: [pp, tp]\n" in s.text
    assert "pipeline:\n  layers: model.layers\n" in s.text
    assert "  - match: model.layers.*.self_attn.o_proj\n    style: rowwise\n" in s.text
    assert s.sharded_fraction["tp"] > 0.9 and "pp" not in s.sharded_fraction
    # its entry boundary on model.layers.0 is a stage edge: not proposed, and said why
    assert [n.what for n in s.narrowed] == ["sequence parallelism"]
    assert "model.layers.0, the first stage's edge" in s.narrowed[0].why
    path = tmp_path / "llama-pp-tp.yaml"
    path.write_text(s.text)
    _recheck(path, "llama", mesh)


def test_a_model_without_a_module_list_is_refused_by_name() -> None:
    # torchvision's ViT holds its blocks in an nn.Sequential (encoder_layer_0, ...)
    spec = "tests.support.byo_models:make_torchvision_vit"
    with pytest.raises(SuggestError) as info:
        suggest_recipe(spec, PP2)
    assert str(info.value) == (
        f"{spec} (VisionTransformer) has no list of repeated blocks to split into pipeline stages: "
        f"its config declares no base_model_pp_plan naming an nn.ModuleList, and no "
        f"nn.ModuleList of it holds repeated blocks with parameters (nn.ModuleLists: none); "
        f"give a mesh without pp, or write the pipeline section by hand (docs/pipeline.md)")


def test_fewer_layers_than_stages_is_refused_naming_the_list() -> None:
    with pytest.raises(SuggestError) as info:
        suggest_recipe("hf:llama", {"pp": 4}, model_config=_config("llama"),
                       options=SuggestOptions(verify=False))
    assert str(info.value) == (
        "hf:llama: model.layers holds 2 layers, fewer than the 4 pipeline stages of pp=4 "
        "(1F1B: one stage per rank, each needs at least one layer); give a config with at "
        "least 4 layers (--check-config for the check's) or a smaller pp")


def test_microbatches_default_to_twice_pp_and_are_taken_as_given() -> None:
    model = build_model("hf:gpt2", _config("gpt2"))
    assert propose_pipeline(model, "hf:gpt2", 2).microbatches == 4
    assert propose_pipeline(model, "hf:gpt2", 2, microbatches=6).microbatches == 6
    with pytest.raises(SuggestError, match="required: at least 2 at pp=2"):
        propose_pipeline(model, "hf:gpt2", 2, microbatches=1)


def test_a_module_the_model_calls_before_the_layers_is_read_off_the_runtimes_message() -> None:
    # Phi-4-multimodal registers embed_tokens_extend after model.layers and calls it first
    proposal = propose_pipeline(build_model("hf:gpt2", _config("gpt2")), "hf:gpt2", 2)
    reason = ("check diverged and no suggested rule could be blamed: production mode diverged "
              "at stage 0 (raised in forward and backward): StageBoundaryError: "
              "model.embed_tokens_extend belongs to pipeline stage 1 (pipeline.last) but was "
              "called on stage 0, which stops after its last layer: the model uses it before")
    assert called_before_the_layers(reason, proposal) == "model.embed_tokens_extend"
    moved = attrs.evolve(proposal, first=("model.embed_tokens_extend",))
    assert called_before_the_layers(reason, moved) is None  # asked once, then given up
    assert moved.fields()["first"] == ["model.embed_tokens_extend"]
    assert called_before_the_layers("production mode diverged at stage 0 -> 1", proposal) is None
