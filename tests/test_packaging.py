"""The wheel carries the shipped recipes and tiny model configs, and works outside a checkout.

The wheel is built from a copy of the sources (so the checkout gets no ``build/``), installed
into a temporary folder, and run from a directory that is not a checkout: ``load_recipe`` finds
a shipped recipe by name and ``hyperrecipe compile llama --model hf:llama --model-config
tiny-llama`` compiles it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tests.support.runtime_harness import ROOT


def test_every_package_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "hyperrecipe").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {found - listed}"
    assert listed - found == {"hyperrecipe._shipped"}


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_an_installed_wheel_compiles_a_shipped_recipe_outside_a_checkout(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")  # the build backend, used without build isolation (offline)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("hyperrecipe", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w",
                    str(wheels)], check=True, cwd=src, timeout=300)
    wheel = next(wheels.glob("hyperrecipe-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("HYPERRECIPE_RECIPES", None)
    probe = ("import hyperrecipe; r = hyperrecipe.load_recipe('llama'); "
             "print(hyperrecipe.__file__); print(r.file)")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           cwd=elsewhere, env=env, timeout=300, check=False)
    assert found.returncode == 0, found.stderr
    package_file, recipe_file = found.stdout.split()
    assert package_file.startswith(str(target))
    assert Path(recipe_file).resolve() == (target / "hyperrecipe/_shipped/llama.yaml").resolve()
    done = subprocess.run([sys.executable, "-m", "hyperrecipe", "compile", "llama", "--model",
                           "hf:llama", "--model-config", "tiny-llama", "--mesh", "tp=2"],
                          capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "plan 'llama' for mesh tp=2" in done.stdout
    assert "collectives per step:" in done.stdout
