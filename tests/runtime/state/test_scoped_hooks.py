"""The installation's global optimizer hooks live as long as the model, no longer, no shorter.

torch's global step pre-hook registry kept every applied model alive for the rest of the process
(a sweep or a notebook building model after model ran out of memory). Dropping the model and the
installation now frees the model; dropping only the installation (``apply``'s return value
unused, the common case) keeps the hooks the model's optimizers need.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import ROOT, llama, llama_batch, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

RECIPE = str(ROOT / "recipes/llama.yaml")


def _freed_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    import torch
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    before = len(_global_optimizer_pre_hooks)
    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)
    per_installation = len(_global_optimizer_pre_hooks) - before
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(input_ids=llama_batch()).logits.sum().backward()
    opt.step()
    model_ref, param_ref = weakref.ref(model), weakref.ref(next(model.parameters()))
    del model, inst, opt
    gc.collect()
    alive = (model_ref() is not None, param_ref() is not None)
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()  # dead hooks: no-ops
    again = llama()  # the next apply takes the dead hooks out of torch's registry
    apply(again, plan, mesh_1d(world), mode=mode)
    return {"alive": alive,
            "left": len(_global_optimizer_pre_hooks) - before - per_installation}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_dropping_model_and_installation_frees_the_model(mode: str) -> None:
    for rank, res in enumerate(run_ranks(_freed_worker, 2, mode, timeout_s=300)):
        assert res["alive"] == (False, False), f"rank {rank}: the applied model outlived every reference"
        assert res["left"] == 0, f"rank {rank}: {res['left']} global optimizer hooks left"


def _dropped_installation_worker(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    apply(model, plan, mesh_1d(world), mode="production")  # the handle is dropped at once
    gc.collect()
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=llama_batch()).logits.sum().backward()
    opt.step()
    state = opt.state_dict()["state"]
    return {"dtensor_moments": sum(isinstance(s["exp_avg"], DTensor) for s in state.values())}


def test_hooks_outlive_a_dropped_installation_while_the_model_trains() -> None:
    for rank, res in enumerate(run_ranks(_dropped_installation_worker, 2, timeout_s=300)):
        # the sharded parameters' moments come out as DTensors (what DCP needs), so the
        # optimizer's state-dict hook was registered at its first step
        assert res["dtensor_moments"] > 0, f"rank {rank}: optimizer hooks were lost"
