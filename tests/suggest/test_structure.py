"""Plan entries read off the model's structure for families that declare no parallel plan
(GPT-Neo, BLOOM, MPT, StableLM, ...): proposed in transformers' plan vocabulary, then translated
and verified by check like a declared plan. Before this source, every such family was refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.models.hf_plans import read_plans
from hyperrecipe.models.hf_tiny import tiny_config
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.structure import (STRUCTURE_SOURCE, structural_entries,
                                           transposed_classes)
from hyperrecipe.suggest.translate import translate

TP2 = {"tp": 2}


def _styles(model_type: str) -> dict[str, tuple[str, int]]:
    model = build_model(f"hf:{model_type}", tiny_config(model_type))
    assert read_plans(model) == ()  # the family declares no plan
    return {e.pattern: (e.style, e.chunks) for e in structural_entries(model)}


def test_projections_from_the_hidden_size_are_colwise_and_the_last_one_back_is_rowwise() -> None:
    assert _styles("stablelm") == {
        **{f"model.layers.*.self_attn.{p}_proj": ("colwise", 0) for p in "qkv"},
        "model.layers.*.self_attn.o_proj": ("rowwise", 0),
        "model.layers.*.mlp.gate_proj": ("colwise", 0),
        "model.layers.*.mlp.up_proj": ("colwise", 0),
        "model.layers.*.mlp.down_proj": ("rowwise", 0),
        "lm_head": ("colwise_gather_output", 0)}


def test_a_fused_projection_is_packed_only_where_the_forward_splits_it() -> None:
    # MPT's Wqkv is chunked into q, k, v: three packed parts, each sharded
    assert _styles("mpt")["transformer.blocks.*.attn.Wqkv"] == ("packed_colwise", 3)
    # BLOOM's query_key_value is viewed per head (heads, 3, head_dim): plain column-wise keeps
    # each head's q, k and v on one rank
    assert _styles("bloom")["transformer.h.*.self_attention.query_key_value"] == ("colwise", 0)


def test_blocks_that_do_not_fit_are_left_out() -> None:
    # GPT-BigCode's fused q/k/v packs one key/value head beside the queries (parts of unequal
    # widths); OPT's fc1/fc2 sit in the decoder layer beside the attention (a nested block with
    # weights)
    assert "transformer.h.*.attn.c_attn" not in _styles("gpt_bigcode")
    assert not any(".fc1" in p or ".fc2" in p for p in _styles("opt"))
    # BERT's self-attention holds query, key and value, all square: value is called on the
    # block's own input, so it is not the projection back out (its output dense is elsewhere)
    assert not any(".attention.self." in p for p in _styles("bert"))


def test_the_packed_parts_become_chunks_of_the_shard() -> None:
    model = build_model("hf:mpt", tiny_config("mpt"))
    t = translate(structural_entries(model), snapshot(model), TP2)
    rule = next(r for r in t.rules if r.match == "transformer.blocks.*.attn.Wqkv")
    assert dict(rule.fields)["params"] == {"weight": {"tp": "shard(0, chunks=3)"}}
    assert any(STRUCTURE_SOURCE in s for s in rule.sources)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["stablelm", "persimmon"])
def test_a_family_without_a_plan_gets_a_verified_recipe_from_its_structure(family: str) -> None:
    s = suggest_recipe(f"hf:{family}", TP2, model_config=tiny_config(family),
                       options=SuggestOptions(timeout_s=120))
    assert s.verified, s.summary()
    assert s.narrowed == ()
    assert "from the model's structure (it declares no parallel plan)" in s.text
    assert f"# {STRUCTURE_SOURCE}: " in s.text
    assert s.sharded_fraction["tp"] > 0.9


def test_the_width_of_the_heads_goes_with_them_where_the_plan_is_read_off_the_structure() -> None:
    # XGLM reshapes its attention output to self.embed_dim: each rank holds half the heads, so
    # half the width; a plan family's attention keeps its global embed_dim (CodeGen cuts its
    # fused projection into groups by it)
    model = build_model("hf:xglm", tiny_config("xglm"))
    t = translate(structural_entries(model), snapshot(model), TP2)
    attn = next(dict(r.fields) for r in t.rules if r.match == "model.layers.*.self_attn"
                and "boundary" in dict(r.fields))
    assert attn["head_counts"] == {"num_heads": "tp", "embed_dim": "tp"}
    codegen = build_model("hf:codegen", tiny_config("codegen"))
    t = translate(read_plans(codegen), snapshot(codegen), TP2)
    assert all("embed_dim" not in dict(r.fields).get("head_counts", {}) for r in t.rules)


# --------------------------------------------------------------- weights stored [in, out]
# transformers' Conv1D (GPT-2, GPT-SW3, OpenAI-GPT) stores its weight [in, out], the transpose of
# nn.Linear's: column-wise is shard(1) of the weight, row-wise shard(0), and its forward shapes
# the output with its global `nf` (recipes/gpt2.yaml writes the same by hand). Before this, every
# Conv1D family was refused.


def _entries(model_type: str) -> dict[str, tuple[str, int, bool, tuple[str, ...], tuple[str, ...]]]:
    model = build_model(f"hf:{model_type}", tiny_config(model_type))
    assert read_plans(model) == ()
    return {e.pattern: (e.style, e.chunks, e.transposed, e.sizes, e.split_sizes)
            for e in structural_entries(model)}


@pytest.mark.parametrize("family", ["gpt2", "openai-gpt"])
def test_projections_that_store_their_weight_in_out_are_read_as_projections(family: str) -> None:
    assert _entries(family) == {
        # q, k and v fused, split by the attention's global `split_size`
        "transformer.h.*.attn.c_attn": ("packed_colwise", 3, True, ("nf",), ("split_size",)),
        "transformer.h.*.attn.c_proj": ("rowwise", 0, True, (), ()),
        "transformer.h.*.mlp.c_fc": ("colwise", 0, True, ("nf",), ()),
        "transformer.h.*.mlp.c_proj": ("rowwise", 0, True, (), ()),
        "lm_head": ("colwise_gather_output", 0, False, (), ())}


class _InOut(nn.Module):
    """A projection that stores its weight [in, out], named like nothing transformers ships."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class _OutIn(_InOut):
    """The same parameters, used as nn.Linear uses them ([out, in])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def test_the_weight_layout_is_told_by_what_the_forward_does_not_by_the_class_name() -> None:
    # a square instance cannot tell; the class is judged by its non-square one
    model = nn.Sequential(_InOut(4, 4), _InOut(4, 12), _OutIn(12, 4), nn.Linear(4, 8))
    assert transposed_classes(model) == frozenset({_InOut})
    with torch.device("meta"):
        only_square = nn.Sequential(_InOut(4, 4))
    assert transposed_classes(only_square) == frozenset()


def test_a_projection_stored_in_out_is_sharded_on_its_output_dim_as_the_hand_written_recipe_does(
        ) -> None:
    model = build_model("hf:gpt2", tiny_config("gpt2"))
    t = translate(structural_entries(model), snapshot(model), TP2)
    rules = {r.match: dict(r.fields) for r in t.rules if "boundary" in dict(r.fields)
             or "params" in dict(r.fields)}
    # as recipes/gpt2.yaml: each of q, k and v sharded by head on the output dim (1)
    assert rules["transformer.h.*.attn.c_attn"] == {
        "params": {"weight": {"tp": "shard(1, chunks=3)"}, "bias": {"tp": "shard(0, chunks=3)"}},
        "head_counts": {"nf": "tp"}}
    assert rules["transformer.h.*.mlp.c_fc"] == {
        "params": {"weight": {"tp": "shard(1)"}, "bias": {"tp": "shard(0)"}},
        "head_counts": {"nf": "tp"}}
    for proj in ("attn", "mlp"):  # the style's nn.Linear input dim (1) is dim 0 here
        assert rules[f"transformer.h.*.{proj}.c_proj"] == {
            "style": "rowwise", "params": {"weight": {"tp": "shard(0)"}}}
    assert rules["transformer.h.*.attn"]["head_counts"] == {
        "num_heads": "tp", "embed_dim": "tp", "split_size": "tp"}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["gpt2", "gpt-sw3", "openai-gpt"])
def test_a_conv1d_family_gets_a_verified_recipe_and_the_written_file_passes_check(
        family: str, tmp_path: Path) -> None:
    config = tiny_config(family)
    s = suggest_recipe(f"hf:{family}", TP2, model_config=config,
                       options=SuggestOptions(timeout_s=120))
    assert s.verified, s.summary()
    # every projection, the embedding and the head are sharded: only norms and positions stay
    assert s.sharded_fraction["tp"] > 0.9
    assert "(weight stored [in, out]: its output dim is 1)" in s.text
    path = tmp_path / f"{family}.yaml"
    path.write_text(s.text)
    report = run_check(CheckOptions(recipe=str(path), model=f"hf:{family}", model_config=config,
                                    mesh=TP2))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    assert report.agree, [(m.mode, m.error) for m in report.modes]
