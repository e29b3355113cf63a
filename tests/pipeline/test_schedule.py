"""Pipeline schedules computed without torch: the textbook bubbles, the activations each rank
holds, every action once on the right rank, torch's refusals word for word in our shape, and
the same order as torch's own ``pipeline_order`` (one documented torch bug aside).

Bubbles use a forward of 1 and a backward of 2 (``I`` and ``W`` 1 each); exact cases are
compared with a tolerance of 1e-9. Torch is imported only inside the tests that compare with it:
the module under test imports none.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from hyperrecipe.errors import RecipeError
from hyperrecipe.pipeline.schedule import (
    SCHEDULES,
    Action,
    bubble_fraction,
    check_schedule,
    schedule_actions,
    simulate_timeline,
    stage_ranks,
)

EXACT = 1e-9
SINGLE = ("GPipe", "1F1B")
# (schedule, pp, microbatches, stages per rank) that torch 2.13 runs, one or two per schedule
# with an uneven case where the schedule has one (rounds, ZBV's cut-back microbatches).
RUNNABLE = [(name, pp, m, 1) for name in SINGLE for pp, m in ((1, 3), (4, 4), (4, 7))] + [
    (name, pp, m, v) for name in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
    for pp, m, v in ((2, 4, 2), (4, 3, 2), (3, 9, 3), (4, 10, 2))] + [
    (name, pp, m, 2) for name in ("ZBVZeroBubble", "DualPipeV")
    for pp, m in ((1, 2), (3, 6), (4, 9))] + [("ZBVZeroBubble", 4, 3, 2)]


def _ids(case: tuple[str, int, int, int]) -> str:
    return "{}-pp{}-m{}-v{}".format(*case)


def torch_order(schedule: str, pp: int, microbatches: int, virtual: int) -> list[list[str]]:
    """Torch's own compute order per rank (``_schedule_visualizer.get_schedule_ops``, which builds
    the schedule class on mock stages): no-op slots and ``REDUCE_GRAD`` dropped, DualPipeV's
    overlapped pairs unpacked into their forward and backward, each action as ``str(_Action)``
    (``"3F1"``: stage 3, forward, microbatch 1)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
    order = []
    for rank in get_schedule_ops(schedule, pp, microbatches, virtual):
        actions = [sub for action in rank if action is not None
                   for sub in (action.sub_actions or (action,))]
        order.append([str(a) for a in actions if "REDUCE_GRAD" not in str(a)])
    return order


def ours(schedule: str, pp: int, microbatches: int, virtual: int) -> list[list[str]]:
    return [[str(a) for a in rank] for rank in schedule_actions(schedule, pp, microbatches,
                                                                   virtual)]


def test_the_schedule_module_imports_no_torch() -> None:
    """Compiling and the dry run reason about schedules where torch may not be importable."""
    import ast
    from pathlib import Path

    import hyperrecipe.pipeline.schedule as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "torch" for name in imported), imported


# -- the names ---------------------------------------------------------------------------------


def test_every_schedule_is_named_as_torch_names_it_and_its_class_exists() -> None:
    from torch.distributed.pipelining import schedules as torch_schedules

    assert sorted(SCHEDULES) == ["1F1B", "DualPipeV", "GPipe", "Interleaved1F1B",
                                 "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble"]
    for name, info in SCHEDULES.items():
        assert info.name == name
        assert torch_schedules.get_schedule_class(name).__name__ == info.torch_class
        single = issubclass(getattr(torch_schedules, info.torch_class),
                            torch_schedules.PipelineScheduleSingle)
        assert single == (str(info.stages_per_rank) == "exactly 1")
    assert [n for n, i in SCHEDULES.items() if i.placement == "v"] == ["ZBVZeroBubble",
                                                                        "DualPipeV"]
    assert [n for n, i in SCHEDULES.items() if i.splits_backward] == [
        "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def test_looped_stages_go_round_the_ranks_and_v_stages_come_back() -> None:
    assert stage_ranks("1F1B", 4, 1) == (0, 1, 2, 3)
    assert stage_ranks("Interleaved1F1B", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_ranks("LoopedBFS", 2, 3) == (0, 1, 0, 1, 0, 1)
    # rank r holds stages r and 2*pp-1-r: the first and last stage both on rank 0
    assert stage_ranks("ZBVZeroBubble", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_ranks("DualPipeV", 4, 2) == stage_ranks("ZBVZeroBubble", 4, 2)


# -- the bubble --------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SINGLE)
@pytest.mark.parametrize(("pp", "m"), [(8, 32), (4, 8), (2, 2), (1, 5)])
def test_gpipe_and_1f1b_lose_p_minus_1_over_m_plus_p_minus_1(schedule: str, pp: int,
                                                               m: int) -> None:
    assert bubble_fraction(schedule, pp, m) == pytest.approx((pp - 1) / (m + pp - 1), abs=EXACT)


def test_pp8_m32_loses_seven_thirty_ninths_with_one_stage_per_rank() -> None:
    assert bubble_fraction("1F1B", 8, 32) == pytest.approx(7 / 39, abs=EXACT)  # 17.9%
    assert round(100 * bubble_fraction("GPipe", 8, 32), 1) == 17.9


@pytest.mark.parametrize(("pp", "m", "v"), [(8, 32, 2), (4, 8, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaving_divides_the_bubble_by_the_stages_per_rank(pp: int, m: int,
                                                                 v: int) -> None:
    """Megatron's (p-1)/(v*m+p-1): each rank's stage is cut in v, so the fill is v times shorter
    while the work stays the same."""
    assert bubble_fraction("Interleaved1F1B", pp, m, v) == pytest.approx(
        (pp - 1) / (v * m + pp - 1), abs=EXACT)


def test_pp8_m32_interleaved_over_two_stages_loses_seven_seventy_firsts() -> None:
    assert bubble_fraction("Interleaved1F1B", 8, 32, 2) == pytest.approx(7 / 71, abs=EXACT)
    assert round(100 * bubble_fraction("Interleaved1F1B", 8, 32, 2), 1) == 9.9


@pytest.mark.parametrize(("pp", "m"), [(8, 32), (4, 8), (4, 16), (2, 4)])
def test_zero_bubble_schedules_lose_less_than_their_full_backward_peers(pp: int, m: int) -> None:
    assert bubble_fraction("ZBVZeroBubble", pp, m) < bubble_fraction("1F1B", pp, m)
    assert bubble_fraction("DualPipeV", pp, m) < bubble_fraction("1F1B", pp, m)
    assert bubble_fraction("InterleavedZeroBubble", pp, m, 2) < bubble_fraction(
        "Interleaved1F1B", pp, m, 2)


@pytest.mark.parametrize(("pp", "m"), [(8, 32), (4, 8), (3, 9), (2, 4)])
def test_zero_bubble_schedules_keep_one_forward_of_fill_per_hop(pp: int, m: int) -> None:
    """Measured, not a textbook formula: at F = I = W = 1 each rank of the three idles p-1,
    against 3*v*m of work (docs/pipeline.md)."""
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert bubble_fraction(name, pp, m, 2) == pytest.approx(
            (pp - 1) / (3 * 2 * m + pp - 1), abs=EXACT), name


def test_pp8_m32_bubbles_as_docs_pipeline_md_tables_them() -> None:
    measured = {name: round(100 * bubble_fraction(name, 8, 32), 1) for name in SCHEDULES}
    assert measured == {"GPipe": 17.9, "1F1B": 17.9, "Interleaved1F1B": 9.9, "LoopedBFS": 9.9,
                        "InterleavedZeroBubble": 3.5, "ZBVZeroBubble": 3.5, "DualPipeV": 3.5}


# -- activations in flight ---------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(8, 32), (4, 3), (4, 4), (1, 5)])
def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp_minus_rank(pp: int, m: int) -> None:
    gpipe = simulate_timeline(schedule_actions("GPipe", pp, m))
    assert gpipe.peak_activations == (m,) * pp
    if check_schedule("1F1B", pp, m, 1) is None:  # torch runs 1F1B only with m >= pp
        one_f_one_b = simulate_timeline(schedule_actions("1F1B", pp, m))
        assert one_f_one_b.peak_activations == tuple(min(pp - r, m) for r in range(pp))


def test_activations_count_stage_chunks_on_interleaved_ranks() -> None:
    """A rank of Interleaved1F1B at v=2 holds more chunks than 1F1B holds stages, each chunk
    half the layers: 23 halves (11.5 stages' worth) on rank 0 against 1F1B's 8."""
    timeline = simulate_timeline(schedule_actions("Interleaved1F1B", 8, 32, 2))
    assert timeline.peak_activations == (23, 21, 19, 17, 15, 13, 11, 9)


# -- every action once, on its rank ------------------------------------------------------------


@pytest.mark.parametrize("case", RUNNABLE, ids=_ids)
def test_each_stage_and_microbatch_runs_forward_and_backward_once_on_its_rank(
        case: tuple[str, int, int, int]) -> None:
    schedule, pp, m, v = case
    ranks = stage_ranks(schedule, pp, v)
    actions = schedule_actions(schedule, pp, m, v)
    assert len(actions) == pp
    seen = Counter((a.kind, a.stage, a.microbatch) for rank in actions for a in rank)
    assert max(seen.values()) == 1
    for stage in range(pp * v):
        for mb in range(m):
            assert ("F", stage, mb) in seen
            full = ("B", stage, mb) in seen
            split = ("I", stage, mb) in seen, ("W", stage, mb) in seen
            assert split == ((False, False) if full else (True, True)), (stage, mb)
    assert sum(seen.values()) == sum(len(rank) for rank in actions)
    assert all(ranks[a.stage] == rank for rank, ops in enumerate(actions) for a in ops)
    splits = any(a.kind in "IW" for rank in actions for a in rank)
    assert splits == SCHEDULES[schedule].splits_backward
    timeline = simulate_timeline(actions)  # and no rank waits forever
    assert timeline.makespan > 0


# -- the same order as torch -------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in RUNNABLE if c[0] != "1F1B"], ids=_ids)
def test_our_order_is_torchs_pipeline_order(case: tuple[str, int, int, int]) -> None:
    assert ours(*case) == torch_order(*case)


@pytest.mark.parametrize("case", [c for c in RUNNABLE if c[0] == "1F1B"], ids=_ids)
def test_1f1b_is_torchs_order_on_every_rank_but_the_last(case: tuple[str, int, int, int]
                                                          ) -> None:
    mine, theirs = ours(*case), torch_order(*case)
    assert mine[:-1] == theirs[:-1]
    # torch's last rank numbers its forwards one too high (the next test); else it is ours
    stage = len(mine) - 1
    renumbered = [f"{stage}F{int(a.split('F')[1]) - 1}" if "F" in a else a for a in theirs[-1]]
    assert mine[-1] == renumbered


def test_torchs_1f1b_numbers_the_last_ranks_forwards_from_one_and_ours_from_zero() -> None:
    """torch 2.13's ``Schedule1F1B._get_pipeline_order`` sets ``forward_mb = 0`` and, on the
    last rank (no warm-up forwards), increments it before its first forward: microbatches 1..8
    for 8 microbatches, an ``F8`` that does not exist and no ``F0``. The runtime's
    ``_step_microbatches`` does not use that order, so training is unaffected; anything that
    reads ``pipeline_order`` (the visualizer, a simulator) is off by one. If torch fixes it, this
    test fails: drop the note in docs/pipeline.md."""
    theirs = torch_order("1F1B", 4, 8, 1)[3]
    assert [a for a in theirs if "F" in a] == [f"3F{m}" for m in range(1, 9)]
    mine = ours("1F1B", 4, 8, 1)[3]
    assert [a for a in mine if "F" in a] == [f"3F{m}" for m in range(8)]
    assert mine == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4",
                    "3F5", "3B5", "3F6", "3B6", "3F7", "3B7"]


GRID = [(name, pp, m, v) for name in SCHEDULES for pp in (2, 4) for m in (1, 3, 5, 9)
        for v in ((1, 2) if SCHEDULES[name].placement == "loop" else (2, 3))]


def test_we_refuse_exactly_what_torch_refuses() -> None:
    """Each combination of a grid built as torch's visualizer builds it: torch raises when and
    only when :func:`check_schedule` refuses. (Looped multi-stage schedules at one stage per
    rank are ours to refuse: the visualizer asserts two or more before torch is asked.)"""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    disagree = []
    for name, pp, m, v in GRID:
        refusal = check_schedule(name, pp, m, v)
        if SCHEDULES[name].stages_per_rank.least == 2 and v == 1:
            assert refusal is not None
            continue
        try:
            get_schedule_ops(name, pp, m, v)
            torch_refuses = False
        except (ValueError, AssertionError):
            torch_refuses = True
        if torch_refuses != (refusal is not None):
            disagree.append((name, pp, m, v, refusal))
    assert disagree == []


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (("Zigzag", 4, 8, 1),
     "unknown pipeline schedule 'Zigzag'. Declared: 'Zigzag'; required: one of ['1F1B', "
     "'DualPipeV', 'GPipe', 'Interleaved1F1B', 'InterleavedZeroBubble', 'LoopedBFS', "
     "'ZBVZeroBubble'] (torch's spelling)."),
    (("GPipe", 0, 8, 1), "GPipe needs a pipeline rank. Declared: pp=0; required: pp >= 1."),
    (("GPipe", 4, 0, 1),
     "GPipe needs a microbatch. Declared: 0 microbatches; required: 1 or more."),
    (("1F1B", 4, 8, 2),
     "1F1B (Schedule1F1B) places exactly 1 stage on each rank. Declared: 2 stages per rank; "
     "required: exactly 1."),
    (("Interleaved1F1B", 4, 8, 1),
     "Interleaved1F1B (ScheduleInterleaved1F1B) places 2 or more stages on each rank. "
     "Declared: 1 stage per rank; required: 2 or more."),
    (("ZBVZeroBubble", 4, 8, 3),
     "ZBVZeroBubble (ScheduleZBVZeroBubble) places exactly 2 stages on each rank in a V. "
     "Declared: 3 stages per rank; required: exactly 2."),
    (("1F1B", 8, 4, 1),
     "1F1B (Schedule1F1B) needs at least as many microbatches as stages. Declared: 4 "
     "microbatches for 8 stages; required: microbatches >= 8."),
    (("DualPipeV", 4, 7, 2),
     "DualPipeV (ScheduleDualPipeV) needs at least as many microbatches as stages. Declared: 7 "
     "microbatches for 8 stages; required: microbatches >= 8."),
    (("Interleaved1F1B", 4, 9, 2),
     "Interleaved1F1B (ScheduleInterleaved1F1B) runs the microbatches in max(1, microbatches "
     "// pp) equal rounds. Declared: 9 microbatches at pp=4, 2 rounds; required: a multiple of "
     "2 (the nearest that run: 8 or 10)."),
    (("InterleavedZeroBubble", 8, 33, 2),
     "InterleavedZeroBubble (ScheduleInterleavedZeroBubble) runs the microbatches in max(1, "
     "microbatches // pp) equal rounds. Declared: 33 microbatches at pp=8, 4 rounds; required: "
     "a multiple of 4 (the nearest that run: 32 or 36)."),
])
def test_a_refusal_says_what_was_declared_and_what_is_required(
        args: tuple[str, int, int, int], message: str) -> None:
    assert check_schedule(*args) == message
    with pytest.raises(RecipeError) as caught:
        schedule_actions(*args)
    assert str(caught.value) == f"{message} @ $.pipeline"


def test_the_nearest_counts_a_rounds_refusal_offers_are_ones_torch_runs() -> None:
    for pp in (2, 3, 4, 8):
        for m in range(1, 80):
            refusal = check_schedule("Interleaved1F1B", pp, m, 2)
            if refusal is None:
                continue
            below, above = refusal.removesuffix(").").rsplit(": ", 1)[1].split(" or ")
            assert int(below) < m < int(above)
            assert check_schedule("Interleaved1F1B", pp, int(below), 2) is None
            assert check_schedule("Interleaved1F1B", pp, int(above), 2) is None
            assert all(check_schedule("Interleaved1F1B", pp, n, 2) is not None
                       for n in range(int(below) + 1, int(above)))


# -- the simulation ----------------------------------------------------------------------------


def test_each_send_between_ranks_waits_p2p() -> None:
    """GPipe on two ranks, one microbatch: F0 [0,1], send, F1 [1.5,2.5], B1 [2.5,4.5], send,
    B0 [5,7]."""
    timeline = simulate_timeline(schedule_actions("GPipe", 2, 1), p2p=0.5)
    assert timeline.makespan == 7.0
    assert timeline.busy == (3.0, 3.0)
    assert timeline.bubble == pytest.approx((4 / 7, 4 / 7), abs=EXACT)


def test_the_turn_of_the_v_sends_nothing() -> None:
    """Stages pp-1 and pp share the last rank, so ZBV pays one p2p fewer per microbatch each
    way than the same number of sends would suggest: with pp=1 nothing crosses a rank."""
    plain = simulate_timeline(schedule_actions("ZBVZeroBubble", 1, 2))
    assert simulate_timeline(schedule_actions("ZBVZeroBubble", 1, 2), p2p=9.0) == plain


def test_weight_sets_w_and_input_grad_takes_the_rest_of_the_backward() -> None:
    ops = ((Action(kind="F", stage=0, microbatch=0), Action(kind="I", stage=0, microbatch=0),
            Action(kind="W", stage=0, microbatch=0)),)
    assert simulate_timeline(ops, backward=2.0, weight=0.5).busy == (3.0,)
    assert simulate_timeline(ops, forward=1.0, backward=3.0).makespan == 4.0
    with pytest.raises(RecipeError) as caught:
        simulate_timeline(ops, backward=2.0, weight=3.0)
    assert str(caught.value) == (
        "the weight gradient cannot cost more than the backward. Declared: weight=3.0, "
        "backward=2.0; required: 0 <= weight <= backward. @ $.pipeline")


def test_lists_that_wait_on_each_other_are_refused_by_their_stuck_actions() -> None:
    ops = ((Action(kind="B", stage=0, microbatch=0), Action(kind="F", stage=0, microbatch=0)),
           (Action(kind="F", stage=1, microbatch=0), Action(kind="B", stage=1, microbatch=0)))
    with pytest.raises(RecipeError) as caught:
        simulate_timeline(ops)
    assert str(caught.value) == (
        "the action lists wait on each other forever. Declared: rank 0: 0B0, rank 1: 1F0 next; "
        "required: each action's inputs run earlier on some rank. @ $.pipeline")
