"""``[tool.hyperrecipe.lint]``: which rules run, which files are skipped, who may install forwards.

The table is read from the nearest ``pyproject.toml`` *that has one*, searching upward from each
linted file, so a monorepo can hold several projects with their own settings. Keys::

    [tool.hyperrecipe.lint]
    rewriter = ["hyperrecipe/rewriter.py"]   # files or folders allowed to install forwards
    exclude  = [".venv*", "build"]            # globs, on top of the built-in excludes
    select   = ["HR0", "process-patch"]        # codes, names or code prefixes (default: all
                                               # but opt-in HR005, selected only by name/code)
    ignore   = ["class-swap"]
    [tool.hyperrecipe.lint.per-file-ignores]
    "tests/*" = ["HR001"]                      # glob -> codes not reported in matching files

Paths and globs are relative to the ``pyproject.toml`` that holds them. Without any table every
rule but the opt-in ones (HR005) is on and no path is allowed to install forwards.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from hyperrecipe._files import read_regular_file
from hyperrecipe.errors import ConfigError, SelectorError, did_you_mean
from hyperrecipe.lint.codes import resolve_selectors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["DEFAULT_EXCLUDE", "ConfigError", "LintConfig", "ConfigFinder", "load_config"]

#: Folders no one wants linted; always skipped, in addition to ``exclude``.
DEFAULT_EXCLUDE: Final[tuple[str, ...]] = (
    ".git", ".hg", ".svn", ".bzr", "__pycache__", ".mypy_cache", ".pytest_cache",
    ".ruff_cache", ".hypothesis", ".tox", ".nox", ".venv", "venv", ".eggs", "*.egg-info",
    "node_modules", "__pypackages__",
)
_KEYS: Final = ("rewriter", "exclude", "select", "ignore", "per-file-ignores")


@attrs.frozen(kw_only=True)
class LintConfig:
    """The settings that apply to one file.

    Args:
        source: the ``pyproject.toml`` they came from (``None``: defaults).
        root: the folder paths and globs are relative to (the pyproject's folder).
        rewriter: absolute paths (files or folders) allowed to install forwards.
        exclude: globs from the table (the built-in :data:`DEFAULT_EXCLUDE` apply as well).
        select: codes, names or prefixes to report; ``None`` for the default selection (every
            rule but the opt-in ones).
        ignore: codes, names or prefixes not to report.
        per_file_ignores: ``(glob, codes)`` pairs: codes not reported in the files the glob
            matches (see :meth:`ignores_for`).
    """

    source: Path | None = None
    root: Path | None = None
    rewriter: tuple[Path, ...] = ()
    exclude: tuple[str, ...] = ()
    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def ignores_for(self, path: Path) -> tuple[str, ...]:
        """The ``per-file-ignores`` codes that apply to ``path`` (absolute), as ruff matches them.

        A glob without ``/`` matches the file name (``"conftest.py"``, ``"test_*.py"``); a glob
        with ``/`` matches the path relative to :attr:`root`, ``*`` crossing folders
        (``"tests/*"`` is every file below ``tests/``).
        """
        if not self.per_file_ignores:
            return ()
        relative = path.name
        if self.root is not None:
            with contextlib.suppress(ValueError):
                relative = path.relative_to(self.root).as_posix()
        found: list[str] = []
        for pattern, codes in self.per_file_ignores:
            subject = relative if "/" in pattern.strip("/") else path.name
            if fnmatch.fnmatchcase(subject, pattern.strip("/")):
                found.extend(codes)
        return tuple(found)

    def allows_forward_install(self, path: Path) -> bool:
        """Whether ``path`` (absolute) is one of the rewriter paths or inside one."""
        if not self.rewriter:
            return False
        text = str(path)  # (on strings: `path.parents` costs ~10 µs a level, for every file)
        for allowed in self.rewriter:
            folder = str(allowed)
            if text == folder or text.startswith(folder.rstrip(os.sep) + os.sep):
                return True
        return False

    def is_excluded(self, path: Path, *, named: Path, force: bool = False) -> bool:
        """Whether ``path`` (absolute, file or folder) matches an exclude glob.

        ``named`` is the path the user named (on the command line, or pre-commit for them) that
        ``path`` was found under, or ``path`` itself. As in ruff, only what lies *below* a named
        path can be excluded: the named path itself and the folders above it never are, so
        ``hyperrecipe lint .venv/lib/.../torch/distributed`` lints that folder although
        ``.venv*`` is excluded. With ``force`` (``--force-exclude``, which the pre-commit hooks
        pass) the named path and its folders up to :attr:`root` are matched too, so the files
        pre-commit hands over honour ``exclude``.

        Globs see the path relative to :attr:`root` (or, without a configuration or for a path
        outside it, relative to the folder holding ``named``). A glob without ``/`` matches any
        single component (``build`` skips every ``build/`` folder); a glob with ``/`` matches the
        relative path or one of its leading folders (``tests/fixtures`` skips all below it).
        """
        parts, named_parts = _relative_parts(path, named, self.root)
        first = 0 if force else len(named_parts)  # components that may exclude start here
        if first >= len(parts):
            return False
        component, nested = _matchers(self.exclude)
        if any(component(part) for part in parts[first:]):
            return True
        if nested is not None:
            for end in range(first + 1, len(parts) + 1):
                if nested("/".join(parts[:end])):
                    return True
        return False


_Matcher = Callable[[str], "re.Match[str] | None"]


@functools.lru_cache(maxsize=64)
def _matchers(exclude: tuple[str, ...]) -> tuple[_Matcher, _Matcher | None]:
    """One regex for the globs matched against single components (with the built-in ones), one
    for those with ``/`` (``None`` if none): what ``fnmatchcase`` does glob by glob, in one match
    (discovery checks every folder and file of a tree)."""
    component: list[str] = []
    nested: list[str] = []
    for pattern in (*DEFAULT_EXCLUDE, *exclude):
        pattern = pattern.strip("/")
        (nested if "/" in pattern else component).append(fnmatch.translate(pattern))
    match_component = re.compile("|".join(component)).match
    match_nested = re.compile("|".join(nested)).match if nested else None
    return match_component, match_nested


def _relative_parts(
    path: Path, named: Path, root: Path | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``path`` and ``named`` as components relative to ``root`` (or to ``named``'s folder).

    ``named`` counts as ``()`` when it lies above the folder (a run over a parent of the
    project): then every component of ``path`` below that folder may exclude it.
    """
    folders = (root, named.parent) if root is not None else (named.parent,)
    for folder in folders:
        relative = _parts_below(path, folder)
        if relative is None:
            continue
        return relative, _parts_below(named, folder) or ()
    return (path.name,), ()


def _parts_below(path: Path, folder: Path) -> tuple[str, ...] | None:
    """``path.relative_to(folder).parts`` for absolute, normalised paths (``None`` when ``path``
    is not below ``folder``), on strings: ``Path.relative_to`` costs ~10 µs and discovery asks
    for every folder and file."""
    text, base = str(path), str(folder)
    if text == base:
        return ()
    if not base.endswith(os.sep):
        base += os.sep
    if not text.startswith(base):
        return None
    return tuple(text[len(base):].split(os.sep))


def _string_list(table: Mapping[str, Any], key: str, source: Path, *,
                 table_name: str = "") -> tuple[str, ...] | None:
    if key not in table:
        return None
    value = table[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        where = f"{table_name} {key!r}" if table_name else key
        msg = (
            f"{source}: [tool.hyperrecipe.lint] {where} must be a list of strings, "
            f"got {str(value)[:200]}"
        )
        raise ConfigError(msg)
    return tuple(value)


MAX_PYPROJECT_BYTES: Final = 16 * 2**20
"""Largest ``pyproject.toml`` read for its ``[tool.hyperrecipe.lint]`` table."""


def load_config(pyproject: Path) -> LintConfig | None:
    """Read ``[tool.hyperrecipe.lint]`` from ``pyproject`` (``None`` when it has no such table).

    Raises:
        ConfigError: the file is not valid TOML, or the table has unknown keys or bad values.
    """
    try:
        raw = read_regular_file(pyproject, limit=MAX_PYPROJECT_BYTES)
        if raw.startswith(b"\xef\xbb\xbf"):
            msg = (f"{pyproject}: cannot read configuration: the file starts with a UTF-8 byte "
                   f"order mark, which TOML parsers (pip's too) refuse; save it as UTF-8 "
                   f"without BOM")
            raise ConfigError(msg)
        data = tomllib.loads(raw.decode("utf-8"))
    except OSError as exc:
        msg = f"{pyproject}: cannot read configuration: {exc.strerror or exc}"
        raise ConfigError(msg) from exc
    except UnicodeDecodeError as exc:
        msg = (f"{pyproject}: cannot read configuration: not UTF-8 text ({exc.reason} at byte "
               f"{exc.start})")
        raise ConfigError(msg) from exc
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        msg = f"{pyproject}: cannot read configuration: {type(exc).__name__}: {exc}"
        raise ConfigError(msg) from exc
    table: Any = data
    for depth, key in enumerate(("tool", "hyperrecipe", "lint")):
        if not isinstance(table, dict):  # `tool = 1`: not ours to judge, but not a table
            where = ".".join(("tool", "hyperrecipe", "lint")[:depth])
            msg = f"{pyproject}: [{where}] must be a table, found {type(table).__name__}"
            raise ConfigError(msg)
        table = table.get(key)
        if table is None:
            return None
    if not isinstance(table, dict):
        msg = f"{pyproject}: [tool.hyperrecipe.lint] must be a table"
        raise ConfigError(msg)
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        msg = (
            f"{pyproject}: [tool.hyperrecipe.lint] has unknown key {unknown[0]!r}"
            f"{did_you_mean(unknown[0], _KEYS)}; known keys: {', '.join(_KEYS)}"
        )
        raise ConfigError(msg)
    root = pyproject.parent.resolve()
    rewriter = _string_list(table, "rewriter", pyproject) or ()
    return LintConfig(
        source=pyproject,
        root=root,
        rewriter=tuple(Path(os.path.normpath(root / entry)) for entry in rewriter),
        exclude=_string_list(table, "exclude", pyproject) or (),
        select=_string_list(table, "select", pyproject),
        ignore=_string_list(table, "ignore", pyproject) or (),
        per_file_ignores=_per_file_ignores(table, pyproject),
    )


def _per_file_ignores(
    table: Mapping[str, Any], source: Path
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    value = table.get("per-file-ignores", {})
    if not isinstance(value, dict):
        msg = (f"{source}: [tool.hyperrecipe.lint] per-file-ignores must be a table of "
               f"glob = [codes], got {value!r}")
        raise ConfigError(msg)
    pairs = []
    for pattern in value:
        listed = _string_list(value, pattern, source, table_name="per-file-ignores")
        if listed is None:  # pragma: no cover - the key is there
            continue
        try:
            resolve_selectors(listed, where=f"{source}: per-file-ignores {pattern!r}")
        except SelectorError as exc:
            raise ConfigError(str(exc)) from exc
        pairs.append((pattern, listed))
    return tuple(pairs)


class ConfigFinder:
    """Finds the configuration for a folder, caching every folder on the way up."""

    def __init__(self) -> None:
        self._by_folder: dict[Path, LintConfig] = {}

    def for_folder(self, folder: Path) -> LintConfig:
        """The configuration that applies to files in ``folder`` (absolute)."""
        cached = self._by_folder.get(folder)
        if cached is not None:
            return cached
        candidate = folder / "pyproject.toml"
        found = load_config(candidate) if candidate.is_file() else None
        if found is None:
            parent = folder.parent
            found = LintConfig() if parent == folder else self.for_folder(parent)
        self._by_folder[folder] = found
        return found

    def for_path(self, path: Path) -> LintConfig:
        """The configuration for a file or folder (absolute)."""
        return self.for_folder(path if path.is_dir() else path.parent)
