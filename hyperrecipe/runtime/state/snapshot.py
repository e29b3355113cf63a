"""One snapshot of the checkpoint a load reads: each file opened once, read only through that
descriptor, and found unchanged before the load succeeds.

A reader that opens files by name, twice, can read two exports: issue 41 saw 1 of 53
``load_weights`` calls, run while another process re-exported into the same folder, return 6
tensors of one export and 24 of the other, because the manifest was hashed from files opened by
name and the tensors were read from files opened by name again. A :class:`Snapshot` opens the
folder itself once (``O_DIRECTORY``) and every file relative to that descriptor
(``openat``), once: a file renamed over one of its names, or the whole folder exchanged with
another (an export that writes a sibling folder and swaps it in), is not read in its place.
What was hashed is what is read. Each file's identity (device, inode, size, modification and
change times) is recorded when it is opened; :meth:`Snapshot.verify` compares it again, so
a file written in place while the load read it (another tool writing into it) is refused by
name. A file opened late (the folder was exchanged and its old copy is being deleted) is
refused saying the folder was replaced while being read, never read from the new folder.

What it does not do: make a folder without a manifest (another tool's export) consistent. Its
files are read from one folder and checked unchanged, but a writer that replaces them one by
one under their names can still leave a mixture there before the snapshot opens it; only a
manifest (``save_pretrained``'s) tells the two exports apart.

This module only opens and reads; which files a load reads is
:mod:`~hyperrecipe.runtime.state.weights`'s to say. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from hyperrecipe._files import open_regular
from hyperrecipe.errors import WeightLoadError

__all__ = ["Hasher", "Snapshot", "borrowed"]


class Hasher(Protocol):
    """What :meth:`Snapshot.digest` feeds (hashlib's and xxhash's objects alike)."""

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...

_DIGEST_CHUNK = 8 << 20
_NOT_REGULAR = (errno.EISDIR, errno.EINVAL, errno.ENXIO)
"""What :func:`~hyperrecipe._files.open_regular` raises for a directory, FIFO, device or socket
(``ENXIO``: a socket opened by name)."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What a write into a file changes: which file it is, its size, when its bytes changed."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Snapshot:
    """The files of ``source`` (a folder or one file) as one load reads them.

    Opening a folder takes a descriptor of it (``O_RDONLY | O_DIRECTORY``); every later
    listing (:meth:`names`) and open (:meth:`open`) goes through that descriptor. A file
    source has no folder descriptor: the file itself is opened once, by its path. Use it as
    a context manager (or :meth:`close` it): it holds a descriptor per file until then.

    Raises:
        WeightLoadError: the folder exists but cannot be opened.
    """

    def __init__(self, source: str | os.PathLike[str]) -> None:
        self.source = Path(source)
        self.dirfd: int | None = None
        self._fds: dict[str, int] = {}
        self._seen: dict[str, os.stat_result] = {}
        self._names: tuple[str, ...] | None = None
        try:
            self.is_dir = stat.S_ISDIR(os.stat(self.source).st_mode)
            self.exists = True
        except (OSError, ValueError):
            self.is_dir, self.exists = False, False
        if self.is_dir:
            flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
            try:
                self.dirfd = os.open(self.source, flags)
            except OSError as exc:
                msg = f"{self.source}: cannot be read: {exc.strerror or exc}"
                raise WeightLoadError(msg) from None
            self._folder = os.fstat(self.dirfd)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.dirfd is not None:
            os.close(self.dirfd)
            self.dirfd = None

    # -- what the folder holds ---------------------------------------------------------------

    def path(self, name: str) -> Path:
        """Where ``name`` lies, for messages (the source itself for a file source)."""
        return self.source / name if self.is_dir else self.source

    def name_of(self, path: Path) -> str:
        """The name :meth:`open` takes for ``path`` (a path built as ``source / name``)."""
        if not self.is_dir:
            return self.source.name
        return os.fspath(path.relative_to(self.source))

    def names(self) -> tuple[str, ...]:
        """The folder's entries, sorted, listed once through its descriptor (a file source:
        the file's own name)."""
        if self._names is None:
            if self.dirfd is not None:
                try:
                    self._names = tuple(sorted(os.listdir(self.dirfd)))
                except OSError as exc:
                    msg = f"{self.source}: cannot be listed: {exc.strerror or exc}"
                    raise WeightLoadError(msg) from None
            else:
                self._names = (self.source.name,) if self.exists else ()
        return self._names

    def is_file(self, name: str) -> bool:
        """Whether ``name`` is a regular file of the folder (symlinks followed), for choosing
        a format; reading checks the file again on its descriptor."""
        if self.dirfd is None:
            return self.exists and name == self.source.name and self.source.is_file()
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self.dirfd).st_mode)
        except (OSError, ValueError):
            return False

    def holds(self, name: str) -> bool:
        """Whether the folder holds ``name`` (symlinks followed)."""
        if self.dirfd is None:
            return name == self.source.name and os.path.exists(self.source)
        try:
            os.stat(name, dir_fd=self.dirfd)
        except (OSError, ValueError):
            return False
        return True

    # -- opening -----------------------------------------------------------------------------

    def open(self, name: str) -> int:
        """The descriptor of the folder's file ``name``, opened once per snapshot (later calls
        return the same descriptor; the snapshot closes it). Read it with positional reads
        (``os.pread``): it is shared.

        Raises:
            WeightLoadError: the file is not a regular file (a FIFO is not waited on), leads
                out of the folder (a symlink; a Hugging Face cache snapshot's symlinks into
                its ``blobs`` are followed), cannot be opened, or is gone because the folder
                was replaced while being read.
        """
        try:
            return self.open_os(name)
        except OSError as exc:
            where = self.path(name)
            if exc.errno in _NOT_REGULAR:
                kind = "a directory" if exc.errno == errno.EISDIR else (
                    exc.strerror.removeprefix("not a regular file ").strip("()")
                    if exc.strerror and exc.strerror.startswith("not a regular file (")
                    else "a device or socket")
                raise WeightLoadError(f"{where}: not a regular file ({kind}); checkpoints are "
                                      f"read only from regular files") from None
            if exc.errno == errno.ENOENT and self.replaced():
                raise WeightLoadError(self.replaced_message(
                    f"{where} was gone when it was opened")) from None
            raise WeightLoadError(f"{where}: cannot be read: {exc.strerror or exc}") from None

    def open_os(self, name: str) -> int:
        """:meth:`open`, raising the :class:`OSError` of an open that failed as it is (the
        source digest records a file that is not regular instead of refusing it).

        Raises:
            OSError: it cannot be opened or is not a regular file.
            WeightLoadError: it leads out of the folder.
        """
        if name in self._fds:
            return self._fds[name]
        if self.dirfd is None:
            if name != self.source.name:
                raise OSError(errno.ENOENT, "not the file this snapshot reads",
                              os.fspath(self.path(name)))
            fd = open_regular(self.source)
        else:
            fd = open_regular(name, dir_fd=self.dirfd)
        try:
            if self.dirfd is not None:
                self._check_inside(name, fd)
            self._seen[name] = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fds[name] = fd
        return fd

    @contextlib.contextmanager
    def borrow(self, name: str) -> Iterator[int]:
        """A descriptor of ``name`` for one read: the snapshot's own when it holds the file
        open, else one opened the same way (through the folder's descriptor) and closed after,
        so a digest of a DCP folder's thousand storage files holds one at a time.

        Raises:
            OSError, WeightLoadError: as :meth:`open_os`.
        """
        if name in self._fds:
            yield self._fds[name]
            return
        fd = open_regular(self.source) if self.dirfd is None else open_regular(
            name, dir_fd=self.dirfd)
        try:
            if self.dirfd is not None:
                self._check_inside(name, fd)
            yield fd
        finally:
            os.close(fd)

    def open_all(self, names: Iterable[str]) -> None:
        """Open each of ``names`` that is a plain entry of the folder now, before any data is
        read, so that the files a load reads are taken from one moment of the folder. A file
        that cannot be opened is left for the reader to open (and refuse) by name."""
        present = set(self.names())
        for name in names:
            if name in present:
                with contextlib.suppress(OSError, WeightLoadError):
                    self.open_os(name)

    def _check_inside(self, name: str, fd: int) -> None:
        """Refuse a file that lies outside the folder once symlinks are followed (read on the
        descriptors themselves where ``/proc`` says where they lie)."""
        assert self.dirfd is not None
        try:
            real = Path(os.readlink(f"/proc/self/fd/{fd}"))
            folder = Path(os.readlink(f"/proc/self/fd/{self.dirfd}"))
        except OSError:  # pragma: no cover - hosts without /proc
            real, folder = (self.source / name).resolve(), self.source.resolve()
        roots = (folder, folder.parent.parent / "blobs") if folder.parent.name == "snapshots" \
            else (folder,)
        if not any(real.is_relative_to(root) for root in roots):
            raise WeightLoadError(f"{self.path(name)}: leads to {real}, outside the checkpoint "
                                  f"folder {self.source}; a checkpoint reads only its own files")

    # -- reading -----------------------------------------------------------------------------

    def size(self, name: str) -> int:
        """The size of the opened file ``name`` when it was opened."""
        self.open(name)
        return self._seen[name].st_size

    def read(self, name: str, *, limit: int) -> bytes:
        """The bytes of ``name`` (opened once, read by position), at most ``limit``.

        Raises:
            WeightLoadError: as :meth:`open`, or the file is larger than ``limit``.
        """
        fd = self.open(name)
        size = self._seen[name].st_size
        if size > limit:
            raise WeightLoadError(f"{self.path(name)}: cannot be read: the file is {size} "
                                  f"bytes; the limit is {limit}")
        chunks: list[bytes] = []
        at = 0
        try:
            while at <= limit:
                chunk = os.pread(fd, min(1 << 20, limit + 1 - at), at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
        except OSError as exc:
            raise WeightLoadError(f"{self.path(name)}: cannot be read: "
                                  f"{exc.strerror or exc}") from None
        if at > limit:
            raise WeightLoadError(f"{self.path(name)}: cannot be read: the file is more than "
                                  f"{limit} bytes")
        return b"".join(chunks)

    def digest(self, name: str, hasher: Hasher) -> str:
        """The hex digest of ``name``'s bytes by ``hasher`` (a fresh one, of
        :func:`~.integrity.new_hasher`: integrity reads through snapshots, so this module does
        not import it), read by position from the descriptor the load reads."""
        fd = self.open(name)
        view = memoryview(bytearray(_DIGEST_CHUNK))
        at = 0
        try:
            while n := os.preadv(fd, [view], at):
                hasher.update(view[:n])
                at += n
        except OSError as exc:
            raise WeightLoadError(f"{self.path(name)}: cannot be read: "
                                  f"{exc.strerror or exc}") from None
        return hasher.hexdigest()

    # -- was it the same folder throughout ---------------------------------------------------

    def replaced(self) -> bool:
        """Whether the folder this snapshot holds is no longer at its path (exchanged with
        another, removed, or moved away)."""
        if self.dirfd is None:
            return False
        try:
            here = os.stat(self.source)
            held = os.fstat(self.dirfd)
        except OSError:
            return True
        return held.st_nlink == 0 or (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino)

    def replaced_message(self, what: str) -> str:
        return (f"{self.source}: the folder was replaced while load_weights read it (another "
                f"export into the same folder?): {what}; nothing of the new folder was read. "
                f"Load again once the export has finished")

    def verify(self) -> None:
        """Refuse the load when a file it read changed since it was opened: another device,
        inode, size or modification time, or another change time while the file kept its
        links (a rename or removal of a name moves only the change time, and the bytes read
        through the descriptor are still the ones opened).

        Raises:
            WeightLoadError: naming every file that changed, and what changed.
        """
        changed: list[str] = []
        for name, fd in sorted(self._fds.items()):
            before = self._seen[name]
            try:
                now = os.fstat(fd)
            except OSError as exc:
                changed.append(f"{self.path(name)}: cannot be checked: {exc.strerror or exc}")
                continue
            if _identity(now) != _identity(before) or (
                    now.st_ctime_ns != before.st_ctime_ns and now.st_nlink >= before.st_nlink):
                changed.append(f"{self.path(name)}: {_what_changed(before, now)}")
        if changed:
            shown = "\n  ".join(changed[:8]) + (f"\n  ... and {len(changed) - 8} more"
                                                if len(changed) > 8 else "")
            raise WeightLoadError(
                f"{self.source}: files changed while load_weights read them (another process "
                f"wrote into them); what was read may mix two versions, so it is refused. "
                f"Load again once the writer has finished:\n  {shown}")


def _what_changed(before: os.stat_result, now: os.stat_result) -> str:
    if now.st_size != before.st_size:
        return f"its size went from {before.st_size} to {now.st_size} bytes"
    if now.st_mtime_ns != before.st_mtime_ns:
        return "written in place (its modification time moved)"
    return "changed in place (its change time moved, its links did not)"


@contextlib.contextmanager
def borrowed(source: str | os.PathLike[str] | Snapshot) -> Iterator[Snapshot]:
    """``source`` itself when it is a snapshot (its owner closes it), else a snapshot of it
    for the ``with`` block: callers given a path read it through a snapshot too."""
    if isinstance(source, Snapshot):
        yield source
        return
    with Snapshot(source) as snapshot:
        yield snapshot
