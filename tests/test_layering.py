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
import re
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
        builder = path.stem.removeprefix("torchtitan-").removesuffix("-dp-tp").replace("-", "_")
        model = build_model(f"hyperrecipe.models.torchtitan:build_{builder}")
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
    "state": {"comm", "preflight"},
    # beside tensor parallel each stage model is applied like any model, with apply handed in
    # by the front (runtime/pipeline/beside.py; Installation for the type checker only);
    # pipe.state is the stages' state fronts over the state room's shared DCP/export code
    "pipeline": {"installation", "preflight", "state"},
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


# Every private name of someone else's code the runtime touches, with why it must. A name that
# starts with an underscore and that no module of the package defines is someone else's private
# attribute (torch's: there is no transformers or other model library's name left, those are
# answered by hyperrecipe/models/ behind its protocol). Our own markers on other objects start
# with ``_hyperrecipe_`` or ``_hr_``.
FOREIGN_PRIVATE_NAMES: dict[str, str] = {
    "_C": "torch's C extension: the functorch transform check and _set_grad_enabled state",
    "_functorch": "torch._C._functorch: whether a functorch transform is active (collectives "
                  "refuse to run inside vmap/grad)",
    "_are_functorch_transforms_active": "the same check on torch versions that expose it flat",
    "_DropoutNd": "the base class of every torch dropout layer (the randomness preflight)",
    "_apply": "nn.Module._apply, the one seam that sees to()/to_empty() moves of parameters",
    "_buffers": "nn.Module._buffers: a buffer is replaced in place after a meta apply",
    "_parameters": "nn.Module._parameters: a parameter is swapped without setattr's checks "
                   "(which refuse a DTensor over a Parameter)",
    "_non_persistent_buffers_set": "which buffers state_dict() leaves out (not in checkpoints)",
    "_cdata": "a meta tensor's storage identity: meta tensors have no data_ptr",
    "_local_tensor": "DTensor's local shard without to_local()'s autograd node",
    "_op_dispatcher": "DTensor's sharding-propagation table, where validate rules register",
    "_scaled_dot_product_flash_attention_for_cpu": "the CPU flash-attention op DTensor has no "
                                                   "rule for (validate mode registers one)",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "its backward, likewise",
    "_execution_engine": "autograd's engine: a callback queued at the end of the backward pass "
                         "reduces gradient buckets",
    "_sequence_nr": "an autograd node's creation order: which input gradients a boundary's "
                    "backward produced",
    "_foreach_norm": "torch's multi-tensor norm, as clip_grad_norm_ computes it",
    "_foreach_mul_": "torch's multi-tensor scale, as clip_grad_norm_ applies it",
    "_get_total_norm": "torch's clip_grad_norm_ helper, routed to the plan's full norm",
    "_clip_grads_with_norm_": "torch's clip_grad_norm_ helper, routed likewise",
    "_active_ddp_module": "DDP's marker of the module it is running (the DDP guard)",
    "_ddp_params_and_buffers_to_ignore": "the parameters DDP must not average (hook-reduced)",
    "_set_params_and_buffers_to_ignore_for_model": "DDP's setter for the same",
    "_MEM_FORMAT_ENCODING": "DCP's metadata pickle names it (the bounded unpickler's allowlist)",
    "_StorageInfo": "DCP's storage record in .metadata (the bounded unpickler's allowlist)",
    "_get_layout": "torch.serialization's layout table, named by DCP's metadata pickle",
}


def _package_names() -> set[str]:
    """Every name the package defines or assigns: its functions, classes, arguments, variables
    and attributes it stores."""
    names: set[str] = set()
    for path in (ROOT / "hyperrecipe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _foreign_private_names(path: Path, ours: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        name = (node.attr if isinstance(node, ast.Attribute)
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.isidentifier() else None)
        if name and name.startswith("_") and not name.startswith("__") and name not in ours \
                and not name.startswith(("_hyperrecipe_", "_hr_")):
            found.add(name)
    return found


def test_every_foreign_private_name_the_runtime_touches_is_allowed_with_a_reason() -> None:
    ours = _package_names()
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "hyperrecipe" / "runtime").rglob("*.py")):
        for name in _foreign_private_names(path, ours):
            used.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    unexplained = {name: where for name, where in used.items()
                   if name not in FOREIGN_PRIVATE_NAMES}
    assert unexplained == {}, "give each a reason in FOREIGN_PRIVATE_NAMES, or ask a library"
    stale = sorted(set(FOREIGN_PRIVATE_NAMES) - set(used))
    assert stale == [], f"no longer used: remove {stale} from FOREIGN_PRIVATE_NAMES"


# The third-party packages the runtime may import, with why; the standard library aside.
RUNTIME_THIRD_PARTY: dict[str, str] = {
    "torch": "the substrate: tensors, autograd, DTensor, process groups, DCP",
    "attrs": "the runtime's records (frozen, slotted)",
    "xxhash": "xxh3_128 file digests where it is installed (sha256 otherwise)",
}


def _top_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_runtime_reaches_model_libraries_only_through_their_protocol() -> None:
    """No runtime module imports a model library (transformers, torchtitan, ...) or a module of
    ``hyperrecipe/models/`` other than its front; what it may import from outside the package
    and the standard library is :data:`RUNTIME_THIRD_PARTY`."""
    from hyperrecipe import models

    offenders = []
    for path in sorted((ROOT / "hyperrecipe" / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "hyperrecipe.models":
                offenders += [f"{rel}: {a.name}" for a in node.names
                              if a.name not in models.__all__]
        for name in _top_level_imports(path):
            top = name.split(".")[0]
            if name.startswith("hyperrecipe.models."):
                offenders.append(f"{rel}: {name} (import hyperrecipe.models' front)")
            elif top != "hyperrecipe" and top not in sys.stdlib_module_names \
                    and top not in RUNTIME_THIRD_PARTY:
                offenders.append(f"{rel}: {name}")
    assert offenders == []


def test_a_plain_model_gets_plain_torchs_answers() -> None:
    """A model no registered library recognises: every question answers "not mine"."""
    from torch import nn

    from hyperrecipe.models import LIBRARY

    model = nn.Sequential(nn.Linear(2, 2))
    assert LIBRARY.attention_implementation(model) is None
    assert LIBRARY.loss_seat(model) is None and LIBRARY.router_loss(model) is None
    assert LIBRARY.initializer(model) is None and not LIBRARY.is_transposed_linear(model[0])
    assert (LIBRARY.tied_weight_keys(model), LIBRARY.base_model_prefix(model),
            tuple(LIBRARY.ignored_checkpoint_keys(model)),
            LIBRARY.expert_kernel_flags(model[0])) == ({}, None, (), {})
    assert LIBRARY.size_to_bytes(1024) == 1024


def test_a_registered_library_is_asked_first() -> None:
    from torch import nn

    from hyperrecipe import models

    class Marked(nn.Linear):
        pass

    class Ours(models.PlainTorch):
        name = "ours"

        def is_transposed_linear(self, module: nn.Module) -> bool:
            return isinstance(module, Marked)

        def base_model_prefix(self, model: nn.Module) -> str | None:
            return "backbone" if isinstance(model, Marked) else None

    library = Ours()
    assert isinstance(models.LIBRARY, models._Libraries)
    models.register_library(library)
    try:
        assert models.LIBRARY.is_transposed_linear(Marked(2, 2))
        assert models.LIBRARY.base_model_prefix(Marked(2, 2)) == "backbone"
        assert models.LIBRARY.base_model_prefix(nn.Linear(2, 2)) is None
    finally:
        models.LIBRARY.registered.remove(library)


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


def _room(module: str) -> str:
    """The room a module lives in: a subpackage of the runtime (``runtime.state``), the mode
    (``runtime.mode``, which every room asks), the runtime's top (``install``,
    ``installation``), or a subpackage or module of the package (``check``, ``plan``)."""
    parts = module.split(".")
    if parts[:2] == ["hyperrecipe", "runtime"] and len(parts) > 2:
        if parts[2] == "mode" or (ROOT / "hyperrecipe" / "runtime" / parts[2]).is_dir():
            return f"runtime.{parts[2]}"
        return "runtime"
    return parts[1] if len(parts) > 1 else "hyperrecipe"


def test_no_room_imports_itself_back_through_another() -> None:
    """Rooms (:func:`_room`) form no cycle in code that runs: imports inside functions count,
    imports for the type checker alone do not."""
    arrows: dict[str, set[str]] = {}
    for module, deps in _module_graph().items():
        for dep in deps:
            if _room(module) != _room(dep):
                arrows.setdefault(_room(module), set()).add(_room(dep))
    assert "runtime.state" in arrows["runtime"] and "runtime.mode" in arrows["runtime.state"]
    cycles = []
    done: set[str] = set()

    def visit(room: str, path: list[str]) -> None:
        for dep in sorted(arrows.get(room, ())):
            if dep in path:
                cycles.append([*path[path.index(dep):], dep])
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(room)

    for room in sorted(arrows):
        if room not in done:
            visit(room, [room])
    assert cycles == []


def test_the_mode_imports_none_of_the_rooms_that_ask_it() -> None:
    """Each mode's behaviour is registered by the feature it concerns (``@answers``); the mode
    itself imports nothing of the runtime in code that runs."""
    graph = _module_graph()
    assert {m for m in graph["hyperrecipe.runtime.mode"] if m.startswith("hyperrecipe.")} == {
        "hyperrecipe.errors"}


ANSWERED = """
import json
import hyperrecipe.runtime.mode as mode_module
from hyperrecipe.runtime.mode import MODES, QUESTIONS, _ANSWERS
missing = [f"{m}.{q}" for m in MODES for q in QUESTIONS if (m, q) not in _ANSWERS]
print(json.dumps({"missing": missing, "questions": len(QUESTIONS),
                  "owners": sorted({f.__module__ for f in _ANSWERS.values()})}))
"""


def test_importing_the_runtime_answers_every_question_for_every_mode() -> None:
    done = subprocess.run([sys.executable, "-c", ANSWERED], capture_output=True, text=True,
                          timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["missing"] == [] and result["questions"] >= 12
    assert "hyperrecipe.runtime.mode" not in result["owners"]
    assert {o.split(".")[2] for o in result["owners"]} >= {"comm", "forward", "features",
                                                           "grads"}


def _named_in(doc: str, name: str) -> bool:
    """Whether a package's docstring names ``name`` (a module or subpackage) as its map does:
    ````name````, ``name.py``, or a ``:mod:`` path ending in it."""
    return re.search(rf"``{name}(/|\.py)?``|`{name}(/|\.py)?`|\.{name}`|\b{name}\.py\b",
                     doc) is not None


def test_every_module_and_subpackage_is_on_its_packages_map() -> None:
    missing = []
    for init in sorted((ROOT / "hyperrecipe").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        package = init.parent
        children = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__",
                                                                           "__main__")]
        children += [d.name for d in package.iterdir() if (d / "__init__.py").is_file()]
        missing += [f"{package.relative_to(ROOT).as_posix()}/{name}" for name in children
                    if not _named_in(doc, name)]
    assert missing == [], "name each in its package's __init__ docstring"


def test_what_sits_above_the_runtime_uses_its_front_only() -> None:
    """``check``, ``verify``, ``simulate``, the trainers and ``api`` import the runtime's front
    (``hyperrecipe.runtime``'s ``__all__``), never a room's module: a room can then be
    reorganised without breaking a trainer."""
    import hyperrecipe.runtime

    offenders = []
    for path in sorted((ROOT / "hyperrecipe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("hyperrecipe/runtime/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "hyperrecipe.runtime"):
                if node.module != "hyperrecipe.runtime":
                    offenders.append(f"{rel}: {node.module}")
                else:
                    offenders += [f"{rel}: {a.name}" for a in node.names
                                  if a.name not in hyperrecipe.runtime.__all__]
            elif isinstance(node, ast.Import):
                offenders += [f"{rel}: {a.name}" for a in node.names
                              if a.name.startswith("hyperrecipe.runtime.")]
    assert offenders == []


def test_the_installation_keeps_at_most_twelve_public_members() -> None:
    """Training state moves in and out through ``inst.state`` (one front), trainer glue is
    plain functions (``hyperrecipe.runtime.data_parallel``, ``leave_together``): the handle
    itself stays small. Members set in ``__init__`` count as attributes do."""
    from hyperrecipe.runtime import Installation

    init = next(node for node in ast.walk(ast.parse(inspect.getsource(Installation)))
                if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    public = sorted({n for n in [*vars(Installation), *assigned] if not n.startswith("_")})
    assert "state" in public and len(public) <= 12, public
