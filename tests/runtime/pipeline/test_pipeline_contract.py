"""The stage contract is loud: another stage's module used where its output would matter
raises StageBoundaryError naming the module, the stage and the fix; plans the runtime cannot
run are refused before the model changes, and a build that fails midway leaves it as it was.
Also the ``loss_fn`` route and a model built on meta (real gloo ranks, pp=2)."""

from __future__ import annotations

from typing import Any

import pytest

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RankFailedError
from tests.support.pipeline_harness import RTOL, contract_worker, misuse_worker


@pytest.fixture(scope="module")
def contract() -> list[dict[str, Any]]:
    return run_ranks(contract_worker, 2, timeout_s=180)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_parameter_outside_the_split_and_the_lists_is_refused_on_every_rank(
        contract: list[dict[str, Any]]) -> None:
    for r in contract:
        assert r["loose"] == (
            "parameters ['model.norm.weight'] are outside the pipeline's split list "
            "'model.layers' and in no module of pipeline.first ['model.embed_tokens'] or "
            "pipeline.last ['lm_head']: declare their module in one of them")
        assert r["loose_untouched"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_build_failing_midway_leaves_the_model_as_it_was(
        contract: list[dict[str, Any]]) -> None:
    assert contract[0]["rollback"].startswith(
        "pipeline stage 0 holds parameters the plan does not give it "
        "(['model.embed_tokens.weight'])")
    assert contract[0]["rollback_untouched"]
    assert contract[1]["rollback_elsewhere_restored"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_plan_of_another_model_is_refused_on_every_rank_before_anything_changes(
        contract: list[dict[str, Any]]) -> None:
    for r in contract:
        assert r["other_model"] == (
            "plan 'test-pp' does not fit this model: parameter 'model.layers.2.self_attn."
            "q_proj.weight': the plan has no such parameter, the model [32, 32] float32; "
            "recompile the recipe against this model"), r["other_model"]
        assert r["other_model_untouched"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_model_whose_own_loss_is_not_the_causal_lm_loss_needs_a_loss_fn(
        contract: list[dict[str, Any]]) -> None:
    for r in contract:
        assert r["no_loss"] == (
            "build_pipeline: Toy's own loss is not transformers' ForCausalLMLoss, whose label "
            "tokens the pipeline counts (with the causal shift) to weigh its microbatches; pass "
            "loss_fn= (docs/pipeline.md#running-a-pipeline) for this model")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_loss_fn_for_a_model_without_labels_gives_the_full_batch_mean(
        contract: list[dict[str, Any]]) -> None:
    for r in contract:
        assert r["loss_fn_loss_err"] <= 1e-6
        assert r["loss_fn_grad_err"] <= RTOL


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_model_built_on_meta_gets_storage_for_its_own_stage_only(
        contract: list[dict[str, Any]]) -> None:
    for r in contract:
        assert r["meta_on_cpu"]
        assert r["placeholders_hold_no_storage"]
        assert r["holds_only_its_stage"]
        assert r["meta_loss_err"] <= 1e-5
        assert r["meta_grad_err"] <= RTOL


def _failure(misuse: str) -> str:
    with pytest.raises(RankFailedError) as info:
        run_ranks(misuse_worker, 2, misuse, timeout_s=60)
    return str(info.value)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_last_module_called_before_the_layers_names_module_and_stage() -> None:
    msg = _failure("head_early")
    assert ("StageBoundaryError: head belongs to pipeline stage 1 (pipeline.last) but was "
            "called on stage 0, which stops after its last layer: the model uses it before or "
            "inside this stage's layers, so it cannot live on a later stage; declare it in the "
            "recipe's pipeline.first (stage 0 owns those), or move the split") in msg


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_first_module_called_inside_the_stage_names_module_and_stage() -> None:
    msg = _failure("embed_late")
    assert ("StageBoundaryError: embed belongs to pipeline stage 0 (pipeline.first) but was "
            "called on stage 1 after that stage's first layer started: the model uses it on the "
            "wrong side of the split, where its output would matter; declare it in the recipe's "
            "pipeline.last (the last stage owns those), or move the split") in msg


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_placeholder_output_reaching_the_first_layer_besides_hidden_states_is_refused() -> None:
    msg = _failure("bias")
    assert ("StageBoundaryError: layers.2, the first layer of pipeline stage 1, got an argument "
            "computed from another stage's module") in msg
    assert "pipeline.first" in msg


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_later_stages_layer_called_early_names_module_and_stage() -> None:
    msg = _failure("layer_early")
    assert ("StageBoundaryError: layers.3 belongs to pipeline stage 1 but was called on stage 0, "
            "which stops after its last layer") in msg


def test_a_placeholder_hands_out_the_plain_attributes_of_the_module_it_stands_in_for() -> None:
    # the model's forward reads them off every layer, owned or not (Inkling-2's
    # decoder_layer.attention_type is a class attribute, Nemotron-H's block_type an instance one)
    import torch
    from torch import nn

    from hyperrecipe.runtime.pipeline.placeholder import StagePlaceholder, StageRun

    class Layer(nn.Module):
        attention_type = "sliding_attention"

        def __init__(self) -> None:
            super().__init__()
            self.block_type = "mamba"
            self.sizes = (2, 3)
            self.proj = nn.Linear(2, 2)

    with torch.device("meta"):
        meta = Layer()
    ph = StagePlaceholder("model.layers.1", meta, "after", "stage 1", StageRun(0),
                          like_input=True)
    assert (ph.attention_type, ph.block_type, ph.sizes) == ("sliding_attention", "mamba", (2, 3))
    for name in ("proj", "extra_repr_of_nothing"):  # a module (no weight here), a missing name
        with pytest.raises(AttributeError):
            getattr(ph, name)
    assert ph.fqn == "model.layers.1" and not list(ph.parameters())
