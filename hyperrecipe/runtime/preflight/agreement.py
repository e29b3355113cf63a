"""Ranks agree before and after ``apply``: one fixed-size exchange each, with a bounded wait.

A rank that disagrees must not leave its peers blocked. Before anything mesh-specific, each rank
runs its local checks (the plan fits its mesh and model), then every rank all-gathers the same
small record over the world group: a digest of the plan and the mesh as this rank sees them, and
whether its local checks passed. Every rank reads the same table, so every rank raises together
when one differs or failed: the failing rank its own error, the others a
:class:`~hyperrecipe.errors.PlanMismatchError` naming it. After installing, the ranks vote the
same way (a rank interrupted mid-apply votes "failed" on its way out).

Each wait is bounded by :func:`agreement_timeout` (``HYPERRECIPE_AGREEMENT_TIMEOUT`` seconds,
default 30): a rank that never arrives (killed, hung in its own code) makes its peers raise
``PlanMismatchError`` after that long instead of waiting for the process group's timeout
(default 30 minutes) and a raw backend error. After such a timeout the process group may hold
an unfinished collective: destroy it before reusing it.

The training state's collectives agree here too, so that every rank-agreement mechanism lives in
one module: the entry check of a gathering call (:class:`EntryCheck`, through the store:
:func:`every_rank_entered`), the digest of a checkpoint every rank is about to read
(:func:`agree_on_source`), every rank's outcome of a step (:func:`agree_on_failure`,
:func:`every_rank_failure`, and :func:`every_rank_outcome` through the store, which names the
ranks that did not arrive and leaves the process group usable) and the meeting at a training
loop's end (:func:`leave_together`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from hyperrecipe.errors import PlanMismatchError, WeightLoadError
from hyperrecipe.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TIMEOUT_ENV", "EntryCheck", "agree_before_apply", "agree_on_digest", "agreement_scope", "current_scope",
           "agree_on_failure", "agree_on_source", "agreement_timeout", "every_rank_entered",
           "every_rank_failure", "every_rank_outcome", "exchange_rows", "leave_together", "vote"]

TIMEOUT_ENV = "HYPERRECIPE_AGREEMENT_TIMEOUT"
_DEFAULT_TIMEOUT_S = 30.0
_MAX_TIMEOUT_S = 1e6  # about 11 days: longer is unbounded in all but name
_WORDS = 4  # 4 x 60 bits of a sha256 digest
_OK, _FAILED = 0, 1
_SCOPE: contextvars.ContextVar[Any] = contextvars.ContextVar("hyperrecipe_agreement_scope",
                                                             default=None)


@contextlib.contextmanager
def agreement_scope(group: Any) -> Iterator[None]:
    """Agree (before apply, and the vote after it) among the ranks of ``group`` instead of
    every rank: a pipeline stage's tensor-parallel ranks apply their stage's view of the plan,
    which the other stages' ranks do not hold. Rank numbers in messages stay global."""
    token = _SCOPE.set(group)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _global_ranks(indices: list[int]) -> list[int]:
    group = _SCOPE.get()
    return indices if group is None else [dist.get_global_rank(group, i) for i in indices]


def agreement_timeout() -> float:
    """Seconds a rank waits for its peers in an exchange (``HYPERRECIPE_AGREEMENT_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= _MAX_TIMEOUT_S:  # inf (or 1e300) overflows the wait's timedelta
        msg = (f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds up to "
               f"{_MAX_TIMEOUT_S:g}")
        raise PlanMismatchError(msg)
    return value


def _device_for(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest_words(plan: Plan, mesh: DeviceMesh) -> list[int]:
    """A fixed-size digest of what must be equal on every rank: the plan and the mesh's
    names and sizes (read locally: no collective)."""
    names = tuple(mesh.mesh_dim_names or ())
    sizes = tuple(int(s) for s in mesh.mesh.shape)
    text = f"{plan.fingerprint}|{','.join(names)}|{sizes}"
    hexdigest = hashlib.sha256(text.encode()).hexdigest()
    return [int(hexdigest[i:i + 15], 16) for i in range(0, 15 * _WORDS, 15)]


def _all_gather_rows(row: list[int], what: str,
                     timeout_s: float | None = None) -> list[list[int]]:
    """Every rank's ``row`` (same length everywhere), waiting at most ``timeout_s`` (default
    :func:`agreement_timeout`).

    Raises:
        PlanMismatchError: a rank did not arrive in time.
    """
    group = _SCOPE.get()
    world = dist.get_world_size(group)
    device = _device_for(group)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13 renamed
    timeout = agreement_timeout() if timeout_s is None else timeout_s
    work = gather(everyone, mine, group=group, async_op=True)
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo: "Operation timed out!"
        done = False
        detail = f" ({exc})"
    else:
        detail = ""
    if done is False:
        msg = (f"rank {dist.get_rank()}: not every rank reached {what} within {timeout:g} s"
               f"{detail}; a rank stopped, hangs or runs other code (set {TIMEOUT_ENV} to wait "
               f"longer); destroy the process group before reusing it")
        raise PlanMismatchError(msg)
    return [list(r) for r in everyone.view(world, -1).cpu().tolist()]


def agree_before_apply(plan: Plan, mesh: DeviceMesh, *local_checks: Callable[[], None]) -> None:
    """Run this rank's ``local_checks`` in order, then agree with every rank on plan, mesh and outcome.

    Every rank calls this before anything mesh-specific; every rank returns, or every rank
    raises.

    Raises:
        Whatever ``local_checks`` raised, on the rank where it failed.
        PlanMismatchError: on the other ranks, when a rank's checks failed or its plan or mesh
            differs, or when a rank did not arrive within :func:`agreement_timeout`.
    """
    error: BaseException | None = None
    try:
        for check in local_checks:
            check()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after every rank knows
        error = exc
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    row = [*_digest_words(plan, mesh), _OK if error is None else _FAILED]
    try:
        rows = _all_gather_rows(row, "the plan agreement")
    except PlanMismatchError:
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise error
    rank = dist.get_rank()
    failed = _global_ranks([r for r, other in enumerate(rows) if other[-1] != _OK])
    if failed:
        msg = (f"rank {rank}: the plan does not fit the model or mesh on rank(s) {failed} "
               f"(see their errors); no rank applied it")
        raise PlanMismatchError(msg)
    differ = _global_ranks([r for r, other in enumerate(rows) if other[:-1] != row[:-1]])
    if differ:
        msg = (f"ranks hold different plans or meshes: this rank (rank {rank}) has plan "
               f"{plan.recipe!r} with fingerprint {plan.fingerprint[:12]} on mesh "
               f"{_mesh_text(mesh)}, ranks {differ} hold another; every rank must apply the same "
               f"plan on the same mesh")
        raise PlanMismatchError(msg)


def agree_on_digest(digest: str | None, what: str) -> tuple[list[int], list[int]]:
    """Every rank's view of one input (``digest``: a hex digest of it, ``None`` when this rank
    could not read it), in one bounded exchange: ``(ranks that could not read it, ranks whose
    digest differs from this rank's)``, the same table on every rank.

    Raises:
        PlanMismatchError: a rank did not arrive within :func:`agreement_timeout`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ([] if digest is not None else [0]), []
    text = digest or "0"
    words = [int(text[i:i + 15].ljust(15, "0"), 16) for i in range(0, 15 * _WORDS, 15)]
    row = [*words, _OK if digest is not None else _FAILED]
    rows = _all_gather_rows(row, what)
    failed = [r for r, other in enumerate(rows) if other[-1] != _OK]
    differ = [r for r, other in enumerate(rows) if other[-1] == _OK and other[:-1] != row[:-1]]
    return failed, differ


def exchange_rows(row: list[int], what: str, timeout_s: float, *,
                  scope: Any = None) -> dict[int, list[int]]:
    """Every rank's ``row`` of non-negative integers below 2**63 (the same length on every
    rank), by global rank, in one all-gather over the world (or over the ranks of ``scope``,
    a group that :func:`agreement_scope` named while the check was installed) that waits at
    most ``timeout_s``: for a check whose verdict every rank must reach from the same table
    (the first training forward's, :mod:`~hyperrecipe.runtime.preflight.first_forward`).

    Raises:
        PlanMismatchError: a rank did not arrive within ``timeout_s``.
    """
    token = _SCOPE.set(scope)
    try:
        rows = _all_gather_rows(row, what, timeout_s)
        return dict(zip(_global_ranks(list(range(len(rows)))), rows, strict=True))
    finally:
        _SCOPE.reset(token)


def current_scope() -> Any:
    """The group :func:`agreement_scope` names now (``None``: every rank)."""
    return _SCOPE.get()


_TEXT_WORDS = 40  # 7 bytes a word: the first 280 bytes of each rank's error


def agree_on_failure(error: str | None, what: str, timeout_s: float | None = None, *,
                     max_bytes: int = 7 * _TEXT_WORDS) -> dict[int, str]:
    """Every rank's outcome of one step, in one bounded exchange: ``{rank: the start of its
    error}`` (its first ``max_bytes`` bytes of UTF-8, the same bound on every rank) for each
    rank that failed (``error`` is this rank's, ``None`` when it succeeded), the same table on
    every rank, so that every rank can name the failing rank and what it said.

    Raises:
        PlanMismatchError: a rank did not arrive within ``timeout_s`` (default
            :func:`agreement_timeout`).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {} if error is None else {0: error}
    n_words = -(-max_bytes // 7)
    raw = (error or "").encode("utf-8", "replace")[:7 * n_words]
    words = [int.from_bytes(raw[i:i + 7], "little") for i in range(0, 7 * n_words, 7)]
    row = [_OK if error is None else _FAILED, len(raw), *words]
    rows = _all_gather_rows(row, what, timeout_s)
    out: dict[int, str] = {}
    for r, (flag, length, *text) in enumerate(rows):
        if flag != _OK:
            data = b"".join(w.to_bytes(7, "little") for w in text)[:length]
            out[r] = data.decode("utf-8", "replace")
    return out


def vote(ok: bool) -> list[int]:
    """Ranks that failed (every rank gets the same answer, or a PlanMismatchError when a rank
    did not vote within :func:`agreement_timeout`).

    Two exchanges: every rank first says it has arrived, then votes. A rank that gives up
    waiting has then only said "arrived", never "ok": a peer arriving after the timeout passes
    the first exchange on that rank's buffered word, but meets nobody in the second and rolls
    back too, instead of keeping a plan its peer rolled back.
    """
    if not dist.is_initialized():
        return [] if ok else [0]
    _all_gather_rows([_OK], "the vote after installing")
    rows = _all_gather_rows([_OK if ok else _FAILED], "the vote after installing")
    return _global_ranks([r for r, (flag,) in enumerate(rows) if flag != _OK])


def _mesh_text(mesh: DeviceMesh) -> str:
    names = tuple(mesh.mesh_dim_names or ())
    sizes = tuple(int(s) for s in mesh.mesh.shape)
    if len(names) != len(sizes):
        return "x".join(str(s) for s in sizes) + " (unnamed)"
    return ",".join(f"{n}={s}" for n, s in zip(names, sizes))


class _Entered:
    """How many collective state calls this process got through (the same on every rank
    while the ranks call them in the same order, which they must for the gathers anyway)."""

    calls = 0


def every_rank_entered(store: Any, label: str, rank: int, world: int,
                       timeout_s: float) -> str | None:
    """Wait up to ``timeout_s`` for every rank to enter this collective call; None when all
    did and all entered ``label``, otherwise why not (the missing ranks, or what others called).

    Through the process group's store, not a collective: a monitored barrier bounds the wait
    only on rank 0 (other ranks wait for rank 0 with the process group's timeout), and a timed
    out collective leaves the group unusable. The store is polled (``check``): a timed-out
    blocking ``wait`` would leave a reply pending on the store's socket. A rank that gives up
    removes its own entry and does not count the call, so a later call finds no stale arrival;
    after a call every rank got through, the last rank to leave removes its keys.
    """
    import time

    key = f"hyperrecipe/collective/{_Entered.calls + 1}"
    mine = f"{key}/{rank}"
    keys = [f"{key}/{r}" for r in range(world)]
    store.set(mine, label)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            store.delete_key(mine)
            return f"rank(s) {missing} did not enter it within {timeout_s:g} s"
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    called = {r: bytes(store.get(k)).decode() for r, k in enumerate(keys)}
    _Entered.calls += 1
    if store.add(f"{key}/left", 1) == world:  # every rank has read every entry
        for k in (*keys, f"{key}/left"):
            store.delete_key(k)
    others = {r: c for r, c in called.items() if c != label}
    if others:
        listed = ", ".join(f"rank {r} {c}()" for r, c in sorted(others.items()))
        return f"other ranks entered another collective at this point: {listed}"
    return None


class _Outcomes:
    """How many outcome exchanges this process took part in (as :class:`_Entered`, but a rank
    that gives up counts the exchange too: it leaves a mark there instead of removing its
    entry, so a late rank reads that it gave up rather than waiting on a stale key)."""

    calls = 0


_GAVE_UP = "\0gave up"


def every_rank_outcome(outcome: str, what: str, timeout_s: float
                       ) -> tuple[dict[int, str], list[int]]:
    """Every rank's ``outcome`` of one step (any text: a message, a path, JSON), whole, in
    one exchange through the process group's store that waits at most ``timeout_s``:
    ``({rank: its outcome}, ranks that did not arrive)``. Every rank that arrived in time
    reads the same table.

    Why the store and not a collective (as :func:`agree_on_failure`): a collective that
    times out leaves the group out of step for every later call, a row of fixed size cuts a
    message short, and only the store can say *which* ranks did not arrive, which is what a
    user needs to find a stopped or killed rank. A rank that gives up overwrites its entry
    with a mark (never removes it: a peer reading it would block on the store's own
    timeout), so a peer that arrives late counts it as missing too; both count the exchange,
    and the next one meets under fresh keys. The waits poll (``check``), as in
    :func:`every_rank_entered`. ``what`` names the step for the caller's message only.
    """
    del what  # the caller says what did not arrive, with its own context
    if not _store_group():
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {r: outcome for r in range(world)}, []
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    _Outcomes.calls += 1
    key = f"hyperrecipe/outcome/{_Outcomes.calls}"
    keys = [f"{key}/{r}" for r in range(world)]
    store.set(keys[rank], "=" + outcome)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                store.set(keys[rank], _GAVE_UP)
                store.add(f"{key}/left", 1)
                return {rank: outcome}, missing
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    values = {r: bytes(store.get(k)).decode("utf-8", "replace") for r, k in enumerate(keys)}
    if store.add(f"{key}/left", 1) == world:  # every rank has read (or given up)
        for k in (*keys, f"{key}/left"):
            store.delete_key(k)
    missing = [r for r, v in values.items() if v == _GAVE_UP]
    return {r: v[1:] for r, v in values.items() if r not in missing}, missing


def _store_group() -> bool:
    """Whether there are peers to wait for through the store: more than one process, and not
    torch's fake process group (a dry run, :mod:`hyperrecipe.simulate`), whose peers are
    imagined."""
    return (dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() != "fake")


@attrs.frozen(kw_only=True)
class EntryCheck:
    """The check at the door of a gathering call: every rank must call it; one that does not
    would leave the others waiting in the gather (or in DCP's exchanges) until the watchdog
    (minutes, then an opaque error). Every rank that called fails within ``timeout_s()``
    instead, naming the missing ranks (:func:`every_rank_entered`).

    ``active`` is decided once, when the installation is attached (the world group existed
    and had peers); ``timeout_s`` is read at each call (``Installation.collective_timeout_s``
    may be changed after apply).
    """

    active: bool
    timeout_s: Callable[[], float]

    @classmethod
    def for_world(cls, timeout_s: Callable[[], float]) -> EntryCheck:
        return cls(active=_store_group(), timeout_s=timeout_s)

    def __call__(self, label: str, why: str = "", advice: str = "only one rank writes") -> None:
        """Return once every rank entered ``label`` (``TrainingState.save_pretrained``,
        ``model.state_dict``...).

        Raises:
            PlanMismatchError: a rank did not enter it within ``timeout_s()``, or entered
                another collective at this point.
        """
        if not self.active:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        timeout = self.timeout_s()
        why_not = every_rank_entered(_get_default_store(), label, dist.get_rank(),
                                     dist.get_world_size(), timeout)
        if why_not is not None:
            msg = (f"{label}() is a collective{why}: every rank must call it (rank "
                   f"{dist.get_rank()} waited {timeout:g} s: {why_not}). Call it on every "
                   f"rank; {advice}")
            raise PlanMismatchError(msg)


def leave_together(what: str, timeout_s: float) -> None:
    """Return once every rank reached the end of ``what``, waiting at most ``timeout_s``; a
    rank that does not arrive is warned about, not raised on (this rank's work is done).

    Why: see :func:`hyperrecipe.runtime.installation.leave_together`, the entry point a
    trainer calls.
    """
    if not _store_group():
        return
    from torch.distributed.distributed_c10d import _get_default_store

    why_not = every_rank_entered(_get_default_store(), what, dist.get_rank(),
                                 dist.get_world_size(), timeout_s)
    if why_not is not None:
        warnings.warn(f"{what}: the ranks did not leave together ({why_not}); a rank that "
                      "failed says why", RuntimeWarning, stacklevel=3)


def agree_on_source(source: str | os.PathLike[str], what: str,
                    read_digest: Callable[[int, int], str]) -> None:
    """Every rank compares a digest of what it is about to read (``read_digest(rank,
    world)``, which may also check this rank's share of the files and raise
    :class:`~hyperrecipe.errors.WeightLoadError`) in one bounded exchange before any rank
    loads: ranks handed different checkpoints (or one a truncated copy) would otherwise each
    load their own and train on a mixture.

    Raises:
        WeightLoadError: this rank could not read it (its own error), another rank could not,
            or the ranks read different contents; no rank loaded.
        PlanMismatchError: a rank did not arrive within :func:`agreement_timeout`.
    """
    error: WeightLoadError | None = None
    digest: str | None = None
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        digest = read_digest(rank, world)
    except WeightLoadError as exc:
        error, digest = exc, None
    failed, differ = agree_on_digest(digest, f"the agreement before {what}")
    if error is not None:
        raise error
    if failed:
        raise WeightLoadError(f"rank {rank}: {what}({os.fspath(source)!r}) cannot read the "
                              f"checkpoint on rank(s) {failed} (see their errors); no rank "
                              f"loaded")
    if differ:
        assert digest is not None
        raise WeightLoadError(
            f"ranks read different checkpoints: this rank (rank {rank}) reads "
            f"{os.fspath(source)!r} (digest {digest[:12]}), rank(s) {differ} read other "
            f"contents (another checkpoint or step, or a truncated or partial copy); every "
            f"rank must {what} the same checkpoint; no rank loaded")


def every_rank_failure(failure: str | None) -> list[tuple[int, str]]:
    """Every rank's failure (rank, why), the same list on every rank, whole (not cut to a fixed
    size as :func:`agree_on_failure`'s): the export's final agreement, which runs on its own
    thread under the export's own bound."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [(0, failure)] if failure is not None else []
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failure)
    return [(r, f) for r, f in enumerate(everyone) if f is not None]
