"""Gradient norms and clipping of an applied model, against one process, on real gloo ranks.

Each case: a tiny transformers model from ``recipes/models/``, the model's own ``labels=`` loss,
backward, then ``Installation.grad_norm(inf)`` and ``Installation.clip_grad_norm_(MAX_NORM)``
(2-norm) with a ``MAX_NORM`` small enough to clip (the one-process norms are 2.7–3.7). The
single-process reference runs ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
Compared, fp32: both norms on every rank (rtol 1e-5, atol 1e-6: the sums of squares are taken
in another order) and every gradient after clipping (atol 2e-6, rtol 1e-5, as the other runtime
tests; measured differences are below 2e-8).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import PlanMismatchError, apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.family_harness import batch, build
from tests.support.runtime_harness import ROOT, assert_close, grads_of

MAX_NORM = 0.05
NORM_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _overrides(mode: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    return dict(base or {})  # both modes run the model's default attention (sdpa)


def _reference(family: str, mode: str, norm_type: float,
               base: dict[str, Any] | None = None) -> dict[str, Any]:
    model = build(family, **_overrides(mode, base))
    _loss(model, batch()).backward()
    grads = [q.grad for q in model.parameters()]
    inf = torch.nn.utils.get_total_norm(grads, math.inf)
    ninf = torch.nn.utils.get_total_norm(grads, -math.inf)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)
    return {"inf": inf, "-inf": ninf, "norm": norm, "grads": grads_of(model)}


def _worker(rank: int, world: int, family: str, recipe: str, shape: dict[str, int], mode: str,
            norm_type: float, base: dict[str, Any] | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    model = build(family, **_overrides(mode, base))
    plan = compile_recipe(recipe, build(family, "meta", **_overrides(mode, base)), shape)
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    inst = apply(model, plan, mesh, mode=mode)  # type: ignore[arg-type]
    _loss(model, batch()).backward()
    inf, ninf = inst.grad_norm(math.inf), inst.grad_norm(-math.inf)
    torch_local = (torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
                   if mode == "production" else None)
    # the foreach kernels (the default on CUDA) in production, one tensor at a time in validate
    norm = inst.clip_grad_norm_(MAX_NORM, norm_type=norm_type, foreach=mode == "production")
    return {"inf": inf, "-inf": ninf, "norm": norm, "torch_local": torch_local,
            "grads": inst.full_grads()}


def _check(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for rank, res in enumerate(results):
        for which in ("norm", "inf", "-inf"):
            torch.testing.assert_close(res[which], ref[which], **NORM_TOL,
                                       msg=lambda m, r=rank, w=which: f"rank {r} {w}: {m}")
        assert res["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            assert_close(res["grads"][name], g, f"rank {rank} clipped grad {name}")


CASES = [
    # mixed Shard/Replicate parameters on one mesh dim
    pytest.param("llama", "recipes/llama.yaml", "tp", None, id="llama-tp2"),
    # chunked (fused q|k|v) shards: _StridedShard in validate mode, a tied vocab-parallel head
    pytest.param("gpt2", "recipes/gpt2.yaml", "tp", None, id="gpt2-tp2"),
    # unequal chunks (q|k|v of a GQA model): plain parts in validate mode, no DTensor
    pytest.param("phi3", "tests/recipes/phi3-gqa.yaml", "tp", {"num_key_value_heads": 2},
                 id="phi3-gqa-tp2"),
    # experts sharded whole over ep, everything else replicated
    pytest.param("mixtral", "recipes/mixtral-ep.yaml", "ep", None, id="mixtral-ep2"),
    # sequence-parallel norms, whose gradients production reduces in buckets; the loss on
    # vocab shards
    pytest.param("llama", "recipes/llama-sp-loss.yaml", "tp", None, id="llama-sp-loss-tp2"),
]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize(("family", "recipe", "dim", "base"), CASES)
def test_grad_norm_and_clipping_equal_one_process_on_every_rank(
        family: str, recipe: str, dim: str, base: dict[str, Any] | None, mode: str) -> None:
    ref = _reference(family, mode, 2.0, base)
    assert ref["norm"] > 20 * MAX_NORM  # the clip scales every gradient down
    results = run_ranks(_worker, 2, family, str(ROOT / recipe), {dim: 2}, mode, 2.0, base,
                        timeout_s=300)
    _check(results, ref)
    if mode == "production":
        # torch's own get_total_norm over model.parameters()' gradients: routed to the full
        # norm while the installation lives (torch_clip_guard); torch alone returned each
        # rank's own shards' norm, 0.02% to 30% off
        for rank, res in enumerate(results):
            torch.testing.assert_close(res["torch_local"], ref["norm"], **NORM_TOL,
                                       msg=lambda m, r=rank: f"rank {r} torch's norm: {m}")


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_grad_norm_on_a_two_dim_mesh_equals_one_process(mode: str) -> None:
    """tp=2 x cp=2 (recipes/llama-tp-cp.yaml): parameters sharded over tp, replicated over cp
    (their gradients reduced over cp by the plan); each is counted once over both dims."""
    base = {"attn_implementation": "sdpa"}  # the cp wrappers hook SDPA, in both modes
    ref = _reference("llama", "production", 2.0, base)
    results = run_ranks(_worker, 4, "llama", str(ROOT / "recipes/llama-tp-cp.yaml"),
                        {"tp": 2, "cp": 2}, mode, 2.0, base, timeout_s=300)
    _check(results, ref)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_clipping_by_the_inf_norm_equals_one_process() -> None:
    ref = _reference("llama", "production", math.inf)
    assert ref["norm"] > 2 * MAX_NORM
    results = run_ranks(_worker, 2, "llama", str(ROOT / "recipes/llama.yaml"), {"tp": 2},
                        "production", math.inf, timeout_s=300)
    _check(results, ref)


def _added_after_apply_worker(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    model = build("llama")
    plan = compile_recipe(str(ROOT / "recipes/llama.yaml"), build("llama", "meta"),
                          {"tp": world})
    inst = apply(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    model.extra = nn.Linear(4, 4)
    model.extra(torch.ones(1, 4)).sum().backward()
    try:
        inst.clip_grad_norm_(1.0)
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_parameter_added_after_apply_is_refused_by_name() -> None:
    """Its layout on the mesh is unknown; leaving it out of the norm would be a wrong norm."""
    msg = run_ranks(_added_after_apply_worker, 2)[0]
    assert msg.startswith("grad_norm: extra.weight, extra.bias are not in the plan (added "
                          "after apply?)"), msg


# -- FSDP2 over dp after apply on tp -------------------------------------------------------


def _fsdp_worker(rank: int, world: int, norm_type: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("llama")
    plan = compile_recipe(str(ROOT / "recipes/llama-dp.yaml"), build("llama", "meta"),
                          {"dp": 2, "tp": 2})
    inst = apply(model, plan, mesh, mode="production")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh.get_local_rank("dp")
    ids = batch()
    half = ids.shape[0] // 2
    _loss(model, ids[dp * half:(dp + 1) * half]).backward()
    inf = inst.grad_norm(math.inf)
    # torch's own norm over FSDP's DTensor pieces: handed the full norm (torch_clip_guard)
    torch_norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
    norm = inst.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
    return {"inf": inf, "norm": norm, "torch_norm": torch_norm, "grads": inst.full_grads()}


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_grad_norm_under_fully_shard_on_dp_equals_one_process() -> None:
    """dp=2 x tp=2: FSDP2 splits each tensor-parallel shard over dp (its gradients are the
    dp mean); the norm counts each piece once over both dims and equals one process on the
    whole batch, and the clipped gradients (gathered through both layouts) equal its own."""
    model = build("llama")
    ids = batch()
    half = ids.shape[0] // 2
    loss = (_loss(model, ids[:half]) + _loss(model, ids[half:])) / 2
    loss.backward()
    inf = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()], math.inf)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert norm > 20 * MAX_NORM
    ref = grads_of(model)
    for rank, res in enumerate(run_ranks(_fsdp_worker, 4, 2.0, timeout_s=300)):
        torch.testing.assert_close(res["norm"], norm, **NORM_TOL)
        torch.testing.assert_close(res["torch_norm"], norm, **NORM_TOL)
        torch.testing.assert_close(res["inf"], inf, **NORM_TOL)
        for name, g in ref.items():
            assert_close(res["grads"][name], g, f"rank {rank} clipped grad {name}")


def test_an_empty_piece_adds_nothing_to_any_norm() -> None:
    """fully_shard can leave a rank an empty piece of a small shard; torch's inf norm of an
    empty tensor raises, so empty pieces are left out (the identity of each reduction)."""
    from hyperrecipe.runtime.grads.grad_norm import _reduce_local

    piece, empty = torch.tensor([3.0, -4.0]), torch.empty(0, 4)
    assert float(_reduce_local([piece, empty], 2.0, None)) == pytest.approx(25.0)
    assert float(_reduce_local([empty, piece], math.inf, True)) == 4.0
    assert float(_reduce_local([empty], math.inf, None)) == 0.0
    assert float(_reduce_local([empty], -math.inf, None)) == math.inf
