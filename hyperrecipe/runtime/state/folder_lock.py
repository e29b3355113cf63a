"""One writer per state folder: the lock ``save_checkpoint`` and ``save_pretrained`` hold.

Two jobs saving into one folder (a requeued job racing its predecessor, two launches given the
same ``--out``) both reported success while one job's checkpoint was gone: each ``dcp.save``
wrote its storage files and ``.metadata`` over the other's, and the last commit record named
whichever files were last. Now one rank of each job (the rank that writes the folder's records:
rank 0 for a checkpoint, ``writer_rank`` for an export) takes the folder's lock before any rank
writes there, and the job's ranks agree on its outcome in one bounded exchange
(:func:`~hyperrecipe.runtime.preflight.agreement.agree_on_failure`): all of them write, or all
of them raise :class:`~hyperrecipe.errors.FolderLockedError` with the same message, naming
the folder, the lock file, its holder (host, pid, what it runs, since when) and what to do.

**The lock** is the file :data:`LOCK` in the folder itself, so two jobs reaching one folder by
different paths (a symlink, a relative path, another mount point) meet at one file. It is
created whole or not at all: the holder's identity is written to a private file beside it,
synced, and hard-linked to :data:`LOCK` (``link`` fails when the name exists, atomically, on
local and network file systems alike: the classic NFS-safe lock file); where the file system
has no hard links, ``O_CREAT | O_EXCL`` creates it instead (a reader may then meet it empty for
an instant, and is refused as for any unreadable lock). No ``fcntl``/``flock`` lock: network
file systems do not all honour them across nodes. While held, a thread refreshes the file's
modification time every :data:`HEARTBEAT_S` (the heartbeat); the holder removes the file when
its save returns or raises, and only if it is still its own (the token it wrote).

**A lock already there** is judged by its holder's identity:

- on this machine (the same kernel boot id and pid namespace) and its process gone (no such
  pid, a zombie, or another process under that pid since: its start time differs): taken over,
  and said (a ``RuntimeWarning`` on the rank that took it);
- on another machine (or pid namespace), which cannot tell whether the holder runs: refused
  while its heartbeat is younger than :data:`LEASE_S`, taken over (and said) once older. The
  age is measured with the file system's own clock where it stamps files (NFS): the lock's
  modification time against that of the private file this rank has just written beside it;
- on this machine and running: refused, however old its heartbeat (a stopped or hung holder
  is alive: end it first).

Taking over a stale lock goes through a marker named after the stale holder's token, created
exclusively, so that of several jobs judging the same lock stale one removes it, and only if
it still names that holder. The refused job writes nothing in the folder: it may have created
the folder (empty) when it did not exist.

What this does not do: guard folders written by other tools (a plain ``dcp.save``,
transformers' own ``save_pretrained`` of an unapplied model), or fence a holder that lost its
lock: a holder on another machine stopped for longer than :data:`LEASE_S` (a suspended job, a
network partition from the file server) is taken over while it lives, and writes on when it
resumes. docs/security.md ("One writer per folder") states the promise and its limits.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from hyperrecipe._files import open_regular
from hyperrecipe.errors import ExportError, FolderLockedError

__all__ = ["HEARTBEAT_S", "LEASE_S", "LOCK", "HeldLock", "Holder", "one_writer", "take_lock"]

LOCK = "hyperrecipe.lock"
"""The lock file, in the folder it guards."""

LOCK_FORMAT = "hyperrecipe-lock/1"

HEARTBEAT_S = 30.0
"""How often the holder refreshes its lock's modification time."""

LEASE_S = 600.0
"""A lock held from another machine whose heartbeat is older than this is taken over: twenty
missed heartbeats, far more than a busy holder's thread is ever late, and well under the time
a requeued job takes to train up to the checkpoint its dead predecessor was writing."""

_MAX_LOCK_BYTES = 1 << 16
_TRIES = 5
"""Rounds of trying to take the lock (each after a takeover, or a lock released meanwhile)."""
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK,
             errno.EXDEV}


@attrs.frozen(kw_only=True)
class Holder:
    """Who holds (or held) a lock: what its file says."""

    host: str
    pid: int
    what: str
    since: float
    token: str
    machine: str
    """The kernel's boot id (``/proc/sys/kernel/random/boot_id``), else ``host:<name>``."""
    pid_ns: str
    """The holder's pid namespace (``/proc/self/ns/pid``), ``""`` where unknown."""
    start: str
    """The holder process's start time in clock ticks since boot, ``""`` where unknown."""

    def as_json(self) -> dict[str, Any]:
        return {"format": LOCK_FORMAT, "host": self.host, "pid": self.pid, "what": self.what,
                "since": self.since, "since_utc": _utc(self.since), "token": self.token,
                "machine": self.machine, "pid_ns": self.pid_ns, "start": self.start,
                "heartbeat_s": HEARTBEAT_S, "lease_s": LEASE_S}

    @classmethod
    def from_json(cls, data: Any) -> Holder:
        """Raises ValueError: not a lock file of :data:`LOCK_FORMAT`."""
        if not isinstance(data, dict) or data.get("format") != LOCK_FORMAT:
            raise ValueError(f"not a {LOCK_FORMAT} lock")
        try:
            holder = cls(host=str(data["host"]), pid=int(data["pid"]), what=str(data["what"]),
                         since=float(data["since"]), token=str(data["token"]),
                         machine=str(data["machine"]), pid_ns=str(data["pid_ns"]),
                         start=str(data["start"]))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"malformed {LOCK_FORMAT} lock ({exc!s:.100})") from None
        return holder

    def describe(self) -> str:
        return (f"pid {self.pid} on host {self.host}, running {self.what} since "
                f"{_utc(self.since)}")


def _utc(when: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
    except (OverflowError, OSError, ValueError):
        return f"{when!r:.30} (not a time)"


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _machine() -> str:
    return _read_small("/proc/sys/kernel/random/boot_id") or f"host:{socket.gethostname()}"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from its third field on (after the command name), or ``None``."""
    text = _read_small_bytes(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def _read_small_bytes(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace")
    except OSError:
        return None


def _start_ticks(pid: int) -> str:
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else ""


def this_process(what: str) -> Holder:
    """This process as a lock's holder, with a fresh token."""
    return Holder(host=socket.gethostname(), pid=os.getpid(), what=what, since=time.time(),
                  token=uuid.uuid4().hex, machine=_machine(), pid_ns=_pid_namespace(),
                  start=_start_ticks(os.getpid()))


def _alive(holder: Holder) -> bool | None:
    """Whether the holder's process runs: ``None`` when this process cannot know (another
    machine or pid namespace)."""
    if holder.machine != _machine() or holder.pid_ns != _pid_namespace():
        return None
    if holder.pid <= 0:
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except OSError:
        return None
    fields = _stat_fields(holder.pid)
    if fields is None:
        return True  # no /proc: the pid exists, and may be another process; assume it runs
    if fields[0] in ("Z", "X"):
        return False  # a zombie: it ended, its parent has not reaped it
    return not (holder.start and len(fields) > 19 and fields[19] != holder.start)


@attrs.frozen(kw_only=True)
class _Found:
    """A lock file as read: its holder (or why it names none) and its modification time."""

    holder: Holder | None
    why: str
    mtime: float


def _read_lock(path: Path) -> _Found | None:
    """The lock file, or ``None`` when there is none (released meanwhile)."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _Found(holder=None, why=exc.strerror or str(exc), mtime=0.0)
    try:
        st = os.fstat(fd)
        data = os.read(fd, _MAX_LOCK_BYTES)
    except OSError as exc:
        return _Found(holder=None, why=exc.strerror or str(exc), mtime=0.0)
    finally:
        os.close(fd)
    try:
        holder = Holder.from_json(json.loads(data.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "it is empty" if not data else f"{exc!s:.120}"
        return _Found(holder=None, why=why, mtime=st.st_mtime)
    return _Found(holder=holder, why="", mtime=st.st_mtime)


def _create(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``, synced; ``False`` when it exists."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        return False
    try:
        data = text.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _link(source: Path, lock: Path, text: str) -> bool:
    """Make ``lock`` the file ``source`` (already holding ``text``), atomically; ``False``
    when ``lock`` exists."""
    try:
        os.link(source, lock)
    except FileExistsError:
        try:  # NFS: a retransmitted link that went through reports EEXIST
            return os.stat(lock).st_ino == os.stat(source).st_ino
        except OSError:
            return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        return _create(lock, text)  # no hard links here: exclusive create, then the content
    return True


@attrs.define
class HeldLock:
    """A lock this process holds: its heartbeat runs until :meth:`release`."""

    path: Path
    holder: Holder
    took_over: str | None = None
    """What was taken over to get it (a stale holder, said in a warning), or ``None``."""
    _inode: int = 0
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        self._inode = os.stat(self.path).st_ino
        self._thread = threading.Thread(target=self._beat, name="hyperrecipe-lock-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._inode:  # still ours
                    os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this holder's (a lock
        taken over meanwhile is left to its new holder, with a warning)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        found = _read_lock(self.path)
        if found is not None and found.holder is not None \
                and found.holder.token == self.holder.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return
        other = (found.holder.describe() if found is not None and found.holder is not None
                 else "no one" if found is None else "an unreadable file")
        warnings.warn(f"{self.path}: this {self.holder.what}'s lock was taken over while it "
                      f"wrote (the lock now names {other}): another writer may have written "
                      f"the folder too", RuntimeWarning, stacklevel=2)


def _refusal(folder: Path, what: str, lock: Path, found: _Found, age: float,
             reclaiming: Path | None = None) -> FolderLockedError:
    head = f"{what} into {folder} refused: another writer holds the folder: {lock}"
    advice = ("Two writers in one folder leave one job's state overwritten by the other's, so "
              "this job wrote nothing there. Wait for that job to finish, or save into "
              "another folder")
    holder = found.holder
    if holder is None:
        msg = (f"{head} exists but names no writer ({found.why}): a writer taking it this "
               f"instant, or one that died while writing it. {advice}; if no job writes this "
               f"folder, remove {lock}")
        return FolderLockedError(msg, folder=str(folder), lock=str(lock))
    beat = f"heartbeat {age:.0f} s ago"
    if reclaiming is not None:
        msg = (f"{head} names {holder.describe()} ({beat}), a stale lock that another writer "
               f"is taking over right now ({reclaiming} names it). {advice}; if no job is "
               f"starting in this folder (one died while taking over), remove {reclaiming}")
    elif _alive(holder) is None:
        here = socket.gethostname()
        where = (f"on another machine than this one (host {here})" if holder.host != here else
                 "under another boot or pid namespace of this host name (a restart, another "
                 "container)")
        msg = (f"{head} names {holder.describe()} ({beat}), {where}, which cannot tell whether "
               f"it still runs. "
               f"{advice}. If that job is gone (killed with its node), remove {lock}, or "
               f"save again once its heartbeat is older than {LEASE_S:.0f} s: such a lock is "
               f"taken over")
    else:
        hung = (f"; its heartbeat stopped {age:.0f} s ago, so it is stopped or hung: end it "
                f"(kill {holder.pid}) and its lock is taken over" if age > LEASE_S else "")
        msg = (f"{head} names {holder.describe()} ({beat}), which is running on this machine. "
               f"{advice}{hung}")
    return FolderLockedError(msg, folder=str(folder), lock=str(lock),
                             holder=holder.as_json())


def _take_over(folder: Path, lock: Path, stale: Holder, me: Holder) -> Path | None:
    """Remove ``lock`` if it still names ``stale``; ``None`` when done (or when another
    holder replaced it meanwhile: try again), else the marker of another process taking it
    over right now."""
    marker = folder / f".{LOCK}.takeover-{stale.token}"
    if not _create(marker, json.dumps(me.as_json())):
        return marker
    try:
        found = _read_lock(lock)
        if found is not None and found.holder is not None and found.holder.token == stale.token:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
    finally:
        with contextlib.suppress(OSError):
            marker.unlink()
    return None


def take_lock(folder: str | os.PathLike[str], what: str) -> HeldLock:
    """Take ``folder``'s lock for ``what`` (creating the folder where missing), taking over a
    stale one (the module docstring says which are), and start its heartbeat.

    Raises:
        FolderLockedError: another writer holds it (the message names the holder and what
            to do).
        OSError: the folder or the lock cannot be written.
    """
    base = Path(folder)
    base.mkdir(parents=True, exist_ok=True)
    lock = base / LOCK
    me = this_process(what)
    text = json.dumps(me.as_json(), indent=2, sort_keys=True) + "\n"
    mine = base / f".{LOCK}.{me.token}"
    if not _create(mine, text):
        raise FileExistsError(errno.EEXIST, "a token collided", str(mine))
    took_over: str | None = None
    try:
        for _ in range(_TRIES):
            if _link(mine, lock, text):
                held = HeldLock(path=lock, holder=me, took_over=took_over)
                try:
                    held.start_heartbeat()
                except BaseException:  # interrupted: the lock must not outlive this call
                    held.release()
                    raise
                return held
            found = _read_lock(lock)
            if found is None:
                continue  # released meanwhile
            now = os.stat(mine).st_mtime  # the file system's clock, as it stamped ours
            age = max(0.0, now - found.mtime)
            holder = found.holder
            if holder is None:
                raise _refusal(base, what, lock, found, age)
            alive = _alive(holder)
            if alive is False:
                why = "which is no longer running on this machine"
            elif alive is None and age > LEASE_S:
                why = (f"whose heartbeat stopped {age:.0f} s ago (more than {LEASE_S:.0f} s) "
                       f"on another machine")
            else:
                raise _refusal(base, what, lock, found, age)
            busy = _take_over(base, lock, holder, me)
            if busy is not None:
                time.sleep(0.05)
                again = _read_lock(lock)
                if again is not None and again.holder is not None \
                        and again.holder.token == holder.token:
                    raise _refusal(base, what, lock, found, age, reclaiming=busy)
                continue
            took_over = f"{holder.describe()}, {why}"
        found = _read_lock(lock)
        raise _refusal(base, what, lock, found or _Found(holder=None, why="it keeps changing",
                                                         mtime=0.0), 0.0)
    finally:
        with contextlib.suppress(OSError):
            mine.unlink()


@contextlib.contextmanager
def one_writer(folder: str | os.PathLike[str], what: str, *, holder: bool,
               agree: Callable[[str | None], dict[int, str]]) -> Iterator[None]:
    """Hold ``folder`` for this job while the body writes it (every rank of the job enters).

    The ``holder`` rank (one per job) takes the lock; then every rank learns its outcome in
    ``agree`` (one bounded exchange: ``{rank: its error}`` for each rank that failed, the same
    on every rank), so either every rank goes on to write, or every rank raises the same
    error and none wrote. The holder releases the lock when the body returns or raises.

    Raises:
        FolderLockedError: another writer holds the folder (on every rank alike).
        ExportError: the lock could not be taken (an unwritable folder), on every rank.
        PlanMismatchError: a rank did not arrive in ``agree`` within its bound.
    """
    held: HeldLock | None = None
    report: str | None = None
    if holder:
        try:
            held = take_lock(folder, what)
        except FolderLockedError as exc:
            report = json.dumps({"kind": "locked", "message": str(exc), "lock": exc.lock,
                                 "holder": exc.holder})
        except OSError as exc:
            lock = Path(folder) / LOCK
            report = json.dumps({"kind": "error", "message": (
                f"{what} into {folder} failed before writing: cannot take its lock {lock}: "
                f"{exc.strerror or exc}"), "lock": str(lock), "holder": {}})
    try:
        failures = agree(report)
    except BaseException:
        if held is not None:
            held.release()
        raise
    if failures:
        if held is not None:
            held.release()
        raise _error_of(folder, failures)
    try:
        if held is not None and held.took_over is not None:
            warnings.warn(f"{what} into {folder}: took over its lock {held.path}, left by "
                          f"{held.took_over}", RuntimeWarning, stacklevel=3)
        yield
    finally:
        if held is not None:
            held.release()


def _error_of(folder: str | os.PathLike[str], failures: dict[int, str]) -> ExportError:
    """The one error every rank raises for the ranks' reports (the holder's, in practice)."""
    reports: list[dict[str, Any]] = []
    for rank, text in sorted(failures.items()):
        try:
            report = json.loads(text)
            if not isinstance(report, dict) or not isinstance(report.get("message"), str):
                raise ValueError(text)
        except ValueError:  # cut short by the exchange's bound: the text as it came
            report = {"kind": "error", "message": f"rank {rank}: {text}"}
        reports.append(report)
    message = "\n".join(r["message"] for r in reports)
    locked = [r for r in reports if r.get("kind") == "locked"]
    if locked:
        holder = locked[0].get("holder")
        return FolderLockedError(message, folder=os.fspath(folder),
                                 lock=str(locked[0].get("lock", "")),
                                 holder=holder if isinstance(holder, dict) else None)
    return ExportError(message)
