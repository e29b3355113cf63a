"""DDP over the data dim of a plan that reduces gradients in buckets (``recipes/llama-sp.yaml``'s
sequence-parallel norms, on a dp=2 x tp=2 mesh: ``tests/recipes/llama-sp-dp.yaml``).

DDP copies each gradient into its own bucket as it accumulates, before the plan's bucket has
reduced it over ``tp``, and writes its average back over the reduced value: 4 of 21 gradients
came out 27-89 % off, silently. ``hyperrecipe.runtime.data_parallel`` leaves the bucketed parameters
out of DDP and averages them over ``dp`` in the plan's buckets; any other DDP over such a plan
is refused at its first forward. Gradients are compared with one process on the whole batch
(each dp rank takes half) at the harness's tolerances (atol 2e-6, rtol 1e-5), with two
micro-batches accumulated under DDP's ``no_sync``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.runtime import data_parallel
from tests.support.runtime_harness import ROOT, assert_close, grads_of, llama

pytestmark = pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)

RECIPE = str(ROOT / "tests/recipes/llama-sp-dp.yaml")


def _micro_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (4, 8), generator=g) for _ in range(2)]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float().pow(2).mean()


def _reference() -> dict[str, torch.Tensor]:
    """One process: each micro-batch's loss is the mean of its two halves' (DDP's average
    over two dp ranks of their half-batch losses)."""
    model = llama()
    for ids in _micro_batches():
        ((_loss(model, ids[:2]) + _loss(model, ids[2:])) / 2).backward()
    return grads_of(model)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _ddp_worker(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh()
    model = llama()
    inst = apply(model, compile_recipe(RECIPE, llama("meta"), {"dp": 2, "tp": 2}), mesh)
    ddp = data_parallel(inst, mesh.get_group("dp"))
    half = slice(2 * mesh.get_local_rank("dp"), 2 * mesh.get_local_rank("dp") + 2)
    first, second = _micro_batches()
    with ddp.no_sync():  # type: ignore[operator]
        _loss(ddp, first[half]).backward()
    _loss(ddp, second[half]).backward()
    return {"grads": inst.full_grads(), "buckets": len(inst.plan.grad_buckets)}


def test_ddp_from_the_installation_averages_bucketed_gradients_like_one_process() -> None:
    ref = _reference()
    for rank, res in enumerate(run_ranks(_ddp_worker, 4, timeout_s=600)):
        assert res["buckets"] > 0, "the plan reduces some gradients in buckets"
        assert set(res["grads"]) == set(ref)
        for name, g in ref.items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")


def _plain_ddp_worker(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    mesh = _mesh()
    model = llama()
    apply(model, compile_recipe(RECIPE, llama("meta"), {"dp": 2, "tp": 2}), mesh)
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    try:
        _loss(ddp, _micro_batches()[0][:2]).backward()
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


def test_a_plain_ddp_over_a_plan_with_gradient_buckets_is_refused_at_its_first_forward() -> None:
    for message in run_ranks(_plain_ddp_worker, 4, timeout_s=600):
        assert message == (
            "DistributedDataParallel over this plan's data dim: the plan reduces the gradients "
            "of model.norm.weight, model.layers.1.post_attention_layernorm.weight, "
            "model.layers.1.input_layernorm.weight and 2 more over its model-parallel dims in "
            "buckets as they accumulate, and DDP copies each gradient before that reduction and "
            "writes its average back over it, so the reduction would be lost (silently wrong "
            "gradients). Wrap with hyperrecipe.runtime.data_parallel(installation, group) "
            "(HyperrecipeTrainer and HyperrecipeAccelerator do), which leaves those parameters "
            "to the buckets and averages them there"), message
