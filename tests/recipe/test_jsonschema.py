"""The JSON Schema editors use: checked in beside the recipes, wired into every shipped recipe,
and strict where JSON Schema can be (docs/editor.md)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hyperrecipe.recipe import check_recipe_file
from hyperrecipe.recipe.jsonschema import SCHEMA_ID, recipe_json_schema

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "recipes" / "recipe.schema.json"
MODELINE = "# yaml-language-server: $schema=recipe.schema.json"
YAML_RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def _validator() -> Any:
    schema = recipe_json_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _errors(data: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    return [(e.message, list(e.absolute_path)) for e in _validator().iter_errors(data)]


def _llama() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "recipes" / "llama.yaml").read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def test_schema_is_draft_07_with_a_urn_id_for_yaml_language_server() -> None:
    schema = recipe_json_schema()
    assert jsonschema.validators.validator_for(schema) is jsonschema.Draft7Validator
    assert schema["$id"] == SCHEMA_ID == "urn:hyperrecipe:recipe-schema:v1"


def test_checked_in_schema_is_what_hyperrecipe_schema_prints() -> None:
    expected = json.dumps(recipe_json_schema(), indent=2, sort_keys=True) + "\n"
    assert SHIPPED.read_text(encoding="utf-8") == expected, (
        "recipes/recipe.schema.json is stale: hyperrecipe schema > recipes/recipe.schema.json")


@pytest.mark.parametrize("path", YAML_RECIPES, ids=lambda p: p.name)
def test_shipped_yaml_recipe_names_the_schema_and_validates(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.splitlines()[0] == MODELINE
    assert (path.parent / "recipe.schema.json").is_file()
    assert _errors(yaml.safe_load(text)) == []


def test_shipped_toml_recipe_validates() -> None:
    with open(REPO / "recipes" / "llama-toml.toml", "rb") as f:
        assert _errors(tomllib.load(f)) == []


def test_a_style_typo_is_an_error_where_the_file_can_only_use_built_ins() -> None:
    data = _llama()
    data["rules"][2]["style"] = "colwse"
    [(message, where)] = _errors(data)
    assert message.startswith("'colwse' is not one of ['colwise', 'colwise_gather_output', ")
    assert where == ["rules", 2, "style"]


@pytest.mark.parametrize("own", ["styles", "extends"])
def test_a_style_the_file_may_define_or_inherit_is_left_to_lint(own: str) -> None:
    data = _llama()
    data["rules"][2]["style"] = "my_colwise"
    data[own] = {"my_colwise": {"style": "colwise"}} if own == "styles" else "llama"
    assert _errors(data) == []
    data["rules"][2]["style"] = "not an identifier"
    assert [w for _, w in _errors(data)] == [["rules", 2, "style"]]


def test_an_undeclared_mesh_dim_passes_the_schema_and_lint_reports_it(tmp_path: Path) -> None:
    # JSON Schema cannot compare a key with the values of `mesh`; docs/editor.md says so and
    # points at `hyperrecipe lint`, which does.
    data = _llama()
    data["rules"][1]["out_src"]["attn_weights"] = {"tp": "shard(1)", "cp": "shard(2)"}
    assert _errors(data) == []
    path = tmp_path / "undeclared.yaml"
    path.write_text(yaml.safe_dump(copy.deepcopy(data), sort_keys=False), encoding="utf-8")
    [error] = check_recipe_file(path)
    assert "placement names mesh dim 'cp', which the recipe does not declare" in str(error)
