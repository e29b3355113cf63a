"""Pipeline beside tensor parallel: pp=2 x tp=2 on four real gloo ranks matches one process.

Each stage model is applied with its share of the plan (a shipped tp recipe extended with a
``pipeline`` section), in both modes. Checked: the loss, every parameter's full gradient
(gathered over tp by the stage's installation), the clipped norm, and a rank holding only a
tp-th of its stage. Tolerance as the pp-only tests: per gradient, max |error| <= 1e-5 x max
|reference| (fp32); loss within 1e-5.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from tests.support.pipeline_harness import RTOL, batch, rel_err, reference, tiny

ROOT = Path(__file__).resolve().parents[3]
EXTENDS = {"llama": "llama", "gpt2": "gpt2", "qwen3": "qwen3", "mixtral": "mixtral"}
LAYERS = {"gpt2": "transformer.h"}


def _plan(family: str, schedule: str, per_rank: int, model: Any) -> Any:
    from hyperrecipe import compile_recipe

    extra = f"  stages_per_rank: {per_rank}\n" if per_rank > 1 else ""
    text = (f"recipe: {family}-pp-tp\nversion: 1\nmesh: [pp, tp]\nextends: {EXTENDS[family]}\n"
            f"pipeline:\n  layers: {LAYERS.get(family, 'model.layers')}\n"
            f"  schedule: {schedule}\n  microbatches: 4\n{extra}rules: []\n")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.yaml"
        path.write_text(text)
        return compile_recipe(str(path), model, {"pp": 2, "tp": 2})


def _worker(rank: int, world: int, family: str, cases: list[tuple[str, int, str]]
            ) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.runtime import build_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    out = []
    for schedule, per_rank, mode in cases:
        ref_loss, ref_grads = reference(family, 4)
        ref = tiny(family, 4)
        ids, labels = batch()
        ref(input_ids=ids, labels=labels).loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
        model = tiny(family, 4)
        plan = _plan(family, schedule, per_rank, model)
        pipe = build_pipeline(model, plan, mesh, mode=mode)  # type: ignore[arg-type]
        loss = pipe.step(input_ids=ids, labels=labels)
        full = pipe.full_grads()
        local = sum(t.numel() for _, p in pipe.named_parameters()
                    for t in [getattr(p, "_local_tensor", p)])
        whole = sum(ref_grads[f].numel() for f in full)
        norm = pipe.clip_grad_norm_(0.5).item()
        out.append({"loss_err": abs(loss.item() - ref_loss),
                    "grad_err": max(rel_err(g, ref_grads[f]) for f, g in full.items()),
                    "held": sorted(full), "norm_err": abs(norm - ref_norm) / ref_norm,
                    "local": local, "whole": whole})
        pipe.restore()
    return out


CASES = {
    "llama": [("1F1B", 1, "production"), ("1F1B", 1, "validate"),
              ("Interleaved1F1B", 2, "production")],
    "gpt2": [("GPipe", 1, "production"), ("GPipe", 1, "validate")],
    "qwen3": [("1F1B", 1, "production"), ("1F1B", 1, "validate")],
    # validate mode refuses transformers' default grouped_mm experts in fp32 by name (the
    # ValidateUnsupportedError of any Mixtral plan on this torch); production runs them
    "mixtral": [("1F1B", 1, "production")],
}


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", sorted(CASES))
def test_pp2_tp2_matches_one_process_in_both_modes(family: str) -> None:
    cases = CASES[family]
    by_rank = run_ranks(_worker, 4, family, cases, timeout_s=400)
    _, ref_grads = reference(family, 4)
    for i, case in enumerate(cases):
        results = [by_rank[r][i] for r in range(4)]
        held = {f for r in results for f in r["held"]}
        assert held == set(ref_grads), case
        for r in results:
            assert r["loss_err"] <= 1e-5, (case, r["loss_err"])
            assert r["grad_err"] <= RTOL, (case, r["grad_err"])
            assert r["norm_err"] <= 1e-5, (case, r["norm_err"])
            assert r["local"] < 0.75 * r["whole"], case  # a tp-th of the sharded weights


def _v_tie_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.errors import PipelineUnsupportedError
    from hyperrecipe.runtime import build_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = tiny("gpt2", 4)
    before = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    plan = _plan("gpt2", "ZBVZeroBubble", 2, model)
    try:
        build_pipeline(model, plan, mesh)
    except PipelineUnsupportedError as exc:
        message = str(exc)
    else:
        message = ""
    after = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return {"message": message, "untouched": after == before}


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_a_tie_across_two_stages_of_one_rank_beside_tp_is_refused_before_anything_changes(
        ) -> None:
    # ZBV puts GPT-2's first and last stage (wte and lm_head, one tied weight) on pp rank 0
    for r in run_ranks(_v_tie_worker, 4, timeout_s=120):
        assert r["message"] == (
            "pipeline ZBVZeroBubble puts stages [0, 3], which share the tied weight "
            "transformer.wte.weight, on one rank; beside tensor parallel each stage holds its "
            "own shard of it, which is not supported yet: use a loop-placed schedule (1F1B, "
            "Interleaved1F1B) for this model, or untie the weights")
        assert r["untouched"]


def test_apply_refuses_a_pipelined_plan_naming_build_pipeline() -> None:
    """apply would run the whole model on every rank: refused before any collective."""
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.errors import UsageError
    from hyperrecipe.runtime import apply

    model = tiny("llama", 4)
    plan = _plan("llama", "1F1B", 1, model)
    fake = DeviceMesh.__new__(DeviceMesh)  # never used: the refusal comes first
    with pytest.raises(UsageError) as err:
        apply(model, plan, fake)
    assert str(err.value) == (
        "apply: plan 'llama-pp-tp' pipelines the model over pp (2 stages, 1F1B); apply would "
        "run the whole model on every rank instead: build the pipeline with "
        "hyperrecipe.runtime.build_pipeline(model, plan, mesh) "
        "(docs/pipeline.md#running-a-pipeline)")


def _tied_load_worker(rank: int, world: int, folder: str, tp: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from hyperrecipe.runtime import build_pipeline

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    if tp > 1:
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("pp", "tp"))
        plan = _plan("gpt2", "1F1B", 1, model)
    else:
        from tests.support.pipeline_plans import pipeline_plan

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        plan = pipeline_plan(model, layers="transformer.h", schedule="1F1B")
    pipe = build_pipeline(model, plan, mesh)
    pipe.state.load_weights(folder)
    ids, labels = batch()
    return float(pipe.step(input_ids=ids, labels=labels).item())


@pytest.mark.slow  # six ranks in two launches (docs/benchmarks.md#test-suite)
def test_a_tied_checkpoint_loads_into_both_stages_at_pp2_and_pp2_tp2(tmp_path: Path) -> None:
    """transformers saves GPT-2's tied head once, as transformer.wte.weight: the last stage's
    copy (lm_head.weight, untied from stage 0's beside tp) reads it under that name."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "gpt2")
    tiny("gpt2", 4).save_pretrained(folder)
    ids, labels = batch()
    expected = AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids, labels=labels).loss
    for tp in (1, 2):
        for loss in run_ranks(_tied_load_worker, 2 * tp, folder, tp, timeout_s=180):
            assert abs(loss - expected.item()) <= 1e-5, (tp, loss, expected.item())
