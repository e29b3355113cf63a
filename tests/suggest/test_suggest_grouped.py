"""`suggest` on an attention written as litgpt (0.5) writes it (tests/support/byo_grouped.py):
one fused ``qkv`` split into ``n_head`` query heads and ``n_query_groups`` key/value heads by
sizes the forward computes from ``self.config``, a config object every module shares.

Before, the fused projection was cut into equal parts (its width is a multiple of the hidden
size) and no count was divided, so ``check`` failed the attention and suggest computed it whole
(77% of litgpt's Llama on tp, 74% of its Pythia). Now its parts are read off the counts
(``chunks=[q, k, v]``) and the counts are divided on the attention's own copy of the config
(``head_counts: {config.n_head: tp, ...}``). Verified like every suggestion: check in both
modes against one process, then the written file checked again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.model_tree import build_model
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.structure import read_structure

TP2 = {"tp": 2}
MODEL = "tests.support.byo_grouped:make_grouped_gpt"


@pytest.mark.parametrize(("groups", "sizes", "chunks"), [(2, (32, 16, 16), 3), (4, (), 3)])
def test_the_fused_parts_are_read_off_the_head_counts(groups: int, sizes: tuple[int, ...],
                                                      chunks: int) -> None:
    entries, _ = read_structure(build_model(MODEL, {"n_query_groups": groups}))
    qkv = next(e for e in entries if e.pattern == "h.*.attn.qkv")
    assert qkv.style == "packed_colwise"
    assert (qkv.chunk_sizes, qkv.chunks) == (sizes, chunks)


def test_one_key_value_head_is_not_divided() -> None:
    # multi-query: the one key/value head (8 wide) cannot be split between ranks
    entries, _ = read_structure(build_model(MODEL, {"n_query_groups": 1}))
    assert not any(e.pattern.startswith("h.*.attn") for e in entries)


def test_counts_that_do_not_add_up_to_the_fused_width_are_not_taken() -> None:
    # 4 query heads of 8 beside 2 groups: 64 wide; a config saying 3 groups (80 wide) is not
    # the layout the weight has: no parts, and the width is cut in 2 equal parts as before
    model = build_model(MODEL, {"n_query_groups": 2})
    for block in model.h:  # type: ignore[union-attr]
        block.attn.config = type(block.attn.config)(n_query_groups=3)
    entries, _ = read_structure(model)
    qkv = next(e for e in entries if e.pattern == "h.*.attn.qkv")
    assert (qkv.chunk_sizes, qkv.chunks) == ((), 2)


@pytest.mark.slow  # suggest's check and the recheck launch ranks
@pytest.mark.parametrize("groups", [2, 4])
def test_a_litgpt_attention_is_sharded_by_its_config_counts(groups: int, tmp_path: Path) -> None:
    config = {"n_query_groups": groups}
    s = suggest_recipe(MODEL, TP2, model_config=config,
                       options=SuggestOptions(timeout_s=120))
    assert s.verified and not s.narrowed, s.summary()
    assert "config.n_head: tp" in s.text and "config.n_query_groups: tp" in s.text
    if groups == 2:
        assert "shard(0, chunks=[32, 16, 16])" in s.text
    assert s.sharded_fraction["tp"] > 0.95, s.summary()
    path = tmp_path / "grouped.yaml"
    path.write_text(s.text)
    report = run_check(CheckOptions(recipe=str(path), model=MODEL, model_config=config,
                                    mesh=TP2, timeout_s=120))
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]


@pytest.mark.slow  # launches ranks
def test_the_pages_snippet_agrees_in_both_modes(tmp_path: Path) -> None:
    # docs/bring-your-own-model.md#head-counts-on-a-shared-config-and-grouped-q-k-v-in-one-projection
    page = (Path(__file__).resolve().parents[2] / "docs/bring-your-own-model.md").read_text()
    section = page.split("### Head counts on a shared config", 1)[1]
    snippet = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "snippet.yaml"
    path.write_text("recipe: snippet\nversion: 1\nmesh: [tp]\nrules:\n" + snippet)
    report = run_check(CheckOptions(recipe=str(path), model=MODEL, mesh=TP2, timeout_s=120))
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]
