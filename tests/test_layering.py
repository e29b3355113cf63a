"""The arrows between rooms: compiling imports no runtime; the mode is one object; the errors
have one root.

- compiling every shipped recipe (llama-cp and its built-in wrappers included) against its tiny
  model imports no ``hyperrecipe.runtime`` module, checked in a fresh interpreter;
- the wrapper registry declares the built-ins exactly as their runtime factories do;
- ``apply`` takes the mode as a string or as the :class:`Mode` object, and refuses others;
- every exception class the package defines derives from ``HyperrecipeError`` and a builtin.
"""

from __future__ import annotations

import ast
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hyperrecipe
from hyperrecipe.errors import HyperrecipeError, ModeError
from tests.support.runtime_harness import ROOT

COMPILE_ALL = """
import json, sys
from pathlib import Path
from hyperrecipe import compile_recipe, load_recipe
from hyperrecipe.model_tree import build_model

root = Path(sys.argv[1])
compiled = []
for path in sorted((root / "recipes").glob("*.yaml")):
    recipe = load_recipe(str(path))
    family = path.stem.split("-")[0]
    model = build_model(f"hf:{family}", str(root / "recipes/models" / f"tiny-{family}.json"))
    plan = compile_recipe(recipe, model, {d: 2 for d in recipe.mesh})
    compiled.append(plan.recipe)
runtime = sorted(m for m in sys.modules if m.startswith("hyperrecipe.runtime"))
print(json.dumps({"compiled": compiled, "runtime": runtime}))
"""


def test_compiling_every_shipped_recipe_imports_no_runtime_module() -> None:
    done = subprocess.run([sys.executable, "-c", COMPILE_ALL, str(ROOT)], capture_output=True,
                          text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert len(result["compiled"]) == len(shipped) and "llama-cp" in shipped
    assert result["runtime"] == []


def test_the_registry_declares_the_built_in_wrappers_as_their_factories_do() -> None:
    from hyperrecipe.wrappers import BUILTIN_WRAPPERS, load_wrapper

    for name, declared in BUILTIN_WRAPPERS.items():
        spec = load_wrapper(name)
        assert (spec.name, spec.hook, spec.mesh_dims, spec.inner_out_src) == (
            declared.name, declared.hook, declared.mesh_dims, declared.inner_out_src)
        assert declared.factory.startswith("hyperrecipe.runtime.")


def test_the_mode_is_one_object_chosen_from_its_name() -> None:
    from hyperrecipe.runtime.mode import PRODUCTION, VALIDATE, as_mode

    assert as_mode("production") is PRODUCTION and as_mode("validate") is VALIDATE
    assert as_mode(VALIDATE) is VALIDATE
    assert PRODUCTION == "production" and VALIDATE != "production"
    assert (PRODUCTION.dtensor_parameters, VALIDATE.dtensor_parameters) == (False, True)
    assert (PRODUCTION.local_kernels, VALIDATE.local_kernels) == (True, False)
    with pytest.raises(ModeError, match="mode must be 'production' or 'validate', not 'fast'"):
        as_mode("fast")
    assert issubclass(ModeError, ValueError)


def test_apply_refuses_an_unknown_mode_before_touching_the_model() -> None:
    from torch import nn

    from hyperrecipe import apply

    model = nn.Linear(2, 2)
    before = model.weight
    with pytest.raises(ModeError):
        apply(model, None, None, mode="fast")  # type: ignore[arg-type]
    assert model.weight is before


def _package_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(hyperrecipe.__path__, "hyperrecipe."):
        if info.name.startswith("hyperrecipe.lint") or info.name == "hyperrecipe.__main__":
            continue
        module = __import__(info.name, fromlist=["_"])
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if not (issubclass(obj, BaseException) and obj.__module__ == info.name):
                continue
            if name.startswith("_") and not issubclass(obj, Exception):
                # a private control-flow signal (check's SIGALRM deadline) that must get past
                # user code's ``except Exception`` and never leaves the module: it is
                # converted into a package error where it is caught
                continue
            found.append(obj)
    return found


def test_every_exception_outside_lint_lives_in_errors_and_has_one_root() -> None:
    classes = _package_exceptions()
    assert classes
    assert HyperrecipeError in classes
    for cls in classes:
        assert cls.__module__ == "hyperrecipe.errors", cls
        if cls is HyperrecipeError:
            continue
        assert issubclass(cls, HyperrecipeError), cls
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins"
                   and b not in (object, BaseException, Exception)]
        assert builtin, f"{cls.__name__} derives from no fitting builtin"


# The runtime's rooms and the rooms each may import (hyperrecipe/runtime/__init__.py's map).
# The top of the package (install, installation, mode) may import every room; no room imports
# the top except ``mode``, which only hands the Mode object around.
RUNTIME_ROOMS: dict[str, set[str]] = {
    "preflight": set(),
    "comm": set(),
    "forward": {"comm"},
    "features": {"forward", "comm"},
    "grads": {"comm", "state"},
    "state": {"comm"},
}


def _runtime_imports(path: Path) -> set[str]:
    """Every ``hyperrecipe.runtime`` module ``path`` imports, at module level or in a function
    (a lazy import is still an arrow)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("hyperrecipe.runtime.")}


@pytest.mark.parametrize("room", sorted(RUNTIME_ROOMS))
def test_each_runtime_room_imports_only_the_rooms_below_it(room: str) -> None:
    folder = ROOT / "hyperrecipe" / "runtime" / room
    assert (folder / "__init__.py").read_text().startswith('"""'), "each room says what it owns"
    allowed = RUNTIME_ROOMS[room] | {room, "mode"}
    for path in sorted(folder.glob("*.py")):
        for module in _runtime_imports(path):
            target = module.split(".")[2]
            assert target in allowed, f"{path.relative_to(ROOT)} imports {module}"


def test_the_runtime_has_no_loose_modules_beyond_its_seam() -> None:
    loose = sorted(p.stem for p in (ROOT / "hyperrecipe" / "runtime").glob("*.py"))
    assert loose == ["__init__", "install", "installation", "mode"]


def _code_strings_and_names(path: Path) -> list[str]:
    """The identifiers and the word-like string constants of ``path``'s code: docstrings and
    messages (strings with spaces) may name transformers for the user; code may not."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    ours = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("hyperrecipe.") for a in node.names}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.alias)) and (getattr(node, "id", None) in ours
                                                        or getattr(node, "name", None) in ours):
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings and not any(c.isspace() for c in node.value):
            found.append(node.value)
        elif isinstance(node, ast.Name):
            found.append(node.id)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, ast.alias):
            found.append(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


# What only a transformers model has: its module, its private attributes, its loss and kernels.
TRANSFORMERS_MARKS = ("transformers.", "_attn_implementation", "ALL_ATTENTION_FUNCTIONS",
                      "ForCausalLMLoss", "_init_weights", "_tied_weights_keys",
                      "base_model_prefix", "_keys_to_ignore", "_is_expert_parallel", "Conv1D",
                      "convert_file_size_to_int")


def test_the_runtime_names_no_transformers_internals_outside_the_integration_room() -> None:
    offenders = []
    for path in sorted((ROOT / "hyperrecipe" / "runtime").rglob("*.py")):
        for text in _code_strings_and_names(path):
            if text.startswith("hyperrecipe."):
                continue
            offenders += [f"{path.relative_to(ROOT)}: {text!r}" for mark in TRANSFORMERS_MARKS
                          if mark in text]
    assert offenders == []
