"""Loading recipe files: formats, ``extends`` chains and shipped recipes.

``load_recipe`` is the one entry point that reads files; everything it returns is validated.
Shipped recipes live in the repository's ``recipes/`` folder and are found by name
(``extends: llama``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from hyperrecipe.errors import RecipeError, SourceSpan, check_path_arg, closest, did_you_mean
from hyperrecipe.recipe.schema import Recipe, Rule, StyleDef
from hyperrecipe.recipe.source import Document, read_document
from hyperrecipe.recipe.styles import BUILTIN_STYLES
from hyperrecipe.recipe.validate import validate_document, validate_rules, validate_styles

__all__ = ["check_recipe_file", "load_recipe", "shipped_recipe_dir", "shipped_recipes"]

_SUFFIXES = (".yaml", ".yml", ".toml")

MAX_EXTENDS_DEPTH = 32
"""Longest ``extends`` chain (shipped recipes use 2)."""
MAX_EXTENDS_LENGTH = 1024
"""Longest ``extends`` value (a relative path or a shipped recipe's name)."""


def shipped_recipe_dir() -> Path:
    """The folder of recipes that ship with hyperrecipe."""
    env = os.environ.get("HYPERRECIPE_RECIPES")
    if env:
        return Path(env)
    from hyperrecipe.shipped import shipped_dir

    return shipped_dir()


def shipped_recipes() -> dict[str, Path]:
    """Shipped recipe name → file."""
    folder = shipped_recipe_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in _SUFFIXES}


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load and validate a recipe file (YAML or TOML), following ``extends``.

    Args:
        path: a recipe file, or the name of a shipped recipe (``"llama"``).

    Returns:
        The recipe with base rules first; nothing about the model has been checked yet.

    Raises:
        RecipeError: the file is missing or malformed; the message names file:line:col.
        UsageError: ``path`` is not a ``str`` or ``os.PathLike``.
    """
    check_path_arg(path, "load_recipe: path")
    p = Path(path)
    if not _is_file(p) and p.suffix == "" and str(path) in shipped_recipes():
        p = shipped_recipes()[str(path)]
    if not _exists(p):
        _missing(str(path), p)
    return _load(p, str(path) if p == Path(path) else _display(p), chain=())


def _what_is_there(path: Path) -> str | None:
    """What a path that is not a regular file names (``None``: nothing)."""
    try:
        if not os.path.lexists(path):
            return None
        if path.is_symlink() and not path.exists():
            return "a symlink that leads nowhere (dangling, or a loop)"
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")


def _none_shipped() -> str:
    env = os.environ.get("HYPERRECIPE_RECIPES")
    return (f"(none found in HYPERRECIPE_RECIPES={env!r}, which should name a folder of "
            f"recipes; unset it for the recipes that ship with hyperrecipe)" if env
            else "(none found)")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return True  # a name the OS refuses: reading it says why


def _missing(given: str, path: Path) -> None:
    """Raise the error for a recipe that is neither a file nor a shipped recipe's name, with
    the nearest of both (a typo in ``recipes/lama.yaml`` or ``lama``)."""
    shipped = shipped_recipes()
    if path.suffix == "" and os.sep not in given and "/" not in given:
        hint = f"shipped recipes: {', '.join(sorted(shipped)) or _none_shipped()}"
        msg = (f"no recipe file {given!r} and no shipped recipe of that name"
               f"{did_you_mean(given, shipped)}")
    else:
        try:
            siblings = [c.name for c in path.parent.iterdir()
                        if c.suffix in _SUFFIXES and _is_file(c)]
        except OSError:
            siblings = []
        found = closest(path.name, siblings, n=1)
        # the path as typed, with the nearest file name of its folder in place of its last part
        near = (f"; did you mean {given[:len(given) - len(path.name)] + found[0]!r}?"
                if found and given.endswith(path.name) else "")
        hint = "a recipe is a .yaml, .yml or .toml file, or a shipped recipe's name (" + \
               ", ".join(sorted(shipped)[:4]) + ", ...)"
        msg = f"cannot read recipe file: no such file{near}"
    raise RecipeError(msg, span=SourceSpan(path=given, line=1, column=1), hint=hint)


def _is_file(path: Path) -> bool:
    """``path.is_file()``, false for names the OS refuses (too long, a NUL byte)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _load(path: Path, display: str, chain: tuple[Path, ...]) -> Recipe:
    doc = read_document(path, display=display)
    content = validate_document(doc)
    base: Recipe | None = None
    if content.extends is not None:
        if len(chain) + 1 >= MAX_EXTENDS_DEPTH:
            raise RecipeError(f"extends chain is longer than {MAX_EXTENDS_DEPTH} files",
                              span=doc.positions.span(("extends",)), path="$.extends",
                              hint=f"the chain so far starts at {chain[0] if chain else path}")
        base_path = _resolve_extends(doc, content.extends, path)
        resolved = base_path.resolve()
        if resolved in chain or resolved == path.resolve():
            names = " -> ".join(str(p) for p in (*chain, path.resolve(), resolved))
            raise RecipeError(f"extends forms a cycle: {names}",
                              span=doc.positions.span(("extends",)), path="$.extends")
        base = _load(base_path, _display(base_path), (*chain, path.resolve()))
        missing = [d for d in base.mesh if d not in content.mesh]
        if missing:
            raise RecipeError(
                f"recipe extends {content.extends!r} whose mesh dims {missing} it does not "
                f"declare", span=doc.positions.span(("mesh",)), path="$.mesh",
                hint=f"declared: [{', '.join(content.mesh)}]; required: "
                     f"[{', '.join(base.mesh)}] and any of this recipe's own")
    inherited: dict[str, StyleDef] = dict(BUILTIN_STYLES)
    if base is not None:
        inherited.update({s.name: s for s in base.styles})
    styles = validate_styles(doc, content, inherited)
    layer = 0 if base is None else len(base.files)
    own_rules = validate_rules(doc, content, styles, layer=layer)
    rules: tuple[Rule, ...] = (*(base.rules if base else ()), *own_rules)
    digest = _digest(doc, base)
    unclaimed = content.unclaimed or (base.unclaimed if base else "replicate")
    return Recipe(
        name=content.name, version=1, mesh=content.mesh, file=display,
        files=(*(base.files if base else ()), display),
        styles=tuple(s for s in styles.values() if not s.builtin),
        rules=rules, unclaimed=unclaimed,  # type: ignore[arg-type]
        adapters=(*(base.adapters if base else ()), *content.adapters),
        digest=digest, description=content.description, positions=doc.positions,
        pipeline=content.pipeline or (base.pipeline if base else None),
    )


def _resolve_extends(doc: Document, ref: str, path: Path) -> Path:
    if len(ref) > MAX_EXTENDS_LENGTH or "\0" in ref:
        problem = (f"is longer than {MAX_EXTENDS_LENGTH} characters" if "\0" not in ref
                   else "contains a NUL character")
        raise RecipeError(f"extends {ref[:60]!r}... {problem}",
                          span=doc.positions.span(("extends",)), path="$.extends")
    candidate = (path.parent / ref)
    if _is_file(candidate):
        return candidate
    shipped = shipped_recipes()
    if ref in shipped:
        return shipped[ref]
    there = _what_is_there(candidate)
    if there is not None:
        raise RecipeError(f"extends {ref!r}: {candidate} is {there}, not a recipe file",
                          span=doc.positions.span(("extends",)), path="$.extends")
    hint = f"shipped recipes: {', '.join(sorted(shipped)) or _none_shipped()}"
    raise RecipeError(f"extends {ref!r}: no such file next to this recipe and no shipped recipe "
                      f"of that name{did_you_mean(ref, shipped)}",
                      span=doc.positions.span(("extends",)), path="$.extends", hint=hint)


def _digest(doc: Document, base: Recipe | None) -> str:
    """Hash of the recipe's content (data, not formatting), including what it extends."""
    h = hashlib.sha256()
    h.update(json.dumps(_canonical(doc.data), sort_keys=True, separators=(",", ":")).encode())
    if base is not None:
        h.update(base.digest.encode())
    return h.hexdigest()


def _canonical(data: Any) -> Any:
    if isinstance(data, dict):
        return {str(k): _canonical(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_canonical(v) for v in data]
    return data


def check_recipe_file(path: str | os.PathLike[str]) -> list[RecipeError]:
    """Validate a recipe file without a model: the errors found (empty when it is valid).

    Used by ``hyperrecipe lint`` on recipe files. Validation stops at the first error of a file.
    Loading is bounded (see :mod:`hyperrecipe.recipe.source`); the RecursionError guard is a
    last resort that should never fire.
    """
    try:
        load_recipe(path)
    except RecipeError as exc:
        return [exc]
    except RecursionError:
        return [RecipeError("recipe nests too deeply", span=SourceSpan(path=str(path), line=1,
                                                                       column=1))]
    return []
