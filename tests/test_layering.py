"""The arrows between rooms: compiling imports no runtime; the mode is one object; the errors
have one root.

- resolving every shipped recipe (llama-cp and its built-in wrappers included) against its tiny
  model imports no ``hyperrecipe.runtime`` module, checked in a fresh interpreter (verification,
  which runs ``apply``, is the step after);
- the wrapper registry declares the built-ins exactly as their runtime factories do;
- ``apply`` takes the mode as a string or as the :class:`Mode` object, and refuses others;
- every exception class the package defines (the lint's included) lives in ``errors.py`` and
  derives from ``HyperrecipeError`` and a builtin (that the lint still imports no torch is
  tests/lint/test_cli.py's);
- the lint's screen and its rule base share only the guarded names, neither imports the other.
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
import importlib.util, json, sys
from pathlib import Path
from hyperrecipe import compile_recipe, load_recipe
from hyperrecipe.model_tree import build_model

root = Path(sys.argv[1])
compiled, skipped = [], []
for path in sorted((root / "recipes").glob("*.yaml")):
    recipe = load_recipe(str(path))
    family = path.stem.split("-")[0]
    if family == "torchtitan":  # torchtitan's own model code, not a transformers family
        if importlib.util.find_spec("torchtitan") is None:
            skipped.append(path.stem)
            continue
        model = build_model("hyperrecipe.models.torchtitan:build_llama3")
    else:
        model = build_model(f"hf:{family}", str(root / "recipes/models" / f"tiny-{family}.json"))
    plan = compile_recipe(recipe, model, {d: 2 for d in recipe.mesh}, verify=False)
    compiled.append(plan.recipe)
runtime = sorted(m for m in sys.modules if m.startswith("hyperrecipe.runtime"))
print(json.dumps({"compiled": compiled, "skipped": skipped, "runtime": runtime}))
"""


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_resolving_every_shipped_recipe_imports_no_runtime_module() -> None:
    """The resolver is pure: ``compile_recipe(..., verify=False)`` imports no runtime module.
    Verification (``hyperrecipe/verify/``) sits above the runtime and runs ``apply``."""
    done = subprocess.run([sys.executable, "-c", COMPILE_ALL, str(ROOT)], capture_output=True,
                          text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert len(result["compiled"]) + len(result["skipped"]) == len(shipped)
    assert "llama-cp" in shipped and "torchtitan-llama3" in shipped
    # only recipes for torchtitan's model code wait for torchtitan (the `titan` extra)
    assert all(name.startswith("torchtitan-") for name in result["skipped"])
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
    assert (PRODUCTION.parameters_are_dtensors, VALIDATE.parameters_are_dtensors) == (False, True)
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


OUTSIDE_THE_ROOT = {
    "DeadlinePassed": "check's SIGALRM deadline is raised inside user code and must get past "
                      "its `except Exception`; parent_deadline turns it into a CheckError",
}
"""Exceptions in errors.py that derive from ``BaseException`` but not ``HyperrecipeError`` (nor
``Exception``), each with its reason. Nothing else may."""

NOT_MOVED_YET: dict[str, str] = {}
"""Exception classes still defined outside errors.py, by module path, with why. Empty this as
each moves: the test fails while a name here has moved, so the list cannot go stale."""


def _package_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in a module of the package, the lint's included."""
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(hyperrecipe.__path__, "hyperrecipe."):
        if info.name == "hyperrecipe.__main__":
            continue
        try:
            module = __import__(info.name, fromlist=["_"])
        except ModuleNotFoundError as exc:  # a trainer integration without its extra
            if info.name.startswith("hyperrecipe.trainers.") and exc.name in (
                    "accelerate", "lightning", "trl"):
                continue
            raise
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_every_exception_lives_in_errors_and_has_one_root() -> None:
    classes = _package_exceptions()
    assert HyperrecipeError in classes
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in classes}
    assert {f"hyperrecipe.lint.{name}" for name in ("codes.SelectorError", "config.ConfigError",
                                                    "prefilter.InterpreterLimit")}.isdisjoint(names)
    for path, why in NOT_MOVED_YET.items():
        assert path in names, f"{path} moved: remove it from NOT_MOVED_YET ({why})"
    for cls in classes:
        path = f"{cls.__module__}.{cls.__qualname__}"
        if path in NOT_MOVED_YET:
            continue
        assert cls.__module__ == "hyperrecipe.errors", f"{path}: define it in hyperrecipe/errors.py"
        if cls is HyperrecipeError:
            continue
        if cls.__name__ in OUTSIDE_THE_ROOT:
            assert not issubclass(cls, Exception), cls
            continue
        assert issubclass(cls, HyperrecipeError), cls
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins"
                   and b not in (object, BaseException, Exception)]
        assert builtin, f"{cls.__name__} derives from no fitting builtin"


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or in a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_lints_rules_and_its_screen_do_not_import_each_other() -> None:
    """The screen (``prefilter``) and the rule base share only the guarded names (``targets``):
    the screen must stay free of libcst, and a rule must not depend on how files are screened."""
    lint = ROOT / "hyperrecipe" / "lint"
    screen = _imported_modules(lint / "prefilter.py")
    assert not {m for m in screen if m.startswith(("libcst", "hyperrecipe.lint.rule"))}, screen
    assert "hyperrecipe.lint.targets" in screen
    for path in [lint / "rule.py", *sorted((lint / "rules").glob("*.py"))]:
        assert "hyperrecipe.lint.prefilter" not in _imported_modules(path), path


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


def _module_graph() -> dict[str, set[str]]:
    """Which ``hyperrecipe`` modules each module imports when it runs (module level or inside
    a function; imports under ``if TYPE_CHECKING:`` are for the type checker only)."""
    package = ROOT / "hyperrecipe"
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module in names:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" in names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in names)
        graph[name] = deps - {name}
    return graph


def test_no_module_of_the_package_imports_itself_back() -> None:
    graph = _module_graph()
    assert "hyperrecipe.runtime.mode" in graph
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
