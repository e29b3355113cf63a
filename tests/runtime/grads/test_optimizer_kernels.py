"""torch's optimizers over an applied model, on real gloo ranks, against one process.

Validate mode keeps replicated parameters outside every boundary plain tensors next to its
DTensors (``recipes/llama.yaml``: the RMSNorm weights). torch's multi-tensor kernels
(``foreach=True``, the default on CUDA, and ``fused=True``) refuse that mix with a bare DTensor
error; the step is refused first with ``MixedParametersError`` naming both kinds and the fix.
One tensor at a time (``foreach=False``) trains like one process, and so do both kernels in
production mode and the foreach kernel in validate mode where no kernel gets both kinds (every
parameter a DTensor with ``llama-sp.yaml``, or each kind in a param group of its own).

Real ``torch.optim.AdamW`` (weight decay 0.1), the model's own ``labels=`` loss, three steps,
tiny Llama at tp=2, fp32: losses to atol 1e-5; the trained weights to atol 1e-3, as the FSDP
test in test_training_state.py, and their mean absolute difference to 1e-6: AdamW divides each
gradient by the root of its second moment, so where a gradient is near zero its ~1e-8 difference
moves that element by up to 2.4e-4 (measured: 1 element of 8192 in one weight), while the
mean absolute differences are at most 2.4e-7.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import MixedParametersError, apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import llama, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

STEPS = 3
LOSS_ATOL = 1e-5
WEIGHT_TOL = {"atol": 1e-3, "rtol": 0.0}
MEAN_ATOL = 1e-6


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 128, (2, 8), generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=_batch(step), labels=_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _adamw(model: nn.Module, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    """AdamW with ``kernel``'s flags; ``split_kinds``: DTensor and plain parameters in param
    groups of their own (same settings), so no kernel gets both kinds."""
    flags = {k: v for k, v in kernel.items() if k != "split_kinds"}
    params: Any = model.parameters()
    if kernel.get("split_kinds"):
        from torch.distributed.tensor import DTensor

        kinds = [[q for q in model.parameters() if isinstance(q, DTensor) is want]
                 for want in (True, False)]
        params = [{"params": k} for k in kinds]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **flags)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    model = llama()
    losses = _train(model, _adamw(model, {"foreach": False}))
    return {"losses": losses, "weights": {n: p.detach().clone()
                                          for n, p in model.named_parameters()}}


def _worker(rank: int, world: int, recipe: str, mode: str,
            kernel: dict[str, bool]) -> dict[str, Any]:
    model = llama()
    plan = compile_recipe(recipe, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    opt = _adamw(model, kernel)
    before = inst.state.full_state_dict()
    try:
        losses = _train(model, opt)
    except MixedParametersError as exc:
        after = inst.state.full_state_dict()
        return {"error": str(exc), "plain": exc.plain, "dtensors": exc.dtensors,
                "unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    return {"losses": losses, "weights": inst.state.full_state_dict()}


def _assert_trains_like_one_process(results: list[dict[str, Any]],
                                    ref: dict[str, Any]) -> None:
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]),
                                   atol=LOSS_ATOL, rtol=0)
        for name, w in ref["weights"].items():
            torch.testing.assert_close(res["weights"][name], w, **WEIGHT_TOL,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
            mean = float((res["weights"][name] - w).abs().mean())
            assert mean < MEAN_ATOL, f"rank {rank} {name}: mean |difference| {mean:.2e}"


@pytest.mark.parametrize("kernel", [{"foreach": True}, {"fused": True}],
                         ids=["foreach", "fused"])
def test_validate_mode_refuses_multi_tensor_kernels_over_mixed_parameters_by_name(
        kernel: dict[str, bool]) -> None:
    """Before the fix: torch's bare ``RuntimeError: aten._foreach_mul_.Scalar got mixed
    torch.Tensor and DTensor`` (``aten._fused_adamw_.default`` with ``fused=True``)."""
    results = run_ranks(_worker, 2, "recipes/llama.yaml", "validate", kernel)
    flag = next(iter(kernel))
    for res in results:
        assert res["error"].startswith(
            f"optimizer.step(): AdamW param group 0 runs torch's multi-tensor kernel "
            f"({flag}=True) over DTensor and plain parameters together, which DTensor refuses. "
            f"Validate mode holds the parameters of boundaries as DTensors (16: "
            f"model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ")
        assert ("keeps replicated parameters outside every boundary plain tensors (5: "
                "model.layers.0.input_layernorm.weight, "
                "model.layers.0.post_attention_layernorm.weight, "
                "model.layers.1.input_layernorm.weight, ...). Build the optimizer with "
                "foreach=False (and no fused=True)") in res["error"]
        assert "model.norm.weight" in res["plain"] and len(res["plain"]) == 5
        assert "lm_head.weight" in res["dtensors"]
        assert res["unchanged"]  # refused before the step touched a weight


def test_validate_mode_with_foreach_false_trains_like_one_process(
        one_process: dict[str, Any]) -> None:
    results = run_ranks(_worker, 2, "recipes/llama.yaml", "validate", {"foreach": False})
    _assert_trains_like_one_process(results, one_process)


@pytest.mark.parametrize(("recipe", "mode", "kernel"), [
    pytest.param("recipes/llama.yaml", "production", {"foreach": True}, id="production-foreach"),
    pytest.param("recipes/llama.yaml", "production", {"fused": True}, id="production-fused"),
    # every parameter in a boundary: all DTensors, nothing mixed, nothing refused
    pytest.param("recipes/llama-sp.yaml", "validate", {"foreach": True}, id="validate-sp-foreach"),
    # mixed, but each kind in a param group of its own
    pytest.param("recipes/llama.yaml", "validate", {"foreach": True, "split_kinds": True},
                 id="validate-split-groups-foreach"),
])
def test_multi_tensor_kernels_train_like_one_process_where_nothing_is_mixed(
        recipe: str, mode: str, kernel: dict[str, bool], one_process: dict[str, Any]) -> None:
    results = run_ranks(_worker, 2, recipe, mode, kernel)
    _assert_trains_like_one_process(results, one_process)
