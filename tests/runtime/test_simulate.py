"""The dry run (:mod:`hyperrecipe.simulate`): apply under a fake process group on meta.

Its per-rank parameter bytes must be exactly what a real gloo run of the same plan holds, and its
collectives exactly what the plan's manifest lists for one step.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from hyperrecipe import compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.cli import main
from hyperrecipe.errors import UsageError
from hyperrecipe.simulate import ADAMW_STATE_BYTES, simulate
from tests.support.runtime_harness import ROOT, llama, mesh_1d

RECIPE = str(ROOT / "recipes/llama.yaml")


def _held_bytes(rank: int, world: int, recipe: str) -> dict[str, int]:
    """What a real rank holds after apply on gloo: its parameters' and buffers' bytes."""
    from hyperrecipe import apply

    model = llama()
    plan = compile_recipe(recipe, llama("meta"), {"tp": world})
    apply(model, plan, mesh_1d(world))
    return {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}


def test_dry_run_parameter_bytes_equal_a_real_gloo_run_at_tp2() -> None:
    held = run_ranks(_held_bytes, 2, RECIPE, timeout_s=300)
    model = llama("meta")
    sim = simulate(model, compile_recipe(RECIPE, model, {"tp": 2}))
    assert [r.rank for r in sim.ranks] == [0, 1]
    for row, real in zip(sim.ranks, held, strict=True):
        assert row.parameters == real["parameters"]
        assert row.buffers == real["buffers"]
        assert row.gradients == row.parameters  # every parameter trains, fp32
        assert row.optimizer == row.parameters // 4 * ADAMW_STATE_BYTES
    full = sum(p.numel() * p.element_size() for p in llama("meta").parameters())
    assert sim.ranks[0].parameters < full  # it is sharded, not the whole model
    assert all(p.device.type == "meta" for p in model.parameters()), "the model is left as it was"


def test_dry_run_collectives_are_the_manifests() -> None:
    model = llama("meta")
    plan = compile_recipe(RECIPE, model, {"tp": 2})
    sim = simulate(model, plan, ranks=[1])
    expected = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest
                       if e.op.communicates)
    assert {(c.kind, c.mesh_dim, c.direction): c.count for c in sim.collectives} == expected
    assert [r.rank for r in sim.ranks] == [1]


def test_dry_run_refuses_a_process_that_already_has_a_process_group() -> None:
    import torch.distributed as dist

    model = llama("meta")
    plan = compile_recipe(RECIPE, model, {"tp": 2})
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with pytest.raises(UsageError, match="already has one"):
            simulate(model, plan)
    finally:
        dist.destroy_process_group()


def test_dry_run_refuses_a_model_that_is_not_on_meta() -> None:
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": 2})
    with pytest.raises(UsageError, match="needs the model built on the meta device"):
        simulate(llama(), plan)


def test_simulate_command_prints_json_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "llama", "--model", "hf:llama", "--model-config",
                 str(ROOT / "recipes/models/tiny-llama.json"), "--mesh", "tp=2", "--format",
                 "json"])
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["mesh"] == {"tp": 2} and [r["rank"] for r in out["ranks"]] == [0, 1]
    assert out["ranks"][0]["total_bytes"] == sum(
        out["ranks"][0][k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes",
                                     "buffer_bytes"))


LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
             "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def test_dry_run_of_a_70b_llama_at_tp8_holds_an_eighth_of_every_sharded_weight() -> None:
    from hyperrecipe.model_tree import build_model

    model = build_model("hf:llama", LLAMA_70B)
    sim = simulate(model, compile_recipe(RECIPE, model, {"tp": 8}), ranks=[5])
    h, i, kv, v, layers = 8192, 28672, 8 * 128, 128256, 80
    per_layer = (2 * h * h + 2 * kv * h + 3 * i * h) // 8 + 2 * h  # norms replicated
    elements = layers * per_layer + 2 * v * h // 8 + h
    (row,) = sim.ranks
    assert (row.rank, row.coords) == (5, (("tp", 5),))
    assert row.parameters == elements * 2  # bf16
    assert row.optimizer == elements * ADAMW_STATE_BYTES


def test_dry_run_of_every_rank_of_a_2d_mesh_with_inner_wrappers() -> None:
    """Context parallel hooks attention process-wide; each rank's copy is restored before the
    next rank's apply, which would otherwise find attention already hooked."""
    model = llama("meta")
    plan = compile_recipe(str(ROOT / "recipes/llama-tp-cp.yaml"), model, {"cp": 2, "tp": 2})
    sim = simulate(model, plan)
    assert [dict(r.coords) for r in sim.ranks] == [
        {"tp": 0, "cp": 0}, {"tp": 0, "cp": 1}, {"tp": 1, "cp": 0}, {"tp": 1, "cp": 1}]
    assert len({r.parameters for r in sim.ranks}) == 1
