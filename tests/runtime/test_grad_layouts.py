"""Declared gradient layouts (``in_grad`` / ``out_grad``) on real gloo ranks, against one process.

A block left replicated under sequence parallelism (tiny Llama, ``llama-sp`` with layer 1's MLP
whole on every rank, ``tests/recipes/llama-sp-replicated-mlp.yaml``): its input is all-gathered
on the sequence and its gradient comes back whole, so the gather's backward is a local slice.
Both modes agree with one process on the logits and every gradient (fp32, atol 2e-6, rtol 1e-5;
measured ~2e-7 and ~1e-8). A declaration that disagrees with the gradient that arrives is
refused by validate mode with the module, the input, the declared and the actual layout, where
production computes wrong gradients without a word. The Mamba mixer (``out_grad`` on an output)
runs through ``hyperrecipe check`` in tests/check/test_cookbook.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RankFailedError, RecipeError
from tests.support.runtime_harness import ATOL, ROOT, RTOL, assert_close, llama, llama_worker, reference

REPLICATED_MLP = ROOT / "tests/recipes/llama-sp-replicated-mlp.yaml"


def _variant(tmp_path: Path, name: str, rules: str) -> str:
    """A recipe over llama-sp with ``rules`` appended (YAML text of rule entries)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"recipe: {name}\nversion: 1\nmesh: [tp]\nextends: {REPLICATED_MLP}\n"
                    f"rules:\n{rules}")
    return str(path)


def _differs(res: dict[str, Any], ref: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, g in ref.items()
            if not torch.allclose(res["grads"][n], g, atol=ATOL, rtol=RTOL)]


def test_the_gather_into_a_replicated_block_is_sliced_in_backward() -> None:
    plan = compile_recipe(str(REPLICATED_MLP), llama("meta"), {"tp": 2})
    block = plan.boundary("model.layers.1.mlp")
    (x,) = block.inputs
    assert str(x.grad) == "replicate"
    ops = [(t.stage, t.forward.kind, t.backward.kind) for t in block.transitions]
    assert ops == [("input", "all_gather", "local_slice"), ("output", "local_slice", "all_gather")]
    assert "declared in_grad" in block.transitions[0].reason
    # the other layers keep llama-sp's reduce-scatter, and plans without the field omit it
    assert [t.backward.kind for t in plan.boundary("model.layers.0.mlp").transitions][0] == \
        "reduce_scatter"
    assert plan.to_json().count('"grad"') == 1


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_replicated_block_under_sequence_parallel_matches_one_process(mode: str) -> None:
    ref_logits, ref_grads = reference()
    results = run_ranks(llama_worker, 2, str(REPLICATED_MLP), mode, {}, timeout_s=300)
    for rank, res in enumerate(results):
        assert_close(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")
    if mode == "production":
        assert results[0]["counted"] == results[0]["expected"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_whole_gradient_declared_where_it_arrives_partial_is_refused(tmp_path: Path) -> None:
    """Layer 0's MLP keeps its sharded gate/up: its input's gradient comes back partial.
    Declared whole, production slices a partial sum and is wrong; validate mode names it."""
    recipe = _variant(tmp_path, "whole-on-partial",
                      "  - match: model.layers.0.mlp\n    in_grad: {x: replicate}\n")
    with pytest.raises(RecipeError) as refused:  # compile's verification sees it first
        compile_recipe(recipe, llama("meta"), {"tp": 2})
    assert "arrives partial on tp" in str(refused.value) and refused.value.span is not None
    # and the runtime, given the plan unverified, is not silent about it either
    _, ref_grads = reference()
    prod = run_ranks(llama_worker, 2, recipe, "production", {}, False, timeout_s=300)
    assert _differs(prod[0], ref_grads), "production computes wrong gradients without an error"
    with pytest.raises(RankFailedError) as err:
        run_ranks(llama_worker, 2, recipe, "validate", {}, False, timeout_s=300)
    assert ("PlanMismatchError: model.layers.0.mlp: the gradient of input 'x' arrives partial "
            "on tp (each rank holds a share of a sum), but the plan takes it whole (declared "
            "in_grad: replicate): production mode runs local_slice there") in str(err.value)
    assert "Declare in_grad: {x: {tp: partial}}" in str(err.value)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_partial_gradient_declared_where_it_arrives_whole_is_refused(tmp_path: Path) -> None:
    """Layer 1's MLP computes replicated: its input's gradient is whole. Declared partial,
    production reduce-scatters it and counts it twice; validate mode names it."""
    recipe = _variant(tmp_path, "partial-on-whole",
                      "  - match: model.layers.1.mlp\n    in_grad: {x: {tp: partial}}\n")
    with pytest.raises(RecipeError) as refused:  # compile's verification sees it first
        compile_recipe(recipe, llama("meta"), {"tp": 2})
    assert "whole (replicate on tp)" in str(refused.value)
    plan = compile_recipe(recipe, llama("meta"), {"tp": 2}, verify=False)
    assert plan.boundary("model.layers.1.mlp").transitions[0].backward.kind == "reduce_scatter"
    _, ref_grads = reference()
    prod = run_ranks(llama_worker, 2, recipe, "production", {}, False, timeout_s=300)
    assert _differs(prod[0], ref_grads), "production computes wrong gradients without an error"
    with pytest.raises(RankFailedError) as err:
        run_ranks(llama_worker, 2, recipe, "validate", {}, False, timeout_s=300)
    assert "PlanMismatchError: model.layers.1.mlp: " in str(err.value)
    assert "whole (replicate on tp)" in str(err.value)
    assert "reduce_scatter" in str(err.value)
