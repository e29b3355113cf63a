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

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

RECIPE = str(ROOT / "recipes/llama.yaml")


def _scaled_step_worker(rank: int, world: int, mode: str, overflow_on: int | None
                        ) -> dict[str, Any]:
    import torch

    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = {n: t.clone() for n, t in inst.state.full_state_dict().items()}
    loss = model(input_ids=llama_batch()).logits.float().pow(2).mean()
    scaler.scale(loss).backward()
    if rank == overflow_on:  # an overflow in this rank's rows only (q_proj is row-sharded)
        grad = model.model.layers[0].self_attn.q_proj.weight.grad
        (grad.to_local() if hasattr(grad, "to_local") else grad)[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after = inst.state.full_state_dict()
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


def _wrapped_by_another_library_worker(rank: int, world: int) -> dict[str, Any]:
    """Another library patches ``_unscale_grads_`` over ours (a plain wrapper that does not set
    ``__wrapped__``), then the last installation goes, then a new one comes."""
    import torch

    scaler_cls = torch.amp.GradScaler
    torch_own = scaler_cls.__dict__["_unscale_grads_"]
    calls = []

    def step_with_overflow(model: Any, overflow_on: int | None) -> tuple[float, bool]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        weight = model.model.layers[0].input_layernorm.weight
        before = weight.detach().clone()
        scaler.scale(model(input_ids=llama_batch()).logits.float().pow(2).mean()).backward()
        if rank == overflow_on:
            model.model.layers[0].self_attn.q_proj.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale(), not torch.equal(before, weight.detach())

    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    first = llama()
    inst = apply(first, plan, mesh_1d(world))
    ours = scaler_cls.__dict__["_unscale_grads_"]
    assert ours is not torch_own, "apply did not guard GradScaler"

    def other_library(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return ours(self, *args, **kwargs)

    scaler_cls._unscale_grads_ = other_library
    try:
        inst.restore()  # the last installation goes while another patch wraps ours
        kept = scaler_cls.__dict__["_unscale_grads_"] is other_library
        # no installation: the chain serves a plain model as torch does (main: IndexError)
        plain_scale, plain_stepped = step_with_overflow(llama(), None)
        second = llama()
        inst2 = apply(second, plan, mesh_1d(world))
        agreed_scale, agreed_stepped = step_with_overflow(second, 0)  # an overflow on rank 0
        inst2.restore()
        back = scaler_cls.__dict__["_unscale_grads_"] is other_library
    finally:
        scaler_cls._unscale_grads_ = torch_own
    return {"kept": kept, "plain": (plain_scale, plain_stepped),
            "agreed": (agreed_scale, agreed_stepped), "back": back, "calls": len(calls)}


def test_a_patch_over_ours_keeps_the_chain_working_after_the_last_installation_goes() -> None:
    results = run_ranks(_wrapped_by_another_library_worker, 2, timeout_s=300)
    for rank, res in enumerate(results):
        assert res["kept"], f"rank {rank}: the other library's patch was replaced"
        assert res["plain"] == (2.0 ** 8, True), f"rank {rank}: {res['plain']}"
        # rank 0's overflow skips the step and halves the scale on every rank
        assert res["agreed"] == (2.0 ** 7, False), f"rank {rank}: {res['agreed']}"
        assert res["back"], f"rank {rank}: restoring ours did not put the other patch back"
        assert res["calls"] == 2, f"rank {rank}: the other patch ran {res['calls']} times"
