"""Recipes and plans are data: code they name is imported only when trusted (docs/security.md).

Every module these tests name writes a marker file when imported, so "nothing ran" is checked
directly, not inferred from an error message.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hyperrecipe import PlanMismatchError, RecipeError, compile_recipe
from hyperrecipe.cli import main
from hyperrecipe.plan import AdapterPlan, Provenance
from hyperrecipe.refs import TRUST_ENV, UntrustedCodeError, _entry_point_packages, resolve_ref
from hyperrecipe.rewriter import Rewrite
from hyperrecipe.runtime.features.adapters import install_adapters
from hyperrecipe.wrappers import WrapperError, load_wrapper
from tests.support.toy_models import Toy

MODULE = '''\
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def factory(ctx):  # not decorated: importing it must not happen either
    raise AssertionError("called")


class Kernel:
    def run(self, x):
        return x
'''

RECIPE = """\
recipe: demo
version: 1
mesh: [tp]
rules:
  - match: layers.*.mlp
    boundary: true
    in_src: {{x: replicate}}
    out_src: {{0: replicate}}
    inner_wrapper: {ref}
"""


@pytest.fixture
def untrusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A module ``pr_module_<n>`` on sys.path (as a pull request's file would be), not imported,
    and no opt-in in the environment."""
    name = f"pr_module_{tmp_path.name.replace('-', '_')}"[:60]
    marker = tmp_path / "IMPORTED"
    (tmp_path / f"{name}.py").write_text(MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(TRUST_ENV, raising=False)
    yield name, marker
    sys.modules.pop(name, None)


def _recipe(tmp_path: Path, ref: str) -> Path:
    path = tmp_path / "demo.yaml"
    path.write_text(RECIPE.format(ref=ref))
    return path


def test_compiling_a_recipe_naming_an_untrusted_wrapper_imports_nothing(
        tmp_path: Path, untrusted: tuple[str, Path]) -> None:
    name, marker = untrusted
    path = _recipe(tmp_path, f"{name}:factory")
    with torch.device("meta"), pytest.raises(RecipeError) as err:
        compile_recipe(str(path), Toy(), {"tp": 2})
    text = str(err.value)
    assert text.startswith(f"{path}:9:20: inner wrapper of 'layers.0.mlp': inner wrapper "
                           f"'{name}:factory' names module '{name}', which is not trusted; "), text
    assert f"pass --trust-code (or --trust {name})" in text
    assert f"trust_code=True (or [{name!r}]) to compile_recipe()/apply()" in text
    assert f"set {TRUST_ENV}=1" in text
    assert not marker.exists()
    assert name not in sys.modules


def test_trusting_the_module_imports_it_and_then_checks_the_declaration(
        tmp_path: Path, untrusted: tuple[str, Path]) -> None:
    name, marker = untrusted
    path = _recipe(tmp_path, f"{name}:factory")
    with torch.device("meta"), pytest.raises(RecipeError) as err:
        compile_recipe(str(path), Toy(), {"tp": 2}, trust_code=[name])
    assert (f"inner wrapper '{name}:factory' is not declared with "
            f"@hyperrecipe.wrappers.inner_wrapper") in str(err.value)
    assert marker.read_text() == "imported"


def test_the_cli_refuses_with_exit_2_and_trust_code_opts_in(
        tmp_path: Path, untrusted: tuple[str, Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    name, marker = untrusted
    path = _recipe(tmp_path, f"{name}:factory")
    argv = ["compile", str(path), "--model", "tests.support.toy_models:make_toy", "--mesh", "tp=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "which is not trusted; " in err and "Traceback" not in err
    assert not marker.exists()
    assert main([*argv, "--trust", name]) == 2  # now imported: refused as undecorated
    assert "is not declared with @hyperrecipe.wrappers.inner_wrapper" in capsys.readouterr().err
    assert marker.exists()


def test_lint_of_a_recipe_naming_code_runs_none_of_it(
        tmp_path: Path, untrusted: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    name, marker = untrusted
    path = _recipe(tmp_path, f"{name}:factory")
    assert main(["lint", str(path)]) == 0, capsys.readouterr()
    assert not marker.exists()


def _adapter(target: str) -> AdapterPlan:
    return AdapterPlan(target=target, mode="wrap",
                       provenance=Provenance(file="demo.yaml", line=7, column=5, rule_index=-1,
                                             reason="adapter wrap"))


def test_a_plan_carrying_an_untrusted_adapter_target_imports_nothing_at_apply(
        untrusted: tuple[str, Path]) -> None:
    name, marker = untrusted
    with Rewrite(label="test") as tx, pytest.raises(PlanMismatchError) as err:
        install_adapters(tx, (_adapter(f"{name}:Kernel.run"),), ("tp",))
    assert str(err.value).startswith(
        f"adapter '{name}:Kernel.run' (demo.yaml:7:5): adapter target '{name}:Kernel.run' names "
        f"module '{name}', which is not trusted; ")
    assert not marker.exists()


def test_a_plan_carrying_an_untrusted_wrapper_imports_nothing_at_apply(
        untrusted: tuple[str, Path]) -> None:
    name, marker = untrusted
    with pytest.raises(WrapperError, match="which is not trusted"):
        load_wrapper(f"{name}:factory")
    assert not marker.exists()


def test_the_environment_opt_in_takes_module_prefixes(
        untrusted: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    name, marker = untrusted
    monkeypatch.setenv(TRUST_ENV, f"other,{name[:-1]}")  # a prefix of a name is not its package
    with pytest.raises(UntrustedCodeError):
        resolve_ref(f"{name}:Kernel", "test")
    monkeypatch.setenv(TRUST_ENV, f"other,{name}")
    assert resolve_ref(f"{name}:Kernel", "test").__name__ == "Kernel"
    assert marker.exists()


def test_built_in_and_already_imported_code_needs_no_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRUST_ENV, raising=False)
    assert load_wrapper("ulysses").name == "ulysses"
    assert resolve_ref("tests.support.toy_models:Toy", "test") is Toy


def test_a_package_declaring_an_entry_point_is_trusted(
        tmp_path: Path, untrusted: tuple[str, Path]) -> None:
    name, marker = untrusted
    info = tmp_path / "demo_wrappers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-wrappers\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[hyperrecipe.wrappers]\nring = {name}:factory\n")
    _entry_point_packages.cache_clear()
    try:
        assert resolve_ref(f"{name}:Kernel", "test").__name__ == "Kernel"
    finally:
        _entry_point_packages.cache_clear()
    assert marker.exists()


def test_a_name_the_user_typed_needs_no_opt_in(untrusted: tuple[str, Path]) -> None:
    name, marker = untrusted
    assert resolve_ref(f"{name}:Kernel", "model spec", named_by_user=True).__name__ == "Kernel"
    assert marker.exists()
