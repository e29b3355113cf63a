"""A pipelined plan handed to a trainer route other than our own loop is refused by name, with
the route to use, before the trainer changes anything (issue 38, item 6).

The Hugging Face Trainer, TRL, accelerate and Lightning run the whole model's forward and
backward on every rank, not a pipeline schedule (``apply`` itself refuses a pipelined plan). One
launch of 2 gloo ranks builds ``recipes/llama-pp.yaml``'s pipeline at pp=2 on the tiny Llama and
hands each route its ``Pipeline`` (or, for Lightning, the recipe); each test reads its route's
outcome. torchtitan's route refuses ``pp`` in its ``ParallelDims`` and a pipelined
``recipe=`` in-process (no ranks needed: the refusal comes before any mesh is read).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="pip install '.[hf]'")

from hyperrecipe.check.launcher import run_ranks  # noqa: E402
from hyperrecipe.errors import PlanMismatchError, TrainerSetupError  # noqa: E402
from tests.support.runtime_harness import llama  # noqa: E402

ROUTE = ("hyperrecipe.runtime.build_pipeline in your own loop "
         "(docs/training.md#pipeline-parallel) or with tools/train.py --pp N")


def _state(model: torch.nn.Module) -> tuple[Any, ...]:
    return ({n: (id(p), p.data_ptr()) for n, p in model.named_parameters()},
            {n for n, m in model.named_modules() if "forward" in vars(m)})


def _outcome(attempt: Any, model: torch.nn.Module) -> dict[str, Any]:
    before = _state(model)
    try:
        attempt()
    except TrainerSetupError as exc:
        message: str | None = str(exc)
    else:
        message = None
    return {"message": message, "untouched": _state(model) == before}


def _routes_worker(rank: int, world: int, out: str) -> dict[str, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    import hyperrecipe
    from hyperrecipe.runtime import build_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    model: Any = llama()
    inst = build_pipeline(model, hyperrecipe.compile_recipe("llama-pp", model, {"pp": world}),
                          mesh)
    results: dict[str, dict[str, Any]] = {}
    if importlib.util.find_spec("transformers") is not None:
        from transformers import TrainingArguments

        from hyperrecipe.trainers.hf_trainer import HyperrecipeTrainer

        results["hf_trainer"] = _outcome(lambda: HyperrecipeTrainer(
            model=model, installation=inst, args=TrainingArguments(output_dir=out, use_cpu=True)), model)
    if importlib.util.find_spec("trl") is not None:
        from trl import SFTConfig

        from hyperrecipe.trainers.trl import HyperrecipeSFTTrainer

        results["trl"] = _outcome(lambda: HyperrecipeSFTTrainer(
            model=model, installation=inst, args=SFTConfig(output_dir=out, use_cpu=True, bf16=False)), model)
    if importlib.util.find_spec("accelerate") is not None:
        from hyperrecipe.trainers.accelerate import HyperrecipeAccelerator

        accelerator = HyperrecipeAccelerator(cpu=True)
        opt = torch.optim.AdamW(inst.parameters())
        results["accelerate"] = _outcome(
            lambda: accelerator.prepare(model, opt, installation=inst), model)
        results["accelerate"]["nothing_prepared"] = (accelerator.installation is None
                                                     and not accelerator._models)
    if importlib.util.find_spec("lightning") is not None:
        from hyperrecipe.trainers.lightning import HyperrecipeStrategy

        fresh: Any = llama()
        strategy = HyperrecipeStrategy(tensor_parallel_size=1)
        results["lightning"] = _outcome(lambda: strategy.apply(fresh, "llama-pp"), fresh)
        results["lightning"]["nothing_applied"] = strategy.installation is None
    inst.restore()
    return results


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    out = str(tmp_path_factory.mktemp("refused"))
    return run_ranks(_routes_worker, 2, out, timeout_s=300)


def _assert_refused(routes: list[dict[str, dict[str, Any]]], route: str, trainer: str) -> None:
    if route not in routes[0]:
        pytest.skip(f"{route} is not installed")
    for rank in routes:
        res = rank[route]
        assert res["message"] is not None, f"{trainer} accepted a pipelined plan"
        assert res["message"].startswith(f"{trainer}: got a Pipeline (build_pipeline's "
                                         f"handle)") or trainer == "HyperrecipeStrategy"
        assert "Pipeline parallelism is not supported through" in res["message"]
        assert ROUTE in res["message"]
        assert res["untouched"]
        assert all(v for k, v in res.items() if k.startswith("nothing"))


def test_the_hf_trainer_refuses_a_pipelined_plan_naming_our_loop_and_train_py(
        routes: list[dict[str, dict[str, Any]]]) -> None:
    _assert_refused(routes, "hf_trainer", "HyperrecipeTrainer")


def test_trl_refuses_a_pipelined_plan_naming_our_loop_and_train_py(
        routes: list[dict[str, dict[str, Any]]]) -> None:
    _assert_refused(routes, "trl", "HyperrecipeSFTTrainer")


def test_accelerate_refuses_a_pipelined_plan_before_preparing_anything(
        routes: list[dict[str, dict[str, Any]]]) -> None:
    _assert_refused(routes, "accelerate", "HyperrecipeAccelerator")


def test_lightning_refuses_a_pipelined_recipe_before_applying_it(
        routes: list[dict[str, dict[str, Any]]]) -> None:
    _assert_refused(routes, "lightning", "HyperrecipeStrategy")
    assert routes[0]["lightning"]["message"].startswith(
        "HyperrecipeStrategy.apply: recipe 'llama-pp' has a pipeline section (schedule 1F1B)")


def test_torchtitan_refuses_pp_and_a_pipelined_recipe_naming_our_loop() -> None:
    pytest.importorskip("torchtitan", reason="the `titan` extra")
    from torchtitan.distributed import ParallelDims

    from hyperrecipe.trainers.torchtitan import parallelize

    model: Any = llama()
    before = {n: id(p) for n, p in model.named_parameters()}
    pp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    with pytest.raises(PlanMismatchError, match="the job asks for pp=2") as exc:
        parallelize(model, parallel_dims=pp)
    assert ROUTE in str(exc.value)
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    with pytest.raises(PlanMismatchError, match="recipe 'llama-pp' has a pipeline section") as exc:
        parallelize(model, parallel_dims=one, recipe="llama-pp")
    assert ROUTE in str(exc.value)
    assert {n: id(p) for n, p in model.named_parameters()} == before
