"""Shipped recipes for Qwen2, Qwen3, Mistral, Mixtral, GPT-2 and Phi-3 on real gloo ranks, against
one process: logits and every parameter's gradient, both modes, 2 and 4 ranks.

Tolerances (fp32): every element within atol 2e-6, rtol 1e-5 (``runtime_harness.assert_close``),
and every tensor's largest difference within 1e-5 of its largest value. The second check is what
catches a missing reduction on a small gradient (the norms' are ~1e-4, below what atol alone
resolves); measured worst cases are ~3e-7 on logits and ~2e-6 relative on gradients (the
Mixtral router's).

Validate mode runs transformers' default ``sdpa`` attention (on the CPU kernel's DTensor rule that
validate mode registers, :mod:`hyperrecipe.runtime.comm.dtensor_rules`) and, for Mixtral,
transformers' ``batched_mm`` experts: the default ``grouped_mm`` has no fp32 DTensor
strategy and the ``eager`` loop calls ``nonzero``, which DTensor cannot shard. Production runs
all three expert implementations on local shards. The batch is 4 x 8 so that DTensor's own
choice of sharding the flattened tokens in Mixtral's backward divides at tp=4.

GPT-2's fused ``c_attn`` is ``shard(1, chunks=3)``: in validate mode a ``_StridedShard`` DTensor
whose ``split`` into q, k and v is done on chunk boundaries (:mod:`hyperrecipe.runtime.comm.strided`).
Phi-3's fused ``qkv_proj`` (``shard(0, chunks=3)``) and ``gate_up_proj`` (``chunks=2``) are
sliced and chunked the same way; its production mode divides ``config.num_attention_heads``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.cli import main
from tests.support.family_harness import (
    FAMILIES,
    TIED_BY_DEFAULT,
    batch,
    build,
    family_worker,
    recipe_path,
    reference,
)
from tests.support.runtime_harness import ROOT, assert_close, mesh_1d

SCALED_TOL = 1e-5
DEFAULTS: dict[str, Any] = {}
VALIDATE_MIXTRAL = {"experts_implementation": "batched_mm"}

CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    ("qwen2", "production", 2, {}),
    ("qwen2", "validate", 2, DEFAULTS),
    ("qwen2", "production", 2, {"tie_word_embeddings": True}),
    ("qwen2", "production", 4, {}),
    ("qwen2", "validate", 4, DEFAULTS),
    ("qwen3", "production", 2, {}),
    ("qwen3", "validate", 2, DEFAULTS),
    ("qwen3", "production", 4, {}),
    ("qwen3", "validate", 4, DEFAULTS),
    ("mistral", "production", 2, {}),
    ("mistral", "validate", 2, DEFAULTS),
    ("mistral", "production", 4, {}),
    ("mistral", "validate", 4, DEFAULTS),
    ("mixtral", "production", 2, {}),  # grouped_mm experts (transformers' default)
    ("mixtral", "production", 2, {"experts_implementation": "eager"}),
    ("mixtral", "production", 2, {"experts_implementation": "batched_mm"}),
    ("mixtral", "validate", 2, VALIDATE_MIXTRAL),
    ("mixtral", "production", 4, {}),
    ("mixtral", "validate", 4, VALIDATE_MIXTRAL),
    ("gpt2", "production", 2, {}),
    ("gpt2", "validate", 2, DEFAULTS),
    ("gpt2", "production", 4, {}),
    ("gpt2", "validate", 4, DEFAULTS),
    ("phi3", "production", 2, {}),
    ("phi3", "validate", 2, DEFAULTS),
    ("phi3", "production", 4, {}),
    ("phi3", "validate", 4, DEFAULTS),
]


def _case_id(family: str, mode: str, world: int, overrides: dict[str, Any]) -> str:
    extra = "-tied" if overrides.get("tie_word_embeddings") else ""
    if "experts_implementation" in overrides:
        extra += f"-{overrides['experts_implementation']}"
    return f"{family}-{mode}-tp{world}{extra}"


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_close(actual, expected, what)
    worst = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert worst <= SCALED_TOL * scale, f"{what}: max diff {worst:.3e} > {SCALED_TOL} x {scale:.3e}"


def _slow(family: str, mode: str, world: int, overrides: dict[str, Any]) -> bool:
    """The quick tier runs each family's recipe in production mode at 2 ranks with transformers'
    defaults; four ranks, validate mode (run for Llama in test_runtime_llama and for Mixtral's
    experts in test_check), tied heads and other experts implementations are the full suite's
    (docs/benchmarks.md#test-suite)."""
    del family
    return (world > 2 or mode == "validate" or bool(overrides.get("tie_word_embeddings"))
            or "experts_implementation" in overrides)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("family", "mode", "world", "overrides"), [
    pytest.param(*c, id=_case_id(*c), marks=[pytest.mark.slow] if _slow(*c) else [])
    for c in CASES])
def test_recipe_matches_single_process_logits_and_every_gradient(
        family: str, mode: str, world: int, overrides: dict[str, Any]) -> None:
    ref_logits, ref_grads, initial = reference(family, **overrides)
    results = run_ranks(family_worker, world, family, mode, overrides, timeout_s=300)
    for rank, res in enumerate(results):
        assert_matches(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads), "every parameter has a full gradient"
        for name, g in ref_grads.items():
            assert_matches(res["grads"][name], g, f"rank {rank} grad {name}")
        assert set(res["restored"]) == set(initial)
        for name, p in initial.items():
            assert torch.equal(res["restored"][name], p), f"rank {rank}: restore() of {name}"
        if family in TIED_BY_DEFAULT or overrides.get("tie_word_embeddings"):
            assert res["tied"] is True, "the tied embedding and head stay one parameter"
            assert res["tied_after_restore"] is True, "and are one again after restore()"
    if mode == "production":
        assert results[0]["counted"] == results[0]["expected"], \
            "collectives issued in one step equal the plan's manifest"


def test_gpt2_ties_its_head_to_the_embedding_by_default() -> None:
    model = build("gpt2", "meta")
    emb, head = TIED_BY_DEFAULT["gpt2"]
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params[emb] is params[head]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_mixtral_router_aux_loss_added_by_the_user_counts_once_like_one_process() -> None:
    """The load-balancing loss is computed from replicated router logits, so its gradient is
    whole on every rank, while the recipe's reductions (the router's reduce_grads, the MoE
    input's all-reduce) sum it over tp: production mode gives the loss function's result 1/tp
    of its gradient (its value unchanged), so ``outputs.aux_loss`` added to a loss of one's own
    trains as in one process (before: counted tp times, the gate's gradient over 10 % off)."""
    _, ref_grads, _ = reference("mixtral", aux_loss=True)
    res = run_ranks(family_worker, 2, "mixtral", "production", {}, 1, timeout_s=300)[0]
    for n, g in ref_grads.items():
        assert_matches(res["grads"][n], g, f"grad {n}")


def _router_loss_step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch()
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out.loss.detach(), out.aux_loss.detach()


def _router_loss_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = build("mixtral")
    if mode == "validate":  # DTensor runs aten._grouped_mm in bf16 only (a named refusal)
        model.set_experts_implementation("batched_mm")  # type: ignore[operator]
    plan = compile_recipe(recipe_path("mixtral"), build("mixtral", "meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    loss, aux = _router_loss_step(model)
    return {"loss": loss, "aux": aux, "grads": inst.full_grads()}


def _two_models_worker(rank: int, world: int) -> dict[str, Any]:
    plan = compile_recipe(recipe_path("mixtral"), build("mixtral", "meta"), {"tp": world})
    first, second = build("mixtral"), build("mixtral")
    kept = apply(first, plan, mesh_1d(world))
    inst = apply(second, plan, mesh_1d(world))  # shares the router loss's replacement
    kept.restore()  # the second keeps it
    loss, aux = _router_loss_step(second)
    return {"loss": loss, "aux": aux, "grads": inst.full_grads()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_two_mixtrals_applied_with_one_plan_share_the_router_loss_scaling() -> None:
    model = build("mixtral")
    ref_loss, ref_aux = _router_loss_step(model)
    for rank, res in enumerate(run_ranks(_two_models_worker, 2, timeout_s=300)):
        assert_matches(res["aux"], ref_aux, f"rank {rank} router loss")
        for n, p in model.named_parameters():
            assert_matches(res["grads"][n], p.grad, f"rank {rank} grad {n}")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_mixtral_own_loss_with_the_router_loss_trains_like_one_process(mode: str) -> None:
    """``labels=`` with ``output_router_logits=True`` (transformers adds
    ``router_aux_loss_coef * aux_loss`` to the model's loss): loss, router loss and every
    gradient as in one process (before: production 6 of 21 gradients off at tp=2, nothing
    refused; validate mode failed inside the loss function, mixing DTensor and plain tensors)."""
    model = build("mixtral")
    ref_loss, ref_aux = _router_loss_step(model)
    for rank, res in enumerate(run_ranks(_router_loss_worker, 2, mode, timeout_s=300)):
        assert_matches(res["loss"], ref_loss, f"rank {rank} loss")
        assert_matches(res["aux"], ref_aux, f"rank {rank} router loss")
        for n, p in model.named_parameters():
            assert_matches(res["grads"][n], p.grad, f"rank {rank} grad {n}")


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_cli_resolves_each_shipped_recipe(family: str, in_root: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = f"recipes/models/tiny-{family}.json"
    assert main(["compile", f"recipes/{family}.yaml", "--model", f"hf:{family}",
                 "--model-config", cfg, "--mesh", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"plan '{family}' for mesh tp=2  fingerprint ")
    assert "collectives per step: " in out


@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_qwen2_and_mistral_are_llama_and_qwen3_adds_only_the_norm_reductions(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def collectives(family: str) -> str:
        main(["compile", recipe_path(family), "--model", f"hf:{family}", "--model-config",
              f"recipes/models/tiny-{family}.json", "--mesh", "tp=2"])
        return next(line for line in capsys.readouterr().out.splitlines()
                    if line.startswith("collectives per step"))

    assert collectives("qwen2") == collectives("mistral") == \
        "collectives per step: 6 forward, 5 backward (all_gather x1, all_reduce x10)"
    # the q_norm and k_norm weights' gradients (two layers) all-reduced in one bucket
    assert collectives("qwen3") == \
        "collectives per step: 6 forward, 6 backward (all_gather x1, all_reduce x11)"


def _validate_chunked_toy(rank: int, world: int, recipe: str) -> str:
    from hyperrecipe.errors import PlanMismatchError
    from hyperrecipe.runtime import apply
    from tests.support.recipe_text import resolve_only
    from tests.support.runtime_harness import mesh_1d
    from tests.support.toy_models import make_toy

    plan = resolve_only(recipe, make_toy(), {"tp": world})  # the runtime's own refusal
    try:
        apply(make_toy(), plan, mesh_1d(world), mode="validate")
    except PlanMismatchError as exc:
        return str(exc)
    return "applied"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_validate_mode_refuses_unequal_chunks_of_input_features(tmp_path: Path) -> None:
    recipe = tmp_path / "chunks.yaml"
    recipe.write_text(
        "recipe: chunks\nversion: 1\nmesh: [tp]\nrules:\n"
        "  - {match: layers.*.mlp, boundary: true, in_src: {x: replicate}, "
        "out_src: {0: replicate}}\n"
        "  - match: layers.*.mlp.down\n"
        "    params: {weight: {tp: 'shard(1, chunks=[8, 4, 4])'}}\n")
    messages = run_ranks(_validate_chunked_toy, 2, str(recipe), timeout_s=120)
    assert messages[0] == (
        "layers.0.mlp.down.weight: {tp: shard(1, chunks=[8, 4, 4])} has no DTensor placement "
        "(unequal chunks, and not of an nn.Linear's output features); validate mode cannot run "
        f"it (production mode can) (placed at {recipe}:7)")


def test_the_plan_records_which_shards_have_a_dtensor_placement(tmp_path: Path) -> None:
    from hyperrecipe import compile_recipe
    from tests.support.toy_models import make_toy

    recipe = tmp_path / "chunks.yaml"
    recipe.write_text(
        "recipe: chunks\nversion: 1\nmesh: [tp]\nrules:\n"
        "  - {match: layers.*.mlp, boundary: true, in_src: {x: replicate}, "
        "out_src: {0: replicate}}\n"
        "  - match: layers.*.mlp.up\n"
        "    params: {weight: {tp: 'shard(0, chunks=[8, 4, 4])'}}\n"
        "  - match: layers.*.mlp.down\n"
        "    params: {weight: {tp: 'shard(1, chunks=2)'}}\n"
        "  - match: head\n"
        "    params: {weight: {tp: 'shard(1, chunks=[4, 2, 2])'}}\n")
    plan = compile_recipe(str(recipe), make_toy(), {"tp": 2}, verify=False)  # the resolver's
    up, down = plan.param("layers.0.mlp.up.weight"), plan.param("layers.0.mlp.down.weight")
    assert (up.dtensor, up.no_dtensor, up.boundary) == (
        ("chunk_parts(0, [8, 4, 4])",), None, "layers.0.mlp")
    assert (down.dtensor, down.no_dtensor) == (("strided_shard(1, 2)",), None)
    assert plan.param("layers.0.mlp.up.bias").dtensor == ("replicate",)
    head = plan.param("head.weight")
    assert (head.dtensor, head.no_dtensor) == (
        (), "unequal chunks, and not of an nn.Linear's output features")


def test_conv1d_bias_free_forward_is_x_at_w() -> None:
    from transformers.pytorch_utils import Conv1D

    from hyperrecipe.runtime.forward.compute import bias_free_forward, class_forward

    torch.manual_seed(0)
    conv = Conv1D(6, 4)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 3, 4)
    out = bias_free_forward(conv, class_forward(conv))(x)
    torch.testing.assert_close(out + conv.bias, conv(x), atol=1e-6, rtol=1e-6)
    assert conv._parameters["bias"] is not None


def test_recipe_files_are_shipped_with_their_tiny_configs() -> None:
    for family in FAMILIES:
        assert (ROOT / f"recipes/{family}.yaml").read_text().startswith("# ")
        assert (ROOT / f"recipes/models/tiny-{family}.json").is_file()


def _phi3_configs(rank: int, world: int) -> dict[str, Any]:
    model = build("phi3")
    plan = compile_recipe(recipe_path("phi3"), build("phi3", "meta"), {"tp": world})
    attn = model.model.layers[0].self_attn
    shared = model.config
    inst = apply(model, plan, mesh_1d(world), mode="production")
    applied = {"own": attn.config is not shared, "heads": attn.config.num_attention_heads,
               "shared_heads": shared.num_attention_heads,
               "one_copy_per_module": attn.config is not model.model.layers[1].self_attn.config,
               "kv": attn.num_key_value_heads}
    inst.restore()
    return {**applied, "restored": attn.config is shared and shared.num_attention_heads == 4}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_phi3_attention_divides_heads_on_its_own_copy_of_the_config() -> None:
    for res in run_ranks(_phi3_configs, 2, timeout_s=120):
        assert res == {"own": True, "heads": 2, "shared_heads": 4, "one_copy_per_module": True,
                       "kv": 2, "restored": True}


def test_a_config_head_count_must_be_an_integer_field_of_the_modules_config(
        tmp_path: Path) -> None:
    from hyperrecipe.errors import RecipeError

    recipe = tmp_path / "phi3.yaml"
    recipe.write_text((ROOT / "recipes/phi3.yaml").read_text().replace(
        "config.num_attention_heads: tp", "config.num_attention_head: tp"))
    with pytest.raises(RecipeError) as info:
        compile_recipe(str(recipe), build("phi3", "meta"), {"tp": 2})
    line = next(i for i, text in enumerate(recipe.read_text().splitlines(), 1)
                if "config.num_attention_head:" in text)
    assert str(info.value).startswith(
        f"{recipe}:{line}:19: module 'model.layers.0.self_attn' has no integer attribute "
        f"'config.num_attention_head'; did you mean 'config.num_attention_heads'?")
