"""The staging folder and its switch (runtime/state/folder_switch.py), on real folders.

Each test writes a state the way a save does (files into ``begin``'s staging folder, then
``commit``) and reads the target back; the crash cases stop a save at a precise point by
calling the steps a save calls, in order, and leaving the rest out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hyperrecipe.runtime.state import folder_switch as fs

STATE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                   r"config\.json|hyperrecipe\.manifest\.json")


def owned(name: str) -> bool:
    return STATE.fullmatch(name) is not None


def write_state(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)


def save(target: Path, files: dict[str, str]) -> fs.Staging:
    staging = fs.begin(target, owned)
    write_state(staging.path, files)
    fs.commit(staging, owned, last=["hyperrecipe.manifest.json"])
    return staging


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.is_file()}


OLD = {"model-00001-of-00002.safetensors": "old1", "model-00002-of-00002.safetensors": "old2",
       "model.safetensors.index.json": "old-index", "config.json": "old-config",
       "hyperrecipe.manifest.json": "old-manifest"}
NEW = {"model.safetensors": "new", "config.json": "new-config",
       "hyperrecipe.manifest.json": "new-manifest"}


@pytest.fixture
def target(tmp_path: Path) -> Path:
    folder = tmp_path / "export"
    folder.mkdir()
    write_state(folder, OLD)
    (folder / "tokenizer.json").write_text("tok")
    (folder / "hyperrecipe.lock").write_text("held")
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("log")
    return folder


def test_exchange_replaces_the_state_whole_and_keeps_everything_else(target: Path) -> None:
    lock_inode = os.stat(target / "hyperrecipe.lock").st_ino
    staging = save(target, NEW)
    assert staging.exchange and staging.path == target.parent / ".export.hyperrecipe-new"
    assert contents(target) == {**NEW, "tokenizer.json": "tok", "hyperrecipe.lock": "held"}
    assert (target / "runs" / "log.txt").read_text() == "log"
    # the lock's holder still holds the same file (its heartbeat and release go by inode)
    assert os.stat(target / "hyperrecipe.lock").st_ino == lock_inode
    assert fs.leftovers(target) == []
    assert sorted(p.name for p in target.parent.iterdir()) == ["export"]


def test_the_folder_keeps_its_mode(target: Path) -> None:
    os.chmod(target, 0o2770)  # a group's shared folder
    save(target, NEW)
    assert os.stat(target).st_mode & 0o7777 == 0o2770


def test_a_save_that_stops_before_its_switch_leaves_the_old_state(target: Path) -> None:
    before = contents(target)
    staging = fs.begin(target, owned)
    write_state(staging.path, {"model.safetensors": "half"})  # killed here
    assert contents(target) == before
    assert fs.leftovers(target) == [staging.path]
    save(target, NEW)  # the next save removes the leftover first
    assert contents(target)["model.safetensors"] == "new"
    assert fs.leftovers(target) == []


def test_a_switch_cut_short_after_the_exchange_is_finished_by_the_next_save(
        target: Path) -> None:
    staging = fs.begin(target, owned)
    write_state(staging.path, NEW)
    (staging.path / fs.MARKER).unlink()
    fs._link_foreign(target, staging.path, owned)
    assert fs._exchange(staging.path, target) == 0  # killed right after the exchange:
    # the new state is whole in the target, the subfolder still in the old state's folder
    assert {n: contents(target)[n] for n in NEW} == NEW
    assert not (target / "runs").exists()
    fs.begin(target, owned)  # the next save (under the lock) finishes the switch
    assert (target / "runs" / "log.txt").read_text() == "log"
    assert "model-00001-of-00002.safetensors" not in contents(target)  # old shards gone
    assert fs._sibling(target).exists()  # its own staging folder, fresh and empty
    assert [p.name for p in fs._sibling(target).iterdir()] == [fs.MARKER]


def test_where_no_exchange_is_possible_files_are_switched_one_by_one(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(target)  # a process's working folder is never exchanged away
    staging = save(target, NEW)
    assert not staging.exchange and staging.path == target / fs.STAGING_SUFFIX
    assert contents(target) == {**NEW, "tokenizer.json": "tok", "hyperrecipe.lock": "held"}
    assert (target / "runs" / "log.txt").read_text() == "log"
    assert fs.leftovers(target) == []


def test_a_symlinked_folder_is_switched_at_its_end(target: Path, tmp_path: Path) -> None:
    link = tmp_path / "latest"
    link.symlink_to(target, target_is_directory=True)
    save(link, NEW)
    assert link.is_symlink() and link.resolve() == target
    assert contents(link)["model.safetensors"] == "new"


def test_an_open_reader_keeps_reading_the_state_it_opened(target: Path) -> None:
    with open(target / "model-00001-of-00002.safetensors") as old:
        save(target, NEW)
        assert old.read() == "old1"  # the old inode lives while open; the name is the new
    assert not (target / "model-00001-of-00002.safetensors").exists()


def test_the_first_state_of_a_new_folder(tmp_path: Path) -> None:
    folder = tmp_path / "fresh"
    folder.mkdir()
    save(folder, NEW)
    assert contents(folder) == NEW


def test_a_staging_folder_whose_switch_began_is_never_abandoned(target: Path) -> None:
    """An interruption after the exchange (a KeyboardInterrupt in the carry-back) leaves the
    previous state, with the user's subfolder, under the staging name: ``abandon`` (what a
    failing save's cleanup calls) must not remove it; the next save moves the subfolder back."""
    staging = fs.begin(target, owned)
    write_state(staging.path, NEW)
    (staging.path / fs.MARKER).unlink()  # what commit does first
    fs._link_foreign(target, staging.path, owned)
    assert fs._exchange(staging.path, target) == 0
    fs.abandon(staging)
    assert (staging.path / "runs" / "log.txt").read_text() == "log"
    fs.begin(target, owned)
    assert (target / "runs" / "log.txt").read_text() == "log"
