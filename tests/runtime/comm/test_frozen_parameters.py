"""A parameter that needs no gradient (a MoE router's bias kept as a parameter, a layer a user
froze) inside a boundary becomes a DTensor in validate mode with no placement hook: there is
no gradient to keep placed, and hooking it raised ``cannot register a hook on a tensor that
doesn't require gradient`` while installing, naming no module (ERNIE-4.5-MoE, AFMoE and
Laguna lost sequence parallelism to it in ``hyperrecipe suggest``). Unfrozen after apply
(gradual unfreezing), it gets its hook before the next forward: the vocab-parallel embedding's
gradient came back replicated (the whole table on every rank, and none of validate mode's
checks of the placement ran). Gradients are compared with one process at the harness's
tolerances (atol 2e-6, rtol 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import (ROOT, assert_close, llama, llama_batch, llama_step,
                                           mesh_1d, reference)

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

RECIPE = str(ROOT / "recipes/llama.yaml")
FROZEN = "model.layers.0.self_attn.o_proj.weight"


def _frozen_worker(rank: int, world: int) -> dict[str, Any]:
    model = llama()
    model.get_parameter(FROZEN).requires_grad_(False)
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode="validate")
    out = llama_step(model, llama_batch())
    frozen = model.get_parameter(FROZEN)
    return {"logits": out, "grads": inst.full_grads(), "frozen_grad": frozen.grad is None,
            "dtensor": hasattr(frozen, "placements")}


def test_a_parameter_that_needs_no_gradient_is_installed_in_validate_mode() -> None:
    ref_logits, ref_grads = reference()
    for rank, res in enumerate(run_ranks(_frozen_worker, 2, timeout_s=300)):
        assert res["dtensor"] and res["frozen_grad"], f"rank {rank}"
        assert_close(res["logits"], ref_logits, f"rank {rank} logits")
        assert FROZEN not in res["grads"]
        assert set(res["grads"]) == set(ref_grads) - {FROZEN}
        for name, g in res["grads"].items():
            assert_close(g, ref_grads[name], f"rank {rank} grad {name}")


EMBED = "model.embed_tokens.weight"


def _unfrozen_worker(rank: int, world: int) -> dict[str, Any]:
    model = llama()
    for fqn in (EMBED, FROZEN):
        model.get_parameter(fqn).requires_grad_(False)
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode="validate")
    for fqn in (EMBED, FROZEN):
        model.get_parameter(fqn).requires_grad_(True)
    out = llama_step(model, llama_batch())
    placed = {name: (tuple(p.grad.placements), tuple(p.placements))
              for name, p in model.named_parameters()
              if p.grad is not None and hasattr(p, "placements")}
    return {"logits": out, "grads": inst.full_grads(), "placed": placed}


def test_a_parameter_unfrozen_after_apply_keeps_its_gradient_placed_in_validate_mode() -> None:
    ref_logits, ref_grads = reference()
    for rank, res in enumerate(run_ranks(_unfrozen_worker, 2, timeout_s=300)):
        assert_close(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads)
        for name, g in res["grads"].items():
            assert_close(g, ref_grads[name], f"rank {rank} grad {name}")
        assert EMBED in res["placed"] and FROZEN in res["placed"]
        for name, (grad, param) in res["placed"].items():
            assert grad == param, f"rank {rank} {name}: gradient {grad}, parameter {param}"
