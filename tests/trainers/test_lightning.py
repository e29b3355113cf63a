"""PyTorch Lightning over an applied plan (``hyperrecipe.trainers.lightning``), on real gloo
ranks: tiny Llama (``recipes/llama.yaml``) applied in ``configure_model`` through
``HyperrecipeStrategy``, five AdamW steps of the model's own ``labels=`` loss with Lightning's
``gradient_clip_val=0.5`` (every step clips), against Lightning on the whole model in one
process with the same seed and batch order. Losses agree to atol 1e-5 (measured: 2e-6).

Lightning's own checkpoint (``ModelCheckpoint``, a sharded DCP folder) written at step 3 at tp=2
resumes at tp=1 with the uninterrupted run's losses for steps 4 and 5. Lightning's own
``ModelParallelStrategy`` with the plan applied by hand clips right too (hyperrecipe supplies
torch's ``clip_grad_norm_`` the full norm; before that, losses were off by 7e-3 at step 5), but
refuses to resume ("Could not find a distributed model in the provided checkpoint
state").
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # trainer runs on launched ranks (docs/benchmarks.md#test-suite)

pytest.importorskip("lightning", reason="pip install '.[trainers]' (lightning 2.6)")
pytest.importorskip("transformers", reason="pip install '.[hf]'")

from hyperrecipe.check.launcher import run_ranks  # noqa: E402
from hyperrecipe.errors import TrainerSetupError  # noqa: E402
from tests.support.checkpoint_harness import Hostile, resume_refused  # noqa: E402
from tests.support.runtime_harness import ROOT, TINY_LLAMA, llama  # noqa: E402

LLAMA = str(ROOT / "recipes/llama.yaml")
DP_TP = str(ROOT / "recipes/llama-dp.yaml")
LOSS_ATOL = 1e-5


def _data(n: int = 6) -> list[dict[str, torch.Tensor]]:
    """Three batches per dp rank: an epoch ends at step 3, where the checkpoint is taken
    (Lightning restarts an epoch's loader from its start on resume)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (n, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _worker(rank: int, world: int, out: str, planned: bool, resume: str | None,
            apply_plan: bool = True, stock: bool = False, dp: int = 1,
            batch: int = 2, norms: bool = False) -> Any:
    """``stock``: Lightning's own ``ModelParallelStrategy`` with the plan applied by hand in
    ``configure_model`` (what a user without the integration writes); ``norms``: return,
    beside the losses, what Lightning's ``grad_norm(self, 2)`` and hyperrecipe's gave in each
    ``on_before_optimizer_step``."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, DistributedSampler

    from hyperrecipe import apply, compile_recipe
    from hyperrecipe.trainers.lightning import HyperrecipeStrategy
    from tests.support.runtime_harness import mesh_1d

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()
            self.losses: list[tuple[int, float]] = []
            self.norms: list[dict[str, float]] = []
            self.stock_norms: list[dict[str, float]] = []

        def configure_model(self) -> None:
            if stock:
                plan = compile_recipe(LLAMA, self.model, {"tp": world})
                apply(self.model, plan, mesh_1d(world))
            elif planned and apply_plan:
                self.trainer.strategy.apply(
                    self.model, LLAMA if dp == 1 else DP_TP,
                    fully_shard_modules=lambda m: m.model.layers)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.losses.append((self.global_step, float(loss.detach())))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if norms:
                from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

                from hyperrecipe.trainers.lightning import grad_norm

                self.norms.append({k: float(v) for k, v in grad_norm(self, 2).items()})
                self.stock_norms.append(
                    {k: float(v) for k, v in lightning_grad_norm(self, 2).items()})

    data = _data(3 * batch * dp)
    if planned:  # Lightning puts its DistributedSampler over `data_parallel` (size 1) in
        loader = DataLoader(data, batch_size=batch)
        strategy = (ModelParallelStrategy(tensor_parallel_size=world) if stock
                    else HyperrecipeStrategy(tensor_parallel_size=world // dp,
                                             data_parallel_size=dp))
        extra: dict[str, Any] = {"strategy": strategy}
    else:  # the same sampler, given by hand: one process keeps a loader's own sampler
        loader = DataLoader(data, batch_size=batch,
                            sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))
        extra = {"use_distributed_sampler": False}
    save = [L.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1)]
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=5, gradient_clip_val=0.5,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=save if resume is None else [], default_root_dir=out, **extra)
    lit = LitLlama()
    trainer.fit(lit, loader, ckpt_path=resume)
    if norms:
        return {"losses": lit.losses, "norms": lit.norms, "stock": lit.stock_norms}
    return lit.losses


def test_grad_norm_under_the_strategy_gives_one_process_s_per_parameter_norms(
        tmp_path: Path) -> None:
    """``hyperrecipe.trainers.lightning.grad_norm(self, 2)`` in
    ``on_before_optimizer_step`` at tp=2 gives one process's every key (each parameter's norm
    and the total) at every step, to rtol 1e-5 at the first step and 1e-4 after (the weights'
    rounding drift through AdamW). Lightning's own ``grad_norm`` there reads each
    rank's shards (its total at step 1 measured 2.938 and 2.509 on the two ranks where one process has 3.864); in one
    process both agree exactly."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), False, None, True, False, 1, 2, True,
                    timeout_s=600)[0]
    assert ref["norms"] == ref["stock"] and len(ref["norms"]) == 5
    total = "grad_2.0_norm_total"
    for ranks in run_ranks(_worker, 2, str(tmp_path / "tp2"), True, None, True, False, 1, 2,
                           True, timeout_s=600):
        assert [v for _, v in ranks["losses"]] == pytest.approx(
            [v for _, v in ref["losses"]], abs=LOSS_ATOL)
        for step, (got, want) in enumerate(zip(ranks["norms"], ref["norms"], strict=True)):
            assert sorted(got) == sorted(want), step
            # step 0: the same weights, only the sum's order differs; later steps also carry
            # the weights' rounding drift, which AdamW's normalised updates amplify (measured
            # 1.1e-5 relative on one norm at step 4, torch 2.13 CPU)
            rel = 1e-5 if step == 0 else 1e-4
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=rel, abs=1e-6), (step, key)
        # Lightning's own reads the shards: the test would see it (and it is why ours exists)
        assert ranks["stock"][0][total] != pytest.approx(ref["norms"][0][total], rel=1e-2)


def test_stock_model_parallel_strategy_clips_by_the_full_norm(tmp_path: Path) -> None:
    """Lightning's own strategy with the plan applied by hand (docs/training.md's table keeps
    this row): ``gradient_clip_val`` reaches ``torch.nn.utils.clip_grad_norm_`` over the
    optimizer's parameters, to which hyperrecipe supplies the full norm while the installation
    lives (``torch_clip_guard``), so the losses are one process's (without it they left one
    process's with nothing raised, measured 7e-3 off at step 5)."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), False, None, timeout_s=600)[0]
    for stock in run_ranks(_worker, 2, str(tmp_path / "stock"), True, None, True, True,
                           timeout_s=600):
        assert [v for _, v in stock] == pytest.approx([v for _, v in ref], abs=LOSS_ATOL)


def _refusal_worker(rank: int, world: int, out: str) -> str:
    try:
        _worker(rank, world, out, True, None, apply_plan=False)
    except TrainerSetupError as exc:
        return str(exc)
    return "ran"


def test_lightning_at_tp2_clips_like_one_process_and_resumes_at_tp1(tmp_path: Path) -> None:
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), False, None, timeout_s=600)[0]
    assert [s for s, _ in ref] == [0, 1, 2, 3, 4]
    out = tmp_path / "tp2"
    for losses in run_ranks(_worker, 2, str(out), True, None, timeout_s=600):
        assert [s for s, _ in losses] == [s for s, _ in ref]
        assert [v for _, v in losses] == pytest.approx([v for _, v in ref], abs=LOSS_ATOL)
    ckpt = out / "epoch=0-step=3.ckpt"
    assert (ckpt / ".metadata").is_file() and (ckpt / "meta.pt").is_file()  # sharded DCP
    resumed = run_ranks(_worker, 1, str(tmp_path / "tp1"), True, str(ckpt), timeout_s=600)[0]
    assert [s for s, _ in resumed] == [3, 4]
    assert [v for _, v in resumed] == pytest.approx([v for _, v in ref[3:]], abs=LOSS_ATOL)
    # the sharded checkpoint is read as data (torch's dcp.load unpickles .metadata)
    hostile = shutil.copytree(ckpt, tmp_path / "hostile.ckpt")
    marker = tmp_path / "ran"
    (hostile / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    message = resume_refused(lambda: run_ranks(_worker, 1, str(tmp_path / "again"), True,
                                                str(hostile), timeout_s=600), marker)
    assert "refused: the pickle names posix.system" in message, message


def test_the_strategy_refuses_a_module_whose_configure_model_applied_no_plan(
        tmp_path: Path) -> None:
    """Without a plan the strategy would train an unsharded model as if it were sharded."""
    for res in run_ranks(_refusal_worker, 2, str(tmp_path), timeout_s=600):
        assert res.startswith("HyperrecipeStrategy: no plan was applied; call "
                              "self.trainer.strategy.apply(module, recipe) in the "
                              "LightningModule's configure_model()")


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_lightning_at_dp2_tp2_with_fully_shard_on_dp_matches_one_process(tmp_path: Path) -> None:
    """dp=2 x tp=2: Lightning's sampler gives each dp rank half of one process's batch of 4
    (so the mean of the two dp ranks' losses is one process's loss),
    fully_shard on dp (per decoder layer and the root) averages, clipping by the full norm
    counts each FSDP piece once. Losses equal one process's; the checkpoint at step 3 resumes at
    tp=2 (dp=1) with the uninterrupted run's losses."""
    ref = run_ranks(_worker, 1, str(tmp_path / "one"), False, None, True, False, 1, 4,
                    timeout_s=600)[0]
    out = tmp_path / "dp-tp"
    ranks = run_ranks(_worker, 4, str(out), True, None, True, False, 2, 2, timeout_s=900)
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3]  # the tp ranks of a replica agree
    mean = [(a + b) / 2 for (_, a), (_, b) in zip(ranks[0], ranks[2], strict=True)]
    assert mean == pytest.approx([v for _, v in ref], abs=LOSS_ATOL)  # each dp rank: half
    resumed = run_ranks(_worker, 2, str(tmp_path / "tp2"), True, str(out / "epoch=0-step=3.ckpt"),
                        True, False, 1, 4, timeout_s=600)[0]
    assert [s for s, _ in resumed] == [3, 4]
    assert [v for _, v in resumed] == pytest.approx([v for _, v in ref[3:]], abs=LOSS_ATOL)


def test_the_strategy_refuses_a_recipe_without_the_data_dim(tmp_path: Path) -> None:
    for res in run_ranks(_mesh_refusal_worker, 2, str(tmp_path), timeout_s=600):
        assert res.startswith("HyperrecipeStrategy.apply: the recipe's mesh is ['tp']; at "
                              "data_parallel_size=2 it must be ['dp', 'tp']")


def _mesh_refusal_worker(rank: int, world: int, out: str) -> str:
    import lightning.pytorch as L

    from hyperrecipe.trainers.lightning import HyperrecipeStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

        def configure_model(self) -> None:
            self.trainer.strategy.apply(self.model, LLAMA)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            raise AssertionError("not reached")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=1, logger=False,
                        strategy=HyperrecipeStrategy(tensor_parallel_size=1,
                                                     data_parallel_size=2),
                        enable_progress_bar=False, enable_checkpointing=False)
    try:
        trainer.fit(Lit(), [_data(2)])
    except TrainerSetupError as exc:
        return str(exc)
    return "ran"
