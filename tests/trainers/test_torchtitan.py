"""torchtitan's own Llama 3 code under a hyperrecipe plan as its parallelize step.

``hyperrecipe.trainers.torchtitan.parallelize_llama`` (torchtitan's ``parallelize_fn``
signature) with ``recipes/torchtitan-llama3.yaml`` (tensor + sequence parallel, loss on vocab
shards) against one process and against torchtitan's own ``parallelize_llama`` (TP + SP + loss
parallel) on real gloo ranks, fp32. Losses of AdamW steps with clipping agree to rtol 1e-5
(measured: equal to ~1e-7); the first step's gradients to atol 2e-6 / rtol 1e-5. With
``dp_shard > 1`` the same step composes FSDP2 (``recipes/torchtitan-llama3-dp-tp.yaml``): at
dp=2 x tp=2 the dp-mean losses equal one process's on the whole batch. torchtitan's Trainer
order (meta, parallelize, ``to_empty``, ``init_weights``) and DCP resumes are covered too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import PlanMismatchError
from tests.support import titan_harness as h

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed (the `titan` extra: `pip install torchtitan==0.3.0 "
           "--no-deps` plus its import deps, see docs/training.md#torchtitan)")

STEPS = 5
RTOL = 1e-5
ATOL = 2e-6


def _close(actual: list[float], expected: list[float], what: str) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=RTOL,
                               atol=0.0, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow  # torchtitan's model and its own TP (~8 s)
def test_plan_trains_torchtitans_llama3_as_one_process_and_as_its_own_tensor_parallel() -> None:
    ref = h.one_process(STEPS)
    ours = run_ranks(h.hyperrecipe_run, 2, STEPS, timeout_s=300)
    theirs = run_ranks(h.torchtitan_run, 2, STEPS, timeout_s=300)
    for rank in range(2):
        _close(ours[rank]["losses"], ref["losses"], f"hyperrecipe rank {rank} vs one process")
        _close(theirs[rank]["losses"], ref["losses"], f"torchtitan rank {rank} vs one process")
    assert set(ours[0]["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(ours[0]["grads"][name], grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, n=name: f"hyperrecipe grad {n}: {m}")
        torch.testing.assert_close(theirs[0]["grads"][name], grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, n=name: f"torchtitan grad {n}: {m}")


def test_torchtitans_trainer_order_on_meta_initializes_as_one_process_and_refuses_its_loss() -> None:
    ref = h.one_process(3)
    results = run_ranks(h.meta_trainer_order, 2, 3, timeout_s=300)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], f"rank {rank} after to_empty + init_weights")
        assert got["unset"] == []
        assert "flatten() on the logits of 'lm_head'" in got["refused"]
        assert "hyperrecipe.vocab_parallel_cross_entropy" in got["refused"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_dcp_checkpoint_resumes_at_the_same_and_at_another_tp_size(tmp_path: Path) -> None:
    full = run_ranks(h.checkpoint_run, 2, str(tmp_path / "ckpt"), 3, 6, timeout_s=300)[0]
    at_two = run_ranks(h.checkpoint_run, 2, str(tmp_path / "ckpt"), None, 3, timeout_s=300)
    at_one = run_ranks(h.checkpoint_run, 1, str(tmp_path / "ckpt"), None, 3, timeout_s=300)
    _close(full, h.one_process(6)["losses"], "tp=2 run vs one process")
    for rank, losses in enumerate(at_two):
        _close(losses, full[3:], f"resumed at tp=2, rank {rank}")
    _close(at_one[0], full[3:], "resumed at tp=1")


@pytest.mark.parametrize(("dims", "asked"), [
    ({"dp_replicate": 2}, "dp_replicate=2"), ({"cp": 2}, "cp=2"), ({"pp": 2}, "pp=2")])
def test_what_this_parallelize_step_does_not_do_is_refused_by_name(
        dims: dict[str, int], asked: str) -> None:
    from torchtitan.distributed import ParallelDims

    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2, "pp": 1, "ep": 1, **dims}
    world = 1
    for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        world *= sizes[name]
    parallel_dims = ParallelDims(**sizes, world_size=world)
    from hyperrecipe.models.torchtitan import build_llama3
    from hyperrecipe.trainers.torchtitan import parallelize_llama

    with torch.device("meta"):
        model = build_llama3()
    with pytest.raises(PlanMismatchError, match=f"the job asks for {asked}"):
        parallelize_llama(model, parallel_dims=parallel_dims)


def test_a_model_class_without_a_shipped_recipe_is_refused_by_name() -> None:
    """A recipe for one model compiles on another that shares its module names and trains it
    wrong (torchtitan-llama3 on torchtitan's Qwen3 leaves the q_norm/k_norm gradients partial),
    so without ``recipe=`` the step refuses a class it has no recipe for (gpt-oss), naming the
    class and the classes it has recipes for, and picks the recipe by class for the others."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.gpt_oss import gptoss_configs

    from hyperrecipe import compile_recipe
    from hyperrecipe.models.torchtitan import build_deepseek_v3, build_llama3, build_qwen3
    from hyperrecipe.trainers.torchtitan import (
        RECIPE,
        parallelize,
        parallelize_llama,
        shipped_recipe_for,
    )

    with torch.device("meta"):
        gpt_oss = gptoss_configs["debugmodel"](moe_comm_backend="standard").build()
        deepseek = build_deepseek_v3()
        qwen3 = build_qwen3()
        llama3 = build_llama3()
    assert compile_recipe(RECIPE, qwen3, {"tp": 2}).params  # what made it silent
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    with pytest.raises(PlanMismatchError) as exc:
        parallelize(gpt_oss, parallel_dims=dims)
    assert str(exc.value).startswith(
        "hyperrecipe's torchtitan parallelize has no shipped recipe for GptOssModel "
        "(torchtitan.models.gpt_oss.model.GptOssModel); shipped: Llama3Model "
        "(torchtitan-llama3, torchtitan-llama3-dp-tp), Qwen3Model (torchtitan-qwen3), "
        "DeepSeekV3Model (torchtitan-deepseek-v3).")
    assert "pass recipe=" in str(exc.value)
    assert parallelize_llama is parallelize
    assert shipped_recipe_for(llama3, fsdp=False) == "torchtitan-llama3"
    assert shipped_recipe_for(llama3, fsdp=True) == "torchtitan-llama3-dp-tp"
    assert shipped_recipe_for(qwen3, fsdp=False) == "torchtitan-qwen3"
    assert shipped_recipe_for(deepseek, fsdp=False) == "torchtitan-deepseek-v3"


@pytest.mark.slow  # launches ranks (~8 s)
def test_plan_trains_torchtitans_qwen3_with_its_per_head_norms_as_one_process() -> None:
    """torchtitan's dense Qwen3 (tied embedding, per-head q_norm/k_norm, head_dim * n_heads !=
    dim) through ``parallelize`` at tp=2 with the recipe it picks by class
    (torchtitan-qwen3): losses of AdamW steps with clipping to rtol 1e-5 and every first-step
    gradient to atol 2e-6 / rtol 1e-5, as for Llama 3 (measured: losses within 5e-6 relative,
    gradients within 1.2e-7). The q/k norm gradients are the ones the Llama 3 recipe left
    partial; the tied ``lm_head.weight`` reports the embedding's gradient."""
    ref = h.one_process(STEPS, "qwen3")
    ours = run_ranks(h.hyperrecipe_run, 2, STEPS, "installation", "qwen3", timeout_s=300)
    for rank in range(2):
        _close(ours[rank]["losses"], ref["losses"], f"hyperrecipe qwen3 rank {rank}")
    assert set(ours[0]["grads"]) == set(ref["grads"]) | {"lm_head.weight"}
    expected = {**ref["grads"], "lm_head.weight": ref["grads"]["tok_embeddings.weight"]}
    for name, grad in expected.items():
        torch.testing.assert_close(ours[0]["grads"][name], grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, n=name: f"qwen3 grad {n}: {m}")


def test_deepseek_v3_with_multi_token_prediction_layers_is_refused_by_name() -> None:
    """Its flavors' ``num_mtp_layers`` adds ``mtp_layers``, for which the shipped recipe has no
    rules; without ``recipe=`` the step refuses the model instead of leaving them unplanned."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    from hyperrecipe.trainers.torchtitan import parallelize

    with torch.device("meta"):
        model = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard",
                                                 num_mtp_layers=1).build()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    with pytest.raises(PlanMismatchError) as exc:
        parallelize(model, parallel_dims=dims)
    assert str(exc.value).startswith(
        "hyperrecipe's torchtitan parallelize: DeepSeekV3Model has multi-token-prediction layers "
        "(mtp_layers), which the shipped torchtitan-deepseek-v3 has no rules for")
    assert "Build it with num_mtp_layers=0" in str(exc.value)


#: DeepSeek-V3's tolerances, relative to each gradient's largest entry (max |ours - one process|
#: <= tol * max |one process|). torchtitan's GroupedExperts compute in bf16 inside the fp32 model
#: (its forward casts input and weights; there is no fp32 path), so at tp=2 each rank rounds its
#: partial routed output (half the hidden dim F) to bf16 before the sum, where one process rounds
#: the full sum once: bf16's unit roundoff is 2**-8 = 3.9e-3. The parameters inside a MoE block
#: and the ffn_norm that feeds it get BF16_TOL, 2.5x that (measured <= 2.9e-3, on the router's
#: gate); every other gradient FP32_TOL (measured <= 1.3e-6: the bf16 differences reach them
#: only through the residual stream, where the MoE output is a small part). Losses: the first
#: step's forward to RTOL (measured 8e-8), the steps after AdamW updates from those gradients to
#: 1e-3 (measured <= 1.7e-4).
BF16_TOL = 1e-2
FP32_TOL = 1e-5
DEEPSEEK_LOSS_RTOL = 1e-3


@pytest.mark.slow  # launches ranks (~12 s each)
@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3_q_lora"])
def test_plan_trains_torchtitans_deepseek_v3_mla_and_moe_as_one_process(variant: str) -> None:
    """torchtitan's DeepSeek-V3 (a dense layer, then MLA + MoE with shared experts) through
    ``parallelize`` at tp=2 with torchtitan-deepseek-v3: MLA by heads with its low-rank
    projections and norms replicated (``wq`` as in its debugmodel, or ``wq_a``/``q_norm``/
    ``wq_b`` with ``q_lora_rank > 0``), routed experts tensor parallel along their hidden dim,
    every first-step gradient and five clipped AdamW losses against one process, with the
    bf16 tolerances stated at :data:`BF16_TOL`."""
    ref = h.one_process(STEPS, variant)
    ours = run_ranks(h.hyperrecipe_run, 2, STEPS, "installation", variant, timeout_s=300)
    for rank in range(2):
        assert ours[rank]["losses"][0] == pytest.approx(ref["losses"][0], rel=RTOL)
        torch.testing.assert_close(torch.tensor(ours[rank]["losses"]),
                                   torch.tensor(ref["losses"]), rtol=DEEPSEEK_LOSS_RTOL, atol=0.0)
    assert set(ours[0]["grads"]) == set(ref["grads"])
    moe_layers = {name.split(".moe.")[0] for name in ref["grads"] if ".moe." in name}
    assert moe_layers == {"layers.1"}
    for name, grad in ref["grads"].items():
        in_bf16 = ".moe." in name or name == "layers.1.ffn_norm.weight"
        tol = BF16_TOL if in_bf16 else FP32_TOL
        worst = (ours[0]["grads"][name] - grad).abs().max().item()
        assert worst <= tol * grad.abs().max().item(), (name, worst, grad.abs().max().item())


@pytest.mark.parametrize(("builder", "cls", "recipe"), [
    ("build_qwen3", "Qwen3Model", "torchtitan-qwen3"),
    ("build_deepseek_v3", "DeepSeekV3Model", "torchtitan-deepseek-v3")])
def test_models_without_a_dp_tp_recipe_are_refused_under_fsdp2_naming_why_and_what_to_run(
        builder: str, cls: str, recipe: str) -> None:
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from hyperrecipe.models import torchtitan as builders
    from hyperrecipe.trainers.torchtitan import parallelize

    with torch.device("meta"):
        model = getattr(builders, builder)()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4,
                        spmd_backend="partial_dtensor")
    with pytest.raises(PlanMismatchError) as exc:
        parallelize(model, parallel_dims=dims, parallelism=ParallelismConfig(
            tensor_parallel_degree=2, data_parallel_shard_degree=2,
            enable_sequence_parallel=False, spmd_backend="partial_dtensor"))
    assert str(exc.value).startswith(
        f"hyperrecipe's torchtitan parallelize has no dp x tp recipe for {cls}: its "
        f"shipped {recipe} reduces gradients over tp through hooks")
    assert "Run it with dp_shard=1" in str(exc.value)


def test_torchtitans_own_clip_on_the_plans_shards_trains_as_one_process() -> None:
    """torchtitan's Trainer clips with ``dist_utils.clip_grad_norm_`` (torch's norm): with the
    installation alive that is the full norm, so the parallelize step accepts torchtitan's
    default ``training.max_norm`` (1.0) and the clipped steps equal one process's (before
    hyperrecipe's guard each rank clipped by its own shards' norm, and the step refused it)."""
    ref = h.one_process(STEPS)
    for rank, got in enumerate(run_ranks(h.hyperrecipe_run, 2, STEPS, "torchtitan",
                                         timeout_s=300)):
        _close(got["losses"], ref["losses"], f"torchtitan's clip, rank {rank}")


@pytest.mark.slow  # starts torchrun and two fresh interpreters
def test_the_documented_torchtitan_example_runs_under_torchrun(tmp_path: Path) -> None:
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs/training.md").read_text(encoding="utf-8").split("\n## torchtitan\n")[1]
    body = re.search(r"```python\n(# file: titan_tp.py\n.*?)```", doc, re.S)
    assert body is not None, "docs/training.md#torchtitan: the titan_tp.py block"
    (tmp_path / "titan_tp.py").write_text(body.group(1), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "titan_tp.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"^step \d loss (\S+)$", done.stdout, re.M)]
    torch.testing.assert_close(torch.tensor(printed), torch.tensor(h.one_process(5)["losses"]),
                               atol=2e-6, rtol=0.0)  # printed with 6 decimals
    assert (tmp_path / "titan-ckpt" / ".metadata").exists()


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_fsdp2_on_the_fsdp_dim_after_the_plan_trains_as_one_process_on_the_whole_batch() -> None:
    ref = h.one_process(STEPS)
    results = run_ranks(h.dp_tp_run, 4, STEPS, timeout_s=400)
    for rank, got in enumerate(results):
        _close(got["losses"], ref["losses"], f"dp x tp rank {rank} (dp mean) vs one process")
    assert set(results[0]["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(results[0]["grads"][name], grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, n=name: f"dp x tp grad {n}: {m}")


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_fsdp2_in_torchtitans_trainer_order_on_meta_initializes_as_one_process() -> None:
    ref = h.one_process(3)
    for rank, got in enumerate(run_ranks(h.dp_tp_run, 4, 3, True, timeout_s=400)):
        _close(got["losses"], ref["losses"], f"dp x tp rank {rank} after to_empty + init_weights")


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_a_dp_times_tp_checkpoint_resumes_at_tp_2_without_fsdp(tmp_path: Path) -> None:
    """Saved under FSDP2 at dp=2 x tp=2 (each rank's FSDP piece of its tp shard, with AdamW's
    moments), resumed by the sequence-parallel tp=2 recipe on the whole batch."""
    folder = str(tmp_path / "ckpt")
    run_ranks(h.dp_tp_run, 4, 3, False, folder, timeout_s=400)
    resumed = run_ranks(h.checkpoint_run, 2, folder, None, 3, timeout_s=300)
    expected = h.one_process(6)["losses"][3:]
    for rank, losses in enumerate(resumed):
        _close(losses, expected, f"resumed at tp=2 from dp x tp, rank {rank}")


def test_sequence_parallel_under_fsdp2_is_refused_naming_the_setting() -> None:
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from hyperrecipe.models.torchtitan import build_llama3
    from hyperrecipe.trainers.torchtitan import parallelize_llama

    with torch.device("meta"):
        model = build_llama3()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    with pytest.raises(PlanMismatchError, match=r"enable_sequence_parallel=True at dp_shard=2 "
                                                r"\(the dp x tp recipe is not: set it False\)"):
        parallelize_llama(model, parallel_dims=dims, parallelism=ParallelismConfig(
            tensor_parallel_degree=2, data_parallel_shard_degree=2))


def test_torchtitans_default_spmd_backend_under_fsdp2_is_refused_naming_the_setting() -> None:
    """torchtitan 0.3's default ``spmd_backend="spmd_types"`` builds no ``fsdp`` mesh dim; the
    step refuses it before any mesh lookup (which failed with torchtitan's bare ``Invalid mesh
    dim: 'fsdp'``), naming the setting. Tensor parallel alone runs under it: the documented
    example (above) builds its ``ParallelDims`` with the default."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from hyperrecipe.models.torchtitan import build_llama3
    from hyperrecipe.trainers.torchtitan import parallelize

    with torch.device("meta"):
        model = build_llama3()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    assert dims.spmd_backend == "spmd_types"  # torchtitan's default
    with pytest.raises(PlanMismatchError) as exc:
        parallelize(model, parallel_dims=dims, parallelism=ParallelismConfig(
            tensor_parallel_degree=2, data_parallel_shard_degree=2,
            enable_sequence_parallel=False))
    assert ("the job asks for spmd_backend='spmd_types' at dp_shard=2 (its mesh has no 'fsdp' "
            "dim: set spmd_backend=\"partial_dtensor\" in ParallelismConfig") in str(exc.value)


@pytest.mark.slow  # launches ranks
def test_validate_mode_refuses_torchtitans_embedding_that_unwraps_its_sharded_weight() -> None:
    """torchtitan's ``Embedding.forward`` calls ``self.weight.to_local()`` and looks the global
    ids up in this rank's vocab rows; in validate mode that was a bare ``IndexError`` from
    ``F.embedding`` (and, with ids inside the shard, would have been wrong rows). Validate mode
    now refuses the unwrapped shard, naming the boundary, the op, the parameter and the route."""
    for got in run_ranks(h.validate_mode_forward, 2, timeout_s=300):
        assert got.startswith(
            "ValidateShardingError: tok_embeddings: validate mode: embedding got this rank's "
            "shard of parameter 'tok_embeddings.weight' (placed {tp: shard(0)}) as a plain "
            "tensor beside DTensors: the module's forward unwrapped the DTensor parameter "
            "itself (to_local())"), got
        assert 'check this model in production mode (apply(..., mode="production")' in got


@pytest.mark.slow  # launches ranks
@pytest.mark.parametrize("model_name", ["qwen3", "deepseek_v3"])
def test_hf_export_through_torchtitans_adapter_equals_its_one_process_export(
        model_name: str) -> None:
    """``hf_state_dict`` at tp=2 gives, key for key and bit for bit, what torchtitan's own
    adapter gives from one process's ``model.state_dict()`` (fused ``wqkv`` split into the
    q/k/v projections as torchtitan's state-dict hook splits it; tied ``lm_head`` left to the
    embedding as its adapter does)."""
    expected = h.one_process_hf_state_dict(model_name)
    for rank, got in enumerate(run_ranks(h.hf_export_run, 2, model_name, timeout_s=300)):
        assert sorted(got) == sorted(expected), f"rank {rank}"
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"rank {rank}: {key}"
    if model_name == "qwen3":
        assert "model.layers.0.self_attn.k_proj.weight" in expected


@pytest.mark.slow  # launches ranks
@pytest.mark.parametrize(("model_name", "rtol"), [("qwen3", RTOL),
                                                  ("deepseek_v3", DEEPSEEK_LOSS_RTOL)])
def test_qwen3_and_deepseek_v3_in_torchtitans_trainer_order_on_meta_train_as_one_process(
        model_name: str, rtol: float) -> None:
    """Built on meta, ``parallelize``, ``to_empty``, ``init_weights``: the weights each rank
    keeps are its shards of what one process draws (Qwen3's tied embedding, which its
    ``init_states`` ties again and initializes through ``lm_head``; DeepSeek-V3's MoE buffers,
    computed before apply), so three clipped steps' losses equal one process's (DeepSeek-V3's
    to the bf16 tolerance stated at :data:`DEEPSEEK_LOSS_RTOL`; measured: 7.7e-7 / 5e-7)."""
    ref = h.one_process(3, model_name)
    for rank, got in enumerate(run_ranks(h.meta_trainer_order, 2, 3, model_name,
                                         timeout_s=300)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=rtol, atol=0.0,
                                   msg=lambda m, r=rank: f"{model_name} rank {r}: {m}")
        assert got["unset"] == []
        assert "flatten() on the logits of 'lm_head'" in got["refused"]
