"""Sequence parallelism in `hyperrecipe suggest` beyond the Llama shape: MoE blocks whose
parameters stay replicated run on this rank's tokens (their gradients all-reduced over tp),
layers of two kinds under one list (dense first layers beside MoE ones) are taken layer by
layer, and a block that cannot take part is named with why.

The translation tests build the model on the meta device only; the end-to-end ones run the real
check (two gloo ranks, production and validate mode, compared with one process, the model's
defaults) and check the written file again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.models.hf_plans import read_plans
from hyperrecipe.models.hf_tiny import tiny_config
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.suggest.sequence import GATHERED_GROUP, SEQUENCE_GROUP
from hyperrecipe.suggest.translate import Translation, translate
from tests.support.runtime_harness import ROOT
from tests.support.suggest_harness import TP2, suggest_and_recheck

SEQ = {"tp": "shard(1)"}
TOKENS = {"tp": "shard(-2)"}


def _translate(family: str, config: str | dict[str, Any]) -> Translation:
    model = build_model(f"hf:{family}", config)
    return translate(read_plans(model), snapshot(model), TP2)


def _sequence_rules(t: Translation) -> dict[str, dict[str, Any]]:
    """Sequence parallelism's rules, the layouts of regions nested in token-local blocks too."""
    return {r.match: dict(r.fields) for r in t.rules if r.group.startswith(SEQUENCE_GROUP)}




def test_a_moe_block_with_replicated_experts_runs_on_this_ranks_tokens() -> None:
    # Mixtral's block (router and experts, both whole on every rank without an ep dim) held
    # parameters outside every region: no sequence parallelism was proposed
    t = _translate("mixtral", str(ROOT / "recipes/models/tiny-mixtral.json"))
    rules = _sequence_rules(t)
    assert rules["model.layers.*.mlp"] == {
        "boundary": True, "local_region": True, "in_src": {"hidden_states": SEQ},
        "in_dst": {"hidden_states": SEQ}, "out_src": {0: SEQ}}
    assert rules["model.layers.*.self_attn"]["in_dst"] == {"hidden_states": "replicate"}
    assert SEQUENCE_GROUP not in {n.what for n in t.narrowed}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_mixtral_with_its_experts_on_this_ranks_tokens_passes_check(tmp_path: Path) -> None:
    s = suggest_and_recheck("mixtral", str(ROOT / "recipes/models/tiny-mixtral.json"),
                             tmp_path)
    assert "    local_region: true\n    in_src: {hidden_states: {tp: shard(1)}}" in s.text
    assert s.narrowed == () or all("so the experts stay whole" in n.why for n in s.narrowed)


def test_dense_first_layers_beside_moe_layers_are_taken_layer_by_layer() -> None:
    # GLM-4-MoE: layer 0's MLP is a dense region, layer 1's a MoE block whose shared experts are
    # a region of their own: "the regions are not all under one list of decoder layers"
    t = _translate("glm4_moe", tiny_config("glm4_moe"))
    rules = _sequence_rules(t)
    assert rules["model.layers.0.mlp"] == {"in_src": {"x": SEQ}, "in_dst": {"x": "replicate"},
                                           "out_src": {0: SEQ}}
    assert rules["model.layers.1.mlp"]["local_region"] is True
    # the shared experts gather the MoE block's tokens ([tokens, hidden] or [batch, seq, hidden])
    shared = rules["model.layers.*.mlp.shared_experts"]
    assert shared["in_src"] == {"x": TOKENS} and shared["out_src"] == {0: TOKENS}
    assert rules["model.layers.*.mlp.shared_experts.down_proj"] == {"out_dst": {0: TOKENS}}
    assert rules["model.layers.*.mlp.down_proj"] == {"out_dst": {0: SEQ}}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_glm4_moe_with_dense_and_moe_layers_passes_check_with_sequence_parallelism(
        tmp_path: Path) -> None:
    suggest_and_recheck("glm4_moe", tiny_config("glm4_moe"), tmp_path)


def test_a_block_computed_replicated_around_a_gathered_projection_is_gathered_whole() -> None:
    # GLM: transformers' plan gathers the fused gate_up_proj's output and splits down_proj's
    # input, so the MLP computes replicated between two collectives; it is no region. It was
    # refused ("needs a sequence gather whose backward is a slice"); now it gathers the
    # sequence, computes whole on every rank and slices on exit, its input gradient declared
    # whole (gate_up_proj all-reduces it, down_proj all-gathers it)
    t = _translate("glm", tiny_config("glm"))
    assert SEQUENCE_GROUP not in {n.what for n in t.narrowed}
    gathered = {r.match: dict(r.fields) for r in t.rules if r.group == GATHERED_GROUP}
    assert gathered == {"model.layers.*.mlp": {
        "boundary": True, "in_src": {"hidden_states": SEQ},
        "in_dst": {"hidden_states": "replicate"}, "out_src": {0: "replicate"},
        "out_dst": {0: SEQ}, "in_grad": {"hidden_states": "replicate"}}}
    source = next(r.sources[0] for r in t.rules if r.group == GATHERED_GROUP)
    assert "computes replicated around projections the plan places" in source
    # the projections keep the plan's own placement; the attention region gathers the sequence
    rules = _sequence_rules(t)
    assert "model.layers.*.mlp.down_proj" not in rules
    assert rules["model.layers.*.self_attn"]["in_src"] == {"hidden_states": SEQ}


def test_a_mamba_mixer_mixes_tokens_so_it_is_gathered_not_token_local() -> None:
    # Bamba's Mamba mixer (a causal convolution and a scan over the sequence) has every
    # parameter replicated: it was proposed token-local, which check rejected. Its parameters
    # see the whole sequence on every rank, so nothing is declared: no gradient reduction
    t = _translate("bamba", tiny_config("bamba"))
    rules = _sequence_rules(t)
    assert rules["model.layers.*.mamba"] == {
        "boundary": True, "in_src": {"hidden_states": SEQ},
        "in_dst": {"hidden_states": "replicate"}, "out_src": {0: "replicate"},
        "out_dst": {0: SEQ}}
    assert next(r.group for r in t.rules if r.match == "model.layers.*.mamba"
                and r.deeper) == GATHERED_GROUP
    assert not any(f.get("local_region") for f in rules.values())


def test_giving_up_a_gathered_block_gives_up_sequence_parallelism_as_a_whole() -> None:
    # without its gather the block would run on this rank's tokens: the fallback is the
    # recipe without sequence parallelism, the plan's own rules kept
    from hyperrecipe.suggest.verify import _give_up

    t = _translate("glm", tiny_config("glm"))
    culprit = next(r for r in t.rules if r.group == GATHERED_GROUP)
    kept, what = _give_up(t.rules, culprit, True, "validate mode diverged at model.layers.0.mlp")
    # said once: the gathered blocks are a part of sequence parallelism ("sequence parallelism
    # and sequence parallelism: blocks computed replicated ..." before)
    assert what == SEQUENCE_GROUP
    assert not any(r.group.startswith(SEQUENCE_GROUP) for r in kept)
    assert {r.match for r in kept if not r.deeper} == {r.match for r in t.rules if not r.deeper}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_glm_with_its_mlp_gathered_passes_check_with_sequence_parallelism(
        tmp_path: Path) -> None:
    s = suggest_and_recheck("glm", tiny_config("glm"), tmp_path)
    assert GATHERED_GROUP in {r.group for r in s.rules}
    assert "in_grad: {hidden_states: replicate}" in s.text
    assert s.narrowed == ()


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["bamba", "phi3"])
def test_gathered_blocks_pass_check_with_sequence_parallelism(family: str,
                                                               tmp_path: Path) -> None:
    # bamba: its Mamba mixers mix tokens; phi3: its plan gathers every projection
    s = suggest_and_recheck(family, tiny_config(family), tmp_path)
    assert GATHERED_GROUP in {r.group for r in s.rules}
    assert s.narrowed == ()


def test_blocks_a_plan_leaves_out_are_read_off_the_structure() -> None:
    # HunYuan's plan shards only the embedding and the head: no region, so no sequence
    # parallelism and no tensor parallelism in its attention and MLP
    from hyperrecipe.suggest.structure import blocks_the_plan_leaves_out, structural_entries

    model = build_model("hf:hunyuan_v1_dense", tiny_config("hunyuan_v1_dense"))
    plan = read_plans(model)
    extra = blocks_the_plan_leaves_out(plan, structural_entries(model))
    assert {(e.pattern, e.style) for e in extra} >= {
        ("model.layers.*.self_attn.q_proj", "colwise"), ("model.layers.*.self_attn.o_proj", "rowwise"),
        ("model.layers.*.mlp.gate_proj", "colwise"), ("model.layers.*.mlp.down_proj", "rowwise")}
    assert not any(e.head for e in extra)  # the plan has its own head
    t = translate((*plan, *extra), snapshot(model), TP2)
    assert "model.layers.*.self_attn" in {r.match for r in t.rules if r.sources[0].startswith(
        "region: ")}
    assert _sequence_rules(t)["model.layers.*.mlp"]["in_dst"] == {"x": "replicate"}


def test_a_block_the_plan_names_is_left_as_the_plan_says() -> None:
    # Qwen2-MoE's plan names nothing of the shared expert, which is nested in the MoE block and
    # called on flattened tokens: it is not read off the structure; Llama's plan names every block
    from hyperrecipe.suggest.structure import blocks_the_plan_leaves_out, structural_entries

    for family, config in (("qwen2_moe", tiny_config("qwen2_moe")),
                           ("llama", str(ROOT / "recipes/models/tiny-llama.json"))):
        model = build_model(f"hf:{family}", config)
        assert blocks_the_plan_leaves_out(read_plans(model), structural_entries(model)) == ()


def test_norms_without_parameters_need_no_rule() -> None:
    # OLMo's LayerNorms hold no parameters: "no norms between the blocks" refused it
    t = _translate("olmo", tiny_config("olmo"))
    rules = _sequence_rules(t)
    assert rules["model.layers.0"]["in_dst"] == {"hidden_states": SEQ}
    assert not any(f.get("style") == "sequence_parallel" for f in rules.values())
    assert SEQUENCE_GROUP not in {n.what for n in t.narrowed}


def test_a_nested_region_the_block_cannot_gather_for_is_given_up_and_the_block_kept() -> None:
    # ERNIE-4.5-MoE calls its shared experts on flattened [tokens, hidden]: with a batch of two,
    # no layout says which rank holds which token, and check names the input it passed them.
    # The shared experts are left replicated; the MoE block still runs on this rank's tokens.
    from hyperrecipe.suggest.sequence import nested_group
    from hyperrecipe.suggest.verify import _give_up, _owner

    t = _translate("ernie4_5_moe", tiny_config("ernie4_5_moe"))
    shared = "model.layers.*.mlp.shared_experts"
    assert {r.group for r in t.rules if r.match.startswith(shared) and r.deeper} == {
        nested_group(shared)}
    why = ("production mode diverged at model.layers.1.mlp (output): entered with agreeing "
           "inputs, but the input x it passed to model.layers.1.mlp.shared_experts differs")
    culprit, exact = _owner("model.layers.1.mlp", t.rules)
    assert culprit is not None and culprit.group == SEQUENCE_GROUP
    kept, what = _give_up(t.rules, culprit, exact, why)
    assert what == (f"{shared} (so that the token-local block around it runs on this rank's "
                    f"tokens)")
    assert not any(r.match.startswith(shared) for r in kept)
    assert dict(next(r for r in kept if r.match == "model.layers.1.mlp").fields)["local_region"]
    # failing anywhere else, sequence parallelism goes as a whole, nested layouts included
    kept, what = _give_up(t.rules, culprit, exact, "validate mode diverged at lm_head")
    assert what == SEQUENCE_GROUP
    assert not any(r.group.startswith(SEQUENCE_GROUP) for r in kept)
    assert any(r.match == shared for r in kept)  # the region itself stays, replicated in and out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_ernie_moe_runs_its_block_on_this_ranks_tokens_with_its_shared_experts_replicated(
        tmp_path: Path) -> None:
    # ERNIE-4.5-MoE's router bias needs no gradient: validate mode hooked it for its placement
    # and failed ("cannot register a hook on a tensor that doesn't require gradient"), naming
    # no module, and sequence parallelism was given up. Its shared experts, called on the
    # flattened tokens, are still left replicated (see the test above).
    s = suggest_and_recheck("ernie4_5_moe", tiny_config("ernie4_5_moe"), tmp_path)
    assert [n.what for n in s.narrowed if "so the experts stay whole" not in n.why] == [
        "model.layers.*.mlp.shared_experts (so that the token-local block around it runs on "
        "this rank's tokens)"]


def test_a_plan_that_gathers_every_projection_gets_sequence_parallelism_on_gathered_blocks(
        ) -> None:
    # Phi-3's plan gathers its fused qkv_proj's and gate_up_proj's outputs and splits o_proj's
    # and down_proj's inputs locally, OLMoE's its q/k/v (under a norm over all heads): no
    # region at all, so "no region to build it around". Each block holding the plan's
    # projections now gathers the sequence, computes whole and slices on exit; OLMoE's MoE
    # block (experts replicated at tp alone) runs on this rank's tokens
    gathered_block = {"boundary": True, "in_src": {"hidden_states": SEQ},
                      "in_dst": {"hidden_states": "replicate"}, "out_src": {0: "replicate"},
                      "out_dst": {0: SEQ}, "in_grad": {"hidden_states": "replicate"}}
    for family, blocks in (("phi3", {"model.layers.*.self_attn", "model.layers.*.mlp"}),
                           ("olmoe", {"model.layers.*.self_attn"})):
        t = _translate(family, tiny_config(family))
        assert SEQUENCE_GROUP not in {n.what for n in t.narrowed}, family
        gathered = {r.match: dict(r.fields) for r in t.rules if r.group == GATHERED_GROUP}
        assert gathered == dict.fromkeys(blocks, gathered_block), family
        rules = _sequence_rules(t)
        assert rules["model.layers.0"]["in_dst"] == {"hidden_states": SEQ}
        assert rules["lm_head"]["in_src"] == {0: SEQ}
    assert _sequence_rules(_translate("olmoe", tiny_config("olmoe")))["model.layers.*.mlp"][
        "local_region"] is True


def test_a_model_with_no_projection_in_its_layers_is_still_refused_sequence_parallelism() -> None:
    # the fallback reads the layer list off the plan's projections; a plan placing none there
    # (HunYuan's shards only the embedding and the head; the blocks it leaves out are read off
    # the structure by suggest, not by the translation) is told why, not given gathered blocks
    # of nothing
    t = _translate("hunyuan_v1_dense", tiny_config("hunyuan_v1_dense"))
    why = next(n.why for n in t.narrowed if n.what == SEQUENCE_GROUP)
    assert why == ("not proposed: no region to build it around, nor a projection the plan "
                   "places in a layer")


def test_blocks_held_in_a_module_list_are_the_layer_s_blocks() -> None:
    # LongCat-Flash's layer holds two attentions, two MLPs and their norms in ModuleLists
    # (self_attn[0], self_attn[1]); a boundary on the list itself named nn.Module's placeholder
    # argument `input` and did not compile, so sequence parallelism was given up. The blocks
    # are what the lists hold
    t = _translate("longcat_flash", tiny_config("longcat_flash"))
    assert SEQUENCE_GROUP not in {n.what for n in t.narrowed}
    rules = _sequence_rules(t)
    assert rules["model.layers.*.self_attn.*"]["in_src"] == {"hidden_states": SEQ}
    assert rules["model.layers.*.mlps.*"]["in_src"] == {"x": SEQ}
    assert rules["model.layers.*.self_attn.*.o_proj"]["out_dst"] == {0: SEQ}
    assert rules["{model.layers.*.input_layernorm.*,model.layers.*.post_attention_layernorm.*,"
                 "model.norm}"] == {"style": "sequence_parallel"}
    assert not any(m.endswith((".self_attn", ".mlps")) for m in rules)
