"""The shipped TOML recipe is recipes/llama.yaml, translated: it compiles to the same plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyperrecipe.model_tree import ModelTree
from hyperrecipe.recipe import load_recipe
from hyperrecipe.resolve import resolve_recipe

_WHERE = {"file", "line", "column", "recipe_files", "checksum"}
"""Where a decision was written (and the checksum over it): the only things allowed to differ."""


def _decisions(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _decisions(v) for k, v in data.items() if k not in _WHERE}
    if isinstance(data, list):
        return [_decisions(v) for v in data]
    return data


def test_toml_llama_compiles_to_the_yaml_plan_with_the_same_fingerprint(
        in_root: Path, tiny_llama_tree: ModelTree) -> None:
    yaml_plan = resolve_recipe(load_recipe("recipes/llama.yaml"), tiny_llama_tree, {"tp": 2})
    toml_plan = resolve_recipe(load_recipe("recipes/llama-toml.toml"), tiny_llama_tree, {"tp": 2})
    assert toml_plan.recipe_digest == yaml_plan.recipe_digest
    assert toml_plan.fingerprint == yaml_plan.fingerprint
    assert toml_plan.recipe_files == ("recipes/llama-toml.toml",)
    yaml_json, toml_json = json.loads(yaml_plan.to_json()), json.loads(toml_plan.to_json())
    assert yaml_json != toml_json, "provenance names each plan's own file and lines"
    assert _decisions(toml_json) == _decisions(yaml_json)


def test_toml_llama_rules_point_at_their_own_lines(in_root: Path,
                                                   tiny_llama_tree: ModelTree) -> None:
    plan = resolve_recipe(load_recipe("recipes/llama-toml.toml"), tiny_llama_tree, {"tp": 2})
    lines = Path("recipes/llama-toml.toml").read_text(encoding="utf-8").splitlines()
    for rule in plan.rules:
        assert lines[rule.line - 1] == "[[rules]]"
        assert lines[rule.line] == f'match = "{rule.match}"'
