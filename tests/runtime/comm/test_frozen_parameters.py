"""A parameter that needs no gradient (a MoE router's bias kept as a parameter, a layer a user
froze) inside a boundary becomes a DTensor in validate mode with no placement hook: there is
no gradient to keep placed, and hooking it raised ``cannot register a hook on a tensor that
doesn't require gradient`` while installing, naming no module (ERNIE-4.5-MoE, AFMoE and
Laguna lost sequence parallelism to it in ``hyperrecipe suggest``). The other gradients are
compared with one process at the harness's tolerances (atol 2e-6, rtol 1e-5).
"""

from __future__ import annotations

from typing import Any

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import (ROOT, assert_close, llama, llama_batch, llama_step,
                                           mesh_1d, reference)

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
