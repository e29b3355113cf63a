"""A state folder replaced in one step: the new state is written beside it, then switched in.

``save_pretrained`` used to rename its files into place one by one once the ranks agreed, and
remove the earlier export's others: a writer killed at the second of four renames left two
exports' shards under one index, which our ``load_weights`` refuses by the manifest but
transformers' ``from_pretrained`` loads without a word, and the old export was gone. A kill
while ``config.json`` was written left invalid JSON. So now every file a loader reads (weights,
index, ``config.json``, the manifest) is written into a *staging folder* first, and the staging
folder replaces the target in one atomic step: a loader sees the old state or the new one,
never a mix, and nothing of the old state is removed before the new one is complete.

**The switch** (:func:`commit`) is ``renameat2(staging, target, RENAME_EXCHANGE)`` (Linux 3.15,
local file systems: ext4, xfs, btrfs, tmpfs): the two folders trade names atomically. The
staging folder is the target's sibling ``.<name>.hyperrecipe-new``, so both lie on one file
system. What the folder holds besides the state (a tokenizer saved there, the lock
``hyperrecipe.lock``, a user's notes, subfolders) is carried over: files are hard-linked into
the staging folder before the exchange (the same inode: the lock's holder keeps its lock), and
whatever could not be linked (folders, or a file system without hard links) is moved across
just after it. The previous state, now under the staging name, is then removed.

**Where the exchange is not possible** (another OS, a network file system that refuses
``RENAME_EXCHANGE``, a target that is a mount point or this process's working folder, a parent
folder this process cannot write), the new state is staged inside the target instead
(``<target>/.hyperrecipe-new``) and renamed into place file by file, the files named ``last``
(the manifest, the commit record) after every other file and after the old state's leftovers
are removed. That is the old guarantee: a crash mid-switch leaves a folder our loaders refuse
by its manifest or commit record, which transformers' loader does not read. docs/security.md
says which file systems get which.

**Interrupted saves** are finished by the next writer of the folder (:func:`begin`, under the
folder's lock): a staging folder left beside the target holds either a new state never
switched in or the previous state after a switch whose cleanup was cut short; either way what
it holds besides the state and the target lacks is moved back, then it is removed.
:func:`leftovers` names such folders for ``status()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from hyperrecipe._files import sync_folder
from hyperrecipe.errors import SwitchIncompleteError

__all__ = ["MARKER", "STAGING_SUFFIX", "Staging", "SwitchIncompleteError", "abandon", "begin",
           "commit", "leftovers"]

STAGING_SUFFIX = ".hyperrecipe-new"
"""The staging folder is ``.<name>`` + this beside the target, or this inside it."""

MARKER = ".hyperrecipe-staging"
"""A file in a staging folder that may be removed whole (:func:`abandon`): there from
:func:`begin` until its switch begins, and again where the switch failed before the target
changed."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV,
                errno.EBUSY, errno.EPERM}
"""``renameat2`` errors that mean "not here" (the file system or kernel has no exchange): the
per-file switch is used instead."""


@attrs.frozen(kw_only=True)
class Staging:
    """Where a writer puts the new state of ``target`` before :func:`commit` switches it in."""

    target: Path
    """The folder the state replaces, resolved (a symlink to it is switched at its end)."""
    path: Path
    """The staging folder, empty but for :data:`MARKER` when :func:`begin` returns."""
    exchange: bool
    """Whether the staging folder is the target's sibling, switched in by exchange (else it is
    inside the target, switched in file by file)."""


def _renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # a C library without it (glibc < 2.28, musl < 1.2.4?)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> int:
    """``renameat2(a, b, RENAME_EXCHANGE)``: 0, or the errno it failed with."""
    fn = _renameat2()
    if fn is None:
        return errno.ENOSYS
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def _sibling(target: Path) -> Path:
    return target.parent / f".{target.name}{STAGING_SUFFIX}"


def _can_exchange(target: Path) -> bool:
    """Whether a sibling staging folder can be exchanged with ``target`` (before trying)."""
    if _renameat2() is None or target.parent == target:
        return False
    try:
        if os.stat(target).st_dev != os.stat(target.parent).st_dev:
            return False  # a mount point: its sibling lies on another file system
        cwd = Path.cwd().resolve()
    except OSError:
        return False
    # a process's working folder moved away under it would leave it in the removed old state
    return target != cwd and target not in cwd.parents


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def leftovers(folder: str | os.PathLike[str]) -> list[Path]:
    """Staging folders an interrupted save left for ``folder`` (its next save removes them)."""
    target = Path(folder).resolve()
    return [p for p in (_sibling(target), target / STAGING_SUFFIX) if os.path.lexists(p)]


def _recover(target: Path, owned: Callable[[str], bool]) -> None:
    """Finish what an interrupted save of ``target`` left. A staging folder inside the target
    is only new files: removed. A sibling one is either a new state never switched in (its
    other entries are links to the target's own) or the previous state after a switch whose
    cleanup was cut short (it may still hold entries that belong in the target): either way
    every entry that is not ``owned`` and not in the target is moved back, then it is
    removed."""
    inside = target / STAGING_SUFFIX
    if os.path.lexists(inside):
        _remove(inside)
    sibling = _sibling(target)
    if sibling.is_dir() and not sibling.is_symlink():
        _carry_back(sibling, target, owned)
    if os.path.lexists(sibling):
        _remove(sibling)


def begin(folder: str | os.PathLike[str], owned: Callable[[str], bool]) -> Staging:
    """An empty staging folder for a new state of ``folder`` (which exists: the caller holds
    its lock inside it), after finishing an interrupted save's switch (``owned`` as for
    :func:`commit`). Call on the one rank that holds the lock; the other ranks are told
    :attr:`Staging.path` where they write too.

    Raises:
        OSError: the staging folder cannot be made, nor an interrupted switch finished.
    """
    target = Path(folder).resolve()
    _recover(target, owned)
    if _can_exchange(target):
        path = _sibling(target)
        try:
            path.mkdir()
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
        else:
            (path / MARKER).touch()
            with contextlib.suppress(OSError):  # the folder keeps its mode (a group's g+w)
                os.chmod(path, stat.S_IMODE(os.stat(target).st_mode))
            return Staging(target=target, path=path, exchange=True)
    path = target / STAGING_SUFFIX
    path.mkdir()
    (path / MARKER).touch()
    return Staging(target=target, path=path, exchange=False)


def abandon(staging: Staging) -> None:
    """Remove a staging folder that will not be switched in (the save failed); the target is
    as it was. One whose :data:`MARKER` is gone is left alone: its switch began, so it may be
    the previous state holding entries of the user's (an interruption during the switch), which
    the next save's :func:`begin` moves back before removing it."""
    if not os.path.lexists(staging.path / MARKER):
        return
    with contextlib.suppress(FileNotFoundError):
        _remove(staging.path)


def commit(staging: Staging, owned: Callable[[str], bool], last: Sequence[str] = ()) -> None:
    """Switch the staging folder's state in for the target's.

    ``owned(name)``: whether an entry of the target belongs to the state being replaced (an
    earlier export's shards, its index, its config; a checkpoint's storage files): those are
    not carried over, so the earlier state's files the new one does not write are gone with
    it. Every other entry is kept. ``last``: names the per-file switch renames after all
    others (a record or manifest that vouches for them).

    Raises:
        SwitchIncompleteError: the switch failed after the target changed.
        OSError: the switch failed before the target changed (the exchange, or the first
            rename of the per-file switch): the staging folder may be abandoned.
    """
    target, path = staging.target, staging.path
    (path / MARKER).unlink()
    sync_folder(path)
    if staging.exchange:
        linked = _link_foreign(target, path, owned)
        failed = _exchange(path, target)
        if failed == 0:
            try:
                sync_folder(target.parent)
                _carry_back(path, target, owned)
                shutil.rmtree(path)
                sync_folder(target)
            except OSError as exc:
                raise SwitchIncompleteError(exc.errno or errno.EIO, f"{target} holds the new "
                                            f"state; moving the rest back from {path} failed: "
                                            f"{exc}") from exc
            return
        if failed not in _NO_EXCHANGE:
            (path / MARKER).touch()  # the target never changed: the folder may be abandoned
            raise OSError(failed, f"cannot switch {path} in for {target}: "
                                  f"{os.strerror(failed)}", str(target))
        for name in linked:  # the links would overwrite the foreign files with themselves
            (path / name).unlink()
    _rename_each(path, target, owned, last)


def _link_foreign(target: Path, path: Path, owned: Callable[[str], bool]) -> set[str]:
    """Hard-link the target's entries that are not ``owned`` (nor in the new state) into the
    staging folder; the names linked (the others are moved after the exchange)."""
    linked: set[str] = set()
    for entry in os.scandir(target):
        name = entry.name
        if owned(name) or name == STAGING_SUFFIX or os.path.lexists(path / name):
            continue
        if entry.is_dir(follow_symlinks=False):
            continue
        try:
            os.link(target / name, path / name, follow_symlinks=False)
        except OSError:
            continue  # moved across after the exchange instead
        linked.add(name)
    return linked


def _carry_back(old: Path, target: Path, owned: Callable[[str], bool]) -> None:
    """Move what a staging folder holds besides a state into the target: every entry not
    ``owned`` and not in the target already (the linked ones are)."""
    for entry in os.scandir(old):
        name = entry.name
        if name in (MARKER, STAGING_SUFFIX) or owned(name) or os.path.lexists(target / name):
            continue
        os.rename(old / name, target / name)


def _rename_each(path: Path, target: Path, owned: Callable[[str], bool],
                 last: Sequence[str]) -> None:
    """The per-file switch: every staged file renamed into the target, the earlier state's
    other files removed, then the ``last`` ones."""
    names = sorted(os.listdir(path))
    first = [n for n in names if n not in last]
    if first:  # until the first rename the target is as it was
        try:
            os.replace(path / first[0], target / first[0])
        except OSError:
            (path / MARKER).touch()  # nothing switched: the folder may be abandoned
            raise
    try:
        for name in first[1:]:
            os.replace(path / name, target / name)
        for entry in os.scandir(target):
            if owned(entry.name) and entry.name not in names:
                _remove(target / entry.name)
        for name in [n for n in last if n in names]:
            os.replace(path / name, target / name)
        sync_folder(target)
        if path != target / STAGING_SUFFIX:  # a sibling the exchange was refused for
            sync_folder(target.parent)
        shutil.rmtree(path)
    except OSError as exc:
        raise SwitchIncompleteError(exc.errno or errno.EIO, f"{target} holds part of the new "
                                    f"state, switched file by file; the rest is in {path}: "
                                    f"{exc}") from exc
