"""`suggest` on MLPs whose Linears sit in a plain ``nn.Sequential`` inside the block, in layers
that are ``nn.ModuleList``s of parts (tests/support/byo_nested.py: x-transformers',
vit-pytorch's and minGPT's layouts, and Meta's reference Llama). Before, neither model had a block suggest could read (the projections
were not children of one module) and both were refused. Each recipe is verified by ``check`` in
both modes against one process, then checked again from the written file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.model_tree import build_model
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.structure import read_structure

TP2 = {"tp": 2}
NESTED = "tests.support.byo_nested"


def _read(factory: str) -> tuple[dict[str, str], dict[str, str]]:
    entries, notes = read_structure(build_model(f"{NESTED}:{factory}", {}))
    return {e.pattern: e.style for e in entries}, {n.what: n.why for n in notes}


def test_a_feed_forward_in_nested_sequentials_is_one_block() -> None:
    styles, notes = _read("make_x_transformer")
    # the innermost module holding the pair is the region: the Sequential, not the layer
    assert styles == {"attn_layers.layers.*.1.ff.0.0": "colwise",
                      "attn_layers.layers.*.1.ff.2": "rowwise",
                      "to_logits": "colwise_gather_output"}
    assert "einops" in notes["attn_layers.layers.*.1 (XAttention)"]


def test_a_layer_of_two_kinds_under_one_pattern_keeps_both() -> None:
    # transformer.layers.N is [Attention, FeedForward]: both fold to transformer.layers.*.*;
    # the attention's rearrange(..., h=self.heads) is divided by its region (head_counts)
    styles, notes = _read("make_vit_pytorch")
    assert styles == {"transformer.layers.*.*.to_qkv": "packed_colwise",
                      "transformer.layers.*.*.to_out.0": "rowwise",
                      "transformer.layers.*.*.net.1": "colwise",
                      "transformer.layers.*.*.net.4": "rowwise"}
    assert notes == {}


def test_the_row_wise_projection_is_found_wherever_it_is_registered() -> None:
    # Meta's reference Llama registers w1, w2, w3: the one projection back to the hidden size
    # from another width is the row-wise one; its attention's n_local_heads are divided
    styles, notes = _read("make_meta_llama")
    assert {k: v for k, v in styles.items() if ".feed_forward." in k} == {
        "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise"}
    assert styles["layers.*.attention.wo"] == "rowwise" and notes == {}


def test_an_mlp_in_a_module_dict_gets_no_region_of_its_own() -> None:
    # minGPT calls its ModuleDict MLP's children through a lambda: no boundary on the dict,
    # each projection with its own (colwise, then rowwise)
    from hyperrecipe.suggest.translate import TranslateOptions, translate
    from hyperrecipe.model_tree import snapshot

    model = build_model(f"{NESTED}:make_mingpt", {})
    entries, _ = read_structure(model)
    rules: dict[str, dict[str, object]] = {}
    for r in translate(entries, snapshot(model), TP2, TranslateOptions()).rules:
        rules.setdefault(r.match, dict(r.fields))  # the first: sequence parallel rules follow
    assert rules["transformer.h.*.mlp.c_fc"]["style"] == "colwise"
    assert rules["transformer.h.*.mlp.c_proj"]["style"] == "rowwise"
    assert "transformer.h.*.mlp" not in rules


@pytest.mark.slow  # suggest's check and the recheck launch ranks
@pytest.mark.parametrize(("factory", "inputs"), [
    ("make_x_transformer", None), ("make_vit_pytorch", f"{NESTED}:make_pixels"),
    ("make_mingpt", None), ("make_meta_llama", None)])
def test_suggest_shards_the_nested_mlps_and_check_agrees(factory: str, inputs: str | None,
                                                         tmp_path: Path) -> None:
    model = f"{NESTED}:{factory}"
    s = suggest_recipe(model, TP2, options=SuggestOptions(timeout_s=120, inputs=inputs))
    assert s.verified, s.summary()
    assert s.sharded_fraction["tp"] > 0.15, s.summary()
    if factory == "make_vit_pytorch":  # its attention too, heads=self.heads divided
        assert "heads: tp" in s.text and ".to_out.0" in s.text, s.text
    assert any(m in s.text for m in (".ff.0.0", ".net.1", ".mlp.c_fc", ".feed_forward.w2"))
    if factory == "make_meta_llama":  # 11.7% before: w2 between w1 and w3, counts undivided
        assert s.sharded_fraction["tp"] > 0.95 and "n_local_heads: tp" in s.text, s.summary()
    path = tmp_path / "nested.yaml"
    path.write_text(s.text)
    report = run_check(CheckOptions(recipe=str(path), model=model, mesh=TP2, inputs=inputs,
                                    timeout_s=120))
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]
