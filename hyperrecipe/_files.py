"""Reading an input file whose path someone else may have chosen, in bounded time and memory.

Recipes (and the files they ``extends``), plans, model configs and ``pyproject.toml`` tables are
data from users and from other people's pull requests. ``Path.read_text`` on such a path can
hang or exhaust memory: a FIFO blocks until a writer appears, ``/dev/zero`` (or a ``.yaml``
symlink to it) never ends, and a regular file may be any size. :func:`read_regular_file` opens
without blocking, refuses anything that is not a regular file, and reads at most ``limit``
bytes; :func:`open_regular` is the same open and check, handing back the descriptor, for
readers that read a file in pieces (checkpoints, digests). Their refusals are :class:`OSError`
with ``strerror`` set, so callers that already turn an unreadable file into their own located
error need no new branch. :func:`sync_folder` is the one way a writer makes its renames
durable (the export's and checkpoint's folder switch). Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["open_regular", "read_regular_file", "sync_folder"]

_KINDS = ((stat.S_ISDIR, errno.EISDIR, "Is a directory"),
          (stat.S_ISFIFO, errno.EINVAL, "not a regular file (a FIFO)"),
          (stat.S_ISCHR, errno.EINVAL, "not a regular file (a character device)"),
          (stat.S_ISBLK, errno.EINVAL, "not a regular file (a block device)"),
          (stat.S_ISSOCK, errno.EINVAL, "not a regular file (a socket)"))


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path``, opened without blocking and checked
    on the descriptor itself (``fstat``), so a file swapped for a FIFO after a caller's
    ``stat`` is refused, not waited on. Read from the descriptor (``os.pread``,
    ``os.fdopen``), never by the name again; the caller closes it. With ``dir_fd`` (a
    directory's descriptor) a relative ``path`` is opened in that directory, whatever its name
    is now: a reader that holds a folder open reads that folder, not one renamed into its
    place.

    Raises:
        OSError: as :func:`read_regular_file`, but for size.
    """
    # O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever. On a
    # regular file it changes nothing (reads of regular files never block), so it stays set.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(os.fspath(path), flags, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        for is_kind, code, reason in _KINDS:
            if is_kind(mode):
                raise OSError(code, reason, os.fspath(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Args:
        path: the file (symlinks are followed; what they end at must be a regular file).
        limit: the largest size accepted, in bytes.

    Raises:
        OSError: the file cannot be opened, is not a regular file (a directory, FIFO, device or
            socket: ``strerror`` says which), or is larger than ``limit`` (``strerror`` gives both
            sizes). A path with a NUL byte raises ``ValueError`` as ``open`` does.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"the file is {size} bytes; the limit is {limit}",
                          os.fspath(path))
        chunks: list[bytes] = []
        total = 0
        while total <= limit:  # the size may change while we read: count what arrives
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise OSError(errno.EFBIG, f"the file is more than {limit} bytes", os.fspath(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """Make the renames in ``folder`` durable (a folder's entries are synced through the folder
    itself); a file system that cannot sync a folder is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
