"""The tiny config ``suggest`` checks on: derived from a family's defaults by rules about the
config's structure (never a family's name), so that families whose defaults do not shrink by
sizes alone still build, run in one process, and get a verified recipe.

Each family below was refused on the earlier derivation (sizes only): its tiny config failed to
build or to run a forward in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperrecipe.models.hf_tiny import tiny_config
from hyperrecipe.model_tree import build_model
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.sequence import SEQUENCE_GROUP
from hyperrecipe.suggest.translate import LOSS_GROUP


def _params(model_type: str, config: dict[str, Any]) -> int:
    return sum(p.numel() for p in build_model(f"hf:{model_type}", config).parameters())


def _one_step(model_type: str, config: dict[str, Any]) -> None:
    """One forward and backward in one process, with the model's defaults (its cache on)."""
    torch.manual_seed(0)
    model = build_model(f"hf:{model_type}", config, device="cpu")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    assert logits.shape[:2] == (2, 8)
    logits.float().sum().backward()


def test_a_size_the_family_derives_and_leaves_none_is_set_to_what_it_derives_to() -> None:
    # head_dim None: the attention computes head_dim ** -0.5 and failed to build
    ministral = tiny_config("ministral")
    assert ministral["head_dim"] == ministral["hidden_size"] // ministral["num_attention_heads"]
    # num_key_value_heads None: one key/value head per query head
    nemotron = tiny_config("nemotron")
    assert nemotron["num_key_value_heads"] == nemotron["num_attention_heads"] == 4
    # a checkpoint's own head_dim is a size: it shrinks like the rest
    assert tiny_config("ministral", {"head_dim": 128})["head_dim"] == 16
    _one_step("ministral", ministral)
    _one_step("nemotron", nemotron)


def test_expert_counts_a_moe_family_leaves_to_its_checkpoints_are_set() -> None:
    dots1 = tiny_config("dots1")  # n_routed_experts, n_shared_experts and top-k all None
    assert (dots1["n_routed_experts"], dots1["n_shared_experts"],
            dots1["num_experts_per_tok"]) == (4, 1, 2)
    _one_step("dots1", dots1)
    # never more experts per token than the family routes: ZAYA supports top-1 only
    assert tiny_config("zaya")["num_experts_per_tok"] == 1
    # a dense family with an experts field left None stays dense (no experts per token field)
    assert "num_experts" not in tiny_config("gemma4_text")


def test_the_rotated_width_of_a_head_shrinks_with_the_head() -> None:
    # rotary_dim 64 of heads of 256; the tiny heads are 16 wide and 64 did not fit in them
    config = tiny_config("codegen")
    assert config["rotary_dim"] == 4
    _one_step("codegen", config)


def test_the_tiny_stack_keeps_one_layer_of_each_kind_the_per_layer_fields_name() -> None:
    config = tiny_config("llama4_text")
    # 48 layers: chunked attention with rope, full attention without (every 4th), all MoE;
    # moe_layers lists every layer index: it stays a list of indices, not one kind per layer
    assert config["num_hidden_layers"] == 2
    assert config["layer_types"] == ["chunked_attention", "full_attention"]
    assert config["no_rope_layers"] == [1, 0]
    assert config["moe_layers"] == [0, 1]


def test_a_per_layer_list_of_sizes_shrinks_like_the_size_it_gives_per_layer() -> None:
    # Laguna's num_attention_heads_per_layer kept 48 heads per layer beside 4 heads of 16 in
    # the tiny hidden size: the gate projection held 3 heads, not divisible by tp=2
    config = tiny_config("laguna")
    assert config["num_attention_heads_per_layer"] == [4] * config["num_hidden_layers"]


def test_periodic_layer_kinds_get_period_two_so_both_kinds_are_in_the_tiny_stack() -> None:
    config = tiny_config("jamba")  # attention every 8th layer from 4, experts every 2nd from 1
    assert (config["attn_layer_period"], config["attn_layer_offset"]) == (2, 1)
    assert (config["expert_layer_period"], config["expert_layer_offset"]) == (2, 1)
    _one_step("jamba", config)


@pytest.mark.parametrize(("family", "field", "value"), [
    ("bamba", "attn_layer_indices", [1]),  # None in the defaults: no attention layer at all
    ("granitemoehybrid", "layer_types", ["linear_attention", "full_attention"]),
])
def test_a_hybrid_stack_without_attention_in_its_defaults_gets_an_attention_layer(
        family: str, field: str, value: list[Any]) -> None:
    # recurrent layers alone failed in one process: transformers' masks need an attention layer
    config = tiny_config(family)
    assert config[field] == value
    _one_step(family, config)


def test_layer_types_left_to_the_checkpoints_and_rope_keyed_by_layer_type_are_filled() -> None:
    lfm2_moe = tiny_config("lfm2_moe")  # layer_types None; the layers index it
    assert lfm2_moe["layer_types"] == ["full_attention"] * lfm2_moe["num_hidden_layers"]
    compass = tiny_config("cohere_compass_text")  # rope_parameters {} read per layer type
    assert compass["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    _one_step("cohere_compass_text", compass)


def test_nested_configs_shrink_by_their_own_family_rules() -> None:
    # llama4's text and vision configs, phi4-multimodal's vision and audio towers: 107 G and
    # 870 M parameters before, refused as not tiny
    assert _params("llama4", tiny_config("llama4")) < 20_000_000
    config = tiny_config("phi4_multimodal")
    assert config["audio_config"]["hidden_size"] == 64
    assert _params("phi4_multimodal", config) < 20_000_000


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["ministral", "codegen", "jamba", "dots1"])
def test_a_family_the_sizes_alone_could_not_shrink_now_gets_a_verified_recipe(family: str) -> None:
    s = suggest_recipe(f"hf:{family}", {"tp": 2}, model_config=tiny_config(family),
                       options=SuggestOptions(timeout_s=120))
    assert s.verified, s.summary()
    # nothing of transformers' plan given up (what suggest adds beyond it, an expert-parallel plan on a mesh without ep,
    # or a plan entry for a module this config does not build, gives nothing up)
    assert [n.what for n in s.narrowed if "matches no module" not in n.why
            and "so the experts stay whole" not in n.why
            and n.what not in (SEQUENCE_GROUP, LOSS_GROUP)] == []
