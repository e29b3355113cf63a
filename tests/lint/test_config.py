"""``[tool.hyperrecipe.lint]``: discovery, the rewriter allowance, excludes and selection."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperrecipe.lint.config import ConfigFinder, load_config
from hyperrecipe.lint.runner import LintUsageError, lint_paths
from tests.lint.conftest import WriteTree

FORWARD = "m.forward = f\n"
SETATTR = 'setattr(m, "forward", f)\n'


def _found(paths: list[str] | None = None, **kwargs: object) -> list[tuple[str, str]]:
    result = lint_paths(paths or ["."], jobs=1, **kwargs)  # type: ignore[arg-type]
    return [(f.path, f.code) for f in result.findings]


def test_without_a_pyproject_every_rule_runs_and_no_path_is_allowed(write_tree: WriteTree) -> None:
    write_tree({"rewriter.py": FORWARD, "pkg/a.py": SETATTR})
    assert _found() == [("pkg/a.py", "HR002"), ("rewriter.py", "HR001")]


def test_the_rewriter_path_may_install_forwards(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nrewriter = ["pkg/rewriter.py"]\n',
        "pkg/rewriter.py": FORWARD + SETATTR + "m.__class__ = C\n",
        "pkg/other.py": FORWARD,
    })
    assert _found() == [("pkg/other.py", "HR001")]


def test_a_rewriter_folder_allows_every_file_inside(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nrewriter = ["pkg/rewrite"]\n',
        "pkg/rewrite/a.py": FORWARD,
        "pkg/rewrite/deep/b.py": FORWARD,
        "pkg/rewrite_not.py": FORWARD,
    })
    assert _found() == [("pkg/rewrite_not.py", "HR001")]


def test_the_allowance_does_not_switch_off_suppression_checks(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nrewriter = ["rw.py"]\n',
        "rw.py": "m.forward = f  # hyperrecipe: ignore[HR001]\n",
    })
    assert _found() == [("rw.py", "HR901")]


def test_rewriter_paths_are_relative_to_the_pyproject_not_the_working_directory(
    write_tree: WriteTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = write_tree({
        "proj/pyproject.toml": '[tool.hyperrecipe.lint]\nrewriter = ["src/rw.py"]\n',
        "proj/src/rw.py": FORWARD,
        "proj/src/x.py": FORWARD,
    })
    monkeypatch.chdir(root / "proj" / "src")
    assert _found() == [("x.py", "HR001")]


def test_the_nearest_pyproject_with_a_table_wins_and_one_without_is_skipped(
    write_tree: WriteTree,
) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nignore = ["HR002"]\n',
        "sub/pyproject.toml": '[project]\nname = "sub"\n',  # no table: keep looking upward
        "sub/a.py": FORWARD + SETATTR,
        "other/pyproject.toml": '[tool.hyperrecipe.lint]\nselect = ["HR002"]\n',
        "other/b.py": FORWARD + SETATTR,
    })
    assert _found() == [("other/b.py", "HR002"), ("sub/a.py", "HR001")]


def test_select_and_ignore_from_the_table_and_from_the_command_line(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": (
            '[tool.hyperrecipe.lint]\nselect = ["HR00"]\nignore = ["forward-setattr"]\n'
        ),
        "a.py": FORWARD + SETATTR + "m.__class__ = C\n",
    })
    assert _found() == [("a.py", "HR001"), ("a.py", "HR004")]
    # --select replaces the configured select; --ignore adds to the configured ignore
    assert _found(select=["HR002", "HR004"]) == [("a.py", "HR004")]
    assert _found(ignore=["HR004"]) == [("a.py", "HR001")]


def test_exclude_globs_match_components_and_relative_paths(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nexclude = ["gen_*", "tests/fixtures"]\n',
        "gen_models/a.py": FORWARD,
        "pkg/gen_x.py": FORWARD,
        "tests/fixtures/b.py": FORWARD,
        "tests/test_c.py": FORWARD,
        ".venv/lib/d.py": FORWARD,  # built-in exclude
    })
    assert _found() == [("tests/test_c.py", "HR001")]


def test_an_excluded_file_named_explicitly_is_linted_unless_force_exclude(
    write_tree: WriteTree,
) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nexclude = ["vendored"]\n',
        "vendored/a.py": FORWARD,
        "vendored/sub/b.py": FORWARD,
    })
    assert _found(["."]) == []
    assert _found(["vendored/a.py"]) == [("vendored/a.py", "HR001")]  # as ruff does
    # pre-commit's hooks pass --force-exclude: the files it hands over honour `exclude`
    assert _found(["vendored/a.py", "vendored/sub/b.py"], force_exclude=True) == []
    assert _found(["vendored"], force_exclude=True) == []


def test_folders_above_the_linted_path_never_exclude_it(write_tree: WriteTree) -> None:
    root = write_tree({"venv/lib/pkg/a.py": FORWARD})
    assert _found(["."]) == []  # `venv` is a built-in exclude below the linted folder...
    # ... but not when it is above the folder the user asked for
    assert _found([str(root / "venv" / "lib" / "pkg")]) == [("venv/lib/pkg/a.py", "HR001")]


def test_an_excluded_folder_in_the_project_does_not_hide_a_path_named_inside_it(
    write_tree: WriteTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README layout: `.venv` inside the repository, and `exclude` naming it."""
    root = write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nexclude = [".venv*", "build"]\n',
        ".venv/lib/site-packages/torch/distributed/a.py": FORWARD,
        ".venv/lib/site-packages/torch/distributed/build/b.py": FORWARD,
        ".venv/lib/site-packages/torch/distributed/.venv-x/c.py": FORWARD,
    })
    named = root / ".venv/lib/site-packages/torch/distributed"
    expected = [(".venv/lib/site-packages/torch/distributed/a.py", "HR001")]
    assert _found([str(named)]) == expected  # excludes below the named folder still apply
    assert _found([str(named.relative_to(root))]) == expected
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # by absolute path from another folder
    assert [code for _, code in _found([str(named)])] == ["HR001"]
    assert _found([str(named)], force_exclude=True) == []


def test_per_file_ignores_match_file_names_and_relative_globs(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": (
            "[tool.hyperrecipe.lint]\n"
            "[tool.hyperrecipe.lint.per-file-ignores]\n"
            '"tests/*" = ["HR001"]\n'
            '"conftest.py" = ["forward-setattr", "HR004"]\n'
        ),
        "tests/deep/test_a.py": FORWARD + SETATTR,
        "pkg/conftest.py": FORWARD + SETATTR,
        "pkg/b.py": FORWARD,
    })
    assert _found() == [
        ("pkg/b.py", "HR001"), ("pkg/conftest.py", "HR001"), ("tests/deep/test_a.py", "HR002"),
    ]


def test_per_file_ignores_with_an_unknown_code_is_a_usage_error(write_tree: WriteTree) -> None:
    write_tree({
        "pyproject.toml": (
            '[tool.hyperrecipe.lint.per-file-ignores]\n"tests/*" = ["HR0O1"]\n'
        ),
        "a.py": "x = 1\n",
    })
    with pytest.raises(LintUsageError, match=r"per-file-ignores 'tests/\*': unknown rule code"):
        lint_paths(["."])


def test_unknown_configuration_key_is_a_usage_error_with_a_suggestion(
    write_tree: WriteTree,
) -> None:
    table = '[tool.hyperrecipe.lint]\nrewriters = ["a.py"]\n'
    root = write_tree({"pyproject.toml": table, "a.py": ""})
    with pytest.raises(LintUsageError) as info:
        lint_paths(["."])
    assert str(info.value) == (
        f"{root / 'pyproject.toml'}: [tool.hyperrecipe.lint] has unknown key 'rewriters'; "
        "did you mean 'rewriter'?; known keys: rewriter, exclude, select, ignore, per-file-ignores"
    )


def test_a_value_of_the_wrong_type_is_a_usage_error(write_tree: WriteTree) -> None:
    root = write_tree({"pyproject.toml": "[tool.hyperrecipe.lint]\nignore = [1]\n", "a.py": ""})
    with pytest.raises(LintUsageError) as info:
        lint_paths(["."])
    assert str(info.value) == (
        f"{root / 'pyproject.toml'}: [tool.hyperrecipe.lint] ignore must be a list of "
        "strings, got [1]"
    )


def test_an_unknown_code_in_the_table_is_a_usage_error(write_tree: WriteTree) -> None:
    table = '[tool.hyperrecipe.lint]\nselect = ["HR042"]\n'
    root = write_tree({"pyproject.toml": table, "a.py": ""})
    with pytest.raises(LintUsageError) as info:
        lint_paths(["."])
    expected = f"{root / 'pyproject.toml'}: unknown rule code or name 'HR042'"
    assert str(info.value).startswith(expected)


def test_invalid_toml_is_a_usage_error(write_tree: WriteTree) -> None:
    write_tree({"pyproject.toml": "[tool.hyperrecipe.lint\n", "a.py": ""})
    with pytest.raises(LintUsageError, match="cannot read configuration"):
        lint_paths(["."])


def test_this_repository_allows_exactly_the_rewriter_modules() -> None:
    root = Path(__file__).resolve().parents[2]
    config = load_config(root / "pyproject.toml")
    assert config is not None
    assert config.rewriter == (root / "hyperrecipe" / "rewriter.py",
                               root / "hyperrecipe" / "process_patches.py")
    finder = ConfigFinder()
    rewriter = root / "hyperrecipe" / "rewriter.py"
    assert finder.for_path(rewriter).allows_forward_install(rewriter)
    runtime = root / "hyperrecipe" / "runtime" / "apply.py"
    assert not finder.for_path(runtime).allows_forward_install(runtime)


PATCH = "import torch\ntorch.nn.utils.clip_grad_norm_ = f\n"


def test_process_patch_is_opt_in_not_reported_or_even_parsed_by_default(
    write_tree: WriteTree,
) -> None:
    write_tree({"patch.py": PATCH, "both.py": PATCH + FORWARD})
    result = lint_paths(["."], jobs=1)
    assert [(f.path, f.code) for f in result.findings] == [("both.py", "HR001")]
    assert result.libcst_files == 1  # the file that only patches is cleared by the screen


@pytest.mark.parametrize("selector", ["HR005", "process-patch"])
def test_process_patch_is_reported_where_selected_by_its_code_or_name(
    write_tree: WriteTree, selector: str
) -> None:
    write_tree({"patch.py": PATCH, "both.py": PATCH + FORWARD})
    assert _found(select=[selector]) == [("both.py", "HR005"), ("patch.py", "HR005")]
    assert _found(select=["HR0", selector]) == [
        ("both.py", "HR005"), ("both.py", "HR001"), ("patch.py", "HR005"),
    ]


@pytest.mark.parametrize("prefix", ["HR", "HR0", "HR00"])
def test_a_prefix_does_not_select_process_patch(write_tree: WriteTree, prefix: str) -> None:
    write_tree({"patch.py": PATCH, "both.py": PATCH + FORWARD})
    assert _found(select=[prefix]) == [("both.py", "HR001")]


def test_a_configured_select_naming_process_patch_reports_it_outside_the_rewriter(
    write_tree: WriteTree,
) -> None:
    write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nrewriter = ["pkg/rw.py"]\n'
                          'select = ["HR0", "process-patch"]\n'
                          '[tool.hyperrecipe.lint.per-file-ignores]\n"tests/*" = ["HR005"]\n',
        "pkg/rw.py": PATCH,
        "pkg/other.py": PATCH,
        "tests/test_x.py": PATCH,
    })
    assert _found() == [("pkg/other.py", "HR005")]
    assert _found(select=["HR0"]) == []  # --select replaces the configured select


def test_this_repository_selects_process_patch_in_the_package_only() -> None:
    root = Path(__file__).resolve().parents[2]
    config = load_config(root / "pyproject.toml")
    assert config is not None and config.select is not None
    assert "process-patch" in config.select or "HR005" in config.select
    assert config.ignores_for(root / "tests" / "test_x.py") == ("HR005",)
    assert config.ignores_for(root / "tools" / "bench_x.py") == ("HR005",)
    assert config.ignores_for(root / "hyperrecipe" / "x.py") == ()
