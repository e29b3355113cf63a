"""Two jobs saving into one folder: the second is refused on every rank, the first's state is whole.

Before the folder lock, two 2-rank jobs calling ``save_checkpoint`` into one folder at the same
moment both returned, and the folder loaded as one job's checkpoint: the other's was gone
without a word (4 of 4 trials; ``save_pretrained`` likewise). Here job A (its own process
group of 2 gloo ranks, launched from a process of its own) takes the folder's lock and stops
inside it; job B (another process group of 2 ranks) saves into the same folder meanwhile and
must be refused on both ranks, by name, leaving every byte of the folder as it was; then A
finishes, and its checkpoint or export loads intact (with a lock file of yet another writer in
the folder, which no loader may take for content). Then the lock of a dead process on this
host is taken over, and a failed save releases the lock.

Real ``dcp.save``, real safetensors, real gloo ranks (forked, one thread each).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.runtime.state import folder_lock
from hyperrecipe.runtime.state.folder_lock import LOCK
from hyperrecipe.runtime.state.integrity import is_committed
from tests.support.checkpoint_harness import applied

pytestmark = pytest.mark.slow  # launches ranks, two jobs at once (docs/benchmarks.md#test-suite)

_WAIT_S = 90.0


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} did not appear within {_WAIT_S:g} s")
        time.sleep(0.01)


def _save(inst: Any, how: str, folder: str) -> None:
    if how == "save_checkpoint":
        inst.state.save_checkpoint(folder)
    else:
        inst.state.save_pretrained(folder)


def _job_a(rank: int, world: int, folder: str, how: str, signals: str) -> dict[str, Any]:
    """Scale the weights (so that A's state is its own), take the folder's lock and stop
    inside it until told to go on; then save."""
    from hyperrecipe.runtime.state import front

    model, inst = applied(world)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    full = inst.state.full_state_dict()
    name = "committed_dcp_save" if how == "save_checkpoint" else "write_safetensors"
    write = getattr(front, name)

    def write_when_told(*args: Any, **kwargs: Any) -> Any:
        if rank == 0:
            (Path(signals) / "held").write_text(str(os.getpid()))
        _wait_for(Path(signals) / "go", "job A")
        return write(*args, **kwargs)

    setattr(front, name, write_when_told)  # this forked rank's module: A's write stops first
    _save(inst, how, folder)
    return {"full": full, "pid": os.getpid()}


def _job_b(rank: int, world: int, folder: str, how: str) -> str:
    model, inst = applied(world)
    try:
        _save(inst, how, folder)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "saved"


class _Background:
    """``run_ranks(fn, 2, *args)`` in a process of its own (forked), so that two jobs (two
    process groups, each with its own store) run at once; results come back pickled."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self._reader, writer = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=self._run, args=(writer, fn, args))
        self._proc.start()
        writer.close()

    @staticmethod
    def _run(writer: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            result: Any = ("ok", run_ranks(fn, 2, *args, timeout_s=240))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result = ("error", f"{type(exc).__name__}: {exc}")
        writer.send_bytes(pickle.dumps(result))  # plain pickle: no shared-memory tensors

    def result(self) -> Any:
        if not self._reader.poll(240):
            self._proc.kill()
            raise TimeoutError("job A did not finish within 240 s")
        kind, value = pickle.loads(self._reader.recv_bytes())
        self._proc.join()
        assert kind == "ok", value
        return value

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def _foreign_lock(folder: Path) -> None:
    """A lock of another writer on another machine, as a job starting in the folder leaves."""
    other = attrs.evolve(folder_lock.this_process("save_checkpoint"), machine="another-boot",
                         host="node7", pid=4242)
    (folder / LOCK).write_text(json.dumps(other.as_json()))


def _second_job_is_refused(tmp_path: Path, how: str) -> tuple[Path, dict[str, Any]]:
    """Job A holds the folder, job B saves into it and is refused; A then finishes. Returns
    the folder and A's rank 0 result."""
    folder = tmp_path / "out"
    signals = tmp_path / "signals"
    signals.mkdir()
    job_a = _Background(_job_a, str(folder), how, str(signals))
    try:
        _wait_for(signals / "held", "job A taking the lock")
        a_pid = int((signals / "held").read_text())
        before = _snapshot(folder)
        assert json.loads(before[LOCK])["pid"] == a_pid
        errors = run_ranks(_job_b, 2, str(folder), how)
        assert _snapshot(folder) == before  # B wrote nothing, A's lock is as A wrote it
        (signals / "go").touch()
        results = job_a.result()
    finally:
        (signals / "go").touch()
        job_a.stop()
    since = json.loads(before[LOCK])["since_utc"]
    assert errors[0] == errors[1], errors  # the same refusal on every rank of B
    assert re.sub(r"\(heartbeat \d+ s ago\)", "(heartbeat N s ago)", errors[0]) == (
        f"FolderLockedError: {how} into {folder} refused: another writer holds the folder: "
        f"{folder / LOCK} names pid {a_pid} on host {socket.gethostname()}, running {how} since "
        f"{since} (heartbeat N s ago), which is running on this machine. Two writers in one "
        f"folder leave one job's state overwritten by the other's, so this job wrote nothing "
        f"there. Wait for that job to finish, or save into another folder")
    assert results[0]["pid"] == a_pid
    assert not (folder / LOCK).exists()  # A released it
    return folder, results[0]


def _load_checkpoint_and_weights(rank: int, world: int, folder: str) -> dict[str, Any]:
    _, resumed = applied(world)
    resumed.state.load_checkpoint(folder)
    _, loaded = applied(world, "meta")
    loaded.state.load_weights(folder)
    return {"resumed": resumed.state.full_state_dict(), "loaded": loaded.state.full_state_dict()}


def test_a_second_job_saving_a_checkpoint_into_the_folder_is_refused_and_the_first_loads_intact(
        tmp_path: Path) -> None:
    folder, a = _second_job_is_refused(tmp_path, "save_checkpoint")
    assert json.loads((folder / "hyperrecipe.commit.json").read_text())["state"] == "committed"
    _foreign_lock(folder)  # no loader takes a lock file for checkpoint content
    assert is_committed(folder)
    got = run_ranks(_load_checkpoint_and_weights, 2, str(folder))[0]
    for name, value in a["full"].items():
        torch.testing.assert_close(got["resumed"][name], value, atol=0, rtol=0)
        torch.testing.assert_close(got["loaded"][name], value, atol=0, rtol=0)


def _load_export(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    _, inst = applied(world, "meta")
    inst.state.load_weights(folder)  # checks the manifest first
    return inst.state.full_state_dict()


def test_a_second_job_exporting_into_the_folder_is_refused_and_the_first_export_loads(
        tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder, a = _second_job_is_refused(tmp_path, "save_pretrained")
    _foreign_lock(folder)
    loaded = run_ranks(_load_export, 2, str(folder))[0]
    hf = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, value in a["full"].items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0)
    for name, value in hf.items():
        torch.testing.assert_close(value, a["full"][name], atol=0, rtol=0)


def _saves_over_a_dead_lock_then_fails_then_saves(rank: int, world: int, root: str,
                                                  dead: dict[str, Any]) -> dict[str, Any]:
    """For each of save_checkpoint and save_pretrained: save into a folder holding ``dead``'s
    lock (taken over), then save again with the writing rank under ``ulimit -f`` (fails), then
    once more (the failed save released the lock)."""
    import resource

    model, inst = applied(world)
    out: dict[str, Any] = {}
    for how in ("save_checkpoint", "save_pretrained"):
        folder = Path(root) / how
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _save(inst, how, str(folder))
        out[f"{how} warnings"] = [str(w.message) for w in caught if "lock" in str(w.message)]
        limited = rank == (1 if how == "save_checkpoint" else 0)
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            _save(inst, how, str(folder))
            out[f"{how} failed"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out[f"{how} failed"] = f"{type(exc).__name__}: {exc}"
        finally:
            if limited:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        out[f"{how} lock after failure"] = (folder / LOCK).exists()
        _save(inst, how, str(folder))
        out[f"{how} lock after"] = (folder / LOCK).exists()
    return out


def test_a_dead_writers_lock_is_taken_over_and_a_failed_save_releases_the_lock(
        tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    dead = attrs.evolve(folder_lock.this_process("save_checkpoint"), pid=child.pid)
    for how in ("save_checkpoint", "save_pretrained"):
        (tmp_path / how).mkdir()
        (tmp_path / how / LOCK).write_text(json.dumps(dead.as_json()))
    results = run_ranks(_saves_over_a_dead_lock_then_fails_then_saves, 2, str(tmp_path),
                        dead.as_json())
    since = dead.as_json()["since_utc"]
    for how in ("save_checkpoint", "save_pretrained"):
        folder = tmp_path / how
        # said on the rank that took it over (rank 0 holds both here), not on the others
        assert results[0][f"{how} warnings"] == [
            f"{how} into {folder}: took over its lock {folder / LOCK}, left by pid {dead.pid} "
            f"on host {socket.gethostname()}, running save_checkpoint since {since}, which is "
            f"no longer running on this machine"]
        assert results[1][f"{how} warnings"] == []
        for res in results:
            failed = res[f"{how} failed"]
            assert failed is not None and failed.startswith(
                f"ExportError: {how} into {folder} failed"), failed
            # the writer under ulimit -f: rank 1 for a checkpoint (torch words it its own way),
            # the export's writer_rank 0
            assert ("rank 1: " if how == "save_checkpoint" else "rank 0: writing") in failed
        # the holder (rank 0 for both) released it before its save returned or raised; a
        # peer may return first (rank 0 still writing the commit record or releasing), and
        # its next save meets rank 0 in that save's entry check anyway
        assert results[0][f"{how} lock after failure"] is False
        assert results[0][f"{how} lock after"] is False
    assert is_committed(tmp_path / "save_checkpoint")
    assert (tmp_path / "save_pretrained" / "hyperrecipe.manifest.json").exists()
