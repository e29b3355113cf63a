"""Checkpoints under stopped and killed ranks: every wait bounded, one error, the old state kept.

A rank stopped (``SIGSTOP``) inside ``save_checkpoint``'s ``dcp.save`` or ``load_checkpoint``'s
``dcp.load`` used to leave its peers waiting for the process group's timeout (torch's 30
minutes); a rank killed there made them raise gloo's bare ``RuntimeError``; a full disk on rank
0's first record left rank 1 inside DCP's first collective; and a save killed halfway left the
folder's previous checkpoint overwritten by a half-written one. Here, with
``collective_timeout_s = 3``:

- every live rank raises the project's error (``ExportError`` for a save, ``WeightLoadError``
  for a load) naming the rank that did not arrive, instead of waiting;
- a failure on rank 0 before anyone wrote reaches every rank as the same ``ExportError``;
- the folder's committed checkpoint is byte for byte what it was, and still loads, whatever
  the save's failure; a save killed before its switch leaves a staging folder beside it that
  the next save removes.

The ranks are real gloo ranks running real ``dcp.save`` / ``dcp.load``, forked by
:func:`_launch` below rather than ``run_ranks``: ``run_ranks`` stops every rank as soon as one
dies, which is the moment these tests are about. No wall-clock asserts: a hang would hit the
launch's own limit (90 s), and the one loose bound asserted, that a rank whose peer stopped
returned in under half the process group's 60 s timeout, tells a bounded wait from that one.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.runtime.state import folder_switch
from hyperrecipe.runtime.state.integrity import COMMIT, is_committed
from tests.support.checkpoint_harness import applied

pytestmark = pytest.mark.slow  # launches ranks several times (docs/benchmarks.md#test-suite)

_TIMEOUT_S = 3.0
_LAUNCH_S = 90.0
_PROCESS_GROUP_S = 60.0


def _rank(fn: Callable[..., Any], rank: int, world: int, store: str, out: str,
          args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=_PROCESS_GROUP_S))
    dist.barrier()
    start = time.monotonic()
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        result = ("raised", f"{type(exc).__name__}: {exc}")
    result = (*result, time.monotonic() - start)
    Path(out, f"rank-{rank}").write_bytes(pickle.dumps(result))
    os._exit(0)  # no teardown: a peer may be stopped or dead


def _launch(fn: Callable[..., Any], world: int, survivors: set[int],
            *args: Any) -> dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` forked gloo ranks; waits for the ``survivors``
    to report (or ``_LAUNCH_S``), then kills every rank still there (a stopped one). Returns
    ``{rank: ("ok", result, seconds) or ("raised", "Type: message", seconds)}`` for the ranks
    that reported."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="hyperrecipe-bounded-") as scratch:
        procs = [ctx.Process(target=_rank, args=(fn, r, world, f"{scratch}/store", scratch,
                                                 args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + _LAUNCH_S
        try:
            while time.monotonic() < deadline and not all(
                    Path(scratch, f"rank-{r}").exists() for r in survivors):
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
        return {r: pickle.loads(Path(scratch, f"rank-{r}").read_bytes())
                for r in range(world) if Path(scratch, f"rank-{r}").exists()}


def _scaled(world: int, scale: float) -> tuple[Any, Any]:
    model, inst = applied(world)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    inst.collective_timeout_s = _TIMEOUT_S
    return model, inst


def _save_worker(rank: int, world: int, folder: str, scale: float) -> dict[str, torch.Tensor]:
    _, inst = _scaled(world, scale)
    inst.state.save_checkpoint(folder)
    full: dict[str, torch.Tensor] = inst.state.full_state_dict()
    return full


def _load_worker(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    _, inst = _scaled(world, 5.0)
    inst.state.load_checkpoint(folder)
    full: dict[str, torch.Tensor] = inst.state.full_state_dict()
    return full


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def _stop_or_kill_in(cls: Any, method: str, how: signal.Signals) -> None:
    """This rank stops (or dies) the moment DCP calls ``cls.method`` (inside its collectives:
    after its planning exchange has begun)."""
    def halt(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), how)
        raise AssertionError("still running after the signal")

    setattr(cls, method, halt)


def _faulty_save(rank: int, world: int, folder: str, victim: int, fault: str) -> str:
    """Save state 2.0 over the folder's committed state with ``fault`` on rank ``victim``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    _, inst = _scaled(world, 2.0)
    if rank == victim and fault in ("stop", "kill"):
        _stop_or_kill_in(FileSystemWriter, "prepare_local_plan",
                         signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    if rank == victim and fault == "kill-before-switch":
        _stop_or_kill_in(folder_switch, "commit", signal.SIGKILL)
    if rank == victim and fault == "full-disk":
        real_begin = folder_switch.begin

        def begin_on_a_full_disk(*args: Any) -> Any:
            staging = real_begin(*args)  # made; its first record lands on a full device
            (staging.path / f".{COMMIT}.tmp-{os.getpid()}").symlink_to("/dev/full")
            return staging

        folder_switch.begin = begin_on_a_full_disk  # type: ignore[assignment]
    if rank == victim and fault == "full-disk-at-commit":
        real_finish = FileSystemWriter.finish

        def finish_then_fill_the_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = real_finish(self, *args, **kwargs)  # .metadata written: the record is next
            (Path(self.path) / f".{COMMIT}.tmp-{os.getpid()}").symlink_to("/dev/full")
            return done

        FileSystemWriter.finish = finish_then_fill_the_disk  # type: ignore[method-assign]
    inst.state.save_checkpoint(folder)
    return "saved"


def _faulty_load(rank: int, world: int, folder: str, victim: int) -> Any:
    from hyperrecipe.errors import WeightLoadError
    from hyperrecipe.runtime.state.dcp_reader import TrustedFileSystemReader

    model, inst = _scaled(world, 5.0)
    before = _own_shards(model)
    if rank == victim:
        _stop_or_kill_in(TrustedFileSystemReader, "read_data", signal.SIGSTOP)
    try:
        inst.state.load_checkpoint(folder)
    except WeightLoadError as exc:
        after = _own_shards(model)
        return {"error": str(exc), "unchanged": all(torch.equal(before[k], after[k])
                                                    for k in before)}
    return "loaded"


def _own_shards(model: Any) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter, read without a collective (the peer is stopped:
    ``model.state_dict()`` of an applied model gathers)."""
    return {name: getattr(p, "to_local", lambda p=p: p)().detach().clone()
            for name, p in model.named_parameters()}


def _committed(tmp_path: Path) -> tuple[Path, dict[str, bytes], dict[str, torch.Tensor]]:
    """A folder holding a committed checkpoint of state 1.0 (and a file of the user's)."""
    folder = tmp_path / "ckpt"
    full = run_ranks(_save_worker, 2, str(folder), 1.0)[0]
    (folder / "notes.txt").write_text("the user's own file\n")
    return folder, _snapshot(folder), full


def _assert_loads(folder: Path, full: dict[str, torch.Tensor]) -> None:
    for rank, got in enumerate(run_ranks(_load_worker, 2, str(folder))):
        for name, value in full.items():
            assert torch.equal(got[name], value), f"rank {rank}: {name}"


def _assert_kept(folder: Path, before: dict[str, bytes], full: dict[str, torch.Tensor]) -> None:
    assert _snapshot(folder) == before, "the committed checkpoint was changed"
    assert is_committed(folder)
    _assert_loads(folder, full)


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_rank_stopped_or_killed_in_dcp_save_makes_the_other_raise_export_error_naming_it(
        tmp_path: Path, fault: str) -> None:
    folder, before, full = _committed(tmp_path)
    results = _launch(_faulty_save, 2, {0}, str(folder), 1, fault)
    assert 1 not in results, "the victim reported"
    kind, message, seconds = results[0]
    assert kind == "raised", message
    assert seconds < _PROCESS_GROUP_S / 2, f"waited {seconds:.0f} s"
    assert message.startswith(
        f"ExportError: save_checkpoint into {folder} failed; the folder holds what it held "
        f"before (the new checkpoint was never switched in):\n  rank 0: dcp.save stopped: "), \
        message
    assert (f"rank(s) [1] did not reach the end of dcp.save within 3 s (collective_timeout_s): "
            f"stopped, hung or killed; restart every rank") in message, message
    assert folder_switch.leftovers(folder) == [], "rank 0 removed its staging folder"
    _assert_kept(folder, before, full)


def test_a_rank_stopped_in_dcp_load_makes_the_other_raise_weight_load_error_naming_it(
        tmp_path: Path) -> None:
    folder, _, _ = _committed(tmp_path)
    results = _launch(_faulty_load, 2, {0}, str(folder), 1)
    assert 1 not in results
    kind, outcome, seconds = results[0]
    assert kind == "ok", outcome
    assert seconds < _PROCESS_GROUP_S / 2, f"waited {seconds:.0f} s"
    assert outcome["unchanged"], "a failed load changed the model"
    message = outcome["error"]
    assert message.startswith(f"load_checkpoint({str(folder)!r}) failed; nothing was loaded:"
                              f"\n  {folder}: dcp.load failed: "), message
    assert message.endswith("rank(s) [1] did not reach the end of dcp.load within 3 s "
                            "(collective_timeout_s): stopped, hung or killed; restart every "
                            "rank"), message


def test_a_full_disk_under_rank_0s_first_record_raises_the_same_error_on_every_rank(
        tmp_path: Path) -> None:
    folder, before, full = _committed(tmp_path)
    results = _launch(_faulty_save, 2, {0, 1}, str(folder), 0, "full-disk")
    kinds = {r: k for r, (k, _, _) in results.items()}
    assert kinds == {0: "raised", 1: "raised"}, results
    assert results[0][1] == results[1][1], "every rank raises the same error"
    staging = folder.resolve().parent / f".ckpt{folder_switch.STAGING_SUFFIX}"
    assert results[0][1] == (
        f"ExportError: save_checkpoint into {folder} failed; the folder holds what it held "
        f"before (the new checkpoint was never switched in):\n  rank 0: cannot write "
        f"{staging / COMMIT}: No space left on device"), results[0][1]
    assert folder_switch.leftovers(folder) == []
    _assert_kept(folder, before, full)


def test_a_full_disk_under_the_committed_record_raises_the_same_error_on_every_rank(
        tmp_path: Path) -> None:
    """After ``dcp.save`` returned everywhere: rank 0's failure reaches every rank in the last
    exchange, as the same error."""
    folder, before, full = _committed(tmp_path)
    results = _launch(_faulty_save, 2, {0, 1}, str(folder), 0, "full-disk-at-commit")
    kinds = {r: k for r, (k, _, _) in results.items()}
    assert kinds == {0: "raised", 1: "raised"}, results
    assert results[0][1] == results[1][1], "every rank raises the same error"
    staging = folder.resolve().parent / f".ckpt{folder_switch.STAGING_SUFFIX}"
    assert results[0][1] == (
        f"ExportError: save_checkpoint into {folder} failed; the folder holds the old "
        f"checkpoint or the new one (a loader refuses anything in between by its commit "
        f"record):\n  rank 0: cannot write {staging / COMMIT}: No space left on device; the "
        f"folder holds what it held before (the new checkpoint was never switched in)"), \
        results[0][1]
    assert folder_switch.leftovers(folder) == []
    _assert_kept(folder, before, full)


def test_a_save_killed_before_its_switch_keeps_the_old_checkpoint_and_the_next_save_cleans_up(
        tmp_path: Path) -> None:
    folder, before, full = _committed(tmp_path)
    results = _launch(_faulty_save, 2, {1}, str(folder), 0, "kill-before-switch")
    kind, message, _ = results[1]
    assert kind == "raised" and message.startswith("ExportError: "), message
    assert "rank(s) [0] did not reach the switch within 3 s" in message, message
    leftover = folder_switch.leftovers(folder)
    assert [p.name for p in leftover] == [f".ckpt{folder_switch.STAGING_SUFFIX}"]
    assert json.loads((leftover[0] / COMMIT).read_text())["state"] == "committed"
    # the killed rank 0's lock stays behind; the old checkpoint is otherwise untouched
    assert {k: v for k, v in _snapshot(folder).items() if k != "hyperrecipe.lock"} == before
    _assert_loads(folder, full)
    newer = run_ranks(_save_worker, 2, str(folder), 3.0)[0]
    assert folder_switch.leftovers(folder) == [], "the next save removed the staging folder"
    assert (folder / "notes.txt").read_text() == "the user's own file\n"
    _assert_loads(folder, newer)


def test_saving_again_into_a_committed_folder_switches_the_new_checkpoint_in(
        tmp_path: Path) -> None:
    folder, before, _ = _committed(tmp_path)
    newer = run_ranks(_save_worker, 2, str(folder), 2.0)[0]
    after = _snapshot(folder)
    assert after != before and set(after) == set(before)
    assert after["notes.txt"] == before["notes.txt"], "the user's file is carried over"
    assert folder_switch.leftovers(folder) == []
    assert is_committed(folder)
    _assert_loads(folder, newer)


def _save_from_inside(rank: int, world: int, folder: str, scale: float) -> dict[str, Any]:
    os.chdir(folder)  # a folder that is the process's working folder is never exchanged away
    full = _save_worker(rank, world, folder, scale)
    return {"full": full, "left": [str(p) for p in folder_switch.leftovers(folder)]}


def test_where_no_exchange_is_possible_the_checkpoint_is_switched_file_by_file(
        tmp_path: Path) -> None:
    """The per-file switch (storage files and ``.metadata`` renamed into place, the commit
    record last): the new checkpoint loads, the user's file is kept, nothing is left over."""
    folder, before, _ = _committed(tmp_path)
    res = run_ranks(_save_from_inside, 2, str(folder), 2.0)
    assert res[0]["left"] == [] and folder_switch.leftovers(folder) == []
    after = _snapshot(folder)
    assert set(after) == set(before) and after["notes.txt"] == before["notes.txt"]
    assert after != before and is_committed(folder)
    _assert_loads(folder, res[0]["full"])
