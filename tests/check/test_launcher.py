"""run_ranks: results by rank, failures and hangs turned into RankFailedError, nothing left behind.

Every test launches real forked processes with gloo process groups (one test spawns). Tests that
stop ranks check that the rank processes are gone (no zombie: ``/proc/<pid>`` no longer exists)
and that the launch returned within a few seconds.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyperrecipe.check.launcher import LaunchError, RankFailedError, run_ranks
from hyperrecipe.errors import HyperrecipeError

FAST_S = 5.0  # a failing launch must be over well within this


def _pid_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pid"


def _write_pid(directory: Path, rank: int) -> None:
    _pid_file(directory, rank).write_text(str(os.getpid()))


def _assert_ranks_gone(directory: Path, world_size: int) -> None:
    for rank in range(world_size):
        pid = int(_pid_file(directory, rank).read_text())
        assert not Path(f"/proc/{pid}").exists(), f"rank {rank} (pid {pid}) is still there"
    assert multiprocessing.active_children() == []


def _wait_for(path: Path, limit_s: float = 10.0) -> None:
    give_up = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > give_up:
            raise TimeoutError(path)
        time.sleep(0.01)


def _describe_rank(rank: int, world_size: int, scale: float) -> dict[str, Any]:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "total": scale * total.item(),
        "tensor": torch.full((2,), float(rank), requires_grad=True) * 2,
    }


def test_results_come_back_in_rank_order_with_env_and_one_thread() -> None:
    results = run_ranks(_describe_rank, 3, 10.0)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, result in enumerate(results):
        assert result["world_size"] == 3
        assert result["env"] == (str(rank), "3", str(rank))
        assert result["threads"] == 1
        assert result["backend"] == "gloo"
        assert result["total"] == 30.0
        # Tensors come back as plain CPU values, cut from the rank's autograd graph.
        assert torch.equal(result["tensor"], torch.full((2,), 2.0 * rank))
        assert not result["tensor"].requires_grad


def test_a_closure_runs_under_fork() -> None:
    offset = 7
    assert run_ranks(lambda rank, world_size: rank + offset, 2) == [7, 8]


def test_failing_rank_raises_and_stops_the_rank_blocked_in_a_collective(tmp_path: Path) -> None:
    def rank_fn(rank: int, world_size: int) -> int:
        _write_pid(tmp_path, rank)
        if rank == 1:
            _wait_for(tmp_path / "rank0-in-collective")
            time.sleep(0.2)  # rank 0 is inside all_reduce by now
            raise ValueError("boom from rank 1")
        (tmp_path / "rank0-in-collective").touch()
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
        return rank

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(rank_fn, 2, timeout_s=60.0)
    elapsed = time.monotonic() - start

    assert elapsed < FAST_S
    error = info.value
    assert isinstance(error, HyperrecipeError) and isinstance(error, RuntimeError)
    assert error.rank == 1
    assert str(error).startswith("rank 1 of 2 failed: ValueError: boom from rank 1")
    assert "--- traceback of rank 1 ---" in str(error)
    assert "in rank_fn" in error.rank_traceback
    assert 'raise ValueError("boom from rank 1")' in error.rank_traceback
    assert error.unfinished == (0, 1)
    _assert_ranks_gone(tmp_path, 2)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_rank_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    def rank_fn(rank: int, world_size: int) -> None:
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _write_pid(tmp_path, rank)
            time.sleep(60)
        _wait_for(_pid_file(tmp_path, 0))
        _write_pid(tmp_path, rank)
        raise KeyError("rank 1 gives up")

    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed: KeyError: 'rank 1 gives up'"):
        run_ranks(rank_fn, 2, timeout_s=60.0)
    assert time.monotonic() - start < FAST_S
    _assert_ranks_gone(tmp_path, 2)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_timeout_names_the_ranks_that_had_not_finished(tmp_path: Path) -> None:
    def rank_fn(rank: int, world_size: int) -> int:
        _write_pid(tmp_path, rank)
        if rank in (1, 2):
            time.sleep(60)
        return rank

    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(rank_fn, 3, timeout_s=1.5)
    assert time.monotonic() - start < 1.5 + FAST_S
    message = str(info.value)
    assert message.startswith(
        "timed out after 1.5 s: rank(s) [1, 2] of 3 had not finished (finished: [0])\n"
    ), message
    # where each stuck rank was: its faulthandler stack, asked for before it was stopped
    for rank in (1, 2):
        where = message.split(f"--- where rank {rank} was (faulthandler) ---\n")[1]
        assert "in rank_fn" in where.split("--- where rank")[0], message
    assert "where rank 0 was" not in message
    assert info.value.rank is None
    assert info.value.unfinished == (1, 2)
    _assert_ranks_gone(tmp_path, 3)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_rank_that_exits_without_a_result_is_reported() -> None:
    def rank_fn(rank: int, world_size: int) -> int:
        if rank == 0:
            os._exit(3)
        time.sleep(60)
        return rank

    a = torch.randn(512, 512)
    torch.mm(a, a)  # the parent's OpenMP pool is there (as after earlier tests): not named
    with pytest.raises(RankFailedError) as info:
        run_ranks(rank_fn, 2, timeout_s=30.0)
    assert str(info.value) == "rank 0 of 2 failed: exited with code 3 without reporting a result"
    assert info.value.rank == 0


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_rank_killed_by_a_signal_is_reported_with_the_signal_name() -> None:
    def rank_fn(rank: int, world_size: int) -> int:
        os.kill(os.getpid(), signal.SIGKILL)
        return rank

    with pytest.raises(RankFailedError, match=r"^rank \d of 2 failed: was killed by SIGKILL "):
        run_ranks(rank_fn, 2, timeout_s=30.0)


def _segfault_in_a_named_frame() -> None:
    ctypes.string_at(0)  # a real segmentation fault, as a native library's bug gives


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_rank_killed_by_a_fault_reports_the_python_stack_it_died_in() -> None:
    def rank_fn(rank: int, world_size: int) -> int:
        if rank == 1:
            _segfault_in_a_named_frame()
        time.sleep(60)
        return rank

    stop = threading.Event()
    beside = threading.Thread(target=stop.wait, name="left-by-an-earlier-test", daemon=True)
    beside.start()
    try:
        with pytest.raises(RankFailedError) as info:
            run_ranks(rank_fn, 2, timeout_s=30.0)
    finally:
        stop.set()
        beside.join()
    message = str(info.value)
    assert "other thread(s) when it forked the ranks: left-by-an-earlier-test" in message
    assert message.startswith(
        "rank 1 of 2 failed: was killed by SIGSEGV without reporting a result\n"
        "--- what faulthandler wrote as rank 1 died ---\nFatal Python error: Segmentation fault"
    ), message
    assert "_segfault_in_a_named_frame" in info.value.rank_traceback
    assert "in rank_fn" in info.value.rank_traceback
    assert "pytest" not in info.value.rank_traceback, "the frames a forked rank inherited stay out"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_unpicklable_result_is_a_rank_failure() -> None:
    def rank_fn(rank: int, world_size: int) -> object:
        return lambda: rank

    with pytest.raises(RankFailedError, match=r"TypeError: the result of rank \d \(function\) "
                       r"cannot be pickled"):
        run_ranks(rank_fn, 2)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_progress_reports_start_and_every_rank_ready_and_done() -> None:
    messages: list[str] = []
    run_ranks(lambda rank, world_size: rank, 2, on_progress=messages.append)
    assert messages[0] == "started 2 rank(s) (fork, gloo)"
    assert len(messages) == 5
    ready = sorted(m for m in messages if m.endswith("process group ready"))
    assert ready == ["rank 0: process group ready", "rank 1: process group ready"]
    done = [m for m in messages if ": done (" in m]
    assert sorted(m.split(":")[0] for m in done) == ["rank 0", "rank 1"]
    assert [m.split(": ")[1] for m in done] == ["done (1/2)", "done (2/2)"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_fork_after_the_parent_used_intra_op_threads_does_not_hang() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        torch.mm(a, a)  # starts the parent's OpenMP pool

        def rank_fn(rank: int, world_size: int) -> float:
            b = torch.randn(512, 512)
            return float(torch.mm(b, b).sum().isfinite())

        assert run_ranks(rank_fn, 2, timeout_s=30.0) == [1.0, 1.0]
    finally:
        torch.set_num_threads(before)  # the rest of the session forks from this process


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_library_that_sizes_its_threads_from_the_environment_keeps_one_in_a_rank() -> None:
    """accelerate raises a CPU rank's thread count when OMP_NUM_THREADS is unset; after the
    parent started its OpenMP pool, the rank then hung in its first parallel region (MKL's
    vectorised cos inside the Hugging Face Trainer's first forward)."""
    a = torch.randn(512, 512)
    torch.mm(a, a)  # the parent's OpenMP pool exists before the fork

    def rank_fn(rank: int, world_size: int) -> tuple[str | None, float]:
        if not os.environ.get("OMP_NUM_THREADS"):  # what accelerate.PartialState does
            torch.set_num_threads(2)
        return os.environ.get("OMP_NUM_THREADS"), float(torch.randn(1 << 16).cos().sum())

    results = run_ranks(rank_fn, 1, timeout_s=60.0)
    assert results[0][0] == "1"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_forked_ranks_clear_dtensor_sharding_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.tensor import debug

    def record_clear() -> None:
        (tmp_path / f"cleared-by-{os.getpid()}").touch()

    monkeypatch.setattr(debug, "_clear_sharding_prop_cache", record_clear)
    pids = run_ranks(lambda rank, world_size: os.getpid(), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"cleared-by-{p}" for p in pids)


def _nested_launch(rank: int, world_size: int) -> str:
    try:
        run_ranks(_describe_rank, 2, 1.0)
    except LaunchError as exc:
        return str(exc)
    return "no error"


def test_launching_from_inside_a_rank_is_refused() -> None:
    assert run_ranks(_nested_launch, 1) == [
        "run_ranks was called in a process that already has a default process group (rank 0 "
        "of 1); ranks cannot be launched from inside a rank"
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be at least 1, got 0"),
        ({"timeout_s": 0.0}, "timeout_s must be positive, got 0.0"),
        (
            {"start_method": "forkserver"},
            "start_method must be 'fork' or 'spawn', got 'forkserver'",
        ),
    ],
)
def test_bad_launch_arguments_raise_launch_error(kwargs: dict[str, Any], message: str) -> None:
    call: dict[str, Any] = {"world_size": 2, **kwargs}
    with pytest.raises(LaunchError) as info:
        run_ranks(_describe_rank, call.pop("world_size"), 1.0, **call)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


@pytest.mark.slow  # starts fresh interpreters (docs/benchmarks.md#test-suite)
def test_spawn_runs_a_module_level_function() -> None:
    results = run_ranks(_describe_rank, 2, 1.0, start_method="spawn", timeout_s=60.0)
    assert [r["total"] for r in results] == [1.0, 1.0]
    assert [r["threads"] for r in results] == [1, 1]
