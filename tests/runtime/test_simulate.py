"""The dry run (:mod:`hyperrecipe.simulate`): apply under a fake process group on meta.

Its per-rank parameter bytes must be exactly what a real gloo run of the same plan holds, and its
collectives exactly what the plan's manifest lists for one step. A traced step (``seq_len``)
must measure exactly what the same trace measures on real gloo ranks (the tiny Llama's shapes
do not depend on values): each boundary's output bytes, and each collective's count and bytes,
inner wrappers' included.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import attrs
import pytest
import torch

from hyperrecipe import compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.cli import main
from hyperrecipe.errors import UsageError
from hyperrecipe.simulate import ADAMW_STATE_BYTES, simulate, trace_step
from tests.support.runtime_harness import ROOT, TINY_LLAMA, llama, mesh_1d

RECIPE = str(ROOT / "recipes/llama.yaml")


def _held_bytes(rank: int, world: int, recipe: str) -> dict[str, int]:
    """What a real rank holds after apply on gloo: its parameters' and buffers' bytes."""
    from hyperrecipe import apply

    model = llama()
    plan = compile_recipe(recipe, llama("meta"), {"tp": world})
    apply(model, plan, mesh_1d(world))
    return {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
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


@pytest.mark.slow  # a 70B Llama on meta (~13 s; tools/bench_simulate covers it too)
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


SEQ = 16


def test_traced_step_collectives_are_the_manifests_sized_by_the_layouts() -> None:
    """llama.yaml at tp=2: every collective of the traced step is one the manifest lists,
    as many times; each all-reduce moves one replicated hidden state, the gather the logits."""
    model = llama("meta")
    plan = compile_recipe(RECIPE, model, {"tp": 2})
    sim = simulate(model, plan, seq_len=SEQ)
    manifest = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest
                       if e.op.communicates)
    hidden, vocab = TINY_LLAMA["hidden_size"], TINY_LLAMA["vocab_size"]
    for row in sim.ranks:
        assert row.step is not None and row.step.seq_len == SEQ
        measured = {(c.kind, c.mesh_dim, c.direction): c for c in row.step.collectives}
        assert {k: c.count for k, c in measured.items()} == manifest
        assert all(c.in_manifest == c.count for c in measured.values())
        for direction in ("forward", "backward"):
            reduce = measured[("all_reduce", "tp", direction)]
            assert reduce.bytes == manifest[("all_reduce", "tp", direction)] * SEQ * hidden * 4
        assert measured[("all_gather", "tp", "forward")].bytes == SEQ * vocab * 4  # fp32 logits
        # replicated hidden states: every boundary but the lm_head hands on [1, SEQ, hidden]
        sizes = {a.boundary: a.bytes for a in row.step.activations}
        assert sizes["model.layers.0.mlp"] == SEQ * hidden * 4
        assert row.step.activation_bytes_per_token == row.step.activation_bytes / SEQ


def _traced_step(rank: int, world: int, recipe: str, dim: str) -> dict[str, Any]:
    """The same trace on a real applied model on gloo (CPU tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply

    model = llama()
    plan = compile_recipe(recipe, llama("meta"), {dim: world})
    apply(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=(dim,)))
    return attrs.asdict(trace_step(model, plan, SEQ, torch.device("cpu")))


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("recipe", "dim"), [("llama-sp.yaml", "tp"), ("llama-cp.yaml", "cp")])
def test_traced_dry_run_step_equals_a_real_gloo_step(recipe: str, dim: str) -> None:
    path = str(ROOT / "recipes" / recipe)
    real = run_ranks(_traced_step, 2, path, dim, timeout_s=300)
    model = llama("meta")
    plan = compile_recipe(path, model, {dim: 2})
    sim = simulate(model, plan, seq_len=SEQ)
    for row, measured in zip(sim.ranks, real, strict=True):
        assert row.step is not None
        assert attrs.asdict(row.step) == measured, f"rank {row.rank}"
    step = sim.ranks[0].step
    assert step is not None
    by = {(c.kind, c.direction): c for c in step.collectives}
    hidden = TINY_LLAMA["hidden_size"]
    if dim == "tp":  # sequence parallel: the layers hand on this rank's half of the tokens
        assert {a.boundary: a.bytes for a in step.activations}["model.layers.0"] == \
            SEQ // 2 * hidden * 4
    else:  # context parallel's K/V gathers are the inner wrapper's, not the manifest's
        assert by[("all_gather", "forward")].count > by[("all_gather", "forward")].in_manifest
        assert by[("all_reduce", "backward")].bytes == sim.grad_bucket_bytes


def test_simulate_command_reports_the_traced_step(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "llama-cp", "--model", "hf:llama", "--model-config",
                 str(ROOT / "recipes/models/tiny-llama.json"), "--mesh", "cp=2", "--seq-len",
                 str(SEQ), "--ranks", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "one step of 16 tokens traced" in out and "act/token" in out
    assert "from an inner wrapper, not in the manifest" in out


def test_traced_step_refuses_validate_mode_and_a_bad_length() -> None:
    model = llama("meta")
    plan = compile_recipe(RECIPE, model, {"tp": 2})
    with pytest.raises(UsageError, match="traces production mode only, not 'validate'"):
        simulate(model, plan, seq_len=SEQ, mode="validate")
    with pytest.raises(UsageError, match="seq_len must be a positive number of tokens, not 0"):
        simulate(model, plan, seq_len=0)
