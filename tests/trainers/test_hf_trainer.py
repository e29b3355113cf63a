"""The Hugging Face Trainer over an applied plan (``hyperrecipe.trainers.hf_trainer``), on
real gloo ranks: tiny Llama (``recipes/llama.yaml``), the model's own ``labels=`` loss, five
AdamW steps with ``max_grad_norm=0.5`` (every step clips: the full norms are 2.1-4.0), against
the stock ``Trainer`` on the whole model in one process with the same seed and data.

Losses and the logged ``grad_norm`` agree to atol 1e-5 (measured: 1e-6 at tp=2 and at dp=2 x
tp=2). A checkpoint written at step 3 at tp=2 resumes at tp=1 with the uninterrupted run's
losses for steps 4 and 5, and its weights load with ``from_pretrained``.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # trainer runs on launched ranks (docs/benchmarks.md#test-suite)

pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install '.[trainers]'")
pytest.importorskip("transformers", reason="pip install '.[hf,trainers]'")

from hyperrecipe import apply, compile_recipe  # noqa: E402
from hyperrecipe.check.launcher import run_ranks  # noqa: E402
from hyperrecipe.errors import PlanMismatchError, TrainerSetupError  # noqa: E402
from tests.support.checkpoint_harness import Hostile, resume_refused  # noqa: E402
from tests.support.runtime_harness import ROOT, TINY_LLAMA, llama, mesh_1d  # noqa: E402
from tests.support.trainer_logs import assert_same_logs  # noqa: E402

LLAMA = str(ROOT / "recipes/llama.yaml")
DP_TP = str(ROOT / "recipes/llama-dp.yaml")
DP_TP_SP = str(ROOT / "tests/recipes/llama-sp-dp.yaml")  # gradients reduced in buckets
LOSS_ATOL = 1e-5
MAX_GRAD_NORM = 0.5


def _data(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (n, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(out: str, batch: int, accumulate: int, eval_batch: int, **more: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=5,
                             per_device_eval_batch_size=eval_batch,
                             gradient_accumulation_steps=accumulate,
                             learning_rate=1e-2, max_grad_norm=MAX_GRAD_NORM, logging_steps=1,
                             save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             **more)


def _logged(trainer: Any) -> list[tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h]


def _eval_data(n: int) -> list[dict[str, torch.Tensor]]:
    return _data(n, seed=5)


def _worker(rank: int, world: int, out: str, how: str, batch: int, samples: int,
            resume: str | None, accumulate: int = 1, evaluate: int = 0,
            eval_batch: int = 3, mode: str = "production",
            more: dict[str, Any] | None = None, loss_scale: float | None = None
            ) -> dict[str, Any]:
    """``how``: ``one`` (stock Trainer, whole model), ``tp`` (tp=world), ``dp-tp`` (2 x 2),
    ``dp-tp-sp`` (2 x 2, sequence parallel: gradients reduced in buckets);
    ``evaluate``: the size of an eval set evaluated after training; ``mode``: apply's;
    ``more``: more ``TrainingArguments``; ``loss_scale``: a ``GradScaler`` with this initial
    scale on the Trainer's accelerator, as ``fp16=True`` makes on a GPU (on the CPU accelerate
    makes none)."""
    from transformers import Trainer

    from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainer

    model = llama()
    args = _args(out, batch, accumulate, eval_batch, **(more or {}))
    sets = {"train_dataset": _data(samples), "eval_dataset": _eval_data(evaluate or 1)}
    if how == "one":
        trainer = Trainer(model=model, args=args, **sets)
    else:
        if how == "tp":
            mesh = mesh_1d(world)
            plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            recipe = DP_TP_SP if how == "dp-tp-sp" else DP_TP
            plan = compile_recipe(recipe, llama("meta"), {"dp": 2, "tp": 2})
        inst = apply(model, plan, mesh, mode=mode)  # type: ignore[arg-type]
        trainer = HyperrecipeTrainer(model=model, installation=inst, args=args, **sets)
    if loss_scale is not None:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale)
        trainer.accelerator.native_amp = True
    trainer.train(resume_from_checkpoint=resume)
    return {"logged": _logged(trainer),
            "eval_loss": trainer.evaluate()["eval_loss"] if evaluate else None,
            "history": trainer.state.log_history}


def _assert_same_run(actual: list[tuple[int, float, float]],
                     expected: list[tuple[int, float, float]]) -> None:
    assert [s for s, _, _ in actual] == [s for s, _, _ in expected]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(actual, expected, strict=True):
        assert loss == pytest.approx(ref_loss, abs=LOSS_ATOL), f"loss at step {step}"
        assert norm == pytest.approx(ref_norm, abs=LOSS_ATOL), f"grad_norm at step {step}"


def test_trainer_at_tp2_clips_like_one_process_and_resumes_at_tp1(tmp_path: Path) -> None:
    """``max_grad_norm`` clips by the full norm (measured with the stock Trainer's clipping
    put back, torch's call over each rank's shards: the fifth loss 1.3e-3 off); ``save_steps=3`` writes consolidated weights and DCP state; resuming from it at
    tp=1 continues the uninterrupted run. ``evaluate()`` on 7 samples in batches of 3 (a short
    last batch) gives one process's eval_loss (measured 1e-6; 4.815 against 4.840 with the
    stock gather and padding)."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", 2, 10, None, 1, 7,
                    timeout_s=600)[0]
    assert all(norm > 2 * MAX_GRAD_NORM for _, _, norm in ref["logged"])  # every step clips
    out = tmp_path / "tp2"
    for ranks in run_ranks(_worker, 2, str(out), "tp", 2, 10, None, 1, 7, timeout_s=600):
        _assert_same_run(ranks["logged"], ref["logged"])
        assert ranks["eval_loss"] == pytest.approx(ref["eval_loss"], abs=LOSS_ATOL)
    ckpt = out / "checkpoint-3"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "hyperrecipe-dcp/.metadata").is_file()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(ckpt)
    assert sum(p.numel() for p in saved.parameters()) == sum(
        p.numel() for p in llama().parameters())
    resumed = run_ranks(_worker, 1, str(out), "tp", 2, 10, str(ckpt), timeout_s=600)[0]
    _assert_same_run([r for r in resumed["logged"] if r[0] > 3], ref["logged"][3:])
    # the model and optimizer state are read as data (torch's dcp.load unpickles .metadata)
    hostile = shutil.copytree(ckpt, tmp_path / "hostile")
    marker = tmp_path / "ran"
    (hostile / "hyperrecipe-dcp/.metadata").write_bytes(pickle.dumps(Hostile(marker)))
    message = resume_refused(lambda: run_ranks(_worker, 1, str(tmp_path / "again"), "tp", 2,
                                                10, str(hostile), timeout_s=600), marker)
    assert "WeightLoadError" in message and "hostile/hyperrecipe-dcp" in message, message


def test_every_number_the_trainer_logs_at_tp2_is_one_process_s(tmp_path: Path) -> None:
    """With ``include_num_input_tokens_seen``, every key of every log line (training steps,
    the closing metrics, ``evaluate()`` on 7 samples in batches of 3) against one process:
    ``num_input_tokens_seen`` (measured 32, 64, ... at tp=2 against 16, 32, ... before: the
    Trainer gathers each rank's count over the world), ``total_flos`` (the Trainer summed each
    rank's shards' count over the world), and the rates by the counts they imply
    (``train_tokens_per_second``; ``eval_steps_per_second`` was counted over
    ``eval_batch_size × world_size``)."""
    more = {"include_num_input_tokens_seen": True}
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", 2, 10, None, 1, 7, 3,
                    "production", more, timeout_s=600)[0]
    assert any("num_input_tokens_seen" in h for h in ref["history"])
    for ranks in run_ranks(_worker, 2, str(tmp_path / "tp2"), "tp", 2, 10, None, 1, 7, 3,
                           "production", more, timeout_s=600):
        assert_same_logs(ranks["history"], ref["history"])


def test_trainer_without_averaging_tokens_across_devices_matches_one_process(
        tmp_path: Path) -> None:
    """``average_tokens_across_devices=False``: each rank divides the loss by its own token
    count, which the Trainer still divided by ``get_tp_size()`` (the loss and every gradient
    came out 2x at tp=2: 9.858 against 4.929)."""
    more = {"average_tokens_across_devices": False}
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", 2, 10, None, 1, 0, 3,
                    "production", more, timeout_s=600)[0]
    for ranks in run_ranks(_worker, 2, str(tmp_path / "tp2"), "tp", 2, 10, None, 1, 0, 3,
                           "production", more, timeout_s=600):
        _assert_same_run(ranks["logged"], ref["logged"])


def test_trainer_with_fp16_loss_scaling_clips_the_unscaled_gradients(tmp_path: Path) -> None:
    """``fp16=True`` with a loss scale of 1024: the gradients are unscaled before the plan's
    clipping, as accelerate's ``clip_grad_norm_`` does (the logged norm was 4075 against 3.98,
    and every step shrank by the scale). fp16 autocast rounds differently on shards, and its
    rounding moves one process's own norms by up to 0.9 % against fp32 over five steps
    (measured): losses agree with one process to rtol 1e-3 (measured 5e-4), norms to rtol 2e-2
    (measured 9e-3), against a gap of 1000x without the unscale."""
    more = {"fp16": True}
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", 2, 10, None, 1, 0, 3,
                    "production", more, 1024.0, timeout_s=600)[0]
    for ranks in run_ranks(_worker, 2, str(tmp_path / "tp2"), "tp", 2, 10, None, 1, 0, 3,
                           "production", more, 1024.0, timeout_s=600):
        assert [s for s, _, _ in ranks["logged"]] == [s for s, _, _ in ref["logged"]]
        for (step, loss, norm), (_, ref_loss, ref_norm) in zip(ranks["logged"], ref["logged"],
                                                               strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-3), f"loss at step {step}"
            assert norm == pytest.approx(ref_norm, rel=2e-2), f"grad_norm at step {step}"


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("how", ["dp-tp", "dp-tp-sp"])
def test_trainer_at_dp2_tp2_splits_batches_over_dp_only_like_one_process(
        tmp_path: Path, how: str) -> None:
    """Each dp rank gets half of one process's batch of 4, both tp ranks of a replica the same
    half; DDP averages over dp only, also with two accumulation steps (DDP's no_sync). Losses,
    norms and eval_loss (8 samples, gathered over dp only) equal one process's. With sequence
    parallelism the norms' gradients are reduced in the plan's buckets and averaged over dp
    there (``hyperrecipe.runtime.data_parallel``; with DDP's own average of them the tp reduction
    was lost and the losses drifted from the second step, nothing refused)."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", 4, 40, None, 2, 8, 4,
                    timeout_s=600)[0]
    for ranks in run_ranks(_worker, 4, str(tmp_path / how), how, 2, 40, None, 2, 8, 2,
                           timeout_s=900):
        _assert_same_run(ranks["logged"], ref["logged"])
        assert ranks["eval_loss"] == pytest.approx(ref["eval_loss"], abs=LOSS_ATOL)


def _refusal_worker(rank: int, world: int, out: str, how: str) -> str:
    from transformers import Trainer, TrainingArguments

    from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainer

    model = llama()
    plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    try:
        if how == "stock":
            Trainer(model=model, args=args, train_dataset=_data(4)).train()
        else:
            trainer = HyperrecipeTrainer(model=llama() if how == "other" else model,
                                         installation=inst, args=args)
            if how == "move":
                trainer._move_model_to_device(model, torch.device("meta"))
    except (PlanMismatchError, TrainerSetupError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def test_the_stock_trainer_at_tp2_is_refused_and_names_the_integration(tmp_path: Path) -> None:
    """The stock Trainer wraps DDP over the tp ranks: refused at the first forward, before a
    step trains on it, naming the route that works."""
    for res in run_ranks(_refusal_worker, 2, str(tmp_path), "stock", timeout_s=600):
        assert res.startswith("PlanMismatchError: DistributedDataParallel over ranks [0, 1]")
        assert "hyperrecipe.trainers.hf_trainer.HyperrecipeTrainer" in res


def test_the_integration_refuses_a_model_other_than_the_applied_one(tmp_path: Path) -> None:
    for res in run_ranks(_refusal_worker, 2, str(tmp_path), "other", timeout_s=600):
        assert res.startswith("TrainerSetupError: HyperrecipeTrainer: model= must be the model "
                              "the installation was applied to")


def test_trainer_in_validate_mode_at_tp2_trains_like_one_process_and_resumes_at_tp1(
        tmp_path: Path) -> None:
    """Validate mode under the Trainer: DTensor parameters, the Trainer's own (fused) AdamW in
    one param group per mesh, the same losses and norms as one process (measured 4.8e-7 and
    6e-6). It was refused while the Trainer's ``model.to(device)`` left the hook that keeps
    each gradient's placement behind (``Module._apply`` swaps DTensor parameters' tensors with
    ``torch.utils.swap_tensors``): the embedding's gradient arrived ``Replicate()`` and the
    norm refused it. The integration no longer moves the model, and validate mode re-binds the
    hooks after any move. ``evaluate()``
    gives one process's eval_loss; the checkpoint resumes in production mode at tp=1."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", 2, 10, None, 1, 7,
                    timeout_s=600)[0]
    out = tmp_path / "validate"
    for ranks in run_ranks(_worker, 2, str(out), "tp", 2, 10, None, 1, 7, 3, "validate",
                           timeout_s=600):
        _assert_same_run(ranks["logged"], ref["logged"])
        assert ranks["eval_loss"] == pytest.approx(ref["eval_loss"], abs=LOSS_ATOL)
    resumed = run_ranks(_worker, 1, str(out), "tp", 2, 10, str(out / "checkpoint-3"),
                        timeout_s=600)[0]
    _assert_same_run([r for r in resumed["logged"] if r[0] > 3], ref["logged"][3:])


def test_the_integration_refuses_to_move_an_applied_model_to_another_device(
        tmp_path: Path) -> None:
    """Every move the Trainer makes (at construction, after ``model_init``, before a full
    fp16/bf16 eval) goes through ``_move_model_to_device``: an applied model stays where apply
    put it, and a move to another device type (here ``meta``, the one a CPU machine has) is
    refused before any parameter is replaced."""
    for res in run_ranks(_refusal_worker, 2, str(tmp_path), "move", timeout_s=600):
        assert res.startswith("TrainerSetupError: HyperrecipeTrainer: the model's parameters "
                              "are on ['cpu'], the Trainer's device is meta; move the model to "
                              "meta before hyperrecipe.apply")


def _leave_together_worker(rank: int, world: int, out: str) -> bool:
    """Rank 0 writes a file of its own at the very end of training (as the Trainer writes its
    state alone), a moment after the others finished; every rank checks the file once
    ``train()`` returned."""
    import time

    from transformers import TrainerCallback

    from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainer

    marker = Path(out) / "rank0-done"

    class Rank0WritesLast(TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == 0:
                time.sleep(2.0)  # rank 0 still busy after the others' last step
                marker.write_text("done")

    model = llama()
    inst = apply(model, compile_recipe(LLAMA, llama("meta"), {"tp": world}), mesh_1d(world))
    args = _args(out, 2, 1, 2)
    args.max_steps, args.save_strategy = 2, "no"
    trainer = HyperrecipeTrainer(model=model, installation=inst, args=args,
                                 train_dataset=_data(8), callbacks=[Rank0WritesLast()])
    trainer.train()
    return marker.is_file()


def test_every_rank_leaves_train_together(tmp_path: Path) -> None:
    """A script that ends after ``trainer.train()`` tears the process group down on every rank
    together: a rank that left while rank 0 still wrote was seen to abort at interpreter exit
    (``terminate called without an active exception``, docs/training.md). Before, rank 1
    returned while rank 0 was still in its ``on_train_end``."""
    assert run_ranks(_leave_together_worker, 2, str(tmp_path), timeout_s=600) == [True, True]
