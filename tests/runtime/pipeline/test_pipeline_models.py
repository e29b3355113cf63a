"""Pipelined tiny causal LMs at pp=2 (real gloo ranks) match one process: the loss and every
gradient, for each schedule.

Tolerance: per gradient, max |pipelined - reference| <= 1e-5 * max |reference| (fp32); the loss
within 1e-5 absolute. Measured: loss exact (Llama, Qwen3, Mixtral) or 5e-7 (GPT-2); gradients
<= 5e-7 relative. The batch ignores some label tokens, so microbatches weigh differently and the
full-batch token count (``num_items_in_batch``) matters.
"""

from __future__ import annotations

from typing import Any

import pytest

from hyperrecipe.check.launcher import run_ranks
from tests.support.pipeline_harness import RTOL, reference, schedules_worker

ONE_STAGE = [("GPipe", 1, 4), ("1F1B", 1, 4)]
TWO_STAGES = [("Interleaved1F1B", 2, 4), ("ZBVZeroBubble", 2, 4)]
CASES: dict[str, list[tuple[str, int, int]]] = {
    "llama": [*ONE_STAGE, *TWO_STAGES, ("Interleaved1F1B", 2, 8), ("LoopedBFS", 2, 4),
              ("InterleavedZeroBubble", 2, 4), ("DualPipeV", 2, 4)],
    "qwen3": [*ONE_STAGE, *TWO_STAGES],
    "gpt2": [*ONE_STAGE, *TWO_STAGES],
    "mixtral": [*ONE_STAGE, *TWO_STAGES],
}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", sorted(CASES))
def test_pipelined_loss_and_every_gradient_match_one_process(family: str) -> None:
    cases = CASES[family]
    by_rank: list[list[dict[str, Any]]] = run_ranks(schedules_worker, 2, family, cases,
                                                    timeout_s=240)
    for i, (schedule, per_rank, layers) in enumerate(cases):
        what = f"{family} {schedule} ({per_rank} stage(s) per rank, {layers} layers)"
        results = [by_rank[rank][i] for rank in range(2)]
        _, ref_grads = reference(family, layers)
        held = [name for r in results for name in r["aliases"]]
        assert sorted(set(held)) == sorted(ref_grads), what
        for r in results:
            assert r["no_grad"] == [], what
            assert r["loss_err"] <= 1e-5, what
            assert r["grad_err"] <= RTOL, (what, r["grad_err"])


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_tied_embedding_lives_on_both_ends_and_is_counted_in_one_place() -> None:
    # GPT-2 ties transformer.wte.weight to lm_head.weight: stage 0 holds the one, the last
    # stage the other (GPipe: ranks 0 and 1; ZBV: both on rank 0, one shared tensor).
    by_rank = run_ranks(schedules_worker, 2, "gpt2", [("GPipe", 1, 4), ("ZBVZeroBubble", 2, 4)],
                        timeout_s=120)
    gpipe = [by_rank[r][0]["params"] for r in range(2)]
    assert "transformer.wte.weight" in gpipe[0] and "lm_head.weight" not in gpipe[0]
    assert "lm_head.weight" in gpipe[1] and "transformer.wte.weight" not in gpipe[1]
    zbv = by_rank[0][1]["params"]
    # rank 0 runs stages 0 and 3: the tied weight is listed once, under its first FQN
    assert "transformer.wte.weight" in zbv and "lm_head.weight" not in zbv
