"""``extends`` and tied parameters: a recipe that extends another may re-place a tied parameter
by placing all of its names the same way; leaving the names placed differently is refused at
the later rule, naming both.

The model is the tiny Llama of ``recipes/models/tiny-llama.json`` with
``tie_word_embeddings=True`` (``lm_head.weight`` is ``model.embed_tokens.weight``); the recipes
are in ``tests/recipes/tied/`` and extend the shipped ``recipes/llama.yaml``, which places both
names ``{tp: shard(0)}``. On the code before this fix the first recipe was refused as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe import compile_recipe
from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model
from hyperrecipe.recipe import load_recipe
from tests.support.recipe_text import locate

ROOT = Path(__file__).resolve().parents[2]
TIED = ROOT / "tests/recipes/tied"
BASE = ROOT / "recipes/llama.yaml"


def tied_config() -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((ROOT / "recipes/models/tiny-llama.json").read_text())
    return {**cfg, "tie_word_embeddings": True}


def meta() -> Any:
    return build_model("hf:llama", tied_config())


def test_extending_recipe_re_places_both_names_of_a_tied_parameter() -> None:
    recipe = TIED / "llama-tied-replicated.yaml"
    plan = compile_recipe(str(recipe), meta(), {"tp": 2})
    params = {p.fqn: p for p in plan.params}
    embed, head = params["model.embed_tokens.weight"], params["lm_head.weight"]
    assert str(embed.placement) == str(head.placement) == "replicate"
    assert head.tied_to == "model.embed_tokens.weight"
    assert embed.local_shape == (128, 64)
    # the decision points at this recipe, with the base's claims kept as overridden
    assert embed.provenance[-1].file == str(recipe)
    base_shown = load_recipe(recipe).files[0]  # as the loader names the shipped base
    assert any(p.file == base_shown and "overridden by rule" in p.reason
               for p in embed.provenance)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_extending_recipe_with_a_tied_parameter_agrees_with_one_process_in_both_modes() -> None:
    report = run_check(CheckOptions(recipe=str(TIED / "llama-tied-replicated.yaml"),
                                    model="hf:llama", model_config=tied_config(),
                                    mesh={"tp": 2}))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    for m in report.modes:
        assert m.agree, (m.mode, m.comparison and m.comparison.first, m.error)
        assert m.comparison is not None
        assert "model.embed_tokens.weight" in {g.name for g in m.comparison.gradients}
    assert report.exit_code == 0


def test_re_placing_one_name_of_a_tied_parameter_is_refused_naming_both_rules() -> None:
    recipe = TIED / "llama-tied-mismatch.yaml"
    line, col = locate(recipe.read_text(), "replicate}")
    base_line, base_col = locate(BASE.read_text(), "- match: lm_head")
    base = load_recipe(recipe).files[0]
    with pytest.raises(RecipeError) as err:
        compile_recipe(str(recipe), meta(), {"tp": 2})
    assert str(err.value) == (
        f"{recipe}:{line}:{col}: tied parameter 'model.embed_tokens.weight' is placed "
        f"{{tp: shard(0)}} by rule 7 ({base}:{base_line}:{base_col + 2}) and replicate by rule 0 "
        f"(match 'model.embed_tokens') @ $.rules[0].params.weight; tied parameters share one "
        f"tensor and need one placement: {recipe} places model.embed_tokens.weight and leaves "
        f"lm_head.weight as {base} placed it; place both names the same way there")


CHILD_DIFFERENT = """\
recipe: child
version: 1
mesh: [tp]
extends: {base}
rules:
  - match: model.embed_tokens
    params: {{weight: replicate}}
    out_src: {{0: replicate}}
  - match: lm_head
    params: {{weight: {{tp: shard(0)}}}}
"""


def test_placing_both_names_differently_in_the_extending_recipe_names_both_of_its_rules(
        tmp_path: Path) -> None:
    recipe = tmp_path / "child.yaml"
    text = CHILD_DIFFERENT.format(base=BASE)
    recipe.write_text(text)
    line, col = locate(text, "{tp: shard(0)}")
    r0_line, r0_col = locate(text, "- match: model.embed_tokens")
    with pytest.raises(RecipeError) as err:
        compile_recipe(str(recipe), meta(), {"tp": 2})
    assert str(err.value) == (
        f"{recipe}:{line}:{col}: tied parameter 'model.embed_tokens.weight' is placed replicate "
        f"by rule 0 ({recipe}:{r0_line}:{r0_col + 2}) and {{tp: shard(0)}} by rule 1 (match "
        f"'lm_head') @ $.rules[1].params.weight; tied parameters share one tensor and need one "
        f"placement")
