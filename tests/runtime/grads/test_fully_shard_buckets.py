"""FSDP2 on the data dim of a plan that reduces gradients in buckets, against one process.

``fully_shard`` replaces every parameter it manages, and the bucket hooks that reduce the
partial gradients of Qwen3's per-head q/k norms (``reduce_grads``) and of sequence-parallel
norms over ``tp`` stay on the old objects: plain ``fully_shard`` is refused at the first step.
``hyperrecipe.runtime.fully_shard_data_parallel`` leaves the bucketed parameters out of FSDP
(``ignored_params``): the buckets reduce them over ``tp`` and average them over ``dp``, FSDP's
reduce-scatter averages every other gradient over ``dp``, each exactly once.

dp=2 x tp=2 (four gloo ranks), each dp rank on half the batch: logits of its half, and every
gradient (gathered through FSDP's and the plan's layouts) against one process on the whole
batch, at the harness's tolerances (atol 2e-6, rtol 1e-5), and ``inst.grad_norm()`` (the bucketed
parameters plain shards replicated over dp, the rest FSDP's pieces) to atol 1e-6 / rtol 1e-5,
for two steps of SGD (the second
backward runs on the stepped, sharded weights and accumulates nothing stale). The plan's
collectives are counted against its manifest (each bucket's tp reduction once per backward).
After the two steps an evaluation forward, then ``save_checkpoint`` (FSDP's pieces and the
plain bucketed shards side by side): the saved weights equal one process's after its two
steps, and ``load_checkpoint`` reads back exactly what was saved.

A ``fully_shard`` with the bucketed parameters ignored by hand, where nothing averages them
over dp (each dp rank would train its own norms), is refused at the first step by name.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.model_tree import build_model
from hyperrecipe.runtime import fully_shard_data_parallel
from tests.support.runtime_harness import ROOT, TINY_LLAMA, assert_close, grads_of

pytestmark = pytest.mark.slow  # four gloo ranks per case (docs/benchmarks.md#test-suite)

TINY_QWEN3 = json.loads((ROOT / "recipes/models/tiny-qwen3.json").read_text())
CASES = {
    "qwen3": ("hf:qwen3", TINY_QWEN3, "tests/recipes/qwen3-dp-tp.yaml"),
    "llama-sp": ("hf:llama", TINY_LLAMA, "tests/recipes/llama-sp-dp-tp.yaml"),
}
LR = 0.5  # SGD: large enough that step 2's gradients differ visibly from step 1's


def _build(case: str, device: str = "cpu") -> nn.Module:
    arch, cfg, _ = CASES[case]
    torch.manual_seed(0)
    return build_model(arch, cfg, device=device)


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, 128, (4, 8), generator=g)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().pow(2).mean()


def _reference(case: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """One process, whole batch: the loss is the mean of the two halves' (FSDP's dp mean)."""
    model = _build(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(2):
        ids = _batch(step)
        logits = [model(input_ids=ids[i:i + 2]).logits for i in (0, 2)]
        ((_loss(logits[0]) + _loss(logits[1])) / 2).backward()
        norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
        out.append({"logits": [t.detach() for t in logits], "grads": grads_of(model),
                    "norm": norm})
        opt.step()
        opt.zero_grad()
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, case: str, folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hyperrecipe.runtime.comm.collectives import count_collectives

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(case)
    plan = compile_recipe(str(ROOT / CASES[case][2]), _build(case, "meta"), {"dp": 2, "tp": 2})
    bucketed = {fqn for b in plan.grad_buckets for fqn in b.params}
    inst = apply(model, plan, mesh, mode="production")
    fully_shard_data_parallel(inst, mesh["dp"], model.model.layers)
    # FSDP holds every parameter but the bucketed ones, which stay the hooked plain shards
    wrapped = {n for n, q in model.named_parameters() if isinstance(q, DTensor)}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp = mesh.get_local_rank("dp")
    steps = []
    for step in range(2):
        ids = _batch(step)[2 * dp:2 * dp + 2]
        with count_collectives() as log:
            logits = model(input_ids=ids).logits
            _loss(logits).backward()
        counted = Counter((r.kind, r.mesh_dim, r.direction) for r in log.records)
        steps.append({"logits": logits.detach(), "grads": inst.full_grads(),
                      "norm": inst.grad_norm(), "counted": dict(counted)})
        opt.step()
        opt.zero_grad()
    expected = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest)
    model.eval()
    with torch.no_grad():
        model(input_ids=_batch(9)[2 * dp:2 * dp + 2])
    model.train()
    inst.state.save_checkpoint(folder, opt)
    saved = inst.state.full_state_dict()
    inst.state.load_checkpoint(folder, opt)
    return {"steps": steps, "expected": dict(expected), "bucketed": sorted(bucketed),
            "wrapped": sorted(wrapped), "names": sorted(n for n, _ in model.named_parameters()),
            "saved": saved, "loaded": inst.state.full_state_dict()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fully_shard_data_parallel_over_gradient_buckets_matches_one_process(
        case: str, tmp_path: Path) -> None:
    ref, ref_weights = _reference(case)
    results = run_ranks(_worker, 4, case, str(tmp_path / "ckpt"), timeout_s=300)
    for rank, res in enumerate(results):
        dp = rank // 2
        assert res["bucketed"], "the plan reduces some gradients in buckets"
        assert set(res["wrapped"]) == set(res["names"]) - set(res["bucketed"])
        for step, (got, want) in enumerate(zip(res["steps"], ref, strict=True)):
            assert got["counted"] == res["expected"], f"rank {rank} step {step} collectives"
            assert_close(got["logits"], want["logits"][dp], f"rank {rank} step {step} logits")
            assert set(got["grads"]) >= set(want["grads"])
            torch.testing.assert_close(got["norm"], want["norm"], atol=1e-6, rtol=1e-5)
            for name, g in want["grads"].items():
                assert_close(got["grads"][name], g, f"rank {rank} step {step} grad {name}")
        for name, value in ref_weights.items():
            assert_close(res["saved"][name], value, f"rank {rank} saved {name}")
            torch.testing.assert_close(res["loaded"][name], res["saved"][name], atol=0, rtol=0)


def _unaveraged_worker(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build("qwen3")
    plan = compile_recipe(str(ROOT / CASES["qwen3"][2]), _build("qwen3", "meta"),
                          {"dp": 2, "tp": 2})
    bucketed = {fqn for b in plan.grad_buckets for fqn in b.params}
    inst = apply(model, plan, mesh, mode="production")
    try:  # the buckets would average over tp
        fully_shard_data_parallel(inst, mesh["tp"], model.model.layers)
        wrong_dim = "no error"
    except Exception as exc:  # noqa: BLE001
        wrong_dim = f"{type(exc).__name__}: {exc}"
    ignored = {q for n, q in model.named_parameters() if n in bucketed}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp = mesh.get_local_rank("dp")
    _loss(model(input_ids=_batch(0)[2 * dp:2 * dp + 2]).logits).backward()
    try:
        opt.step()
        step = "no error"
    except Exception as exc:  # noqa: BLE001
        step = f"{type(exc).__name__}: {exc}"
    return {"step": step, "wrong_dim": wrong_dim}


def test_fully_shard_ignoring_the_bucketed_params_by_hand_is_refused_at_the_step() -> None:
    """And fully_shard_data_parallel over a model-parallel dim is refused before it shards."""
    for out in run_ranks(_unaveraged_worker, 4, timeout_s=300):
        assert out["wrong_dim"] == (
            "UsageError: fully_shard_data_parallel: the mesh has dims ['tp']; pass the one-dim "
            "mesh of a data dim of the plan's mesh (data dims: ['dp']; model-parallel: "
            "['tp']), e.g. mesh['dp']"), out["wrong_dim"]
        res = out["step"]
        assert res.startswith("PlanMismatchError: optimizer.step(): the model is under "
                              "fully_shard with the parameters whose gradients"), res
        assert "nothing averages their gradients over the data dim" in res
        assert "hyperrecipe.runtime.fully_shard_data_parallel(inst, mesh['dp']" in res
