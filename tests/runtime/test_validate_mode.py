"""Validate mode is the executable specification: every recipe field means in it what it means
in production, on the model's own defaults.

The matrix (field x placement x mode): a shipped recipe's field — Qwen3's ``reduce_grads`` on
the per-head q/k norms, Phi-3's ``head_counts`` of its fused attention — with the attention left
a plain boundary or marked ``local_region: true`` (its compute then runs on this rank's local
shards in both modes), each applied in production and in validate mode on two gloo ranks and
compared with one process: the logits and every parameter's gradient, fp32, every element within
atol 2e-6 / rtol 1e-5 and every tensor's largest difference within 1e-5 of its largest value
(the q/k norms' gradients are ~1e-4: a missing reduction is off by ~100%). The models run with
transformers' defaults (``sdpa`` attention), so validate mode runs the CPU SDPA kernel on
hyperrecipe's DTensor rule (:mod:`hyperrecipe.runtime.comm.dtensor_rules`) outside the region.

The other kind of ``reduce_grads`` in a local region — a region computing on whole data whose
output gradients arrive partial in production (DeepSeek-V3's router) — is
``tests/check/test_cookbook.py``'s ``deepseek_v3`` case: validate mode must not reduce it twice.

Before the fix, validate mode dropped ``reduce_grads`` inside a local region (the norms'
gradients off by up to 100% with nothing refused) and kept the head counts global there (Phi-3's
attention sliced its local fused q/k/v at global offsets).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RankFailedError, RecipeError
from tests.support.family_harness import build, recipe_path, reference, step
from tests.support.runtime_harness import ROOT, assert_close, mesh_1d

SCALED_TOL = 1e-5

FIELDS = {"reduce_grads": "qwen3", "head_counts": "phi3"}
"""The field under test and the shipped recipe that declares it on the attention."""


def _recipe(tmp_path: Path, family: str, local_region: bool) -> str:
    if not local_region:
        return recipe_path(family)
    path = tmp_path / f"{family}-local.yaml"
    path.write_text(f"recipe: {family}-local\nversion: 1\nmesh: [tp]\nextends: {family}\n"
                    f"rules:\n  - match: model.layers.*.self_attn\n    local_region: true\n")
    return str(path)


def _worker(rank: int, world: int, family: str, recipe: str, mode: str,
            overrides: dict[str, Any], verify: bool = True) -> dict[str, Any]:
    model = build(family, **overrides)
    plan = compile_recipe(recipe, build(family, "meta", **overrides), {"tp": world},
                          verify=verify)
    inst = apply(model, plan, mesh_1d(world), mode=mode,  # type: ignore[arg-type]
                 verify=verify)
    logits = step(model)
    grads = inst.full_grads()
    inst.restore()
    return {"logits": logits, "grads": grads}


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_close(actual, expected, what)
    worst = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert worst <= SCALED_TOL * scale, f"{what}: max diff {worst:.3e} > {SCALED_TOL} x {scale:.3e}"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("where", ["boundary", "local_region"])
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_field_means_the_same_in_both_modes_inside_and_outside_a_local_region(
        tmp_path: Path, field: str, where: str, mode: str) -> None:
    family = FIELDS[field]
    ref_logits, ref_grads, _ = reference(family)
    recipe = _recipe(tmp_path, family, where == "local_region")
    for rank, res in enumerate(run_ranks(_worker, 2, family, recipe, mode, {}, timeout_s=300)):
        _assert_matches(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads), "every parameter has a full gradient"
        for name, g in ref_grads.items():
            _assert_matches(res["grads"][name], g, f"rank {rank} grad {name}")


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_the_cpu_sdpa_rules_are_registered_by_validate_apply_only_and_once() -> None:
    """Importing hyperrecipe and resolving leave DTensor's registry alone (verification runs
    validate mode's apply, which registers them); registering twice keeps the first
    registration (the same strategy object)."""
    code = """
import torch
from torch.distributed.tensor import DTensor
import hyperrecipe
from hyperrecipe.model_tree import build_model
root = __import__("pathlib").Path(__import__("sys").argv[1])
model = build_model("hf:llama", str(root / "recipes/models/tiny-llama.json"), device="meta")
hyperrecipe.compile_recipe(str(root / "recipes/llama.yaml"), model, {"tp": 2}, verify=False)
funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
ops = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default]
print([op in funcs for op in ops])
from hyperrecipe.runtime.comm.dtensor_rules import register_validate_rules
register_validate_rules()
first = [funcs[op] for op in ops]
register_validate_rules()
print([op in funcs for op in ops], [funcs[op] is f for op, f in zip(ops, first)])
"""
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[False, False]", "[True, True] [True, True]"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_an_op_dtensor_cannot_shard_is_refused_naming_the_boundary_and_the_op() -> None:
    """transformers' ``eager`` experts call ``nonzero`` on routing masks: validate mode refuses
    it through ``apply``'s forward with hyperrecipe's error, not DTensor's bare text."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(_worker, 2, "mixtral", recipe_path("mixtral"), "validate",
                  {"experts_implementation": "eager"}, False, timeout_s=300)
    text = str(info.value)
    assert ("ValidateUnsupportedError: model.layers.0.mlp: validate mode cannot run "
            f"aten.nonzero.default here: DTensor (torch {torch.__version__}) cannot shard it: "
            "its output's shape depends on the data") in text
    assert "`local_region: true`" in text and "Production mode needs no DTensor rule" in text


def test_compile_notes_an_op_whose_shape_depends_on_the_data_and_production_still_compiles(
) -> None:
    """The same op, seen by the verification step at compile: ``nonzero``'s output shape
    depends on the data, which no placement describes and fake tensors do not have. That is a
    limit of validate mode on these experts, not of the recipe (production runs them on local
    tensors): the plan compiles and its record says what was left to ``check``."""
    model = build("mixtral", "meta", experts_implementation="eager")
    plan = compile_recipe(recipe_path("mixtral"), model, {"tp": 2})
    assert plan.verification is not None
    assert plan.verification.modes == ("production", "validate")
    # the model's own eager experts call nonzero: on the meta device even without the plan
    assert any("cannot run its step on fake tensors in model.layers.0.mlp.experts" in n
               and "nonzero" in n for n in plan.verification.notes), plan.verification.notes
