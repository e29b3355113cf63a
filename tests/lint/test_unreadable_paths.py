"""A path the lint could not read is reported (``HR997 path-not-read``), never passed (issue 41).

The walk used to skip a folder it could not list, and an entry it could not examine, without a
word: a tree whose folders were unreadable linted "clean" with exit 0. Each case here is real:
a ``chmod 000`` folder (tests run as root, whom permissions do not stop, so the lint runs
under ``setpriv`` without the two capabilities that let root read anything), a symlink loop
named ``*.py``, and a folder whose absolute path is longer than ``PATH_MAX``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hyperrecipe.lint.runner import lint_paths
from tests.support.runtime_harness import ROOT

HIT = "def f(m):\n    m.forward = None\n"


def _rows(tmp_path: Path, *paths: Path) -> tuple[list[tuple[str, str, str]], int]:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = lint_paths([str(p) for p in paths], jobs=1)
    finally:
        os.chdir(cwd)
    return [(f.path, f.code, f.message) for f in result.findings], result.exit_code


def test_a_folder_that_cannot_be_listed_is_reported_and_fails_the_run(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "locked").mkdir(parents=True)
    (tree / "locked" / "hit.py").write_text(HIT)
    (tree / "clean.py").write_text("x = 1\n")
    os.chmod(tree / "locked", 0)
    tree.chmod(0o755)
    command = [sys.executable, "-m", "hyperrecipe", "lint", "tree"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root reads a chmod-000 folder, and setpriv is not here to stop it")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    try:
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.chmod(tree / "locked", 0o755)
    assert done.stdout == ("tree/locked:1:1: HR997 path-not-read folder could not be read "
                           "(Permission denied); nothing below it was checked\n")
    assert done.stderr == "hyperrecipe lint: 0 findings, 1 path not read in 1 file checked\n"
    assert done.returncode == 2


def test_a_symlink_loop_named_like_a_python_file_is_reported(tmp_path: Path) -> None:
    (tmp_path / "loop.py").symlink_to("loop.py")
    (tmp_path / "hit.py").write_text(HIT)
    rows, code = _rows(tmp_path, tmp_path)
    assert rows[0][:2] == ("hit.py", "HR001")
    assert rows[1] == ("loop.py", "HR997", "could not be read (Too many levels of symbolic "
                                           "links); not checked")
    assert code == 1  # a finding; without it the unread path alone exits 2


def _deep_folder(base: Path, total: int) -> None:
    """A chain of 200-character folder names below ``base`` whose absolute path is longer
    than ``total`` bytes, made through directory descriptors (no path the OS is handed is
    too long), with a file holding a finding at the bottom."""
    name = "d" * 200
    fd = os.open(base, os.O_RDONLY)
    try:
        for _ in range(total // (len(name) + 1) + 1):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        hit = os.open("hit.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(hit, HIT.encode())
        os.close(hit)
    finally:
        os.close(fd)


def test_files_below_a_path_longer_than_path_max_are_reported_not_skipped(
        tmp_path: Path) -> None:
    deep = tmp_path / "deep"
    deep.mkdir()
    _deep_folder(deep, 6000)
    path_max = os.pathconf("/", "PC_PATH_MAX")  # 4096 on Linux, the terminating NUL included
    first = deep / ("d" * 200)  # the first folder whose pyproject.toml cannot be looked for
    while len(str(first / "pyproject.toml")) < path_max:
        first = first / ("d" * 200)
    rows, code = _rows(tmp_path, deep)
    assert rows == [(str(first.relative_to(tmp_path)), "HR997", "folder could not be read "
                     "(File name too long); nothing below it was checked")]
    assert code == 2


def test_an_unreadable_path_cannot_be_deselected(tmp_path: Path) -> None:
    (tmp_path / "loop.py").symlink_to("loop.py")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = lint_paths(["."], select=["HR001"], ignore=["HR9"], jobs=1)
    finally:
        os.chdir(cwd)
    assert [f.code for f in result.findings] == ["HR997"] and result.exit_code == 2
