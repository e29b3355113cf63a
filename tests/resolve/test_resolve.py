"""Resolving recipes into plans: golden plans, determinism, round trips, refinement, ties."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hyperrecipe import load_plan
from tests.support.recipe_text import resolve_only as compile_recipe
from hyperrecipe.collective import CollectiveOp
from hyperrecipe.model_tree import snapshot
from hyperrecipe.placement import Replicate, Shard
from hyperrecipe.plan import Plan
from hyperrecipe.recipe import load_recipe
from tests.support.toy_models import Toy

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden"
REGEN = os.environ.get("HYPERRECIPE_REGEN_GOLDEN") == "1"


def toy(**kw: object) -> Toy:
    with torch.device("meta"):
        return Toy(**kw)  # type: ignore[arg-type]


def check_golden(name: str, plan: Plan) -> None:
    path = GOLDEN / name
    if REGEN:
        path.write_text(plan.to_json())
    assert path.exists(), f"golden {path} missing; run with HYPERRECIPE_REGEN_GOLDEN=1"
    assert plan.to_json() == path.read_text(), f"plan differs from golden {name}"


@pytest.mark.parametrize(("recipe", "mesh", "golden"), [
    ("tests/recipes/toy.yaml", {"dp": 1, "tp": 2}, "toy-tp2.json"),
    ("tests/recipes/toy-sp.yaml", {"dp": 2, "tp": 4}, "toy-sp-dp2-tp4.json"),
])
def test_golden_plans_for_small_models(in_root: Path, recipe: str, mesh: dict[str, int],
                                       golden: str) -> None:
    check_golden(golden, compile_recipe(recipe, toy(), mesh))


def test_llama_recipe_compiles_to_its_golden_plan(in_root: Path, tiny_llama_tree: object) -> None:
    plan = compile_recipe("recipes/llama.yaml", tiny_llama_tree, {"tp": 2})  # type: ignore[arg-type]
    check_golden("llama-tp2.json", plan)


def test_declared_gradient_layouts_compile_to_their_golden_plan(in_root: Path,
                                                               tiny_llama_tree: object) -> None:
    """``in_grad`` is recorded on the input's layout (``grad``), changes the gather's backward
    to a slice, and round-trips; plans without it carry no ``grad`` key at all."""
    plan = compile_recipe("tests/recipes/llama-sp-replicated-mlp.yaml", tiny_llama_tree,  # type: ignore[arg-type]
                          {"tp": 2})
    check_golden("llama-sp-replicated-mlp-tp2.json", plan)
    assert Plan.from_json(plan.to_json()) == plan
    (x,) = plan.boundary("model.layers.1.mlp").inputs
    assert x.grad is not None and x.grad.is_replicate
    assert '"grad"' not in (GOLDEN / "llama-tp2.json").read_text()


def test_out_grad_partial_all_reduces_a_replicated_output_in_backward(tmp_path: Path) -> None:
    r = tmp_path / "r.yaml"
    r.write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules:\n  - match: layers.*.mlp.down\n"
                 "    style: rowwise\n    out_grad: {0: {tp: partial}}\n")
    plan = compile_recipe(r, toy(), {"tp": 2})
    [t] = plan.boundary("layers.0.mlp.down").transitions
    assert (t.stage, t.forward, t.backward) == (
        "output", CollectiveOp(kind="all_reduce", mesh_dim="tp"),
        CollectiveOp(kind="all_reduce", mesh_dim="tp"))
    assert t.reason.startswith("declared out_grad")
    backward = [e for e in plan.manifest if e.boundary == "layers.0.mlp.down"
                and e.direction == "backward"]
    assert [e.op.kind for e in backward] == ["all_reduce"]
    # on a mesh dim of size 1 nothing communicates either way
    assert compile_recipe(r, toy(), {"tp": 1}).boundary("layers.0.mlp.down").transitions == ()


def test_yaml_and_toml_spellings_give_the_same_decisions(in_root: Path) -> None:
    a = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2})
    b = compile_recipe("tests/recipes/toy.toml", toy(), {"tp": 2})
    assert a.params == tuple(p for p in b.params) or [
        (p.fqn, p.placement) for p in a.params] == [(p.fqn, p.placement) for p in b.params]
    assert [(p.fqn, p.placement, p.local_shape) for p in a.params] == \
        [(p.fqn, p.placement, p.local_shape) for p in b.params]
    assert a.manifest == b.manifest
    assert a.recipe_digest == b.recipe_digest, "same content in either format hashes the same"


def test_compiling_twice_gives_identical_bytes(in_root: Path) -> None:
    a = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2}).to_json()
    b = compile_recipe(load_recipe("tests/recipes/toy.yaml"), snapshot(toy()), {"tp": 2}).to_json()
    assert a == b


def test_plan_round_trips_through_json_and_files(in_root: Path, tmp_path: Path) -> None:
    plan = compile_recipe("tests/recipes/toy-sp.yaml", toy(), {"dp": 2, "tp": 2})
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded == plan
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_fingerprint_changes_with_recipe_model_and_mesh(in_root: Path) -> None:
    base = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2}).fingerprint
    assert compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 4}).fingerprint != base
    assert compile_recipe("tests/recipes/toy.yaml", toy(layers=3), {"tp": 2}).fingerprint != base
    assert compile_recipe("tests/recipes/toy-sp.yaml", toy(), {"tp": 2}).fingerprint != base


def test_edited_plan_is_rejected_by_its_fingerprint(in_root: Path, tmp_path: Path) -> None:
    from hyperrecipe.errors import PlanFormatError

    plan = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2})
    import attrs

    from hyperrecipe.plan import MeshDim

    # a consistent-looking plan (checksum re-sealed) for another mesh than it was compiled for
    moved = attrs.evolve(plan, mesh=(MeshDim(name="tp", size=4),)).sealed()
    with pytest.raises(PlanFormatError, match="fingerprint .* does not match"):
        Plan.from_json(moved.to_json())
    with pytest.raises(PlanFormatError) as err:
        Plan.from_json(plan.to_json().replace('"recipe": "toy"', '"recipe": "toy", "extra": 1'))
    assert "extra fields found" in str(err.value)


def test_megatron_lowering_one_backward_all_reduce_per_block(in_root: Path) -> None:
    plan = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2})
    block = plan.boundary("layers.0.mlp")
    [t] = block.transitions
    assert (t.stage, t.name, t.forward.kind, t.backward) == (
        "input", "x", "identity", CollectiveOp(kind="all_reduce", mesh_dim="tp"))
    down = plan.boundary("layers.0.mlp.down")
    assert [(t.stage, t.forward.kind, t.backward.kind) for t in down.transitions] == [
        ("output", "all_reduce", "identity")]
    assert down.defer_bias == ("bias",) and plan.param("layers.0.mlp.down.bias").deferred
    assert plan.param("layers.0.mlp.down.bias").grad_reduce == (), "replicated output: full data"
    head = plan.boundary("head")
    kinds = sorted((t.stage, t.forward.kind, t.backward.kind) for t in head.transitions)
    assert kinds == [("input", "identity", "all_reduce"), ("output", "all_gather", "local_slice")]
    # token ids carry no gradient: the embedding's input has no backward collective
    assert [(t.stage, t.backward.kind) for t in plan.boundary("embed").transitions] == [
        ("output", "identity")]


def test_sequence_parallel_lowers_gathers_and_reduce_scatters(in_root: Path) -> None:
    plan = compile_recipe("tests/recipes/toy-sp.yaml", toy(), {"dp": 1, "tp": 2})
    ops = {(t.boundary, t.stage): (t.forward.kind, t.backward.kind)
           for b in plan.boundaries for t in b.transitions}
    assert ops[("embed", "output")] == ("reduce_scatter", "all_gather")
    assert ops[("layers.0.mlp", "input")] == ("all_gather", "reduce_scatter")
    assert ops[("layers.0.mlp.down", "output")] == ("reduce_scatter", "all_gather")
    assert ops[("head", "input")] == ("all_gather", "reduce_scatter")
    assert ("layers.0.mlp", "output") not in ops


def test_sequence_parallel_norm_weights_get_their_gradients_all_reduced(in_root: Path) -> None:
    plan = compile_recipe("tests/recipes/toy-sp.yaml", toy(), {"dp": 1, "tp": 2})
    norm = plan.param("layers.0.norm.weight")
    assert norm.placement.is_replicate
    assert norm.grad_reduce == (CollectiveOp(kind="all_reduce", mesh_dim="tp"),)
    # the deferred bias is added to a sequence-sharded output: each rank sees its tokens only
    assert plan.param("layers.0.mlp.down.bias").grad_reduce == (
        CollectiveOp(kind="all_reduce", mesh_dim="tp"),)
    # the six reductions run as one bucket: one manifest entry (tests/runtime/grads/test_grad_buckets.py)
    assert sum(len(b.params) for b in plan.grad_buckets) == 6
    assert [e.name for e in plan.manifest if e.stage == "param_grad"] == ["grad_buckets[0]"]
    # the refining rule overrode the base rule, and explain shows both
    assert "overridden by rule 1 of tests/recipes/toy-sp.yaml" in norm.provenance[0].reason
    assert norm.provenance[-1].file == "tests/recipes/toy-sp.yaml"


def test_head_counts_are_divided_per_module(in_root: Path) -> None:
    plan = compile_recipe("tests/recipes/toy.yaml", toy(heads=8), {"tp": 4})
    assert [(h.module, h.attr, h.global_value, h.local_value) for h in plan.head_counts] == [
        ("layers.0.mlp", "num_heads", 8, 2), ("layers.1.mlp", "num_heads", 8, 2)]


def test_size_one_mesh_dims_lower_to_nothing(in_root: Path) -> None:
    plan = compile_recipe("tests/recipes/toy.yaml", toy(), {"dp": 2, "tp": 1})
    assert plan.manifest == ()
    assert all(p.local_shape == p.shape for p in plan.params)


def test_tied_embeddings_stay_tied_with_one_placement(in_root: Path, tmp_path: Path) -> None:
    plan = compile_recipe("tests/recipes/toy.yaml", toy(tie=True), {"tp": 2})
    head = plan.param("head.weight")
    assert head.tied_to == "embed.weight"
    assert head.placement == plan.param("embed.weight").placement
    assert head.local_shape == (16, 8)


def test_tied_weight_claimed_through_one_alias_is_placed_for_both(tmp_path: Path) -> None:
    r = tmp_path / "r.yaml"
    r.write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules:\n  - match: head\n"
                 "    params: {weight: {tp: shard(0)}}\n")
    plan = compile_recipe(r, toy(tie=True), {"tp": 2})
    assert plan.param("embed.weight").placement.get("tp") == Shard(dim=0)
    assert "through head.weight (tied to embed.weight)" in plan.param("embed.weight").provenance[-1].reason


def test_chunked_shard_checks_each_part_and_keeps_local_shape(tmp_path: Path) -> None:
    r = tmp_path / "r.yaml"
    r.write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules:\n  - match: layers.*.mlp.up\n"
                 "    params: {weight: {tp: 'shard(0, chunks=[8, 4, 4])'}}\n")
    plan = compile_recipe(r, toy(), {"tp": 2})
    assert plan.param("layers.0.mlp.up.weight").local_shape == (8, 8)
    from hyperrecipe.errors import RecipeError

    with pytest.raises(RecipeError, match=r"chunk of size 4 of dim 0 \(size 16\) is not divisible by "
                                          r"mesh dim tp=8"):
        compile_recipe(r, toy(), {"tp": 8})


def test_when_conditions_skip_rules_on_small_meshes(tmp_path: Path) -> None:
    r = tmp_path / "r.yaml"
    r.write_text("recipe: r\nversion: 1\nmesh: [tp, cp]\nrules:\n"
                 "  - match: nothing.matches.this\n    when: {cp: '>1'}\n    style: replicate\n"
                 "  - match: head\n    style: colwise\n")
    plan = compile_recipe(r, toy(), {"tp": 2})
    assert [(ref.index, ref.active, ref.matched) for ref in plan.rules] == [(0, False, 0), (1, True, 1)]


def test_unclaimed_parameters_are_replicated_with_provenance(in_root: Path) -> None:
    plan = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2})
    assert plan.param("layers.0.norm.weight").placement.get("tp") == Replicate()
    p = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2})
    assert p.param("layers.0.mlp.down.bias").provenance[-1].rule_index == 3
    assert p.param("layers.0.norm.weight").grad_reduce == (), "replicated input: full data"


@pytest.mark.slow  # starts fresh interpreters (docs/benchmarks.md#test-suite)
def test_plan_bytes_do_not_depend_on_the_hash_seed(in_root: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"plan{seed}.json"
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(in_root)}
        subprocess.run([sys.executable, "-m", "hyperrecipe", "compile", "tests/recipes/toy-sp.yaml",
                        "--model", "tests.support.toy_models:make_toy", "--mesh", "dp=2,tp=2", "-o",
                        str(out)], check=True, env=env, capture_output=True)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_reduce_grads_declares_partial_gradients_of_replicated_parameters(tmp_path: Path) -> None:
    from hyperrecipe.errors import RecipeError

    r = tmp_path / "r.yaml"
    r.write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules:\n  - match: layers.*.norm\n"
                 "    reduce_grads: {weight: tp}\n")
    plan = compile_recipe(r, toy(), {"tp": 2})
    assert plan.param("layers.0.norm.weight").grad_reduce == (
        CollectiveOp(kind="all_reduce", mesh_dim="tp"),)
    assert plan.param("layers.0.norm.bias").grad_reduce == ()
    r.write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules:\n  - match: layers.*.mlp.up\n"
                 "    style: colwise\n    reduce_grads: {weight: tp}\n")
    with pytest.raises(RecipeError, match=r"reduce_grads: parameter 'layers.0.mlp.up.weight' is "
                                          r"placed \{tp: shard\(0\)\}; only a replicated"):
        compile_recipe(r, toy(), {"tp": 2})


def test_hand_edited_decision_is_caught_by_the_checksum(in_root: Path) -> None:
    from hyperrecipe.errors import PlanFormatError

    text = compile_recipe("tests/recipes/toy.yaml", toy(), {"tp": 2}).to_json()
    edited = text.replace('"placement": "{tp: shard(1)}"', '"placement": "{tp: shard(0)}"', 1)
    assert edited != text
    with pytest.raises(PlanFormatError, match="checksum does not match the plan's content"):
        Plan.from_json(edited)
