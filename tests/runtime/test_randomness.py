"""The ranks of a tensor-parallel group must draw the same dropout in the replicated parts of
the model (``hyperrecipe/runtime/preflight/randomness.py``).

GPT-2 with its default dropout (0.1 for embeddings, residuals and attention) at tp=2 in
``train()``: seeded per rank, the embedding's dropout differed between the ranks and so did
the replicated weights' gradients (the final norm's by 7e-3 of 1.3e-2), in both modes, with
nothing refused. Now the first training forward compares the ranks' generator states and
refuses a difference by name; seeded alike, the replicated gradients are the same on both
ranks; in ``eval()`` nothing is drawn and nothing is checked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import PlanMismatchError
from tests.support.family_harness import batch, build, recipe_path
from tests.support.runtime_harness import mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}  # GPT-2's defaults


def _worker(rank: int, world: int, mode: str, seed_per_rank: bool, train: bool
            ) -> dict[str, Any]:
    model = build("gpt2", **DROPOUT)
    plan = compile_recipe(recipe_path("gpt2"), build("gpt2", "meta", **DROPOUT), {"tp": world})
    apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    model.train(train)
    torch.manual_seed(100 + rank if seed_per_rank else 100)
    try:
        model(input_ids=batch()).logits.float().pow(2).mean().backward()
    except PlanMismatchError as exc:
        return {"error": str(exc)}
    grad = model.get_parameter("transformer.ln_f.weight").grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return {"error": None, "ln_f": local.detach().clone()}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_ranks_seeded_apart_are_refused_at_the_first_training_forward(mode: str) -> None:
    for res in run_ranks(_worker, 2, mode, True, True, timeout_s=300):
        assert res["error"] == (
            "the ranks [0, 1] of mesh dim 'tp' draw different random numbers (their torch "
            "generator states differ: a seed per rank?), and the model has dropout "
            "(config.attn_pdrop=0.1, config.embd_pdrop=0.1, config.resid_pdrop=0.1 and more): "
            "replicated activations would differ between these ranks and the replicated weights "
            "drift apart, silently. Seed every rank of a model-parallel group alike "
            "(torch.manual_seed(s) or transformers.set_seed(s) on every rank, not "
            "device-specific), or set dropout to 0"), res


@pytest.mark.parametrize(("seed_per_rank", "train"), [(False, True), (True, False)])
def test_ranks_seeded_alike_or_in_eval_run_and_agree_on_replicated_gradients(
        seed_per_rank: bool, train: bool) -> None:
    first, second = run_ranks(_worker, 2, "production", seed_per_rank, train, timeout_s=300)
    assert first["error"] is None and second["error"] is None
    torch.testing.assert_close(first["ln_f"], second["ln_f"], atol=0, rtol=0)
