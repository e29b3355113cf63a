"""``torch.amp.GradScaler`` over production shards: an overflow on one rank's shard makes every
rank skip the step and lower its scale alike.

Before the guard (``runtime/grads/scaler_guard.py``) rank 0, whose rows of ``q_proj`` held the
inf, skipped the step and halved its scale while rank 1 stepped: the replicated weights then
differed between the ranks and nothing said so. Real gloo ranks, tiny Llama at tp=2, the
scaler on the CPU (what fp16 training runs, with the gradients' own values).
"""

from __future__ import annotations

from typing import Any

import pytest

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RankFailedError
from tests.support.runtime_harness import ROOT, llama, llama_batch, mesh_1d

RECIPE = str(ROOT / "recipes/llama.yaml")


def _scaled_step_worker(rank: int, world: int, mode: str, overflow_on: int | None
                        ) -> dict[str, Any]:
    import torch

    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = {n: t.clone() for n, t in inst.full_state_dict().items()}
    loss = model(input_ids=llama_batch()).logits.float().pow(2).mean()
    scaler.scale(loss).backward()
    if rank == overflow_on:  # an overflow in this rank's rows only (q_proj is row-sharded)
        grad = model.model.layers[0].self_attn.q_proj.weight.grad
        (grad.to_local() if hasattr(grad, "to_local") else grad)[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after = inst.full_state_dict()
    # a weight replicated on every rank: its value is this rank's own copy
    norm = model.model.layers[0].input_layernorm.weight
    local_norm = (norm.to_local() if hasattr(norm, "to_local") else norm).detach().clone()
    return {"scale": scaler.get_scale(), "local_norm": local_norm,
            "changed": sorted(n for n in before if not torch.equal(before[n], after[n]))}


def test_an_overflow_on_one_ranks_shard_skips_the_step_on_every_rank() -> None:
    import torch

    results = run_ranks(_scaled_step_worker, 2, "production", 0, timeout_s=300)
    for rank, res in enumerate(results):
        assert res["changed"] == [], f"rank {rank} stepped past an overflow on rank 0"
        assert res["scale"] == 2.0 ** 7, f"rank {rank}'s scale: {res['scale']}"
    assert torch.equal(results[0]["local_norm"], results[1]["local_norm"])


def test_without_an_overflow_every_rank_steps_with_the_same_scale() -> None:
    import torch

    results = run_ranks(_scaled_step_worker, 2, "production", None, timeout_s=300)
    for rank, res in enumerate(results):
        assert res["changed"], f"rank {rank} skipped a step without an overflow"
        assert res["scale"] == 2.0 ** 8
    assert torch.equal(results[0]["local_norm"], results[1]["local_norm"])


def test_validate_mode_refuses_the_scaler_by_name_before_unscaling() -> None:
    with pytest.raises(RankFailedError, match=r"MixedParametersError: GradScaler over an applied "
                                              r"model in validate mode.*production mode"):
        run_ranks(_scaled_step_worker, 2, "validate", None, timeout_s=300)
