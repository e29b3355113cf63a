"""Verification at compile on two families whose tensor parallelism leaves state-space or
low-rank parameters between sharded compute: a recipe that forgets their gradient declaration
is refused by name, and the same recipe with it compiles verified.

- **Multi-head latent attention** (transformers' ``deepseek_v3`` and ``deepseek_v2``): the
  up-projections ``q_b_proj``/``kv_b_proj`` column-wise, ``o_proj`` row-wise, the low-rank
  down-projections ``q_a_proj``/``kv_a_proj_with_mqa`` and their norms replicated inside the
  attention boundary. What they compute feeds this rank's heads only, so their gradients come
  back partial over tp: without ``reduce_grads`` validate mode refuses each of them.
- **Mamba mixers** (transformers' ``mamba``; Jamba's mixer, ``tests/recipes/cookbook``): the
  mixer over its intermediate channels as Megatron's Mamba. ``x_proj``'s whole output feeds
  per-channel code that is no module, so its gradient arrives partial: without ``out_grad``
  validate mode refuses it; Jamba's norms on ``dt``, ``B``, ``C`` without ``reduce_grads``
  likewise. The step reaches the mixer's backward because the scan's initial state (plain
  zeros) is known to be zeros on the meta device (:mod:`hyperrecipe.verify.known_zeros`);
  before, validate mode stopped there and a forgotten declaration compiled.

Models are built on the meta device from small configs written to ``tmp_path`` (the model's
own defaults otherwise); recipes are written there too.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe import compile_recipe
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model
from hyperrecipe.plan import Plan
from tests.support.runtime_harness import ROOT

STOPPED = "stopped at an op that needs values"
"""The record's note when a mode could not run the whole step on fake tensors."""

MLA_CONFIG: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "vocab_size": 128, "max_position_embeddings": 128,
    # every layer dense: the recipe shards attention only
    "first_k_dense_replace": 2,
}

MLA_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")
"""The low-rank down-projections and their norms, whole on every rank inside the boundary."""

MLA_SHARDED = """
    recipe: mla
    version: 1
    mesh: [tp]
    rules:
      - match: model.layers.*.self_attn
        boundary: true
        in_src: {hidden_states: replicate}
        out_names: [attn_output, attn_weights]
        out_src: {attn_output: replicate, attn_weights: {tp: shard(1)}}
      # heads: the up-projections column-wise, o_proj row-wise
      - match: model.layers.*.self_attn.{q_b_proj,kv_b_proj}
        style: colwise
        boundary: false
      - match: model.layers.*.self_attn.o_proj
        style: rowwise
"""


def _mla_recipe(reduced: tuple[str, ...]) -> str:
    body = textwrap.dedent(MLA_SHARDED).lstrip()
    if reduced:
        body += ("  # the latents feed this rank's heads only: their gradients are partial\n"
                 f"  - match: model.layers.*.self_attn.{{{','.join(reduced)}}}\n"
                 "    reduce_grads: {weight: tp}\n")
    return body


MAMBA_CONFIG: dict[str, Any] = {"hidden_size": 64, "state_size": 8, "num_hidden_layers": 2,
                                "vocab_size": 128}

MAMBA_SHARDED = """
    recipe: mamba
    version: 1
    mesh: [tp]
    rules:
      # the mixer over its intermediate channels, as Megatron's Mamba (docs/cookbook.md)
      - match: backbone.layers.*.mixer
        boundary: true
        in_src: {hidden_states: replicate}
        out_src: {0: replicate}
        params: {A_log: {tp: shard(0)}, D: {tp: shard(0)}}
      # x and the gate are the two halves of in_proj's output
      - match: backbone.layers.*.mixer.in_proj
        style: colwise
        boundary: false
        params: {weight: {tp: "shard(0, chunks=2)"}}
      - match: backbone.layers.*.mixer.{conv1d,dt_proj}
        params: {weight: {tp: shard(0)}, bias: {tp: shard(0)}}
      # dt, B and C leave whole and feed per-channel code: their gradient comes back partial
      - match: backbone.layers.*.mixer.x_proj
        style: rowwise
        out_grad: {0: {tp: partial}}
      - match: backbone.layers.*.mixer.out_proj
        style: rowwise
    adapters:
      # validate mode: the cache's conv state and the depthwise convolution on this rank's
      # channels, as production runs them (docs/cookbook.md#mamba-mixers-jamba)
      - {target: "transformers.cache_utils:LinearAttentionLayer.update_conv_state", mode: marshal}
      - target: "transformers.models.mamba.modeling_mamba:causal_conv1d_fn"
        within: backbone.layers.*.mixer
        mode: marshal
"""

OUT_GRAD = "    out_grad: {0: {tp: partial}}\n"
"""x_proj's declaration, as the dedented recipe spells it."""

JAMBA = ROOT / "tests/recipes/cookbook/jamba-mamba.yaml"
JAMBA_NORMS = ("  - match: model.layers.*.mamba.{dt_layernorm,b_layernorm,c_layernorm}\n"
               "    reduce_grads: {weight: tp}\n")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _model(tmp_path: Path, model_type: str, config: dict[str, Any]) -> Any:
    return build_model(f"hf:{model_type}",
                       str(_write(tmp_path, f"{model_type}.json", json.dumps(config))))


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1)
                if line.strip() == text)


def _verified_whole(plan: Plan) -> None:
    """Both modes ran the whole step: no mode stopped at an op that needs values."""
    record = plan.verification
    assert record is not None
    assert record.modes == ("production", "validate")
    assert not [n for n in record.notes if STOPPED in n], record.notes


MLA_TYPES = [
    "deepseek_v3",
    # slow: the same attention (~1 s); the quick tier, held under 5 minutes, keeps V3
    pytest.param("deepseek_v2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_mla_with_its_replicated_latents_reduced_compiles_verified(
        tmp_path: Path, model_type: str) -> None:
    recipe = _write(tmp_path, "mla.yaml", _mla_recipe(MLA_REPLICATED))
    plan = compile_recipe(recipe, _model(tmp_path, model_type, MLA_CONFIG), {"tp": 2})
    _verified_whole(plan)


@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_mla_without_reduce_grads_is_refused_at_the_attention_boundary(
        tmp_path: Path, model_type: str) -> None:
    recipe = _write(tmp_path, "mla.yaml", _mla_recipe(()))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, _model(tmp_path, model_type, MLA_CONFIG), {"tp": 2})
    err = caught.value
    text = str(err)
    # the first partial gradient backward meets: the last layer's kv latent norm
    assert ("verification (validate mode, one training step on fake tensors) refused the plan: "
            "model.layers.1.self_attn.kv_a_layernorm.weight: its gradient comes back partial "
            "over tp") in text
    assert ("Declare the reduction: `reduce_grads: {weight: tp}` on "
            "model.layers.1.self_attn.kv_a_layernorm's rule") in text
    # placed by no rule: the location is the boundary it computes in
    assert err.span is not None and err.span.path == str(recipe)
    assert err.span.line == _line_of(recipe, "- match: model.layers.*.self_attn")
    assert err.path == "$.rules[0]"


# slow: four compiles (~1 s each); the quick tier keeps the recipe that forgets them all
@pytest.mark.slow
@pytest.mark.parametrize("forgotten", MLA_REPLICATED)
def test_mla_names_each_replicated_latent_whose_reduction_is_forgotten(
        tmp_path: Path, forgotten: str) -> None:
    reduced = tuple(m for m in MLA_REPLICATED if m != forgotten)
    recipe = _write(tmp_path, "mla.yaml", _mla_recipe(reduced))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, _model(tmp_path, "deepseek_v3", MLA_CONFIG), {"tp": 2})
    text = str(caught.value)
    assert (f"model.layers.1.self_attn.{forgotten}.weight: its gradient comes back partial "
            f"over tp") in text
    assert (f"`reduce_grads: {{weight: tp}}` on model.layers.1.self_attn.{forgotten}'s rule"
            ) in text


def test_a_mamba_mixer_over_its_channels_compiles_verified_through_its_scan(
        tmp_path: Path) -> None:
    recipe = _write(tmp_path, "mamba.yaml", textwrap.dedent(MAMBA_SHARDED).lstrip())
    plan = compile_recipe(recipe, _model(tmp_path, "mamba", MAMBA_CONFIG), {"tp": 2})
    _verified_whole(plan)  # validate mode used to stop at the scan's initial state


def test_a_mamba_mixer_without_x_projs_out_grad_is_refused_at_its_rule(tmp_path: Path) -> None:
    body = textwrap.dedent(MAMBA_SHARDED).lstrip()
    assert body.count(OUT_GRAD) == 1
    recipe = _write(tmp_path, "mamba.yaml", body.replace(OUT_GRAD, ""))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, _model(tmp_path, "mamba", MAMBA_CONFIG), {"tp": 2})
    err = caught.value
    text = str(err)
    assert ("verification (validate mode, one training step on fake tensors) refused the plan: "
            "backbone.layers.1.mixer.x_proj: the gradient of output 'output' arrives partial on "
            "tp (each rank holds a share of a sum), but the plan takes it whole") in text
    assert "Declare out_grad: {0: {tp: partial}} so that production reduces it" in text
    assert err.span is not None and err.span.path == str(recipe)
    assert err.span.line == _line_of(recipe, "- match: backbone.layers.*.mixer.x_proj")


# slow: two compiles of Jamba (attention, experts, mixers), ~2 s warm; the cookbook's Jamba
# case is in the slow tier too
@pytest.mark.slow
def test_jambas_mamba_norms_without_reduce_grads_are_refused_and_with_them_compile(
        tmp_path: Path) -> None:
    config = str(ROOT / "tests/recipes/cookbook/models/tiny-jamba.json")
    _verified_whole(compile_recipe(JAMBA, build_model("hf:jamba", config), {"tp": 2}))
    text = JAMBA.read_text()
    assert text.count(JAMBA_NORMS) == 1
    recipe = _write(tmp_path, "jamba.yaml", text.replace(JAMBA_NORMS, ""))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model("hf:jamba", config), {"tp": 2})
    err = caught.value
    assert ("model.layers.0.mamba.c_layernorm.weight: its gradient comes back partial over tp"
            ) in str(err)
    assert "`reduce_grads: {weight: tp}` on model.layers.0.mamba.c_layernorm's rule" in str(err)
    assert err.span is not None and err.span.path == str(recipe)
    assert err.span.line == _line_of(recipe, "- match: model.layers.*.mamba")
