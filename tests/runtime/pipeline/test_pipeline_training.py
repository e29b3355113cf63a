"""Five AdamW steps, each accumulating two batches and clipped by the global gradient norm,
pipelined at pp=2 match one process.

The norm is the whole model's (squares summed over the pipeline ranks, GPT-2's tied embedding
counted once); clipping is active (max_norm 0.5, norms around 1.8-2.5). AdamW with lr 1e-3 and
eps 1e-6 (see ``tests/support/pipeline_harness.EPS``). Tolerances: norms and losses 1e-5
relative (measured <= 3e-7); final parameters within 1e-3 of ``lr * steps``, the furthest Adam
moves an element (measured <= 1e-4: Adam divides by the root of tiny second moments, so fp32
reassociation differences of 1e-7 in a gradient become 1e-4 of a step).
"""

from __future__ import annotations

import pytest

from hyperrecipe.check.launcher import run_ranks
from tests.support.pipeline_harness import training_worker


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("family", "schedule", "per_rank"),
                         [("gpt2", "1F1B", 1), ("gpt2", "ZBVZeroBubble", 2),
                          ("llama", "Interleaved1F1B", 2)])
def test_clipped_adamw_with_accumulation_matches_one_process(family: str, schedule: str,
                                                             per_rank: int) -> None:
    results = run_ranks(training_worker, 2, family, schedule, per_rank, timeout_s=240)
    for r in results:
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert min(r["ref_norms"]) > 0.5, "clipping must be active"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["param_err"] <= 1e-3, (r["param_err"], r["worst"])
