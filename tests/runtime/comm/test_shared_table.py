"""The table boundaries share install-time objects through: one entry per key, held while an
owner lives (``hyperrecipe/runtime/comm/shared_table.py``)."""

from __future__ import annotations

import gc

import pytest

from hyperrecipe.runtime.comm.shared_table import SharedTable


def _owner() -> object:
    def forward() -> None:  # an installed forward is a function: weak-referenceable
        return None

    return forward


def test_owners_of_one_key_share_its_entry_until_the_last_is_gone() -> None:
    table: SharedTable[tuple[str, int], list[int]] = SharedTable()
    made: list[int] = []

    def make() -> list[int]:
        made.append(1)
        return [7]

    first, second, other = _owner(), _owner(), _owner()
    a = table.acquire(("mlp", 0), make)
    table.release_with(first, ("mlp", 0), a)
    b = table.acquire(("mlp", 0), make)
    table.release_with(second, ("mlp", 0), b)
    c = table.acquire(("attn", 0), lambda: [8])
    table.release_with(other, ("attn", 0), c)
    assert a == b != c and len(made) == 1 and table.entries[a] == [7] and len(table) == 2

    del first
    gc.collect()
    assert table.entries[a] == [7]  # the second owner still uses it
    del second
    gc.collect()
    assert a not in table.entries and len(table) == 1
    d = table.acquire(("mlp", 0), make)  # made again, under a new index
    assert d not in (a, c) and len(made) == 2
    del other
    gc.collect()
    assert set(table.entries) == {d}


def test_a_failing_make_leaves_nothing_behind() -> None:
    table: SharedTable[str, int] = SharedTable()

    def make() -> int:
        raise ValueError("no")

    with pytest.raises(ValueError):
        table.acquire("k", make)
    assert len(table) == 0
    assert table.entries[table.acquire("k", lambda: 3)] == 3


class _CollectingKey:
    """A key whose comparison, once armed, runs the cyclic collector, as an allocation inside
    ``acquire``'s lookup can: the collector then runs a finalizer in the middle of that acquire.
    (A dict compares the key it holds with the one looked up, so the held key is armed.)"""

    def __init__(self, name: str) -> None:
        self.name, self.collect = name, False

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        if self.collect:
            self.collect = False
            gc.collect()
        return isinstance(other, _CollectingKey) and other.name == self.name


def test_a_release_the_collector_runs_inside_acquire_waits_for_it() -> None:
    table: SharedTable[_CollectingKey, str] = SharedTable()
    owner = _owner()
    owner.cycle = owner  # type: ignore[attr-defined]  # freed only by the cyclic collector
    held = _CollectingKey("mlp")
    first = table.acquire(held, lambda: "converter")
    table.release_with(owner, held, first)
    del owner
    gc.disable()  # the collector runs where the key compares, not before
    try:
        held.collect = True
        again = table.acquire(_CollectingKey("mlp"), lambda: "made again")
    finally:
        gc.enable()
    assert not held.collect, "the lookup never compared the held key"
    
    # the old owner's release waited for the acquire: the index it returned has its entry
    assert table.entries[again] == "converter" and again == first and len(table) == 1
    later = _owner()
    table.release_with(later, _CollectingKey("mlp"), again)
    del later
    gc.collect()
    assert len(table) == 0
    assert table.entries[table.acquire(_CollectingKey("mlp"), lambda: "new")] == "new"
