"""The cookbook's recipes under verification: every recipe the cookbook says agrees with one
process in both modes compiles, verified; every naive recipe ``check`` shows wrong and that
shapes and placements can show is refused at compile, at a line of its own file.

The norm sharded naively over the heads (``olmo2-naive-sharded-norm.yaml``) has shapes that fit
and values that are wrong; it is refused because validate mode sums the ranks' partial means of
squares inside the norm, where production has no collective (docs/verification.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from hyperrecipe import compile_recipe
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model
from tests.check.test_cookbook import (
    CASES,
    DECLARED_RESIDUAL,
    MODELS,
    NAIVE_ALIBI,
    NAIVE_BERT,
    NAIVE_COPY,
    ROOT,
)


QUICK_REPRESENTATIVES = {"dbrx-chunked-qkv", "olmo2"}


def _agreeing(cases: list[Any]) -> list[Any]:
    out = []
    for case in cases:
        values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
        recipe, model, config, modes, agree = values
        if set(modes) == {"production", "validate"} and all(agree):
            name = recipe.rsplit("/", 1)[-1].removesuffix(".yaml")
            # the quick tier keeps two representatives (a chunked fused q|k|v, per-head norms)
            tier = () if name in QUICK_REPRESENTATIVES else (pytest.mark.slow,)
            out.append(pytest.param(recipe, model, config, marks=(*marks, *tier), id=name))
    return out


@pytest.mark.parametrize(("recipe", "model", "config"), _agreeing(CASES))
def test_a_cookbook_recipe_that_agrees_in_both_modes_compiles_verified(
        recipe: str, model: str, config: str | None) -> None:
    meta = build_model(model, str(ROOT / config) if config else None)
    plan = compile_recipe(str(ROOT / recipe), meta, {"tp": 2})
    assert plan.verification is not None
    assert plan.verification.modes == ("production", "validate")


@pytest.mark.parametrize(("recipe", "model", "config", "words"), [
    (NAIVE_COPY, "hf:olmo2", f"{MODELS}/tiny-olmo2.json",
     "production mode cannot run one training step"),
    pytest.param(NAIVE_ALIBI, "hf:bloom", f"{MODELS}/tiny-bloom.json",
                 "production mode cannot run one training step", marks=pytest.mark.slow),
    (NAIVE_BERT, "hf:bert/sequence-classification", f"{MODELS}/tiny-bert.json",
     "whose share of its gradient comes back whole"),
    pytest.param(DECLARED_RESIDUAL, "hf:bloom", f"{MODELS}/tiny-bloom.json",
                 "whose share of its gradient comes back whole", marks=pytest.mark.slow),
    ("tests/recipes/cookbook/olmo2-naive-sharded-norm.yaml", "hf:olmo2",
     f"{MODELS}/tiny-olmo2.json",
     "model.layers.0.self_attn.q_norm (transformers/models/olmo2/modeling_olmo2.py:"),
], ids=["olmo2-naive-qwen3-copy", "bloom-naive-alibi", "bert-naive-attention-residual",
        "bloom-declared-residual", "olmo2-naive-sharded-norm"])
def test_a_naive_cookbook_recipe_check_shows_wrong_is_refused_at_compile(
        recipe: str, model: str, config: str, words: str) -> None:
    meta = build_model(model, str(ROOT / config))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(str(ROOT / recipe), meta, {"tp": 2})
    assert words in str(caught.value)
    assert caught.value.span is not None and caught.value.span.path == str(ROOT / recipe)
