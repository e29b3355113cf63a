"""The lock on a state folder, in one process: who is refused, what is taken over, what is said.

The jobs of two real process groups meeting in one folder are in ``test_one_writer.py``; here
the lock itself, against holders written as their lock files would be (a dead pid on this
host, a holder on another machine with a fresh or an old heartbeat, a live one that stopped
beating, an empty file, a takeover under way), and :func:`one_writer` without a process group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import warnings
from pathlib import Path

import attrs
import pytest

from hyperrecipe.errors import ExportError, FolderLockedError
from hyperrecipe.runtime.state import folder_lock
from hyperrecipe.runtime.state.folder_lock import LEASE_S, LOCK, Holder, one_writer, take_lock


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _write_lock(folder: Path, holder: Holder, age_s: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK
    lock.write_text(json.dumps(holder.as_json()))
    if age_s:
        then = time.time() - age_s
        os.utime(lock, (then, then))
    return lock


def _since(holder: Holder) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.since))


def _no_agreement(report: str | None) -> dict[int, str]:
    """One process: the holder's outcome is everyone's."""
    return {} if report is None else {0: report}


def test_a_second_writer_is_refused_naming_the_folder_the_holder_and_what_to_do(
        tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    first = take_lock(folder, "save_checkpoint")
    before = (folder / LOCK).read_bytes()
    with pytest.raises(FolderLockedError) as refused:
        take_lock(folder, "save_pretrained")
    since = _since(first.holder)
    assert str(refused.value) == (
        f"save_pretrained into {folder} refused: another writer holds the folder: "
        f"{folder / LOCK} names pid {os.getpid()} on host {socket.gethostname()}, running "
        f"save_checkpoint since {since} (heartbeat 0 s ago), which is running on this "
        f"machine. Two writers in one folder leave one job's state overwritten by the "
        f"other's, so this job wrote nothing there. Wait for that job to finish, or save into "
        f"another folder")
    assert refused.value.folder == str(folder) and refused.value.lock == str(folder / LOCK)
    assert refused.value.holder["pid"] == os.getpid()
    assert isinstance(refused.value, ExportError)
    assert (folder / LOCK).read_bytes() == before  # the holder's lock is untouched
    assert sorted(os.listdir(folder)) == [LOCK]  # no private file left behind
    first.release()
    assert os.listdir(folder) == []
    take_lock(folder, "save_pretrained").release()  # free again


def test_the_lock_file_names_its_holder(tmp_path: Path) -> None:
    held = take_lock(tmp_path, "save_checkpoint")
    record = json.loads((tmp_path / LOCK).read_text())
    held.release()
    assert record["format"] == "hyperrecipe-lock/1"
    assert (record["host"], record["pid"], record["what"]) == (
        socket.gethostname(), os.getpid(), "save_checkpoint")
    assert record["since_utc"] == _since(held.holder)
    assert record["lease_s"] == LEASE_S


def test_a_lock_left_by_a_dead_process_on_this_host_is_taken_over_and_said(
        tmp_path: Path) -> None:
    dead = attrs.evolve(folder_lock.this_process("save_checkpoint"), pid=_dead_pid())
    _write_lock(tmp_path, dead)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with one_writer(tmp_path, "save_checkpoint", holder=True, agree=_no_agreement):
            mine = json.loads((tmp_path / LOCK).read_text())
    assert mine["pid"] == os.getpid() and mine["token"] != dead.token
    assert [str(w.message) for w in caught] == [
        f"save_checkpoint into {tmp_path}: took over its lock {tmp_path / LOCK}, left by pid "
        f"{dead.pid} on host {socket.gethostname()}, running save_checkpoint since "
        f"{_since(dead)}, which is no longer running on this machine"]
    assert os.listdir(tmp_path) == []


def test_a_pid_now_running_another_process_is_taken_over(tmp_path: Path) -> None:
    """This pid runs, but not the process that wrote the lock: its start time differs."""
    reused = attrs.evolve(folder_lock.this_process("save_checkpoint"), start="1")
    _write_lock(tmp_path, reused)
    held = take_lock(tmp_path, "save_checkpoint")
    held.release()
    assert held.took_over is not None and "no longer running on this machine" in held.took_over


def test_a_holder_on_another_machine_is_refused_until_its_heartbeat_is_older_than_the_lease(
        tmp_path: Path) -> None:
    other = attrs.evolve(folder_lock.this_process("save_checkpoint"), machine="another-boot",
                         host="node7", pid=4242)
    lock = _write_lock(tmp_path, other, age_s=LEASE_S - 60)
    with pytest.raises(FolderLockedError) as refused:
        take_lock(tmp_path, "save_checkpoint")
    message = str(refused.value)
    assert f"names pid 4242 on host node7, running save_checkpoint since {_since(other)} " \
           f"(heartbeat 540 s ago), on another machine than this one (host " \
           f"{socket.gethostname()}), which cannot tell whether it still runs." in message
    assert message.endswith(f"If that job is gone (killed with its node), remove {lock}, or "
                            f"save again once its heartbeat is older than 600 s: such a lock "
                            f"is taken over")
    then = time.time() - LEASE_S - 60
    os.utime(lock, (then, then))
    held = take_lock(tmp_path, "save_checkpoint")
    held.release()
    assert held.took_over == (f"pid 4242 on host node7, running save_checkpoint since "
                              f"{_since(other)}, whose heartbeat stopped 660 s ago (more than "
                              f"600 s) on another machine")


def test_a_holder_under_another_boot_of_this_host_name_is_judged_as_another_machine(
        tmp_path: Path) -> None:
    """A restart (another boot id) or another container (another pid namespace) of the same
    host name: its pid says nothing here."""
    rebooted = attrs.evolve(folder_lock.this_process("save_checkpoint"), machine="before-reboot",
                            pid=_dead_pid())
    _write_lock(tmp_path, rebooted, age_s=5)
    with pytest.raises(FolderLockedError) as refused:
        take_lock(tmp_path, "save_checkpoint")
    assert (f"(heartbeat 5 s ago), under another boot or pid namespace of this host name (a "
            f"restart, another container), which cannot tell whether it still runs.") \
        in str(refused.value)


def test_the_holder_beats_while_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(folder_lock, "HEARTBEAT_S", 0.02)
    held = take_lock(tmp_path, "save_checkpoint")
    then = time.time() - 1000
    os.utime(tmp_path / LOCK, (then, then))
    deadline = time.monotonic() + 10
    while os.stat(tmp_path / LOCK).st_mtime < then + 500 and time.monotonic() < deadline:
        time.sleep(0.01)
    held.release()
    assert time.monotonic() < deadline, "the heartbeat did not refresh the lock"


def test_a_live_holder_on_this_machine_is_refused_however_old_its_heartbeat(
        tmp_path: Path) -> None:
    alive = folder_lock.this_process("save_checkpoint")  # this process: it runs
    _write_lock(tmp_path, alive, age_s=LEASE_S + 100)
    with pytest.raises(FolderLockedError) as refused:
        take_lock(tmp_path, "save_checkpoint")
    assert str(refused.value).endswith(
        f"; its heartbeat stopped 700 s ago, so it is stopped or hung: end it (kill "
        f"{os.getpid()}) and its lock is taken over")


def test_a_lock_that_names_no_writer_is_refused_naming_the_file_to_remove(
        tmp_path: Path) -> None:
    (tmp_path / LOCK).write_text("")
    with pytest.raises(FolderLockedError) as refused:
        take_lock(tmp_path, "save_checkpoint")
    assert str(refused.value).startswith(
        f"save_checkpoint into {tmp_path} refused: another writer holds the folder: "
        f"{tmp_path / LOCK} exists but names no writer (it is empty): a writer taking it this "
        f"instant, or one that died while writing it.")
    assert str(refused.value).endswith(f"; if no job writes this folder, remove {tmp_path / LOCK}")
    assert (tmp_path / LOCK).read_text() == ""


def test_a_takeover_under_way_is_left_to_the_one_taking_over(tmp_path: Path) -> None:
    dead = attrs.evolve(folder_lock.this_process("save_checkpoint"), pid=_dead_pid())
    lock = _write_lock(tmp_path, dead)
    marker = tmp_path / f".{LOCK}.takeover-{dead.token}"
    marker.write_text("{}")
    with pytest.raises(FolderLockedError) as refused:
        take_lock(tmp_path, "save_checkpoint")
    assert f"a stale lock that another writer is taking over right now ({marker} names it)" \
        in str(refused.value)
    assert json.loads(lock.read_text())["token"] == dead.token  # left alone


def test_release_leaves_a_lock_taken_over_meanwhile_to_its_new_holder(tmp_path: Path) -> None:
    held = take_lock(tmp_path, "save_checkpoint")
    usurper = attrs.evolve(folder_lock.this_process("save_checkpoint"), host="node7")
    (tmp_path / LOCK).unlink()
    _write_lock(tmp_path, usurper)
    with pytest.warns(RuntimeWarning, match="lock was taken over while it wrote"):
        held.release()
    assert json.loads((tmp_path / LOCK).read_text())["token"] == usurper.token


def test_the_lock_is_released_when_the_write_fails(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="disk full"):
        with one_writer(tmp_path, "save_checkpoint", holder=True, agree=_no_agreement):
            assert (tmp_path / LOCK).exists()
            raise OSError("disk full")
    assert os.listdir(tmp_path) == []


def test_a_rank_that_does_not_hold_the_lock_raises_what_the_holder_reported(
        tmp_path: Path) -> None:
    """What ``one_writer`` makes of the exchange's table on a rank that took no lock."""
    first = take_lock(tmp_path, "save_checkpoint")
    with pytest.raises(FolderLockedError) as on_holder:
        take_lock(tmp_path, "save_checkpoint")
    report = json.dumps({"kind": "locked", "message": str(on_holder.value),
                         "lock": on_holder.value.lock, "holder": on_holder.value.holder})
    with pytest.raises(FolderLockedError) as elsewhere:
        with one_writer(tmp_path, "save_checkpoint", holder=False,
                        agree=lambda mine: {0: report}):
            pytest.fail("a refused rank entered the body")
    first.release()
    assert str(elsewhere.value) == str(on_holder.value)
    assert elsewhere.value.holder == on_holder.value.holder


def test_a_folder_that_cannot_be_made_fails_before_writing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "ckpt"  # under a regular file: no folder can be made there
    with pytest.raises(ExportError) as failed:
        with one_writer(folder, "save_checkpoint", holder=True, agree=_no_agreement):
            pytest.fail("wrote")
    assert not isinstance(failed.value, FolderLockedError)
    assert str(failed.value) == (f"save_checkpoint into {folder} failed before writing: cannot "
                                 f"take its lock {folder / LOCK}: Not a directory")
