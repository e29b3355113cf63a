"""Verification inside a job: ``compile_recipe`` on every rank of a gloo job, and ``apply`` of a
plan that carries no verification, run the step on the job's own group, every rank together."""

from __future__ import annotations

from typing import Any

import pytest

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model
from tests.support.family_harness import batch, build, recipe_path
from tests.support.runtime_harness import ROOT, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)


def _compile_on_every_rank(rank: int, world: int) -> dict[str, Any]:
    plan = compile_recipe(recipe_path("qwen3"), build("qwen3", "meta"), {"tp": world})
    assert plan.verification is not None
    return {"ranks": plan.verification.ranks, "modes": plan.verification.modes}


def test_compile_recipe_on_every_rank_of_a_job_verifies_on_the_jobs_group() -> None:
    out = run_ranks(_compile_on_every_rank, 2)
    assert [o["ranks"] for o in out] == [(0, 1), (0, 1)]  # the same plan bytes on every rank
    assert all(o["modes"] == ("production", "validate") for o in out)


def _apply_unverified(rank: int, world: int, recipe: str) -> dict[str, Any]:
    meta = build_model("hf:qwen3", str(ROOT / "recipes/models/tiny-qwen3.json"))
    plan = compile_recipe(recipe, meta, {"tp": world}, verify=False)
    model = build("qwen3")
    before = {n: p for n, p in model.named_parameters()}
    try:
        apply(model, plan, mesh_1d(world))
    except RecipeError as exc:
        untouched = all(model.get_parameter(n) is p for n, p in before.items())
        return {"error": str(exc), "untouched": untouched}
    model(input_ids=batch()).logits.float().pow(2).mean().backward()
    return {"error": None}


def test_apply_verifies_an_unverified_plan_first_and_refuses_on_every_rank() -> None:
    out = run_ranks(_apply_unverified, 2, str(ROOT / "recipes/llama.yaml"))
    for o in out:
        assert o["error"] is not None and o["untouched"]
        assert "recipes/llama.yaml" in o["error"] and "k_norm.weight" in o["error"]


def test_apply_verifies_a_right_unverified_plan_and_trains() -> None:
    out = run_ranks(_apply_unverified, 2, str(recipe_path("qwen3")))
    assert [o["error"] for o in out] == [None, None]


def _compile_for_one_replica(rank: int, world: int) -> dict[str, Any]:
    # a tp=2 plan in a 4-rank job (dp left to DDP or FSDP): each replica verifies on its ranks
    plan = compile_recipe(recipe_path("llama"), build("llama", "meta"), {"tp": 2})
    assert plan.verification is not None
    return {"ranks": plan.verification.ranks, "modes": plan.verification.modes}


@pytest.mark.slow
def test_a_plan_for_one_replica_verifies_in_a_larger_job() -> None:
    out = run_ranks(_compile_for_one_replica, 4)
    assert [o["ranks"] for o in out] == [(0, 1)] * 4
    assert all(o["modes"] == ("production", "validate") for o in out)
