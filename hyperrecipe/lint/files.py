"""Which files a lint run looks at: Python sources and recipe files, found under the given paths."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

from hyperrecipe.lint.config import ConfigFinder, LintConfig
from hyperrecipe.lint.recipes import RECIPE_SUFFIXES, is_recipe_file

__all__ = ["PYTHON_SUFFIXES", "Target", "discover", "display_path"]

PYTHON_SUFFIXES: Final = (".py", ".pyi")
TargetKind = Literal["python", "recipe"]


@attrs.frozen(kw_only=True)
class Target:
    """One file to lint.

    Args:
        path: absolute path.
        display: how it is shown (relative to the working directory when inside it).
        kind: ``"python"`` or ``"recipe"``.
        config: the configuration that applies to it.
        size: bytes, to schedule big files first.
        from_stdin: the source is standard input (``-``); ``path`` is ``--stdin-filename``.
    """

    path: Path
    display: str
    kind: TargetKind
    config: LintConfig
    size: int
    from_stdin: bool = False


def display_path(path: Path, cwd: Path) -> str:
    try:
        return path.relative_to(cwd).as_posix()
    except ValueError:
        return str(path)


def _walk(folder: Path, named: Path, finder: ConfigFinder,
          unreadable: list[tuple[Path, str]]) -> Iterator[tuple[Path, int, bool]]:
    """Files under ``folder`` as (path, size, is_python), skipping excluded folders and files;
    a folder that cannot be listed, or an entry that cannot be examined (a symlink loop, a
    path longer than the OS allows, an entry removed while walked), is appended to
    ``unreadable`` with what to say about it, never skipped silently."""
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        config = finder.for_folder(folder)  # looks for its pyproject.toml
    except OSError as exc:
        unreadable.append((folder, f"folder could not be read ({_reason(exc)}); nothing below "
                                   f"it was checked"))
        return
    for entry in entries:
        path = folder / entry.name
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError as exc:
            unreadable.append((path, f"could not be read ({_reason(exc)}); not checked"))
            continue
        if is_dir:
            try:
                excluded = config.is_excluded(path, named=named)
            except OSError:
                excluded = False  # reported by the walk below, which cannot list it either
            if not excluded:
                yield from _walk(path, named, finder, unreadable)
            continue
        try:
            suffix = os.path.splitext(entry.name)[1]
            if suffix not in PYTHON_SUFFIXES and suffix not in RECIPE_SUFFIXES:
                continue
            if not entry.is_file():  # a symlink to nothing, a FIFO, a socket: nothing to read
                continue
            if not config.is_excluded(path, named=named):
                yield path, entry.stat().st_size, suffix in PYTHON_SUFFIXES
        except OSError as exc:
            unreadable.append((path, f"could not be read ({_reason(exc)}); not checked"))


def _reason(exc: OSError) -> str:
    """What the OS said, without the path (the finding names it)."""
    return exc.strerror or type(exc).__name__


def discover(
    paths: Sequence[str], finder: ConfigFinder, *, force_exclude: bool = False
) -> tuple[list[Target], list[str], list[tuple[Path, str]]]:
    """Expand the command-line paths into targets.

    Folders are walked (recursively, not following symlinked folders) for ``.py``/``.pyi`` files
    and for ``.yaml``/``.yml``/``.toml`` files with a top-level ``recipe`` key. A file named
    explicitly is linted as Python unless it has a recipe suffix (pre-commit hands over scripts
    without a suffix). A named file or folder is linted even where ``exclude`` matches it or a
    folder above it, unless ``force_exclude`` (ruff's ``--force-exclude``; the pre-commit hooks
    pass it, so the files pre-commit hands over honour ``exclude``).

    Returns:
        The targets (each file once, in a stable order), the paths that do not exist, and the
        folders and entries below the named paths that could not be read, each with a message
        giving the OS's reason.
    """
    cwd = Path.cwd()
    seen: set[Path] = set()
    targets: list[Target] = []
    missing: list[str] = []
    unreadable: list[tuple[Path, str]] = []

    def add(path: Path, size: int, is_python: bool) -> None:
        if path in seen:
            return
        seen.add(path)
        if not is_python and not is_recipe_file(path):
            return
        targets.append(
            Target(
                path=path,
                display=display_path(path, cwd),
                kind="python" if is_python else "recipe",
                config=finder.for_folder(path.parent),
                size=size,
            )
        )

    for raw in paths:
        path = Path(os.path.abspath(raw))
        kind = _kind(path)
        if kind == "dir":
            if finder.for_folder(path).is_excluded(path, named=path, force=force_exclude):
                continue
            for found, size, is_python in _walk(path, path, finder, unreadable):
                add(found, size, is_python)
        elif kind == "file":
            if finder.for_folder(path.parent).is_excluded(path, named=path, force=force_exclude):
                continue
            add(path, path.stat().st_size, path.suffix not in RECIPE_SUFFIXES)
        else:
            missing.append(raw if kind is None else f"{raw} ({kind})")
    return targets, missing, unreadable


def _kind(path: Path) -> str | None:
    """``"dir"``, ``"file"`` (regular), what else is there (``"a FIFO, not a regular file"``),
    or ``None`` when nothing is; a name the OS refuses (too long, a NUL byte) is ``None``."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    what = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
            or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "special")
    return f"{what}, not a regular file"
