"""Install-time objects that many boundaries share, kept once in a module-level table and read
by index.

Why a table: under ``torch.compile`` dynamo guards every object a traced function reads, on
every call of the compiled step, under the source it read it through. An object reached
through a boundary forward's closure is guarded once per boundary (``layers[3].mlp.forward.
__closure__[1]...``), even when all eight layers hold the very same object; one read through a
module-level table is guarded once per graph (guards on the same global source are
deduplicated). So what boundaries share (the bound collective pairs, a boundary's declared-slot
converters) lives here, and each boundary keeps only the int that indexes it: dynamo guards one
int per boundary. Eager calls pay one dict lookup.

An entry lives exactly as long as some owner uses it (an installed forward, a bound
transition): each owner is counted, and ``weakref.finalize`` on it takes its count back when it
is collected, so the table never keeps a process group (or a model's converters) past the
installations that made them, and restoring or dropping an installation empties it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["SharedTable"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SharedTable(Generic[K, V]):
    """Values interned by key, each under a stable int index.

    ``entries`` is the dict a hot path reads (``table.entries[index]``; keep a module-level name
    for it, so dynamo sees one global source): it is never replaced, only added to and removed
    from.
    """

    def __init__(self) -> None:
        self.entries: dict[int, V] = {}
        self._index: dict[K, int] = {}
        self._users: dict[int, int] = {}
        self._next = itertools.count()
        # A finalizer runs wherever the collector frees its owner: in another thread (it waits
        # for the lock) or in this one in the middle of ``acquire`` (the lock is reentrant, so
        # it gets in): a release arriving there is deferred to the end of the acquire, or it
        # could drop the very entry whose index the acquire has found and is about to count.
        self._lock = threading.RLock()
        self._acquiring = 0
        self._deferred: list[tuple[K, int]] = []

    def acquire(self, key: K, make: Callable[[], V]) -> int:
        """The index of ``key``'s entry, made by ``make`` the first time, with one more user:
        tie that user to its owner with :meth:`release_with` (the owner usually closes over
        the index, so it is made after this call)."""
        with self._lock:
            self._acquiring += 1
            try:
                index = self._index.get(key)
                if index is None:
                    value = make()  # first: a failing make leaves nothing behind
                    index = self._index[key] = next(self._next)
                    self.entries[index] = value
                self._users[index] = self._users.get(index, 0) + 1
            finally:
                self._acquiring -= 1
                while not self._acquiring and self._deferred:
                    self._release(*self._deferred.pop())
            return index

    def release_with(self, owner: object, key: K, index: int) -> None:
        """Give back one user of ``index`` once ``owner`` is collected. ``owner`` must be
        weak-referenceable (a function is) and not reachable from the entry, or the entry
        would keep itself alive."""
        weakref.finalize(owner, self._release, key, index)

    def _release(self, key: K, index: int) -> None:
        with self._lock:
            if self._acquiring:  # a finalizer run by the collector inside acquire
                self._deferred.append((key, index))
                return
            users = self._users.get(index, 0) - 1
            if users > 0:
                self._users[index] = users
                return
            self._users.pop(index, None)
            self.entries.pop(index, None)
            if self._index.get(key) == index:
                del self._index[key]

    def __len__(self) -> int:
        return len(self.entries)
