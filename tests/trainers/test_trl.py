"""TRL's ``SFTTrainer`` (and, at the end of the file, ``DPOTrainer``) over an applied plan (``hyperrecipe.trainers.trl``), on real gloo
ranks: tiny Llama (``recipes/llama.yaml``), a word-level tokenizer over its 128 ids built here
(no download), a pre-tokenised ``datasets.Dataset``, five AdamW steps with
``max_grad_norm=0.5`` (every step clips: the full norms are 3.8-5.0), against the stock
``SFTTrainer`` on the whole model in one process with the same seed and data.

Losses agree to atol 1e-5 and the logged ``grad_norm`` to rtol 1e-5 (measured 1e-6 at tp=2 in
both modes, 7e-6 relative at dp=2 x tp=2); a
checkpoint written at step 3 at tp=2 resumes at tp=1 with the uninterrupted run's losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # trainer runs on launched ranks (docs/benchmarks.md#test-suite)

pytest.importorskip("trl", reason="pip install '.[hf,trainers]'")

from hyperrecipe import apply, compile_recipe  # noqa: E402
from hyperrecipe.check.launcher import run_ranks  # noqa: E402
from hyperrecipe.errors import TrainerSetupError  # noqa: E402
from tests.support.runtime_harness import ROOT, TINY_LLAMA, llama, mesh_1d  # noqa: E402
from tests.support.trainer_logs import assert_same_logs  # noqa: E402

LLAMA = str(ROOT / "recipes/llama.yaml")
DP_TP = str(ROOT / "recipes/llama-dp.yaml")
ATOL = 1e-5
RTOL = 1e-5  # norms: at dp=2 x tp=2 measured 2.1e-5 apart at 2.97 (7e-6 relative)
MAX_GRAD_NORM = 0.5


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_LLAMA["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                   unk_token="t2")


def _data(n: int) -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, TINY_LLAMA["vocab_size"], (n, 8), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def _worker(rank: int, world: int, out: str, how: str, mode: str,
            resume: str | None, batch: int = 2, history: bool = False
            ) -> list[tuple[int, float, float]] | list[dict[str, Any]] | str:
    """``how``: ``one`` (stock SFTTrainer, whole model), ``sft`` (HyperrecipeSFTTrainer at
    tp=world), ``dp-tp`` (HyperrecipeSFTTrainer at 2 x 2), ``mixin``
    (``class _(HyperrecipeTrainerMixin, SFTTrainer)``)."""
    from trl import SFTConfig, SFTTrainer

    from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainerMixin
    from hyperrecipe.trainers.trl import HyperrecipeSFTTrainer

    class MixedSFT(HyperrecipeTrainerMixin, SFTTrainer):  # type: ignore[misc]
        pass

    model = llama()
    args = SFTConfig(output_dir=out, per_device_train_batch_size=batch, max_steps=5,
                     learning_rate=1e-2, max_grad_norm=MAX_GRAD_NORM, logging_steps=1,
                     save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                     bf16=False)
    sets = {"train_dataset": _data(20), "processing_class": _tokenizer()}
    if how == "one":
        trainer = SFTTrainer(model=model, args=args, **sets)
    else:
        if how == "dp-tp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            plan = compile_recipe(DP_TP, llama("meta"), {"dp": 2, "tp": 2})
        else:
            mesh = mesh_1d(world)
            plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
        inst = apply(model, plan, mesh, mode=mode)  # type: ignore[arg-type]
        cls = MixedSFT if how == "mixin" else HyperrecipeSFTTrainer
        try:
            trainer = cls(model=model, installation=inst, args=args, **sets)
        except TrainerSetupError as exc:
            return f"{type(exc).__name__}: {exc}"
    trainer.train(resume_from_checkpoint=resume)
    if history:  # every log line, and an evaluate()'s
        trainer.evaluate(_data(7))
        return trainer.state.log_history
    logged = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history
              if "loss" in h]
    if resume is None and how in ("one", "sft"):  # eval_loss as the step-0 entry
        logged.insert(0, (0, trainer.evaluate(_data(7))["eval_loss"], 0.0))
    return logged


def _assert_same_run(actual: Any, expected: Any) -> None:
    assert isinstance(actual, list), actual
    assert [s for s, _, _ in actual] == [s for s, _, _ in expected]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(actual, expected, strict=True):
        assert loss == pytest.approx(ref_loss, abs=ATOL), f"loss at step {step}"
        assert norm == pytest.approx(ref_norm, rel=RTOL, abs=ATOL), f"grad_norm at step {step}"


def test_sft_at_tp2_in_production_matches_one_process_and_resumes_at_tp1(
        tmp_path: Path) -> None:
    """SFTTrainer's fused LM head multiplies by the output weight itself; on production shards
    it got this rank's vocab slice (measured: step 1's loss 4.147 where one process has 4.841,
    nothing warned). HyperrecipeSFTTrainer hands it the gathered weight: one process's losses
    and norms, and ``evaluate()`` on 7 samples one process's eval_loss (logged as step 0); its
    checkpoint resumes at tp=1."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", "production", None,
                    timeout_s=600)[0]
    assert isinstance(ref, list) and all(n > 2 * MAX_GRAD_NORM for _, _, n in ref[1:])
    out = tmp_path / "tp2"
    for ranks in run_ranks(_worker, 2, str(out), "sft", "production", None, timeout_s=600):
        _assert_same_run(ranks, ref)
    resumed = run_ranks(_worker, 1, str(out), "sft", "production", str(out / "checkpoint-3"),
                        timeout_s=600)[0]
    assert isinstance(resumed, list), resumed
    _assert_same_run([r for r in resumed if r[0] > 3], ref[4:])


def test_sft_at_tp2_in_validate_mode_matches_one_process(tmp_path: Path) -> None:
    """Validate mode's output weight is a DTensor, which TRL's fused head gathers itself."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", "production", None,
                    timeout_s=600)[0]
    for ranks in run_ranks(_worker, 2, str(tmp_path / "v"), "sft", "validate", None,
                           timeout_s=600):
        _assert_same_run(ranks, ref)


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_sft_at_dp2_tp2_matches_one_process(tmp_path: Path) -> None:
    """Each dp rank gets half of one process's batch of 4 and DDP averages over dp only; TRL
    scales the loss by the world over ``get_tp_size()``, the ranks that share a batch."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", "production", None, 4,
                    timeout_s=600)[0]
    for ranks in run_ranks(_worker, 4, str(tmp_path / "dp-tp"), "dp-tp", "production", None, 2,
                           timeout_s=900):
        _assert_same_run(ranks, ref[1:])  # ref[0]: one process's eval_loss


def test_the_bare_mixin_over_sfttrainer_in_production_is_refused_by_name(
        tmp_path: Path) -> None:
    for res in run_ranks(_worker, 2, str(tmp_path), "mixin", "production", None,
                         timeout_s=600):
        assert isinstance(res, str) and res.startswith(
            "TrainerSetupError: HyperrecipeTrainer: MixedSFT patched the model with TRL's fused "
            "LM head"), res


# -- DPO ------------------------------------------------------------------------------------
# DPOTrainer scores the policy and the reference through TRL's fused head as SFT does. One
# process: the stock DPOTrainer with a plain copy of the initial model as ref_model; tp=2: the
# same plain ref_model, to which the trainer applies the policy's plan. Three steps,
# max_grad_norm 0.5, against one process: losses to atol 1e-5, logged grad_norm to rtol 1e-5,
# and DPO's own reward metrics to 1e-5.


def _pairs(n: int) -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)

    def text(k: int) -> list[str]:
        ids = torch.randint(3, TINY_LLAMA["vocab_size"], (n, k), generator=g)
        return [" ".join(f"t{i}" for i in row) for row in ids.tolist()]

    return Dataset.from_dict({"prompt": text(5), "chosen": text(4), "rejected": text(3)})


def _dpo_worker(rank: int, world: int, out: str, how: str, mode: str,
                history: bool = False, precompute: bool = False) -> Any:
    """``how``: ``one`` (stock DPOTrainer), ``dpo`` (HyperrecipeDPOTrainer at tp=world),
    ``mixin`` (``class _(HyperrecipeTrainerMixin, DPOTrainer)``), ``applied-ref`` (a
    ref_model with a plan of its own)."""
    from trl import DPOConfig, DPOTrainer

    from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainerMixin
    from hyperrecipe.trainers.trl import HyperrecipeDPOTrainer

    class MixedDPO(HyperrecipeTrainerMixin, DPOTrainer):  # type: ignore[misc]
        pass

    model, ref = llama(), llama()
    args = DPOConfig(output_dir=out, per_device_train_batch_size=2, max_steps=3,
                     learning_rate=1e-2, max_grad_norm=MAX_GRAD_NORM, logging_steps=1,
                     save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                     bf16=False, precompute_ref_log_probs=precompute)
    pairs = _pairs(12)
    if precompute:  # TRL caches the scores beside the dataset's files, for every rank to read
        from datasets import load_from_disk

        pairs = load_from_disk(out + "-pairs")
    sets = {"ref_model": None if how == "no-ref" else ref, "train_dataset": pairs,
            "processing_class": _tokenizer()}
    if how == "one":
        trainer = DPOTrainer(model=model, args=args, **sets)
    else:
        plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
        inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
        if how == "no-ref":
            how = "dpo"
        more: dict[str, Any] = {}
        if how in ("applied-ref", "planned-ref"):
            ref_inst = apply(ref, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
            if how == "planned-ref":
                more["ref_installation"] = ref_inst
        cls = MixedDPO if how == "mixin" else HyperrecipeDPOTrainer
        try:
            trainer = cls(model=model, installation=inst, args=args, **sets, **more)
        except TrainerSetupError as exc:
            return f"{type(exc).__name__}: {exc}"
    trainer.train()
    if history:
        return trainer.state.log_history
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen")
    return [(h["step"], *(float(h[k]) for k in keys)) for h in trainer.state.log_history
            if "loss" in h]


def _assert_same_dpo_run(actual: Any, expected: Any) -> None:
    assert isinstance(actual, list), actual
    assert [r[0] for r in actual] == [r[0] for r in expected] and len(actual) == 3
    for got, ref in zip(actual, expected, strict=True):
        step, loss, norm, *metrics = got
        assert loss == pytest.approx(ref[1], abs=ATOL), f"loss at step {step}"
        assert norm == pytest.approx(ref[2], rel=RTOL, abs=ATOL), f"grad_norm at step {step}"
        assert metrics == pytest.approx(list(ref[3:]), rel=RTOL, abs=ATOL), f"step {step}"


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_dpo_at_tp2_matches_one_process(mode: str, tmp_path: Path) -> None:
    """Production: the bare mixin is refused (TRL's head got this rank's vocab slice);
    HyperrecipeDPOTrainer hands it the gathered weight. Validate: TRL gathers the DTensor
    weight itself. Both give one process's losses, norms and reward metrics."""
    ref = run_ranks(_dpo_worker, 1, str(tmp_path / "one"), "one", "production",
                    timeout_s=600)[0]
    assert all(r[2] > MAX_GRAD_NORM for r in ref), ref  # every step clips
    for ranks in run_ranks(_dpo_worker, 2, str(tmp_path / "tp2"), "dpo", mode, timeout_s=600):
        _assert_same_dpo_run(ranks, ref)


def test_dpo_refusals_name_the_route(tmp_path: Path) -> None:
    """The bare mixin over DPOTrainer in production, and a ref_model with a plan applied."""
    for res in run_ranks(_dpo_worker, 2, str(tmp_path), "mixin", "production", timeout_s=600):
        assert isinstance(res, str) and res.startswith(
            "TrainerSetupError: HyperrecipeTrainer: MixedDPO patched the model with TRL's fused "
            "LM head"), res
        assert "HyperrecipeDPOTrainer" in res
    _pairs(12).save_to_disk(f"{tmp_path}-pairs")
    for res in run_ranks(_dpo_worker, 2, str(tmp_path), "no-ref", "production", False, True,
                         timeout_s=600):
        assert isinstance(res, str) and res.startswith(
            "TrainerSetupError: HyperrecipeDPOTrainer: precompute_ref_log_probs=True without a "
            "ref_model"), res
    for res in run_ranks(_dpo_worker, 2, str(tmp_path), "applied-ref", "production",
                         timeout_s=600):
        assert isinstance(res, str) and res.startswith(
            "TrainerSetupError: HyperrecipeDPOTrainer: ref_model (LlamaForCausalLM) has an "
            "applied plan"), res


# -- every logged number ------------------------------------------------------------------


def test_every_number_sft_logs_at_tp2_is_one_process_s(tmp_path: Path) -> None:
    """Every key of every SFT log line, and of an ``evaluate()``, against one process:
    ``num_tokens`` (TRL gathers each batch's token count over the world and divides by its
    ``_tp_size``, 1 without accelerate's ParallelismConfig: measured 32, 64, ... at tp=2
    against 16, 32, ...), ``entropy``, ``mean_token_accuracy``, ``total_flos`` and the rates
    by the counts they imply."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), "one", "production", None, 2, True,
                    timeout_s=600)[0]
    assert any("num_tokens" in h for h in ref), ref
    for ranks in run_ranks(_worker, 2, str(tmp_path / "tp2"), "sft", "production", None, 2,
                           True, timeout_s=600):
        assert_same_logs(ranks, ref)


def test_every_number_dpo_logs_at_tp2_is_one_process_s(tmp_path: Path) -> None:
    """Every key of every DPO log line against one process, with the reference passed as a
    plain whole model: ``num_tokens`` (measured 190 at tp=2 against 95 before), rewards,
    margins, log-probabilities, logits, entropy, accuracy, ``rewards/accuracies`` at step 1
    included. There policy and reference have the same weights, so one process's rewards are
    exactly 0 and ``chosen > rejected`` never holds (0.0); before HyperrecipeDPOTrainer applied
    the policy's plan to a plain reference, the reference was scored whole and the policy
    sharded, 1e-7 apart (the row-parallel sums), and ``>`` turned that rounding into 0.5
    (issue #40). Now its step-1 rewards are exactly 0 on every rank too."""
    ref = run_ranks(_dpo_worker, 1, str(tmp_path / "one"), "one", "production", True,
                    timeout_s=600)[0]
    assert any("num_tokens" in h for h in ref), ref
    assert ref[0]["rewards/accuracies"] == 0.0 and ref[0]["rewards/chosen"] == 0.0
    for ranks in run_ranks(_dpo_worker, 2, str(tmp_path / "tp2"), "dpo", "production", True,
                           timeout_s=600):
        assert ranks[0]["rewards/chosen"] == ranks[0]["rewards/rejected"] == 0.0
        assert ranks[0]["rewards/accuracies"] == 0.0
        assert_same_logs(ranks, ref)


def test_dpo_with_precomputed_reference_log_probs_at_tp2_logs_one_process_s(
        tmp_path: Path) -> None:
    """``precompute_ref_log_probs=True`` with a plain ``ref_model``: TRL scores the reference
    once over batches it splits over every rank (the whole reference on each: no collective)
    and gathers them in order; every logged number is one process's but ``rewards/accuracies``
    at step 1: a precomputed plain reference stays whole (a sharded one cannot run TRL's
    split batches), its scores 1e-7 from the sharded policy's, and ``>`` counts that as 0.5
    against one process's 0.0 (issue #40, left open for this route). Without a ``ref_model`` it is refused (the refusals test).
    The pairs are read from disk (a copy per run), where TRL's cache of the scores, written by
    rank 0, is seen by every rank (an in-memory dataset's cache is a per-process temp folder:
    rank 1 then fails to open rank 0's file, loudly, with the stock trainer too)."""
    for run in ("one", "tp2"):
        _pairs(12).save_to_disk(str(tmp_path / f"{run}-pairs"))
    ref = run_ranks(_dpo_worker, 1, str(tmp_path / "one"), "one", "production", True, True,
                    timeout_s=600)[0]
    for ranks in run_ranks(_dpo_worker, 2, str(tmp_path / "tp2"), "dpo", "production", True,
                           True, timeout_s=600):
        assert_same_logs(ranks, ref, not_compared=frozenset({(1, "rewards/accuracies")}))


def test_dpo_with_the_reference_under_the_same_plan_logs_exactly_one_process_s(
        tmp_path: Path) -> None:
    """The reference applied with the policy's plan and passed with ``ref_installation=``:
    scored by the policy's own program, its log-probabilities at step 1 (equal weights) are
    the policy's bit for bit, as in one process, so every logged number is one process's,
    ``rewards/accuracies`` at step 1 included (0.0; with a whole reference 0.5: the two
    programs differ by rounding, which TRL's ``chosen > rejected`` counts)."""
    ref = run_ranks(_dpo_worker, 1, str(tmp_path / "one"), "one", "production", True,
                    timeout_s=600)[0]
    assert ref[0]["rewards/accuracies"] == 0.0 and ref[0]["rewards/chosen"] == 0.0
    for ranks in run_ranks(_dpo_worker, 2, str(tmp_path / "tp2"), "planned-ref", "production",
                           True, timeout_s=600):
        assert ranks[0]["rewards/chosen"] == 0.0
        assert_same_logs(ranks, ref)
