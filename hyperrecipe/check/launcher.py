"""Run one function on ``world_size`` local ranks, each in its own process with a process group.

:func:`run_ranks` is what ``hyperrecipe check`` and the multi-rank tests stand on. The parent
starts one process per rank (``fork`` by default: about 0.1 s per launch against about 2-3 s for
``spawn``, which re-imports torch in every child; figures in ``docs/launcher.md``), rendezvouses
them through a :class:`torch.distributed.FileStore` in a fresh temporary directory (no TCP port is
chosen, so two launches can never race for one), runs ``fn(rank, world_size, *args)`` in each and
returns the results in rank order. A rank that raises, dies or does not finish in time takes the
whole launch down: every other rank is terminated (then killed), every process is reaped, and the
parent raises :class:`RankFailedError` with the failing rank and its traceback. A rank killed by a
fault (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) has no traceback to send, so every rank enables
:mod:`faulthandler` into a file of its own and the error carries what it wrote as it died: the
Python stack of each of its threads. On a timeout the ranks still running are asked for the same
(a signal faulthandler answers), so the error says where each was stuck.

Fork caveats, which :func:`run_ranks` handles where it can:

- The child inherits the parent's memory, including caches that are wrong in a new process.
  DTensor's sharding-propagation cache is cleared in every child (a forked child that keeps the
  parent's entries can compute wrong gradients).
- Threads do not survive ``fork``. The parent should not hold locks in other threads while
  launching; torch's intra-op pool is re-created in the child, which is pinned to one thread
  (``torch.set_num_threads(1)``, and ``OMP_NUM_THREADS=1`` so that libraries such as accelerate
  keep it) so that ranks do not oversubscribe the cores. A child that raises its thread count
  after the parent started its OpenMP pool hangs in GNU OpenMP's first parallel region.
- CUDA cannot be used in a forked child once the parent has initialised it. The backend is
  chosen with :func:`torch.cuda.device_count`, which asks NVML and does not initialise CUDA; if
  CUDA is already initialised and NCCL is needed, pass ``start_method="spawn"``.

With ``spawn``, ``fn`` and ``args`` must be picklable (a module-level function).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal, TypeVar

from hyperrecipe.errors import HyperrecipeError, LaunchError, RankFailedError

__all__ = ["LaunchError", "RankFailedError", "StartMethod", "default_backend", "run_ranks"]

T = TypeVar("T")
StartMethod = Literal["fork", "spawn"]

_KILL_GRACE_S = 1.0
"""How long a terminated rank gets to exit before it is killed."""

_EXIT_GRACE_S = 30.0
"""How long a rank that reported its result gets to tear its process group down and exit."""

_FAULT_DUMP_CHARS = 64_000
"""The most of a dead rank's faulthandler file put in the error (its threads' stacks)."""

_STACKS_SIGNAL = int(signal.SIGRTMIN) + 3 if hasattr(signal, "SIGRTMIN") else None
"""Sent to the ranks still running when a launch times out: each writes its threads' Python
stacks to its faulthandler file. A real-time signal, which no library here handles (SIGUSR1
is Lightning's on SLURM)."""

_STACKS_WAIT_S = 1.0
"""How long a timed-out launch waits for the stuck ranks' stacks before stopping them."""


def default_backend(world_size: int) -> str:
    """``"nccl"`` when CUDA has at least ``world_size`` devices, otherwise ``"gloo"``.

    Uses :func:`torch.cuda.device_count`, which asks NVML first and so does not initialise CUDA
    in the caller (that would make forked ranks unable to use it).
    """
    import torch

    if torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 120.0,
    start_method: StartMethod = "fork",
    on_progress: Callable[[str], None] | None = None,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return the results by rank.

    Each rank runs in its own process with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` set, one intra-op thread, and the default process group initialised
    (timeout ``timeout_s``); with NCCL, ``torch.cuda.set_device(rank)`` is called first. Results
    travel back through a pipe, pickled with plain :mod:`pickle`; tensors in lists, tuples and
    dicts are detached and moved to the CPU first, so results never hold autograd graphs or
    device memory.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` in every rank; its result must be picklable.
        world_size: number of ranks (processes), at least 1.
        *args: passed to ``fn`` after ``rank`` and ``world_size``.
        backend: process-group backend; ``None`` chooses with :func:`default_backend`.
        timeout_s: wall-clock limit for the whole launch, start-up included.
        start_method: ``"fork"`` (cheap; ``fn`` may be a closure) or ``"spawn"``.
        on_progress: called in the parent with one-line messages (a rank is ready, a rank is done).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message), exited without a
            result, or the timeout passed (the unfinished ranks are named). All ranks are
            stopped and reaped before this is raised.
        LaunchError: bad arguments, or the parent is in a state ranks cannot start from.

    Example::

        def double_sum(rank: int, world_size: int, scale: float) -> float:
            t = torch.tensor([float(rank)])
            torch.distributed.all_reduce(t)
            return scale * t.item()

        assert run_ranks(double_sum, 2, 2.0) == [2.0, 2.0]
    """
    chosen = _check_launch(world_size, timeout_s, start_method, backend)
    if start_method == "fork":
        _import_cache_clearers()
    progress = on_progress if on_progress is not None else _ignore
    ctx = (
        multiprocessing.get_context("spawn")
        if start_method == "spawn"
        else multiprocessing.get_context("fork")
    )
    store_dir = tempfile.mkdtemp(prefix="hyperrecipe-ranks-")
    store_path = os.path.join(store_dir, "store")
    deadline = time.monotonic() + timeout_s
    procs: list[BaseProcess] = []
    conns: dict[int, Connection] = {}
    parent = os.getpid()
    fault_paths = [os.path.join(store_dir, f"rank-{rank}.fault") for rank in range(world_size)]
    beside = _threads_beside_fork() if start_method == "fork" else ""
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, args, chosen, store_path, timeout_s, writer, parent,
                      fault_paths[rank]),
                name=f"hyperrecipe-rank-{rank}",
            )
            try:
                proc.start()
            except Exception as exc:
                hint = ""
                if start_method == "spawn":
                    hint = " (with start_method='spawn', fn and args must be picklable)"
                msg = f"could not start rank {rank}: {type(exc).__name__}: {exc}{hint}"
                raise LaunchError(msg) from exc
            finally:
                writer.close()
            procs.append(proc)
            conns[rank] = reader
        progress(f"started {world_size} rank(s) ({start_method}, {chosen})")
        return _collect(procs, conns, deadline, timeout_s, progress, fault_paths, beside)
    finally:
        _stop(procs)
        for conn in conns.values():
            conn.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _ignore(message: str) -> None:
    del message


def _check_launch(
    world_size: int, timeout_s: float, start_method: str, backend: str | None
) -> str:
    """Validate the arguments and the parent's state; return the backend to use."""
    if world_size < 1:
        msg = f"world_size must be at least 1, got {world_size}"
        raise LaunchError(msg)
    if timeout_s <= 0:
        msg = f"timeout_s must be positive, got {timeout_s}"
        raise LaunchError(msg)
    if start_method not in ("fork", "spawn"):
        msg = f"start_method must be 'fork' or 'spawn', got {start_method!r}"
        raise LaunchError(msg)
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        msg = (
            "run_ranks was called in a process that already has a default process group "
            f"(rank {dist.get_rank()} of {dist.get_world_size()}); ranks cannot be launched "
            "from inside a rank"
        )
        raise LaunchError(msg)
    chosen = backend if backend is not None else default_backend(world_size)
    cuda_ready = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    if chosen == "nccl" and start_method == "fork" and cuda_ready:
        msg = (
            "CUDA is already initialised in this process, so forked ranks cannot use it for "
            "NCCL; pass start_method='spawn'"
        )
        raise LaunchError(msg)
    return chosen


def _collect(
    procs: Sequence[BaseProcess],
    conns: dict[int, Connection],
    deadline: float,
    timeout_s: float,
    progress: Callable[[str], None],
    fault_paths: Sequence[str],
    beside: str,
) -> list[Any]:
    """Read every rank's messages until all have reported, one failed, or the deadline passed."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: list[tuple[float, int, str, str]] = []  # (when, rank, summary, traceback)
    died: set[int] = set()  # ranks that ended without a report: their "traceback" is a dump
    open_conns = dict(conns)

    def read(rank: int) -> None:
        conn = open_conns[rank]
        try:
            message = conn.recv()
        except (EOFError, OSError):
            del open_conns[rank]
            return
        tag = message[0]
        if tag == "ready":
            progress(f"rank {rank}: process group ready")
        elif tag == "ok":
            try:
                results[rank] = pickle.loads(message[1])
            except Exception as exc:
                summary = f"its result could not be unpickled: {type(exc).__name__}: {exc}"
                failures.append((time.monotonic(), rank, summary, ""))
                return
            progress(f"rank {rank}: done ({len(results)}/{world_size})")
        elif tag == "error":
            _, when, summary, rank_tb = message
            failures.append((when, rank, summary, rank_tb))

    while len(results) < world_size and not failures:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [open_conns[r] for r in sorted(open_conns)]
        waitables += [
            procs[r].sentinel
            for r in range(world_size)
            if r not in open_conns and r not in results
        ]
        ready = multiprocessing.connection.wait(waitables, timeout=remaining)
        for obj in ready:
            rank = _owner(obj, open_conns, procs)
            if rank is None:
                continue
            if rank in open_conns:
                read(rank)
            elif rank not in results and not any(f[1] == rank for f in failures):
                procs[rank].join(_KILL_GRACE_S)
                summary = f"{_describe_exit(procs[rank].exitcode)} without reporting a result"
                died.add(rank)
                failures.append((time.monotonic(), rank, summary, _fault_dump(fault_paths[rank])))

    if failures:
        # Ranks that failed at about the same time (a peer noticing the first failure): read what
        # is already there so the earliest one is blamed, not the first one read.
        for rank in sorted(open_conns):
            while rank in open_conns and open_conns[rank].poll(0):
                read(rank)
        failures.sort()
        when, rank, summary, rank_tb = failures[0]
        unfinished = tuple(r for r in range(world_size) if r not in results)
        others = [f"rank {r}: {s}" for _, r, s, _ in failures[1:]]
        also = f"\nalso failed: {'; '.join(others)}" if others else ""
        what = f"what faulthandler wrote as rank {rank} died" if rank in died else (
            f"traceback of rank {rank}")
        body = f"\n--- {what} ---\n{rank_tb.rstrip()}" if rank_tb else ""
        code = procs[rank].exitcode
        # a signal (not an exit code of its own choosing) is where the fork's leftovers matter
        note = f"\n{beside}" if rank in died and beside and code is not None and code < 0 else ""
        msg = f"rank {rank} of {world_size} failed: {summary}{also}{body}{note}"
        raise RankFailedError(msg, rank=rank, rank_traceback=rank_tb, unfinished=unfinished)

    if len(results) < world_size:
        unfinished = tuple(r for r in range(world_size) if r not in results)
        done = [r for r in range(world_size) if r in results]
        msg = (
            f"timed out after {timeout_s:g} s: rank(s) {list(unfinished)} of {world_size} had "
            f"not finished (finished: {done})"
        )
        for rank, stacks in _stacks_of(procs, unfinished, fault_paths).items():
            msg += f"\n--- where rank {rank} was (faulthandler) ---\n{stacks}"
        raise RankFailedError(msg, rank=None, unfinished=unfinished)

    for proc in procs:
        proc.join(max(0.0, min(_EXIT_GRACE_S, deadline - time.monotonic())))
    return [results[r] for r in range(world_size)]


def _threads_beside_fork() -> str:
    """The launching process's other threads as the ranks are forked, said for a rank that
    dies without reporting (``""`` when there are none): a fork copies none of them, so what
    one of them was in the middle of (a lock it held, a pool's bookkeeping) is left half-done
    in every rank."""
    try:
        native = len(os.listdir("/proc/self/task")) - 1
    except OSError:  # not Linux: the Python threads only
        native = 0
    named = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    count = max(native, len(named))
    if count == 0:
        return ""
    rest = count - len(named)
    parts = [*named, f"{rest} native (OpenMP, BLAS or another library's pool)"] if rest else named
    return (f"the launching process had {count} other thread(s) when it forked the ranks: "
            f"{', '.join(parts)}")


def _stacks_of(procs: Sequence[BaseProcess], ranks: Sequence[int],
               fault_paths: Sequence[str]) -> dict[int, str]:
    """The Python stacks of the live ``ranks``, asked for with :data:`_STACKS_SIGNAL` and read
    from their faulthandler files once each has stopped growing (at most
    :data:`_STACKS_WAIT_S`); ranks that wrote nothing are left out."""
    if _STACKS_SIGNAL is None:
        return {}
    asked = []
    for rank in ranks:
        pid = procs[rank].pid
        if pid is not None and procs[rank].is_alive():
            with contextlib.suppress(OSError):
                os.kill(pid, _STACKS_SIGNAL)
                asked.append(rank)
    sizes: dict[int, int] = {}
    give_up = time.monotonic() + _STACKS_WAIT_S
    while asked and time.monotonic() < give_up:
        time.sleep(0.05)
        now = {}
        for rank in asked:
            with contextlib.suppress(OSError):
                now[rank] = os.path.getsize(fault_paths[rank])
        if all(now.get(r, 0) > 0 and now[r] == sizes.get(r) for r in asked):
            break
        sizes = now
    dumps = {rank: _fault_dump(fault_paths[rank]) for rank in asked}
    return {rank: text for rank, text in dumps.items() if text}


def _fault_dump(path: str) -> str:
    """What faulthandler wrote in a rank that died (``""``: nothing, e.g. SIGKILL or ``_exit``).

    A forked rank's main thread still has the parent's frames below :func:`_rank_main` (the
    launch, the caller's own stack): they say nothing about the rank and are left out.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(_FAULT_DUMP_CHARS)
    except OSError:
        return ""
    kept: list[str] = []
    below_rank_main = False
    for line in text.splitlines():
        if below_rank_main and line.startswith("  File "):
            continue
        below_rank_main = line.startswith("  File ") and line.endswith(f" in {_rank_main.__name__}")
        kept.append(line)
    return "\n".join(kept).strip()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _owner(
    obj: object, open_conns: dict[int, Connection], procs: Sequence[BaseProcess]
) -> int | None:
    for rank, conn in open_conns.items():
        if conn is obj:
            return rank
    for rank, proc in enumerate(procs):
        if proc.sentinel == obj:
            return rank
    return None


def _stop(procs: Sequence[BaseProcess]) -> None:
    """Terminate every live rank, kill those still alive after a grace period, reap them all."""
    live = [p for p in procs if p.pid is not None and p.is_alive()]
    for proc in live:
        with contextlib.suppress(OSError):
            proc.terminate()
    give_up = time.monotonic() + _KILL_GRACE_S
    for proc in live:
        proc.join(max(0.0, give_up - time.monotonic()))
    for proc in live:
        if proc.is_alive():
            with contextlib.suppress(OSError):
                proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join()


def _import_cache_clearers() -> None:
    """In the parent: import what the children need to clear inherited caches, once.

    When the parent has loaded DTensor (``torch.testing`` alone does), it may hold a sharding-
    propagation cache. Importing ``torch.distributed.tensor.debug`` takes about a second, which
    every forked child would otherwise pay again, concurrently.
    """
    if "torch.distributed.tensor" in sys.modules:
        with contextlib.suppress(ImportError):
            import torch.distributed.tensor.debug  # noqa: F401


# ---------------------------------------------------------------------------------------------
# In the rank process.


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    backend: str,
    store_path: str,
    timeout_s: float,
    conn: Connection,
    parent: int,
    fault_path: str,
) -> None:
    _die_with_parent(parent)
    # A fault in native code (a segmentation fault in a library, an abort in C++ teardown) kills
    # the rank before it can report; the parent puts this file's stacks in its error. The file
    # stays open for the process's life (faulthandler writes to its descriptor from the signal
    # handler). It replaces whatever the parent had enabled (pytest writes to its stderr, where
    # ranks' dumps interleave and no error names them).
    # On a timeout the parent sends _STACKS_SIGNAL, and the same file gets where it was stuck.
    with contextlib.suppress(OSError):
        fault_file = open(fault_path, "w", encoding="utf-8")  # open for the process's life
        faulthandler.enable(file=fault_file, all_threads=True)
        if _STACKS_SIGNAL is not None:
            faulthandler.register(_STACKS_SIGNAL, file=fault_file, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        # what the pinning below chose, said where libraries look: accelerate raises the
        # thread count of a CPU rank whose OMP_NUM_THREADS is unset, and a forked child whose
        # parent had started its OpenMP pool then hangs in its first parallel region
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        _clear_inherited_caches()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Gloo may return from init on one rank while a peer is still completing its handshake
        # (seen with torch 2.15: a rank whose function returned at once tore its group down,
        # and the peer's init failed with "Connection closed by peer"). No rank runs its
        # function, or exits, before every rank is connected.
        dist.barrier()
        conn.send(("ready",))
        result = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(_portable(result), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            msg = f"the result of rank {rank} ({type(result).__name__}) cannot be pickled: {exc}"
            raise TypeError(msg) from exc
        conn.send(("ok", payload))
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt too
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        # hyperrecipe's own errors name the recipe, rule and module already: their traceback
        # would only bury that message under our internals; one that wraps a user's exception
        # keeps it, since it points into the user's code
        own = isinstance(exc, HyperrecipeError) and exc.__cause__ is None
        tb = "" if own else traceback.format_exc()
        with contextlib.suppress(Exception):
            conn.send(("error", time.monotonic(), summary, tb))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this rank when the launching process dies (best effort)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _clear_inherited_caches() -> None:
    """Drop state a forked child inherits from the parent but must not reuse.

    Only what the parent imported can hold stale state, so nothing is imported here: the
    parent imported ``torch.distributed.tensor.debug`` (see :func:`_import_cache_clearers`).
    """
    debug = sys.modules.get("torch.distributed.tensor.debug")
    if debug is None:
        return
    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if callable(clear):
        with contextlib.suppress(Exception):
            clear()


def _portable(result: Any) -> Any:
    """``result`` with its tensors (in lists, tuples, dicts) detached and moved to the CPU."""
    import torch
    from torch.utils import _pytree

    def to_cpu(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().cpu()
        return leaf

    return _pytree.tree_map(to_cpu, result)
