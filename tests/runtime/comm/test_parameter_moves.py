"""A module move after apply (``model.to(device)``, ``model.float()``), the call every trainer
makes, keeps validate mode's gradients right.

``Module._apply`` replaces each DTensor parameter's tensor through ``torch.utils.swap_tensors``:
the Python object stays, but the autograd hooks on its old tensor and its ``__dict__`` go. The
hook that keeps a replicated parameter's gradient replicated when it met sharded data went with
them, so after ``model.to("cpu")`` a vocab-sharded embedding's gradient came back replicated (the whole
table on every rank) and a replicated parameter's partial (the Hugging
Face Trainer calls ``model.to(args.device)``). Compared with one process on every gradient at the
harness's tolerances (atol 2e-6, rtol 1e-5).
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


def _moved_worker(rank: int, world: int, move: str) -> dict[str, Any]:
    import torch

    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode="validate")
    if move == "to-device":
        model.to("cpu")
    elif move == "to-dtype":
        model.to(torch.float32)
    elif move == "float":
        model.float()
    out = llama_step(model, llama_batch())
    off = {n: (str(p.placements), str(getattr(p.grad, "placements", None)))
           for n, p in model.named_parameters()
           if hasattr(p, "placements") and tuple(p.placements) != tuple(p.grad.placements)}
    return {"logits": out, "grads": inst.full_grads(), "off": off}


@pytest.mark.parametrize("move", ["to-device", "to-dtype", "float"])
def test_validate_gradients_survive_a_module_move(move: str) -> None:
    ref_logits, ref_grads = reference()
    for rank, res in enumerate(run_ranks(_moved_worker, 2, move, timeout_s=300)):
        assert res["off"] == {}, f"rank {rank}: gradients whose placement left the parameter's"
        assert_close(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name} after {move}")
