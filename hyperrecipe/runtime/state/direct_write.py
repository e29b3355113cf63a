"""Ranks on one host write their own blocks of an export straight into the writer's file.

Sending a shard to the writer costs two kernel copies and the loopback TCP stack on each
side, and the writer then copies the bytes once more into its file; issue 29 measured half
the export waiting on that. When every rank sees the writer's temporary files as the same
files of the same kernel, each rank instead writes its block of every sharded tensor to its
place in the file (``os.pwrite`` per run: one per part of a dim-0 block, one per row of a
row-parallel block) and tells the writer it did (a 4-byte message, sent without waiting for the
writer to take it: :class:`Reports`); no tensor byte crosses a socket.

Same kernel, same file, checked three ways before any tensor is written (:func:`offer`,
:func:`accept`): the ranks' ``/proc/sys/kernel/random/boot_id`` are equal (one running kernel,
so one page cache: what a rank writes the others read at once), each temporary file opened by
name on the peer has the writer's device and inode numbers, and the peer reads back a random
nonce the writer put in the file without syncing it. Anything else (another host, a network
file system, no ``/proc``) and the export sends the blocks to the writer as before.

The manifest does not change: the writer still records each file's digest over its final bytes
in order. It hashes what it wrote itself from its buffers, and every tensor that other ranks
wrote parts of from the file's pages once the tensor is complete (:func:`hash_range`: a
shared read-only mapping, no copy), so the digest covers what is in the file, whoever wrote it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from hyperrecipe.runtime.comm.gather_into import OwnBlocks
from hyperrecipe.runtime.state.integrity import Hasher

__all__ = ["Offer", "Reports", "accept", "hash_range", "host_identity", "map_for_hashing", "offer",
           "wait_written", "write_runs"]

NONCE_BYTES = 16
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; advisory
_HASH_STEP = 64 << 20


def host_identity() -> str | None:
    """This kernel's boot id (random per boot, shared by every process and container it
    runs), or ``None`` where there is none to read (not Linux): then no rank writes directly."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


@attrs.frozen(kw_only=True)
class Offer:
    """What the writer tells its peers: its kernel, its temporary files (path, device, inode)
    and the nonce it wrote at ``nonce_at`` of the first one."""

    host: str
    files: tuple[tuple[str, int, int], ...]
    nonce: bytes
    nonce_at: int


def offer(fds: Sequence[int], paths: Sequence[Path], nonce_at: int) -> Offer | None:
    """The writer's offer for its open temporary files, the nonce written (unsynced) into the
    first at ``nonce_at`` (a place that tensor bytes overwrite later), or ``None``."""
    host = host_identity()
    if host is None or not fds:
        return None
    nonce = secrets.token_bytes(NONCE_BYTES)
    if os.pwrite(fds[0], nonce, nonce_at) != NONCE_BYTES:
        return None
    files = []
    for fd, path in zip(fds, paths, strict=True):
        st = os.fstat(fd)
        files.append((os.fspath(path.resolve()), st.st_dev, st.st_ino))
    return Offer(host=host, files=tuple(files), nonce=nonce, nonce_at=nonce_at)


def accept(offered: Offer | None) -> list[int] | None:
    """On a peer: each offered file opened for writing (never created), or ``None`` (and
    nothing left open) unless this rank runs on the writer's kernel, each file by its name is
    the writer's file (device and inode), and the first holds the writer's nonce."""
    if offered is None or host_identity() != offered.host:
        return None
    fds: list[int] = []
    try:
        for path, dev, ino in offered.files:
            flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(path, flags)
            fds.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
                raise OSError("another file")
        if os.pread(fds[0], NONCE_BYTES, offered.nonce_at) != offered.nonce:
            raise OSError("the writer's bytes are not visible")
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def write_runs(fd: int, data_offset: int, blocks: OwnBlocks) -> int:
    """Write this rank's runs of a tensor whose bytes start at ``data_offset`` of the file;
    return the bytes written."""
    if not blocks.length:
        return 0
    element = blocks.data.element_size()
    view = blocks.data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
    total = 0
    for full, local, n in blocks.runs():
        start, end = local * element, (local + n) * element
        at = data_offset + full * element
        while start < end:
            done = os.pwrite(fd, view[start:end], at)
            if done <= 0:
                raise OSError(f"pwrite wrote {done} bytes")
            start += done
            at += done
            total += done
    return total


class Reports:
    """A peer's reports to the writer, sent without waiting for the writer to take them.

    A blocking ``send`` on gloo returns only once the writer posted the matching receive,
    which it does after writing its own blocks of the same tensor: the peer then idled
    through every one of the writer's writes (issue 29 measured 1.8-2.3 s of a 4-6 s export
    on a loaded machine), in lockstep. Sent this way the peer writes its next blocks at once;
    :meth:`finish` waits for every report before the ranks' final agreement.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work | None, torch.Tensor]] = []

    def send(self, blocks: OwnBlocks, failed: bool) -> None:
        """Tell the writer this rank's blocks of the tensor are in the file (or could not be)."""
        if blocks.length:
            flag = torch.tensor([int(failed)], dtype=torch.int32)
            self._pending.append((dist.isend(flag, blocks.writer), flag))

    def finish(self) -> None:
        """Wait until the writer took every report sent so far."""
        pending, self._pending = self._pending, []
        for work, _flag in pending:
            if work is not None:
                work.wait()


def wait_written(blocks: OwnBlocks) -> list[int]:
    """On the writer: wait until every peer wrote its blocks; the peers that could not."""
    failed = []
    flag = torch.zeros(1, dtype=torch.int32)
    for peer in blocks.peers:
        dist.recv(flag, peer)
        if int(flag.item()):
            failed.append(peer)
    return failed


def map_for_hashing(fd: int) -> mmap.mmap | None:
    """A read-only mapping of the whole file for :func:`hash_range`, or ``None`` where the file
    system cannot map it (then the bytes are read instead)."""
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def hash_range(hasher: Hasher, fd: int, mapping: mmap.mmap | None, start: int,
               end: int) -> None:
    """Feed ``hasher`` the file's bytes ``[start, end)`` straight from its pages (a shared
    read-only mapping of the file, mapped ahead in 64 MiB steps), or read in 8 MiB pieces
    where there is no mapping.

    Raises:
        OSError: the file is shorter than ``end`` (it cannot be: the writer sized it first).
    """
    if mapping is None:
        buffer = bytearray(8 << 20)
        at = start
        while at < end:
            n = os.preadv(fd, [memoryview(buffer)[:min(len(buffer), end - at)]], at)
            if n <= 0:
                raise OSError(f"the file ends at {at}, before {end}")
            hasher.update(memoryview(buffer)[:n])
            at += n
        return
    page = mmap.PAGESIZE
    at = start
    while at < end:
        stop = min(end, at + _HASH_STEP)
        aligned = at - at % page
        try:
            mapping.madvise(_POPULATE_READ, aligned, stop - aligned)
        except (OSError, ValueError):
            pass  # advisory: the pages fault in one by one instead
        view = memoryview(mapping)[at:stop]
        try:
            hasher.update(view)
        finally:
            view.release()
        at = stop
