"""apply() and Installation on real gloo ranks: restore, atomicity, mismatches, masking, bias.

Numerical checks compare against a single-process run (fp32, atol 2e-6, rtol 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe.runtime import apply
from hyperrecipe.check.launcher import RankFailedError, run_ranks
from hyperrecipe.errors import PlanMismatchError, RewriteError
from tests.support.runtime_harness import ROOT, assert_close, mesh_1d
from tests.support.recipe_text import resolve_only as compile_recipe
from tests.support.toy_models import Toy

TOY = str(ROOT / "tests/recipes/toy.yaml")
TOY_SP = str(ROOT / "tests/recipes/toy-sp.yaml")


def toy(device: str = "cpu", **kw: Any) -> Toy:
    torch.manual_seed(0)
    with torch.device(device):
        return Toy(**kw)


def toy_plan(recipe: str, world: int, **kw: Any):  # type: ignore[no-untyped-def]
    return compile_recipe(recipe, toy("meta", **kw), {"tp": world})


def snapshot_state(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "param_ids": {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
        "forwards": sorted(n for n, m in model.named_modules() if "forward" in vars(m)),
        "attrs": {n: dict(vars(m)).get("num_heads") for n, m in model.named_modules()},
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["param_ids"] == b["param_ids"] and a["forwards"] == b["forwards"]
            and a["attrs"] == b["attrs"] and a["state"].keys() == b["state"].keys()
            and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]))


def _restore_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = toy(tie=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inst = apply(model, toy_plan(TOY, world, tie=True), mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    shard = model.layers[0].mlp.up.weight
    sharded_shape = tuple(shard.to_local().shape if hasattr(shard, "to_local") else shard.shape)
    heads = model.layers[0].mlp.num_heads
    rows = inst.state.status()
    full = inst.state.full_state_dict()
    inst.restore()
    after = model.state_dict()
    return {
        "sharded_shape": sharded_shape, "heads": heads,
        "states": sorted({r.state for r in rows}), "kinds": sorted({r.what for r in rows}),
        "full_equal": all(torch.equal(full[k], before[k]) for k in before),
        "restored_equal": all(torch.equal(after[k], before[k]) for k in before),
        "same_keys": after.keys() == before.keys(),
        "forward_in_vars": [n for n, m in model.named_modules() if "forward" in vars(m)],
        "heads_after": model.layers[0].mlp.num_heads,
        "tied_after": model.head.weight is model.embed.weight,
        "plain_after": type(model.head.weight.data).__name__,
    }


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_restore_returns_the_model_bit_for_bit(mode: str) -> None:
    res = run_ranks(_restore_worker, 2, mode)[0]
    assert res["sharded_shape"] == (8, 8)
    assert res["heads"] == (2 if mode == "production" else 4), "head counts divided in production"
    assert res["states"] == ["installed"]
    assert "forward" in res["kinds"] and "parameter weight" in res["kinds"]
    assert res["full_equal"], "full_state_dict gathers the original values"
    assert res["restored_equal"] and res["same_keys"]
    assert res["forward_in_vars"] == []
    assert res["heads_after"] == 4
    assert res["tied_after"], "tied parameters are one object again"
    assert res["plain_after"] == "Tensor"


class Boom(RuntimeError):
    pass


def _atomic_worker(rank: int, world: int, fail_rank: int, mode: str) -> dict[str, Any]:
    import hyperrecipe.runtime.install as apply_mod

    model = toy()
    before = snapshot_state(model)
    real = apply_mod.make_boundary_forward
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if rank == fail_rank and calls["n"] == 3:  # midway: after params, two wrappers in
            raise Boom("injected failure")
        return real(*args, **kwargs)

    apply_mod.make_boundary_forward = failing  # type: ignore[assignment]
    try:
        apply(model, toy_plan(TOY, world), mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    except Boom:
        error = "Boom"
    except PlanMismatchError as exc:
        error = f"PlanMismatchError: {exc}"
    else:
        error = "none"
    finally:
        apply_mod.make_boundary_forward = real
    return {"error": error, "unchanged": same_state(before, snapshot_state(model))}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_failure_midway_on_one_rank_rolls_back_every_rank(mode: str) -> None:
    res = run_ranks(_atomic_worker, 2, 1, mode)
    assert res[1]["error"] == "Boom"
    assert res[0]["error"] == ("PlanMismatchError: applying plan 'toy' failed on rank(s) [1]; "
                               "this rank rolled back too (see the failing rank's error)")
    assert res[0]["unchanged"] and res[1]["unchanged"], \
        "forwards, parameters (same objects, same values) and attributes as before"


def _mismatch_worker(rank: int, world: int) -> str:
    model = toy()
    plan = toy_plan(TOY if rank == 0 else TOY_SP, world)
    try:
        apply(model, plan, mesh_1d(world))
    except PlanMismatchError as exc:
        return str(exc)
    return "applied"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_ranks_with_different_plans_all_raise_instead_of_hanging() -> None:
    res = run_ranks(_mismatch_worker, 2, timeout_s=60)
    assert res[0].startswith("ranks hold different plans or meshes: this rank (rank 0) has plan "
                             "'toy' with fingerprint ")
    assert res[0].endswith("on mesh tp=2, ranks [1] hold another; every rank must apply the same "
                           "plan on the same mesh")
    assert res[1].startswith("ranks hold different plans or meshes: this rank (rank 1) has plan "
                             "'toy-sp'")


def _mesh_and_model_mismatch_worker(rank: int, world: int) -> list[str]:
    out = []
    plan = toy_plan(TOY, 4)
    try:
        apply(toy(), plan, mesh_1d(world))
    except PlanMismatchError as exc:
        out.append(str(exc))
    try:
        apply(toy(layers=3), toy_plan(TOY, world), mesh_1d(world))
    except PlanMismatchError as exc:
        out.append(str(exc))
    model = toy()
    apply(model, toy_plan(TOY, world), mesh_1d(world))
    try:
        apply(model, toy_plan(TOY, world), mesh_1d(world))
    except RewriteError as exc:
        out.append(str(exc))
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_plan_for_another_mesh_or_model_or_applied_twice_is_refused() -> None:
    mesh_err, model_err, twice = run_ranks(_mesh_and_model_mismatch_worker, 2)[0]
    assert mesh_err == ("plan 'toy' was compiled for mesh tp=4, but the DeviceMesh is tp=2; "
                        "recompile with --mesh tp=2 or build the mesh the plan names")
    assert model_err == ("plan 'toy' does not fit this model: parameter 'layers.2.norm.weight': "
                         "the plan has no such parameter, the model [8] float32; recompile the "
                         "recipe against this model")
    assert twice.startswith("embed already has a forward installed by 'hyperrecipe production toy'")


def _vocab_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = toy(vocab=32)
    apply(model, toy_plan(TOY, world, vocab=32), mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    per = 32 // world
    edges = sorted({0, 31, *[k * per for k in range(world)], *[k * per - 1 for k in range(1, world)]})
    ids = torch.tensor([edges, list(reversed(edges))])
    out = model.embed(ids)
    out = out.to_local() if hasattr(out, "to_local") else out
    out.sum().backward()
    g = model.embed.weight.grad
    return {"ids": ids, "out": out.detach(), "grad_rows": (g.to_local() if hasattr(g, "to_local")
                                                           else g).abs().sum(-1)}


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("mode", "world"), [("production", 2), ("production", 4), ("validate", 2)])
def test_vocab_parallel_lookup_is_exact_on_every_shard_edge(mode: str, world: int) -> None:
    res = run_ranks(_vocab_worker, world, mode)
    ref = toy(vocab=32)
    ids = res[0]["ids"]
    expected = ref.embed(ids)
    expected.sum().backward()
    assert ref.embed.weight.grad is not None
    counts = ref.embed.weight.grad.abs().sum(-1)
    for rank, r in enumerate(res):
        assert_close(r["out"], expected.detach(), f"rank {rank} embedding")
        per = 32 // world
        assert_close(r["grad_rows"], counts[rank * per:(rank + 1) * per], f"rank {rank} rows")


def _bias_worker(rank: int, world: int) -> dict[str, Any]:
    model = toy()
    apply(model, toy_plan(TOY, world), mesh_1d(world))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    return {"out": model.layers[0].mlp(x).detach()}


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("world", [2, 4])
def test_rowwise_bias_is_added_once_after_reduction(world: int) -> None:
    ref = toy()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    expected = ref.layers[0].mlp(x).detach()
    assert ref.layers[0].mlp.down.bias.abs().sum() > 0, "the bias is not zero, so doubling shows"
    for r in run_ranks(_bias_worker, world):
        assert_close(r["out"], expected, "mlp output")


def _load_worker(rank: int, world: int) -> dict[str, Any]:
    model = toy()
    inst = apply(model, toy_plan(TOY_SP, world), mesh_1d(world))
    other = toy()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2.0)
    inst.state.load_full_state_dict(other.state_dict())
    back = inst.state.full_state_dict()
    return {"equal": all(torch.equal(back[k], v) for k, v in other.state_dict().items())}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_load_full_state_dict_keeps_each_ranks_shard() -> None:
    assert all(r["equal"] for r in run_ranks(_load_worker, 2))


def _raises_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded")
    torch.distributed.barrier()


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_that_raises_ends_the_run_with_its_error() -> None:
    with pytest.raises(RankFailedError, match="rank one exploded"):
        run_ranks(_raises_worker, 2, timeout_s=60)


class ScaledEmbedding(nn.Embedding):
    """An Embedding subclass that post-processes the lookup (as Gemma's does)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 3.0


def scaled_toy(device: str = "cpu") -> Toy:
    model = toy(device)
    torch.manual_seed(5)
    with torch.device(device):
        model.embed = ScaledEmbedding(32, 8, padding_idx=20)
    return model


def _scaled_worker(rank: int, world: int) -> dict[str, Any]:
    model = scaled_toy()
    plan = compile_recipe(TOY, scaled_toy("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world))
    padding_during = model.embed.padding_idx
    ids = torch.tensor([[0, 15, 16, 20, 31], [20, 1, 17, 30, 14]])
    out = model(ids)
    out.pow(2).mean().backward()
    grads = inst.full_grads()
    inst.restore()
    return {"out": out.detach(), "grad": grads["embed.weight"], "padding_during": padding_during,
            "padding_after": model.embed.padding_idx}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_vocab_parallel_keeps_an_embedding_subclass_forward_and_its_padding_row() -> None:
    ref = scaled_toy()
    ids = torch.tensor([[0, 15, 16, 20, 31], [20, 1, 17, 30, 14]])
    expected = ref(ids)
    expected.pow(2).mean().backward()
    res = run_ranks(_scaled_worker, 2)
    assert [r["padding_during"] for r in res] == [None, 4], "row 20 lives on rank 1 as local row 4"
    assert all(r["padding_after"] == 20 for r in res)
    assert ref.embed.weight.grad is not None
    for r in res:
        assert_close(r["out"], expected.detach(), "logits")
        assert_close(r["grad"], ref.embed.weight.grad, "embedding gradient (padding row zero)")


def _no_grad_recipe(tmp_path: Path) -> str:
    text = Path(TOY).read_text().replace(
        "    in_src: {x: replicate}\n", "    in_src: {x: replicate}\n    no_grad: [x]\n", 1)
    assert "no_grad" in text
    path = tmp_path / "toy-no-grad.yaml"
    path.write_text(text)
    return str(path)


def test_no_grad_input_drops_its_backward_collective(tmp_path: Path) -> None:
    def backward_ops(recipe: str) -> list[tuple[str, str]]:
        plan = toy_plan(recipe, 2)
        return sorted((e.boundary, e.name) for e in plan.manifest
                      if e.direction == "backward" and e.stage == "input"
                      and e.boundary.endswith(".mlp"))

    # the MLP's replicated input feeds tp-sharded weights: its gradient is partial (Megatron's f)
    assert backward_ops(TOY) == [("layers.0.mlp", "x"), ("layers.1.mlp", "x")]
    plan = toy_plan(_no_grad_recipe(tmp_path), 2)
    assert plan.boundary("layers.0.mlp").no_grad == ("x",)
    assert backward_ops(_no_grad_recipe(tmp_path)) == []


def _no_grad_worker(rank: int, world: int, recipe: str, mode: str) -> dict[str, Any]:
    model = toy()
    apply(model, toy_plan(recipe, world), mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    ids = torch.arange(8).reshape(2, 4)
    with torch.no_grad():
        inference = model(ids)  # nothing requires grad: the declaration holds
    try:
        model(ids).sum().backward()
    except PlanMismatchError as exc:
        return {"error": str(exc), "inference_shape": list(inference.shape)}
    return {"error": None, "inference_shape": list(inference.shape)}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_no_grad_input_that_requires_grad_is_refused_not_silently_wrong(
        tmp_path: Path, mode: str) -> None:
    for r in run_ranks(_no_grad_worker, 2, _no_grad_recipe(tmp_path), mode):
        assert r["inference_shape"] == [2, 4, 32]
        assert r["error"] is not None and r["error"].startswith(
            "layers.0.mlp: input 'x' is declared no_grad, but it requires grad")
