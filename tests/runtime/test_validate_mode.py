"""Validate mode is the executable specification: every recipe field means in it what it means
in production, on the model's own defaults.

The matrix (field x placement x mode): a shipped recipe's field — Qwen3's ``reduce_grads`` on
the per-head q/k norms, Phi-3's ``head_counts`` of its fused attention — with the attention left
a plain boundary or marked ``local_region: true`` (its compute then runs on this rank's local
shards in both modes), each applied in production and in validate mode on two gloo ranks and
compared with one process: the logits and every parameter's gradient, fp32, every element within
atol 2e-6 / rtol 1e-5 and every tensor's largest difference within 1e-5 of its largest value
(the q/k norms' gradients are ~1e-4: a missing reduction is off by ~100%). The models run with
transformers' defaults (``sdpa`` attention), so validate mode runs the CPU SDPA kernel on
hyperrecipe's DTensor rule (:mod:`hyperrecipe.runtime.comm.dtensor_rules`) outside the region.

The other kind of ``reduce_grads`` in a local region — a region computing on whole data whose
output gradients arrive partial in production (DeepSeek-V3's router) — is
``tests/check/test_cookbook.py``'s ``deepseek_v3`` case: validate mode must not reduce it twice.

Before the fix, validate mode dropped ``reduce_grads`` inside a local region (the norms'
gradients off by up to 100% with nothing refused) and kept the head counts global there (Phi-3's
attention sliced its local fused q/k/v at global offsets).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RankFailedError, RecipeError
from tests.support.family_harness import build, recipe_path, reference, step
from tests.support.runtime_harness import ROOT, assert_close, mesh_1d

SCALED_TOL = 1e-5

FIELDS = {"reduce_grads": "qwen3", "head_counts": "phi3"}
"""The field under test and the shipped recipe that declares it on the attention."""


def _recipe(tmp_path: Path, family: str, local_region: bool) -> str:
    if not local_region:
        return recipe_path(family)
    path = tmp_path / f"{family}-local.yaml"
    path.write_text(f"recipe: {family}-local\nversion: 1\nmesh: [tp]\nextends: {family}\n"
                    f"rules:\n  - match: model.layers.*.self_attn\n    local_region: true\n")
    return str(path)


def _worker(rank: int, world: int, family: str, recipe: str, mode: str,
            overrides: dict[str, Any], verify: bool = True) -> dict[str, Any]:
    model = build(family, **overrides)
    plan = compile_recipe(recipe, build(family, "meta", **overrides), {"tp": world},
                          verify=verify)
    inst = apply(model, plan, mesh_1d(world), mode=mode,  # type: ignore[arg-type]
                 verify=verify)
    logits = step(model)
    grads = inst.full_grads()
    inst.restore()
    return {"logits": logits, "grads": grads}


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_close(actual, expected, what)
    worst = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert worst <= SCALED_TOL * scale, f"{what}: max diff {worst:.3e} > {SCALED_TOL} x {scale:.3e}"


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("where", ["boundary", "local_region"])
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_field_means_the_same_in_both_modes_inside_and_outside_a_local_region(
        tmp_path: Path, field: str, where: str, mode: str) -> None:
    family = FIELDS[field]
    ref_logits, ref_grads, _ = reference(family)
    recipe = _recipe(tmp_path, family, where == "local_region")
    for rank, res in enumerate(run_ranks(_worker, 2, family, recipe, mode, {}, timeout_s=300)):
        _assert_matches(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads), "every parameter has a full gradient"
        for name, g in ref_grads.items():
            _assert_matches(res["grads"][name], g, f"rank {rank} grad {name}")


def test_the_cpu_sdpa_rules_are_registered_by_validate_apply_only_and_once() -> None:
    """Importing hyperrecipe and resolving leave DTensor's registry alone (verification runs
    validate mode's apply, which registers them); registering twice keeps the first
    registration (the same strategy object)."""
    code = """
import torch
from torch.distributed.tensor import DTensor
import hyperrecipe
from hyperrecipe.model_tree import build_model
root = __import__("pathlib").Path(__import__("sys").argv[1])
model = build_model("hf:llama", str(root / "recipes/models/tiny-llama.json"), device="meta")
hyperrecipe.compile_recipe(str(root / "recipes/llama.yaml"), model, {"tp": 2}, verify=False)
funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
ops = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default]
print([op in funcs for op in ops])
from hyperrecipe.runtime.comm.dtensor_rules import register_validate_rules
register_validate_rules()
first = [funcs[op] for op in ops]
register_validate_rules()
print([op in funcs for op in ops], [funcs[op] is f for op, f in zip(ops, first)])
"""
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[False, False]", "[True, True] [True, True]"]


def test_an_op_dtensor_cannot_shard_is_refused_naming_the_boundary_and_the_op() -> None:
    """transformers' ``eager`` experts call ``nonzero`` on routing masks: validate mode refuses
    it through ``apply``'s forward with hyperrecipe's error, not DTensor's bare text."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(_worker, 2, "mixtral", recipe_path("mixtral"), "validate",
                  {"experts_implementation": "eager"}, False, timeout_s=300)
    text = str(info.value)
    assert ("ValidateUnsupportedError: model.layers.0.mlp: validate mode cannot run "
            f"aten.nonzero.default here: DTensor (torch {torch.__version__}) cannot shard it: "
            "its output's shape depends on the data") in text
    assert "`local_region: true`" in text and "Production mode needs no DTensor rule" in text


def test_compile_refuses_an_op_validate_mode_cannot_run_naming_what_is_needed() -> None:
    """The same refusal, seen by the verification step at compile, at the experts' rule."""
    model = build("mixtral", "meta", experts_implementation="eager")
    with pytest.raises(RecipeError) as info:
        compile_recipe(recipe_path("mixtral"), model, {"tp": 2})
    text = str(info.value)
    assert "verification (validate mode, one training step on fake tensors) refused" in text
    assert "validate mode cannot run aten.nonzero.default here" in text
    assert "`local_region: true`" in text and info.value.span is not None


def _refusals(rank: int, world: int) -> dict[str, tuple[str, str, str]]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyperrecipe.errors import ValidateShardingError, ValidateUnsupportedError
    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    mask = DTensor.from_local(torch.tensor([True, False, True]), mesh, (Replicate(),))
    a = DTensor.from_local(torch.ones(4, 6), mesh, (Shard(1),))  # global [4, 12]
    b = DTensor.from_local(torch.ones(6, 3), mesh, (Shard(0),))  # global [12, 3]
    wrong = DTensor.from_local(torch.ones(3, 3), mesh, (Shard(0),))  # global [6, 3]
    out: dict[str, tuple[str, str, str]] = {}
    validate_compute(lambda: a @ b, "blk.proj")()  # fits: nothing raised
    for case, compute in (("nonzero", lambda: torch.nonzero(mask)), ("mm", lambda: a @ wrong)):
        try:
            validate_compute(compute, "blk.proj")()
        except (ValidateUnsupportedError, ValidateShardingError) as exc:
            out[case] = (type(exc).__name__, f"{exc.fqn} {exc.op}", str(exc))
    return out


def test_dtensor_refusals_name_the_boundary_and_tell_an_unshardable_op_from_a_shape() -> None:
    """``nonzero`` (an output shape that depends on the data) cannot be sharded at all: refused
    as unsupported (a ``NotImplementedError``; ``check`` reports the mode as unable to run). A
    matmul of shapes that do not fit is the module's mistake: a ``RuntimeError`` that ``check``
    diagnoses as the step's failure. Both name the boundary and the op."""
    from hyperrecipe.errors import ValidateShardingError, ValidateUnsupportedError

    res = run_ranks(_refusals, 2, timeout_s=120)[0]
    kind, where, text = res["nonzero"]
    assert (kind, where) == ("ValidateUnsupportedError", "blk.proj aten.nonzero.default")
    assert text.startswith("blk.proj: validate mode cannot run aten.nonzero.default here")
    kind, where, text = res["mm"]
    assert (kind, where) == ("ValidateShardingError", "blk.proj aten.mm.default")
    assert text.startswith(f"blk.proj: DTensor (torch {torch.__version__}) refused "
                           "aten.mm.default on these inputs in validate mode: ")
    assert issubclass(ValidateUnsupportedError, NotImplementedError)
    assert not issubclass(ValidateShardingError, NotImplementedError)


def _expand_kv(rank: int, world: int, scoped: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    kv_full, rot_full = _kv_inputs()
    kv = DTensor.from_local(kv_full.chunk(world, 1)[rank].clone(), mesh,
                            (Shard(1),)).requires_grad_()
    rot = DTensor.from_local(rot_full, mesh, (Replicate(),)).requires_grad_()

    def expand() -> Any:  # DeepSeek-V2's expand_kv, on head-sharded keys
        keys = kv.new_empty(*kv.shape[:-1], 8)
        keys[..., :6].copy_(kv)
        keys[..., 6:].copy_(rot.expand(-1, kv.shape[1], -1, -1))
        return keys

    keys = (validate_compute(expand, "attn") if scoped else expand)()
    keys.pow(2).sum().backward()
    assert isinstance(kv.grad, DTensor) and isinstance(rot.grad, DTensor)
    return {"placements": str(keys.placements), "keys": keys.full_tensor(),
            "kv_grad": kv.grad.full_tensor(), "rot_grad": rot.grad.full_tensor()}


def _kv_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 3, 6, generator=g), torch.randn(2, 1, 3, 2, generator=g)


@pytest.mark.parametrize("scoped", [True, False])
def test_new_empty_of_head_sharded_keys_keeps_their_placement_in_a_validate_compute(
        scoped: bool) -> None:
    """``kv.new_empty(*kv.shape[:-1], d)`` of keys sharded by head: DTensor alone hands back a
    replicated tensor (the unscoped run shows it), so the keys built in it arrive replicated
    where production holds this rank's heads; in a validate compute it is sharded like ``kv``.
    Values and both gradients equal one process's exactly (a copy and a square)."""
    kv, rot = (t.requires_grad_() for t in _kv_inputs())
    keys = kv.new_empty(*kv.shape[:-1], 8)
    keys[..., :6].copy_(kv)
    keys[..., 6:].copy_(rot.expand(-1, kv.shape[1], -1, -1))
    keys.pow(2).sum().backward()
    for res in run_ranks(_expand_kv, 2, scoped, timeout_s=120):
        assert res["placements"] == ("(Shard(dim=1),)" if scoped else "(Replicate(),)")
        torch.testing.assert_close(res["keys"], keys.detach(), atol=0, rtol=0)
        torch.testing.assert_close(res["kv_grad"], kv.grad, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["rot_grad"], rot.grad, atol=1e-6, rtol=1e-6)


def _bias_and_masks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(2, 4, 3, 3, generator=g)  # [batch, heads, q, kv], T5's position bias
    causal = torch.ones(3, 3, dtype=torch.bool).tril().view(1, 1, 3, 3)
    per_head = torch.randn(1, 4, 3, 3, generator=g) > 0
    return bias, causal, per_head


def _masked_bias(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    bias_full, causal, per_head = _bias_and_masks()
    bias = DTensor.from_local(bias_full.chunk(world, 1)[rank].clone(), mesh,
                              (Shard(1),)).requires_grad_()
    # transformers' SDPA path for T5: a causal mask made on the spot, [1, 1, q, kv]
    out = validate_compute(lambda: torch.where(causal, bias, -1e4), "attn")()
    out.pow(2).sum().backward()
    assert isinstance(bias.grad, DTensor)
    # a plain tensor with the heads dim: a rank's piece or the whole? still refused
    local_heads = per_head.chunk(world, 1)[rank]
    try:
        validate_compute(lambda: torch.where(local_heads, bias, -1e4), "attn")()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {"placements": str(out.placements), "out": out.full_tensor().detach(),
            "grad": bias.grad.full_tensor(), "refused": refused}


def test_a_plain_mask_that_broadcasts_over_the_sharded_heads_is_taken_as_replicated() -> None:
    """T5's decoder self-attention under transformers' SDPA: ``torch.where(causal_mask,
    position_bias, min)`` with a plain ``[1, 1, q, kv]`` mask beside a head-sharded DTensor bias.
    DTensor refuses the mix; the mask broadcasts over the heads, so validate mode takes it as
    replicated: placement kept, values and gradient equal one process's exactly. A plain mask
    that has the heads dim (which could be one rank's piece) is still refused."""
    bias, causal, _ = _bias_and_masks()
    bias.requires_grad_()
    expected = torch.where(causal, bias, -1e4)
    expected.pow(2).sum().backward()
    for res in run_ranks(_masked_bias, 2, timeout_s=120):
        assert res["placements"] == "(Shard(dim=1),)"
        torch.testing.assert_close(res["out"], expected.detach(), atol=0, rtol=0)
        torch.testing.assert_close(res["grad"], bias.grad, atol=0, rtol=0)
        assert "got mixed torch.Tensor and DTensor" in res["refused"]


def _mla_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # multi-head latent attention's shapes: query/key heads wider than value heads, so CPU
    # SDPA takes its math kernel, which builds the causal mask inside the op
    return (torch.randn(2, 4, 5, 12, generator=g), torch.randn(2, 4, 5, 12, generator=g),
            torch.randn(2, 4, 5, 8, generator=g))


def _causal_sdpa(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    q, k, v = (DTensor.from_local(t.chunk(world, 1)[rank].clone(), mesh,
                                  (Shard(1),)).requires_grad_() for t in _mla_qkv())
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = validate_compute(lambda: sdpa(q, k, v, is_causal=True, scale=0.3), "attn")()
    out.pow(2).sum().backward()
    grads = [t.grad.full_tensor() for t in (q, k, v) if isinstance(t.grad, DTensor)]
    return {"placements": str(out.placements), "out": out.full_tensor().detach(), "grads": grads}


def test_causal_sdpa_on_the_math_kernel_runs_on_head_sharded_dtensors_like_one_process() -> None:
    """DeepSeek-V3's attention under transformers' defaults (``sdpa``, ``is_causal=True``, no
    mask) on CPU: query/key heads of 12 beside values of 8 send SDPA to its math kernel, whose
    own causal mask is a plain tensor, and DTensor refused the mix (``aten.add.Tensor got mixed
    torch.Tensor and DTensor``; `suggest` then left DeepSeek's whole attention replicated).
    Validate mode passes the same mask explicitly as a replicated DTensor: heads stay sharded,
    the output and the three input gradients equal one process's (atol 1e-6, rtol 1e-5: the
    softmax is computed in another order)."""
    q, k, v = (t.requires_grad_() for t in _mla_qkv())
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    expected.pow(2).sum().backward()
    for res in run_ranks(_causal_sdpa, 2, timeout_s=120):
        assert res["placements"] == "(Shard(dim=1),)"
        torch.testing.assert_close(res["out"], expected.detach(), atol=1e-6, rtol=1e-5)
        assert len(res["grads"]) == 3
        for got, want in zip(res["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


EP_LLAMA4 = """recipe: llama4-ep
version: 1
mesh: [ep]
rules:
  - match: model.layers.0.feed_forward.experts
    boundary: true
    local_region: true
    in_src: {hidden_states: replicate}
    out_src: {0: {ep: partial}}
    out_dst: {0: replicate}
    params: {gate_up_proj: {ep: shard(0)}, down_proj: {ep: shard(0)}}
"""


@pytest.mark.parametrize(("local_region", "line", "column", "message"), [
    (True, 7, 19, "model.layers.0.feed_forward.experts: the expert-parallel kernel calls the "
                  "experts' forward as forward(hidden_states, expert ids, routing weights) with "
                  "this rank's ids; Llama4TextExperts.forward takes (hidden_states): it is "
                  "handed tokens already routed, so no kernel can pick this rank's experts"),
    (False, 10, 28, "model.layers.0.feed_forward.experts: its experts are sharded whole over ep "
                    "('gate_up_proj' {ep: shard(0)}), but only an expert-parallel local region "
                    "picks this rank's experts; without one each rank computes with its 2 local "
                    "experts against the router's global ids"),
])
def test_expert_parallelism_no_kernel_can_run_is_refused_at_compile_time(
        tmp_path: Path, local_region: bool, line: int, column: int, message: str) -> None:
    """Llama-4's experts take tokens already routed (``forward(hidden_states)``): with a local
    region the kernel would raise a raw ``TypeError`` at the first forward; without one,
    production ran and was silently wrong (the model reads the expert count off its local
    weights). Both are refused at compile time, at the recipe line."""
    from hyperrecipe.errors import RecipeError
    from hyperrecipe.model_tree import build_model

    text = EP_LLAMA4 if local_region else EP_LLAMA4.replace("    local_region: true\n", "")
    path = tmp_path / "ep.yaml"
    path.write_text(text)
    model = build_model("hf:llama4_text", str(ROOT / "tests/recipes/models/tiny-llama4_text.json"),
                        device="meta")
    with pytest.raises(RecipeError) as info:
        compile_recipe(str(path), model, {"ep": 2})
    assert str(info.value).startswith(f"{path}:{line}:{column}: {message}")


def test_the_default_grouped_mm_experts_are_refused_at_validate_apply_with_the_fix() -> None:
    """Mixtral built with transformers' default experts kernel (``grouped_mm``): DTensor runs
    ``aten._grouped_mm`` in bfloat16 only, so fp32 experts on DTensors would fail inside
    transformers at the first forward; ``apply`` refuses them first, naming the module and both
    ways out. (The ``batched_mm`` experts agree with one process: test_family_recipes.)"""
    with pytest.raises(RankFailedError) as info:
        run_ranks(_worker, 2, "mixtral", recipe_path("mixtral"), "validate", {}, timeout_s=300)
    text = str(info.value)
    assert ("ValidateUnsupportedError: model.layers.0.mlp.experts: transformers' default experts "
            "kernel (experts_implementation='grouped_mm') calls aten._grouped_mm, which DTensor "
            f"(torch {torch.__version__}) runs in bfloat16 only, and these experts are float32. "
            "For validate mode build the model with experts_implementation='batched_mm'") in text
    assert "Sharding propagation failed" not in text


def _padded_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = build("llama")
    plan = compile_recipe(recipe_path("llama"), build("llama", "meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    logits = _padded_step(model)
    grads = inst.full_grads()
    inst.restore()
    return {"logits": logits, "grads": grads}


def _padded_step(model: Any) -> torch.Tensor:
    ids = torch.arange(16).reshape(2, 8) % 128
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding: sdpa gets an explicit [B, 1, L, L] mask, not is_causal
    logits: torch.Tensor = model(input_ids=ids, attention_mask=mask).logits
    logits.float().pow(2).mean().backward()
    return logits.detach()


def test_sdpa_with_a_padding_mask_runs_in_validate_mode_like_one_process() -> None:
    """A padded batch hands the CPU SDPA kernel an ``attn_mask`` (broadcast over heads): the
    rule keeps it replicated beside head-sharded q, k, v, in forward and backward."""
    model = build("llama")
    ref_logits = _padded_step(model)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank, res in enumerate(run_ranks(_padded_worker, 2, "validate", timeout_s=300)):
        _assert_matches(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            _assert_matches(res["grads"][name], g, f"rank {rank} grad {name}")
