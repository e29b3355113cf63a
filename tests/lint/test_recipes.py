"""Recipe files in a lint run: found when walking, checked against the schema as HR100."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperrecipe.lint.recipes import is_recipe_file
from hyperrecipe.lint.runner import lint_paths
from hyperrecipe.recipe import check_recipe_file
from tests.lint.conftest import WriteTree

ROOT = Path(__file__).resolve().parents[2]

BAD_STYLE = """\
recipe: bad
version: 1
mesh: [tp]
rules:
  - match: layers.*.attn
    style: colwize
"""


def test_a_schema_error_becomes_an_hr100_finding_at_its_line_and_column(
    write_tree: WriteTree,
) -> None:
    root = write_tree({"recipes/bad.yaml": BAD_STYLE})
    result = lint_paths(["."], jobs=1)
    (expected,) = check_recipe_file(root / "recipes" / "bad.yaml")
    assert expected.span is not None
    (finding,) = result.findings
    assert (finding.path, finding.line, finding.column, finding.code, finding.name) == (
        "recipes/bad.yaml", 6, 12, "HR100", "recipe-schema",
    )
    assert (finding.line, finding.column) == (expected.span.line, expected.span.column)
    assert finding.message.startswith(
        "unknown style 'colwize'; did you mean 'colwise'? @ $.rules[0].style"
    )
    assert finding.message == str(expected).removeprefix(f"{expected.span}: ")
    assert result.exit_code == 1


@pytest.mark.parametrize("name", ["toy.yaml", "toy.toml", "toy-sp.yaml"])
def test_the_repository_test_recipes_are_clean(name: str) -> None:
    result = lint_paths([str(ROOT / "tests" / "recipes" / name)], jobs=1)
    assert result.findings == ()
    assert result.files == 1


def test_a_broken_toml_recipe_is_reported(write_tree: WriteTree) -> None:
    write_tree({"r.toml": 'recipe = "x"\nversion = \n'})
    (finding,) = lint_paths(["."], jobs=1).findings
    assert (finding.path, finding.code) == ("r.toml", "HR100")


def test_yaml_and_toml_without_a_top_level_recipe_key_are_not_recipes(
    write_tree: WriteTree,
) -> None:
    root = write_tree({
        "ci.yaml": "jobs:\n  recipe: not top level\n",
        "pyproject.toml": '[project]\nname = "x"\n',
        "r.yml": "# a recipe\nrecipe: y\n",
        "r2.toml": '[recipe]\nname = "y"\n',
    })
    assert not is_recipe_file(root / "ci.yaml")
    assert not is_recipe_file(root / "pyproject.toml")
    assert is_recipe_file(root / "r.yml")
    assert is_recipe_file(root / "r2.toml")


def test_ignoring_hr100_skips_recipe_files(write_tree: WriteTree) -> None:
    write_tree({"bad.yaml": BAD_STYLE})
    assert lint_paths(["."], ignore=["recipe-schema"], jobs=1).findings == ()


def test_a_crashing_checker_is_an_internal_error_not_a_traceback(
    write_tree: WriteTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hyperrecipe.recipe

    def boom(path: object) -> list[object]:
        raise KeyError("surprise")

    monkeypatch.setattr(hyperrecipe.recipe, "check_recipe_file", boom)
    write_tree({"bad.yaml": BAD_STYLE})
    result = lint_paths(["."], jobs=1)
    assert [(f.code, f.message, f.severity) for f in result.findings] == [
        ("HR999", "checking the recipe failed: KeyError: 'surprise'", "error")
    ]
    assert result.exit_code == 2
