"""Pipeline schedules computed by us, without torch: who runs which stage, in what order, and
how much of the step each rank spends waiting.

The schedules are the ones ``torch.distributed.pipelining`` ships, under the names its
``get_schedule_class`` accepts, so a recipe can name one and the runtime hand the same name to
torch. The action lists follow torch 2.13's own algorithms (read from ``schedules.py``) with one
exception: torch's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..m
instead of 0..m-1; ours are 0-based on every rank (``docs/pipeline.md``). We compute them
ourselves because torch only builds them from live stage objects, which compiling and the dry
run do not have.

An action is a compute step of one stage on one microbatch: ``F`` forward, ``B`` full backward,
or for the zero-bubble schedules ``I`` (the gradient of the input, which the previous stage
waits for) and ``W`` (the gradient of the weights, which nobody waits for and so fills bubbles).
Communication is not an action; :func:`simulate_timeline` charges it as a delay on each
cross-rank dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal

import attrs

from hyperrecipe.errors import RecipeError

ActionKind = Literal["F", "B", "I", "W"]
Placement = Literal["loop", "v"]


@attrs.frozen(kw_only=True)
class Action:
    """One compute step of a rank: ``kind`` on global ``stage`` for ``microbatch`` (0-based)."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@attrs.frozen(kw_only=True)
class StagesPerRank:
    """How many stages a schedule places on each rank: at least ``least``, at most ``most``
    (``None``: no upper bound). Torch's single-stage schedules take exactly one, its looped
    multi-stage schedules two or more, and its V schedules exactly two."""

    least: int
    most: int | None

    def allows(self, virtual: int) -> bool:
        """Whether ``virtual`` stages per rank is one this schedule can place."""
        return virtual >= self.least and (self.most is None or virtual <= self.most)

    def __str__(self) -> str:
        if self.most == self.least:
            return f"exactly {self.least}"
        if self.most is None:
            return f"{self.least} or more"
        return f"{self.least} to {self.most}"


@attrs.frozen(kw_only=True)
class ScheduleInfo:
    """What a schedule is, as far as placing stages and timing them needs.

    Args:
        name: the name torch's ``get_schedule_class`` accepts (``"Interleaved1F1B"``).
        stages_per_rank: how many stages each rank may hold.
        placement: ``"loop"`` puts stage ``s`` on rank ``s % pp``; ``"v"`` gives rank ``r``
            stages ``r`` and ``2*pp-1-r``, so the first and last stage share rank 0 and the turn
            of the V stays on the last rank without a send.
        splits_backward: whether the schedule runs the backward as ``I`` and ``W`` (some or all
            of it), which is how zero-bubble schedules fill their bubbles.
        torch_class: the class in ``torch.distributed.pipelining.schedules``.
        doc: one line on what it does.
    """

    name: str
    stages_per_rank: StagesPerRank
    placement: Placement
    splits_backward: bool
    torch_class: str
    doc: str


_ONE = StagesPerRank(least=1, most=1)
_LOOPED = StagesPerRank(least=2, most=None)
_V = StagesPerRank(least=2, most=2)

SCHEDULES: Mapping[str, ScheduleInfo] = MappingProxyType({info.name: info for info in (
    ScheduleInfo(name="GPipe", stages_per_rank=_ONE, placement="loop", splits_backward=False,
                 torch_class="ScheduleGPipe",
                 doc="every forward, then every backward; holds all microbatches' activations"),
    ScheduleInfo(name="1F1B", stages_per_rank=_ONE, placement="loop", splits_backward=False,
                 torch_class="Schedule1F1B",
                 doc="pp-1-rank warm-up forwards, then one forward one backward; GPipe's bubble "
                     "with at most pp-rank activations in flight"),
    ScheduleInfo(name="Interleaved1F1B", stages_per_rank=_LOOPED, placement="loop",
                 splits_backward=False, torch_class="ScheduleInterleaved1F1B",
                 doc="1F1B over several looped stages per rank (Megatron's interleaving, "
                     "depth first); the bubble shrinks by the stages per rank"),
    ScheduleInfo(name="LoopedBFS", stages_per_rank=_LOOPED, placement="loop",
                 splits_backward=False, torch_class="ScheduleLoopedBFS",
                 doc="breadth first: each local stage runs every microbatch before the next"),
    ScheduleInfo(name="InterleavedZeroBubble", stages_per_rank=_LOOPED, placement="loop",
                 splits_backward=True, torch_class="ScheduleInterleavedZeroBubble",
                 doc="interleaved 1F1B with the backward split, weight gradients deferred into "
                     "the bubbles (ZB1P)"),
    ScheduleInfo(name="ZBVZeroBubble", stages_per_rank=_V, placement="v", splits_backward=True,
                 torch_class="ScheduleZBVZeroBubble",
                 doc="zero bubble on a V of two stages per rank (ZB-V); no bubble when forward, "
                     "input and weight gradients cost the same"),
    ScheduleInfo(name="DualPipeV", stages_per_rank=_V, placement="v", splits_backward=True,
                 torch_class="ScheduleDualPipeV",
                 doc="DeepSeek's DualPipe folded into a V; pairs a forward with a backward so "
                     "the runtime can overlap their communication"),
)})
"""Torch's pipeline schedules by the name ``get_schedule_class`` accepts."""


# -- what torch will run ---------------------------------------------------------------------


def _rounds(pp: int, microbatches: int) -> int:
    """Torch's interleaved schedules cut the microbatches into this many equal rounds."""
    return max(1, microbatches // pp)


def _rounds_divide(pp: int, microbatches: int) -> bool:
    return microbatches % _rounds(pp, microbatches) == 0


def check_schedule(schedule: str, pp: int, microbatches: int, virtual: int) -> str | None:
    """Why torch 2.13 would refuse this combination, or ``None`` when it runs it.

    The rules are torch's own constructor checks (``schedules.py``), stated before any stage
    exists so that a recipe is refused at compile time rather than on the cluster.

    Args:
        schedule: a name in :data:`SCHEDULES`.
        pp: pipeline ranks.
        microbatches: microbatches per step.
        virtual: stages per rank.

    Returns:
        The refusal, saying what was declared and what is required; ``None`` if torch runs it.
    """
    info = SCHEDULES.get(schedule)
    if info is None:
        return (f"unknown pipeline schedule {schedule!r}. Declared: {schedule!r}; required: one "
                f"of {sorted(SCHEDULES)} (torch's spelling).")
    if pp < 1:
        return f"{schedule} needs a pipeline rank. Declared: pp={pp}; required: pp >= 1."
    if microbatches < 1:
        return (f"{schedule} needs a microbatch. Declared: {microbatches} microbatches; "
                "required: 1 or more.")
    if not info.stages_per_rank.allows(virtual):
        noun = "stage" if info.stages_per_rank.most == 1 else "stages"
        return (f"{schedule} ({info.torch_class}) places {info.stages_per_rank} {noun} on each "
                f"rank{' in a V' if info.placement == 'v' else ''}. Declared: {virtual} stage"
                f"{'' if virtual == 1 else 's'} per rank; required: {info.stages_per_rank}.")
    stages = pp * virtual
    if schedule in ("1F1B", "DualPipeV") and microbatches < stages:
        return (f"{schedule} ({info.torch_class}) needs at least as many microbatches as stages. "
                f"Declared: {microbatches} microbatches for {stages} stages; required: "
                f"microbatches >= {stages}.")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and not _rounds_divide(
            pp, microbatches):
        below = next(m for m in range(microbatches - 1, 0, -1) if _rounds_divide(pp, m))
        above = next(m for m in range(microbatches + 1, 2 * microbatches + 2)
                     if _rounds_divide(pp, m))
        rounds = _rounds(pp, microbatches)
        return (f"{schedule} ({info.torch_class}) runs the microbatches in "
                f"max(1, microbatches // pp) equal rounds. Declared: {microbatches} microbatches "
                f"at pp={pp}, {rounds} rounds; required: a multiple of {rounds} (the nearest "
                f"that run: {below} or {above}).")
    return None


def _refuse_unless_runnable(schedule: str, pp: int, microbatches: int, virtual: int) -> None:
    refusal = check_schedule(schedule, pp, microbatches, virtual)
    if refusal is not None:
        raise RecipeError(refusal, path="$.pipeline")


def stage_ranks(schedule: str, pp: int, virtual: int) -> tuple[int, ...]:
    """The rank holding each global stage, indexed by stage.

    Looped schedules put stage ``s`` on rank ``s % pp``; V schedules give rank ``r`` stages
    ``r`` and ``2*pp-1-r`` (torch's ``generate_stage_to_rank_mapping`` with ``style="v"``).

    Raises:
        RecipeError: the schedule is unknown or cannot hold ``virtual`` stages per rank.
    """
    # placement does not depend on the microbatches: ask with a count every schedule runs
    _refuse_unless_runnable(schedule, pp, max(1, pp * virtual), virtual)
    if SCHEDULES[schedule].placement == "v":
        return tuple(range(pp)) + tuple(reversed(range(pp)))
    return tuple(stage % pp for stage in range(pp * virtual))


# -- the action lists ------------------------------------------------------------------------


def _gpipe(pp: int, microbatches: int, rank: int) -> list[Action]:
    return ([Action(kind="F", stage=rank, microbatch=m) for m in range(microbatches)]
            + [Action(kind="B", stage=rank, microbatch=m) for m in range(microbatches)])


def _one_f_one_b(pp: int, microbatches: int, rank: int) -> list[Action]:
    warmup = min(pp - 1 - rank, microbatches)
    ops = [Action(kind="F", stage=rank, microbatch=m) for m in range(warmup)]
    for m in range(warmup, microbatches):
        ops.append(Action(kind="F", stage=rank, microbatch=m))
        ops.append(Action(kind="B", stage=rank, microbatch=m - warmup))
    ops += [Action(kind="B", stage=rank, microbatch=m)
            for m in range(microbatches - warmup, microbatches)]
    return ops


def _looped_bfs(pp: int, microbatches: int, rank: int, virtual: int) -> list[Action]:
    stages = range(rank, pp * virtual, pp)
    ops = [Action(kind="F", stage=s, microbatch=m) for s in stages for m in range(microbatches)]
    return ops + [Action(kind="B", stage=s, microbatch=m)
                  for s in reversed(stages) for m in reversed(range(microbatches))]


def _interleaved(pp: int, microbatches: int, rank: int, virtual: int,
                 zero_bubble: bool) -> list[Action]:
    """Torch's ``_get_1f1b_rank_ops`` (Megatron's interleaving, relaxed to rounds of
    ``microbatches // rounds``): warm-up forwards, then one forward one backward, then the
    remaining backwards; with ``zero_bubble`` the backward is ``I`` and rank ``r`` defers its
    ``W``s by ``r`` steps (ZB1P)."""
    per_round = microbatches // _rounds(pp, microbatches)
    hops = (2 if not zero_bubble else 1) * (pp - 1 - rank)
    warmup = min((virtual - 1) * per_round + hops, microbatches * virtual)
    steady = microbatches * virtual - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % virtual * pp + rank

    def backward_stage(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * pp + rank

    counts: dict[tuple[str, int], int] = {}

    def next_action(kind: ActionKind, stage: int) -> Action:
        mb = counts.get((kind, stage), 0)
        counts[kind, stage] = mb + 1
        return Action(kind=kind, stage=stage, microbatch=mb)

    grad: ActionKind = "I" if zero_bubble else "B"
    ops: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0
    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            ops.append(next_action("F", forward_stage(step)))
        if step >= warmup:
            ops.append(next_action(grad, backward_stage(step)))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                ops.append(next_action("W", backward_stage(backward_steps[weights_done])))
                weights_done += 1
    if zero_bubble:
        ops += [next_action("W", backward_stage(step)) for step in backward_steps[weights_done:]]
    return ops


def _zbv(pp: int, microbatches: int, rank: int) -> list[Action]:
    """Torch's ``ScheduleZBVZeroBubble`` (the zero-bubble paper's ZB-V, section 6), computed
    for ``max(2*pp-1, microbatches)`` microbatches and cut back, as torch does."""
    n_micro = max(2 * pp - 1, microbatches)
    chunk0, chunk1 = rank, 2 * pp - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0

    def add(kind: ActionKind, stage: int, mb: int) -> None:
        ops.append(Action(kind=kind, stage=stage, microbatch=mb))

    for _ in range(2 * (pp - rank) - 1):
        add("F", chunk0, f0)
        f0 += 1
    for _ in range(rank):
        add("F", chunk1, f1)
        f1 += 1
        add("F", chunk0, f0)
        f0 += 1
    for _ in range(pp - rank):
        add("F", chunk1, f1)
        f1 += 1
        add("I", chunk1, b1)
        add("W", chunk1, b1)
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            add("F", chunk0, f0)
            f0 += 1
        add("I", chunk0, b0)
        add("W", chunk0, b0)
        b0 += 1
        add("F", chunk1, f1)
        f1 += 1
        add("I", chunk1, b1)
        add("W", chunk1, b1)
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        add("I", chunk0, b0)
        b0 += 1
        add("I", chunk1, b1)
        b1 += 1
    for _ in range(pp - rank):
        add("I", chunk0, b0)
        b0 += 1
        add("W", chunk0, w0)
        w0 += 1
    ops += [Action(kind="W", stage=chunk1, microbatch=mb) for mb in range(w1, b1)]
    ops += [Action(kind="W", stage=chunk0, microbatch=mb) for mb in range(w0, b0)]
    return [op for op in ops if op.microbatch < microbatches]


def _dual_pipe_v(pp: int, microbatches: int, rank: int) -> list[Action]:
    """Torch's ``ScheduleDualPipeV`` (DeepSeek's DualPipe folded into a V). Its overlapped
    forward-and-backward pairs are listed as the forward, then the full backward."""
    stage0, stage1 = rank, 2 * pp - 1 - rank
    counts: dict[tuple[str, int], int] = {}
    weights: list[tuple[int, int]] = []
    ops: list[Action] = []

    def add(kind: ActionKind, stage: int) -> None:
        key = ("I" if kind == "B" else kind, stage)
        mb = counts.get(key, 0)
        counts[key] = mb + 1
        ops.append(Action(kind=kind, stage=stage, microbatch=mb))
        if kind == "I":
            weights.append((stage, mb))

    def add_weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            ops.append(Action(kind="W", stage=stage, microbatch=mb))

    for _ in range((pp - rank - 1) * 2):
        add("F", stage0)
    for _ in range(rank + 1):
        add("F", stage0)
        add("F", stage1)
    for _ in range(pp - rank - 1):
        add("I", stage1)
        add_weight()
        add("F", stage1)
    for _ in range(microbatches - 2 * pp + rank + 1):
        add("F", stage0)
        add("B", stage1)
        add("F", stage1)
        add("B", stage0)
    for _ in range(pp - rank - 1):
        add("B", stage1)
        add("F", stage1)
        add("B", stage0)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add("I" if split else "B", stage1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add("I" if split else "B", stage0)
    for _ in range(pp - rank - 1):
        add_weight()
        add("I" if split else "B", stage0)
    for _ in range(rank + 1):
        add_weight()
    return ops


def schedule_actions(schedule: str, pp: int, microbatches: int,
                     virtual: int | None = None) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions, in the order it runs them.

    Args:
        schedule: a name in :data:`SCHEDULES`.
        pp: pipeline ranks.
        microbatches: microbatches per step.
        virtual: stages per rank; ``None`` takes the fewest the schedule allows (1, or 2).

    Returns:
        One tuple per rank. Every (stage, microbatch) appears once as ``F`` and once as ``B``
        or as ``I`` and ``W``, on the rank :func:`stage_ranks` gives.

    Raises:
        RecipeError: :func:`check_schedule` refuses the combination.

    Example::

        >>> [str(a) for a in schedule_actions("1F1B", 2, 3)[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    if virtual is None:
        virtual = SCHEDULES[schedule].stages_per_rank.least if schedule in SCHEDULES else 1
    _refuse_unless_runnable(schedule, pp, microbatches, virtual)
    build: Callable[[int], list[Action]] = {
        "GPipe": lambda r: _gpipe(pp, microbatches, r),
        "1F1B": lambda r: _one_f_one_b(pp, microbatches, r),
        "Interleaved1F1B": lambda r: _interleaved(pp, microbatches, r, virtual, False),
        "LoopedBFS": lambda r: _looped_bfs(pp, microbatches, r, virtual),
        "InterleavedZeroBubble": lambda r: _interleaved(pp, microbatches, r, virtual, True),
        "ZBVZeroBubble": lambda r: _zbv(pp, microbatches, r),
        "DualPipeV": lambda r: _dual_pipe_v(pp, microbatches, r),
    }[schedule]
    return tuple(tuple(build(rank)) for rank in range(pp))


# -- timing ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Timeline:
    """One simulated step of a schedule.

    Args:
        makespan: time from the first forward to the last action on any rank.
        busy: per rank, the time it computes.
        bubble: per rank, the share of the makespan it waits (``1 - busy / makespan``).
        mean_bubble: the mean of ``bubble``: the share of the pipeline's compute time lost.
        peak_activations: per rank, the most microbatch activations it holds at once: forwards
            run whose input gradient (``B`` or ``I``) has not. The unit is one stage's
            activations for one microbatch, so a rank of an interleaved schedule holds chunks
            of ``1/virtual`` of its layers each.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    mean_bubble: float
    peak_activations: tuple[int, ...]


def _peak_in_flight(actions: Sequence[Action]) -> int:
    held = peak = 0
    for action in actions:
        held += {"F": 1, "B": -1, "I": -1, "W": 0}[action.kind]
        peak = max(peak, held)
    return peak


def simulate_timeline(actions: Sequence[Sequence[Action]], *, forward: float = 1.0,
                      backward: float = 2.0, weight: float | None = None,
                      p2p: float = 0.0) -> Timeline:
    """Run the ranks' action lists against each other and time them.

    Each rank runs its actions in order, one at a time, each as soon as its inputs exist: a
    forward after the previous stage's forward of that microbatch, a backward (``B`` or ``I``)
    after its own forward and after the next stage's backward, a ``W`` after its ``I``. A
    dependency on another rank arrives ``p2p`` later. Torch's runtime orders the same way, so
    the idle time this finds is the schedule's bubble, not the simulator's.

    Args:
        actions: per rank, the ordered actions (:func:`schedule_actions`).
        forward: the time of ``F`` on one stage for one microbatch.
        backward: the time of ``B``; ``I`` and ``W`` split it.
        weight: the time of ``W``; ``I`` takes the rest of ``backward``. ``None`` halves it.
        p2p: the delay of each send between ranks.

    Returns:
        The :class:`Timeline`.

    Raises:
        RecipeError: the lists wait on each other forever (a hand-made order that deadlocks),
            naming each rank's first stuck action, or ``weight`` exceeds ``backward``.
    """
    w_time = backward / 2 if weight is None else weight
    if not 0 <= w_time <= backward:
        msg = (f"the weight gradient cannot cost more than the backward. Declared: weight="
               f"{w_time}, backward={backward}; required: 0 <= weight <= backward.")
        raise RecipeError(msg, path="$.pipeline")
    cost = {"F": forward, "B": backward, "I": backward - w_time, "W": w_time}
    owner = {a.stage: rank for rank, ops in enumerate(actions) for a in ops}
    last_stage = max(owner, default=0)
    done: dict[tuple[str, int, int], float] = {}

    def inputs(action: Action) -> list[tuple[str, int, int]]:
        s, m = action.stage, action.microbatch
        if action.kind == "F":
            return [("F", s - 1, m)] if s > 0 else []
        if action.kind == "W":
            return [("G", s, m)]
        return [("F", s, m)] + ([("G", s + 1, m)] if s < last_stage else [])

    clock = [0.0] * len(actions)
    position = [0] * len(actions)
    total = sum(len(ops) for ops in actions)
    finished = 0
    while finished < total:
        progressed = False
        for rank, ops in enumerate(actions):
            while position[rank] < len(ops):
                action = ops[position[rank]]
                needed = inputs(action)
                if any(key not in done for key in needed):
                    break
                start = max([clock[rank]] + [
                    done[key] + (p2p if owner[key[1]] != rank else 0.0) for key in needed])
                clock[rank] = start + cost[action.kind]
                key_kind = "G" if action.kind in ("B", "I") else action.kind
                done[key_kind, action.stage, action.microbatch] = clock[rank]
                position[rank] += 1
                finished += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {rank}: {ops[position[rank]]}" for rank, ops in enumerate(actions)
                     if position[rank] < len(ops)]
            msg = (f"the action lists wait on each other forever. Declared: {', '.join(stuck)} "
                   "next; required: each action's inputs run earlier on some rank.")
            raise RecipeError(msg, path="$.pipeline")
    makespan = max(clock, default=0.0)
    busy = tuple(sum(cost[a.kind] for a in ops) for ops in actions)
    bubble = tuple(1 - b / makespan if makespan else 0.0 for b in busy)
    return Timeline(makespan=makespan, busy=busy, bubble=bubble,
                    mean_bubble=sum(bubble) / len(bubble) if bubble else 0.0,
                    peak_activations=tuple(_peak_in_flight(ops) for ops in actions))


def bubble_fraction(schedule: str, pp: int, microbatches: int,
                    virtual: int | None = None) -> float:
    """The share of the pipeline's time its ranks wait, with a forward costing 1 and a
    backward 2 (the usual ratio; ``I`` and ``W`` 1 each): :func:`simulate_timeline`'s mean
    bubble for :func:`schedule_actions`. ``virtual=None`` takes the fewest stages per rank the
    schedule allows.

    Example::

        >>> round(bubble_fraction("1F1B", 8, 32), 4)
        0.1795
    """
    return simulate_timeline(schedule_actions(schedule, pp, microbatches, virtual)).mean_bubble
