"""Bounded workers: every file is checked in a forked process with a time and a memory budget.

One bad file must not end a run. libcst's native parser overflows its stack (``SIGSEGV``) on
deeply nested sources, a multi-megabyte generated file can take minutes and gigabytes, and a
recipe YAML full of aliases can expand without end. So each task runs in a worker process the
parent forks (inheriting what the parent has imported), one task at a time:

* **Memory**: the worker caps its own address space (``RLIMIT_AS``) at what it already uses plus
  the budget. Python raises ``MemoryError``; native code that cannot allocate aborts the worker.
* **Time**: the parent gives each task a deadline and kills the worker (``SIGKILL``) past it.
* **Crashes**: a worker that dies (a signal, or any exit) is noticed through its pipe.

In each case the task's file gets one ``HR998 file-not-checked`` error naming the reason, a
fresh worker takes over, and every other file's findings are kept.

:func:`run_here` runs one task in the calling process under the same memory budget, for the
caller to use where forking costs more than the task and the task's time is bounded by its size
(the runner screens a few small files this way: the pre-commit case). ``multiprocessing`` is
imported only when a worker is started.

Nothing here knows about rules: a task is a picklable function and argument; the caller says
what a failed task reports.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

if TYPE_CHECKING:
    import multiprocessing.process
    from multiprocessing.connection import Connection

__all__ = ["Budget", "TaskFailure", "run_bounded", "run_here"]

T = TypeVar("T")
R = TypeVar("R")

_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@attrs.frozen(kw_only=True)
class Budget:
    """What one file may cost.

    Args:
        seconds: wall-clock seconds per file (``None``: unbounded).
        memory_mib: MiB of address space per worker on top of what it holds when it starts
            (``None``: unbounded).
    """

    seconds: float | None = 60.0
    memory_mib: int | None = 4096


@attrs.frozen(kw_only=True)
class TaskFailure:
    """A task that did not finish: ``reason`` says why, in words for the finding."""

    reason: str


def _address_space() -> int:
    """Bytes of address space this process uses now (``/proc/self/statm``; 0 if unknown)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _limit_memory(budget_mib: int | None) -> int | None:
    """Cap this process's address space at what it uses now plus the budget.

    Returns:
        The soft limit it replaced (to restore with :func:`_restore_memory`), or ``None`` when
        nothing was changed.
    """
    if budget_mib is None:
        return None
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    used = _address_space()
    if not used:
        return None
    limit = used + budget_mib * 1024 * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        return None
    return soft


def _restore_memory(soft: int | None) -> None:
    if soft is None:
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # a soft limit may rise up to hard


def _call(function: Callable[[T], R], argument: T, memory_mib: int | None) -> R | TaskFailure:
    """``function(argument)``, with running out of memory or stack as a :class:`TaskFailure`."""
    try:
        return function(argument)
    except MemoryError:
        return TaskFailure(
            reason=f"it needs more than the memory budget ({memory_mib} MiB), or is nested "
            "too deeply for the interpreter's parser (MemoryError)"
        )
    except RecursionError:
        return TaskFailure(reason="it is nested too deeply to check (RecursionError)")


def run_here(function: Callable[[T], R], argument: T, *, budget: Budget) -> R | TaskFailure:
    """Run one task in this process, under the budget's memory limit (lifted afterwards).

    No time limit can interrupt the interpreter's parser from inside the process, and a crash
    would end the run: use this only for work whose time is bounded by its (small) size and
    that cannot crash the interpreter — the runner screens small files this way, and hands
    anything for libcst (whose native parser can crash) to :func:`run_bounded`.
    """
    soft = _limit_memory(budget.memory_mib)
    try:
        return _call(function, argument, budget.memory_mib)
    finally:
        _restore_memory(soft)


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this worker when the parent dies (Linux ``PR_SET_PDEATHSIG``).

    Without it a worker outlives a killed parent: its pipe does not close, because the
    workers forked after it inherited the parent's end, so a worker blocked sending a result
    stays blocked, orphaned. Elsewhere the worker notices on its next read (``EOFError``).
    """
    if not os.uname().sysname == "Linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker(
    conn: Connection,
    function: Callable[[Any], Any],
    arguments: Sequence[Any],
    memory_mib: int | None,
    parent: int,
) -> None:
    """The worker loop: receive task indices, send back one result per task, until told to stop.

    The worker is forked, so it already holds ``arguments``: only indices cross the pipe, a
    batch per message; results go back one by one, so the parent always knows which task is
    running (for its deadline, and to name it if the worker dies).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _die_with_parent(parent)
    _limit_memory(memory_mib)
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        for index in batch:
            conn.send(_call(function, arguments[index], memory_mib))


_SIGNAL_REASONS: Final = {
    signal.SIGSEGV: "the parser crashed (SIGSEGV: a stack overflow, usually from deep nesting)",
    signal.SIGABRT: "the parser aborted (SIGABRT: usually out of its memory budget)",
    signal.SIGBUS: "the parser crashed (SIGBUS)",
    signal.SIGKILL: "the worker was killed (SIGKILL: out of memory?)",
}


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        number = -exitcode
        if number in _SIGNAL_REASONS:
            return _SIGNAL_REASONS[signal.Signals(number)]
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"the checking process died ({name})"
    return f"the checking process exited with status {exitcode}"


class _Slot:
    """One worker process and the tasks sent to it, in order; the first is running."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.tasks: collections.deque[int] = collections.deque()
        self.started = 0.0  # when the first of ``tasks`` started


#: At least this many tasks are sent to a worker ahead of its results, and about a sixth of
#: its share with many tasks (at most :data:`_MAX_IN_FLIGHT`), so it never waits on the parent
#: between files — not even while the parent imports libcst for the next phase.
_MIN_IN_FLIGHT: Final = 2
_SHARES_IN_FLIGHT: Final = 6
_MAX_IN_FLIGHT: Final = 256


def run_bounded(
    function: Callable[[T], R],
    arguments: Sequence[T],
    *,
    workers: int,
    budget: Budget,
) -> Iterator[tuple[int, R | TaskFailure]]:
    """Run ``function`` on each argument in forked workers, each call bounded by ``budget``.

    Each worker has several tasks in flight (the next waits in its pipe, so the worker does
    not idle while the parent is busy); a task's time starts when the parent sees the one
    before it on that worker finish (so a busy parent only makes the budget more lenient). When a worker fails, its running task gets the failure and the
    tasks queued behind it go to a fresh worker.

    Args:
        function: a module-level function (workers are forked, so it need not be importable
            by name, but its result must pickle).
        arguments: one per task; biggest first balances best.
        workers: processes to run at once (at least 1).
        budget: time and memory per task.

    Yields:
        ``(index, result)`` as tasks finish; ``result`` is a :class:`TaskFailure` for a task
        that ran out of time or memory, or whose worker died.
    """
    if not arguments:
        return
    import multiprocessing
    from multiprocessing.connection import wait

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    slots: list[_Slot] = []
    pending: collections.deque[int] = collections.deque(range(len(arguments)))
    count = max(1, min(workers, len(arguments)))
    in_flight = min(_MAX_IN_FLIGHT,
                    max(_MIN_IN_FLIGHT, len(arguments) // (count * _SHARES_IN_FLIGHT)))
    parent = os.getpid()

    def start() -> _Slot:
        parent_end, child_end = context.Pipe(duplex=True)
        process = context.Process(
            target=_worker, args=(child_end, function, arguments, budget.memory_mib, parent),
            daemon=True,
        )
        process.start()
        child_end.close()
        return _Slot(process, parent_end)

    def fill(slot: _Slot, now: float) -> None:
        # A worker reads its next batch only after finishing the one it holds, and meanwhile
        # sends a result per task. Sending a batch per result would fill the parent-to-worker
        # socket (every small message costs ~1 KiB of its buffer) while the worker fills the
        # other direction: both block in send, forever (8,000 files did it). So a batch goes
        # out only when at most half of the tasks in flight remain: then the worker has read
        # every earlier batch, and at most one message waits in the socket.
        if slot.tasks and len(slot.tasks) > in_flight // 2:
            return
        batch: list[int] = []
        while pending and len(slot.tasks) < in_flight:
            index = pending.popleft()
            if not slot.tasks:
                slot.started = now
            slot.tasks.append(index)
            batch.append(index)
        if batch:
            slot.conn.send(batch)

    def retire(slot: _Slot) -> None:
        if slot.process.is_alive():
            slot.process.kill()
        slot.process.join()
        slot.conn.close()

    try:
        for _ in range(count):
            slots.append(start())
        for slot in slots:
            fill(slot, time.monotonic())
        while any(slot.tasks for slot in slots):
            busy = [slot for slot in slots if slot.tasks]
            timeout: float | None = None
            if budget.seconds is not None:
                now = time.monotonic()
                timeout = max(0.0, min(s.started + budget.seconds - now for s in busy))
            ready = wait([slot.conn for slot in busy], timeout)
            now = time.monotonic()
            for position, slot in enumerate(slots):
                if not slot.tasks:
                    continue
                index = slot.tasks[0]
                failed = False
                if slot.conn in ready:
                    try:
                        result: R | TaskFailure = slot.conn.recv()
                    except (EOFError, OSError):
                        slot.process.join()
                        result = TaskFailure(reason=_death_reason(slot.process.exitcode))
                        failed = True
                    else:
                        failed = isinstance(result, TaskFailure)  # a MemoryError: start afresh
                elif budget.seconds is not None and now - slot.started >= budget.seconds:
                    result = TaskFailure(
                        reason=f"it took longer than the time budget ({budget.seconds:g} s)"
                    )
                    failed = True
                else:
                    continue
                slot.tasks.popleft()
                yield index, result
                now = time.monotonic()
                if failed:
                    pending.extendleft(reversed(slot.tasks))  # queued, never started
                    slot.tasks.clear()
                    retire(slot)
                    if pending:
                        slots[position] = slot = start()
                else:
                    slot.started = now
                fill(slot, now)
    finally:
        for slot in slots:
            if slot.process.is_alive():
                with contextlib.suppress(OSError, BrokenPipeError):
                    slot.conn.send(None)
        for slot in slots:
            slot.process.join(timeout=1.0)
            retire(slot)
