"""Training state on real gloo ranks: apply on meta, load_weights, DCP checkpoints, resume on
another tp size, export. Checkpoints are real: ``save_pretrained`` of a tiny transformers Llama
split into several safetensors files, and real ``torch.distributed.checkpoint`` folders.

Numerical comparisons are against one process with the same weights and batches, fp32,
atol 2e-6 / rtol 1e-5 (logits and gradients), and losses of resumed runs to atol 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import RankFailedError, run_ranks
from hyperrecipe.runtime.state.weights import WeightLoadError
from tests.support.runtime_harness import ROOT, TINY_LLAMA, assert_close, grads_of, llama, mesh_1d

LLAMA = str(ROOT / "recipes/llama.yaml")
CFG = {**TINY_LLAMA, "num_key_value_heads": 4}  # whole heads at tp=4 too
LOSS_ATOL = 1e-5


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG["vocab_size"], (2, 8), generator=g)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # the model's own defaults otherwise


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Hugging Face checkpoint folder, split into several safetensors files."""
    folder = tmp_path_factory.mktemp("hf-llama")
    model = llama(**{k: v for k, v in CFG.items() if k not in TINY_LLAMA or TINY_LLAMA[k] != v})
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


def _meta_applied(world: int, mode: str) -> tuple[nn.Module, Any]:
    meta = llama("meta", **_overrides())
    plan = compile_recipe(LLAMA, meta, {"tp": world})
    inst = apply(meta, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    return meta, inst


def _overrides() -> dict[str, Any]:
    return {k: v for k, v in CFG.items() if TINY_LLAMA.get(k) != v}


# -- apply on meta + load_weights ----------------------------------------------------------


def _meta_load_worker(rank: int, world: int, folder: str, mode: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, mode)
    before = [r.state for r in inst.state.status() if r.what == "weights"]
    devices = {p.device.type for p in model.parameters()}
    inst.state.load_weights(folder)
    rows = {r.what: r.state for r in inst.state.status() if r.what.startswith("weights")}
    local_numel = sum(p.numel() if not hasattr(p, "to_local") else p.to_local().numel()
                      for p in model.parameters())
    loss = _loss(model, _batch(0))
    loss.backward()
    return {"loss": loss.detach(), "grads": inst.full_grads(), "before": before, "rows": rows,
            "devices": sorted(devices), "local_numel": local_numel,
            "inv_freq": model.model.rotary_emb.inv_freq.clone()}


@pytest.mark.parametrize("mode", ["production"])
def test_meta_apply_then_load_weights_matches_one_process(hf_checkpoint: Path, mode: str) -> None:
    ref = llama(**_overrides())
    ref_loss = _loss(ref, _batch(0))
    ref_loss.backward()
    ref_grads = grads_of(ref)
    full_numel = sum(p.numel() for p in ref.parameters())
    results = run_ranks(_meta_load_worker, 2, str(hf_checkpoint), mode)
    for res in results:
        assert res["before"] == ["unset"], "status says the meta-built model has no values yet"
        assert res["rows"] == {"weights safetensors": "loaded", "weights torch": "not tried",
                               "weights dcp": "not tried"}
        assert res["devices"] == ["cpu"]
        assert res["local_numel"] < 0.6 * full_numel, "each rank allocated only its shards"
        torch.testing.assert_close(res["inv_freq"], ref.model.rotary_emb.inv_freq)
        torch.testing.assert_close(res["loss"], ref_loss.detach(), atol=2e-6, rtol=1e-5)
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"grad {name}")


def _bad_load_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, "production")
    try:
        inst.state.load_weights(folder)
    except WeightLoadError as exc:
        still_unset = all(torch.isnan(p).all() for p in model.parameters())
        return {"error": str(exc), "still_unset": still_unset,
                "rows": [(r.what, r.state) for r in inst.state.status() if r.what.startswith("weights")]}
    return {"error": None}


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _file_of(folder: Path, key: str) -> str:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return str(index["weight_map"][key])


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_truncated_checkpoint_names_the_file_and_leaves_the_model_unset(
        hf_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(hf_checkpoint, tmp_path / "ckpt")
    victim = folder / _file_of(folder, "model.layers.1.mlp.down_proj.weight")
    victim.write_bytes(victim.read_bytes()[:-100])
    res = run_ranks(_bad_load_worker, 2, str(folder))[0]
    assert res["error"] is not None
    assert f"{victim}: the header does not fit the file" in res["error"]
    assert "(a truncated file)" in res["error"]
    assert res["still_unset"]
    assert ("weights safetensors", "failed") in res["rows"] or res["rows"][0][1] == "failed"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_missing_and_misshaped_tensors_are_named_together_with_their_files(
        hf_checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy_checkpoint(hf_checkpoint, tmp_path / "ckpt")
    gone = "model.layers.0.self_attn.k_proj.weight"
    wrong = "model.layers.1.mlp.up_proj.weight"
    for key in (gone, wrong):
        path = folder / _file_of(folder, key)
        tensors = load_file(str(path))
        if key == gone:
            del tensors[key]
        else:
            tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][gone]
    index["weight_map"]["model.extra.weight"] = index["weight_map"][wrong]
    index_path.write_text(json.dumps(index))
    path = folder / index["weight_map"][wrong]
    tensors = load_file(str(path))
    tensors["model.extra.weight"] = torch.zeros(3)
    save_file(tensors, str(path), metadata={"format": "pt"})
    res = run_ranks(_bad_load_worker, 2, str(folder))[0]
    err = res["error"]
    assert err is not None and "does not fit the model (3 problems)" in err
    assert f"missing {gone!r} (shape [64, 64])" in err
    assert f"{wrong!r} in {index['weight_map'][wrong]}: shape [128, 63], the model expects [128, 64]" in err
    assert f"unexpected 'model.extra.weight' in {index['weight_map'][wrong]}" in err
    assert res["still_unset"]


# -- DCP checkpoints: save at tp=2, resume at tp=1, 2 and 4 -----------------------------------


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, _batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _reference_run() -> list[float]:
    model = llama(**_overrides())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return _train(model, opt, range(6))


def _save_worker(rank: int, world: int, folder: str, ckpt: str, mode: str) -> list[float]:
    import torch.distributed.checkpoint as dcp

    model, inst = _meta_applied(world, mode)
    inst.state.load_weights(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = _train(model, opt, range(3))
    dcp.save(inst.state.state_dict(opt), checkpoint_id=ckpt)
    return losses + _train(model, opt, range(3, 6))


def _resume_worker(rank: int, world: int, ckpt: str, mode: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, inst = _meta_applied(world, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = inst.state.state_dict(opt)  # optimizer state created, so DCP has somewhere to load
    dcp.load(state, checkpoint_id=ckpt)
    inst.state.load_state_dict(state, opt)
    unset = [r for r in inst.state.status() if r.what == "weights"]
    return {"losses": _train(model, opt, range(3, 6)), "unset": unset}


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    """Six AdamW steps of one process on the whole model: the uninterrupted run."""
    return _reference_run()


@pytest.fixture(scope="module")
def tp2_checkpoint(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
                   reference_losses: list[float]) -> str:
    """A DCP checkpoint of model and AdamW state after three steps at tp=2 (the run goes on to
    six steps, which equal the uninterrupted run's)."""
    ckpt = str(tmp_path_factory.mktemp("dcp") / "step-3")
    saved = run_ranks(_save_worker, 2, str(hf_checkpoint), ckpt, "production")[0]
    assert saved == pytest.approx(reference_losses, abs=LOSS_ATOL)
    return ckpt


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("resume_world", [
    1, 2, pytest.param(4, marks=pytest.mark.slow)])  # four ranks (docs/benchmarks.md#test-suite)
def test_dcp_checkpoint_at_tp2_resumes_at_other_tp_sizes_like_an_uninterrupted_run(
        tp2_checkpoint: str, reference_losses: list[float], resume_world: int) -> None:
    ref = reference_losses
    resumed = run_ranks(_resume_worker, resume_world, tp2_checkpoint, "production")
    for res in resumed:
        assert res["unset"] == []
        assert res["losses"] == pytest.approx(ref[3:], abs=LOSS_ATOL)


def _dcp_weights_worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, "production")
    inst.state.load_weights(ckpt)
    rows = {r.what: r.state for r in inst.state.status() if r.what.startswith("weights")}
    return {"rows": rows, "full": inst.state.full_state_dict()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_load_weights_reads_a_dcp_folder_saved_on_another_mesh(tp2_checkpoint: str) -> None:
    ckpt = tp2_checkpoint
    trained = run_ranks(_dcp_weights_worker, 2, ckpt)[0]
    assert trained["rows"] == {"weights safetensors": "ineligible", "weights torch": "ineligible",
                               "weights dcp": "loaded"}
    again = run_ranks(_dcp_weights_worker, 1, ckpt)[0]
    for name, value in trained["full"].items():
        torch.testing.assert_close(again["full"][name], value, atol=0, rtol=0)


def _stale_worker(rank: int, world: int) -> str:
    model = llama(**_overrides())
    plan = compile_recipe(LLAMA, llama("meta", **_overrides()), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode="production")
    model.to_empty(device="meta")  # replaces the parameter objects behind the installation
    try:
        inst.state.state_dict()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_state_dict_refuses_parameters_replaced_after_apply() -> None:
    msg = run_ranks(_stale_worker, 2)[0]
    assert msg.startswith("PlanMismatchError: model.embed_tokens.weight is on the meta device")


# -- torch's own state-dict API on a production-mode model ----------------------------------


def _torch_api_save_worker(rank: int, world: int, folder: str, ckpt: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, inst = _meta_applied(world, "production")
    inst.state.load_weights(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = _train(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    return losses + _train(model, opt, range(3, 6))  # the live state is untouched by saving


def _torch_api_resume_worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    model, inst = _meta_applied(world, "production")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, opt)
    kinds = sorted({type(v).__name__ for v in model_sd.values()})
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    moments = sorted({type(v).__name__ for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0})
    plain = not any(isinstance(p, DTensor) for p in model.parameters())
    return {"kinds": kinds, "moments": moments, "plain": plain,
            "losses": _train(model, opt, range(3, 6))}


@pytest.fixture(scope="module")
def torch_api_checkpoint(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
                         reference_losses: list[float]) -> str:
    ckpt = str(tmp_path_factory.mktemp("dcp-torch-api") / "step-3")
    saved = run_ranks(_torch_api_save_worker, 2, str(hf_checkpoint), ckpt)[0]
    assert saved == pytest.approx(reference_losses, abs=LOSS_ATOL)
    return ckpt


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("resume_world", [1, 2])
def test_get_state_dict_of_a_production_model_is_a_correct_dcp_checkpoint(
        torch_api_checkpoint: str, reference_losses: list[float], resume_world: int) -> None:
    """torch's get_state_dict/set_state_dict on local shards: DTensors out, shards back in."""
    ckpt = torch_api_checkpoint
    ref = reference_losses
    for info in run_ranks(_torch_api_resume_worker, resume_world, ckpt):
        if resume_world > 1:  # DTensors out of get_state_dict, local shards back in
            assert "DTensor" in info["kinds"] and info["moments"] == ["Tensor"] and info["plain"]
        assert info["losses"] == pytest.approx(ref[3:], abs=LOSS_ATOL)


# -- export -----------------------------------------------------------------------------------


def _export_worker(rank: int, world: int, folder: str, out: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, "production")
    inst.state.load_weights(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(2))
    inst.state.save_pretrained(out, max_shard_bytes=60_000)
    still_applied = not inst.restored and "forward" in vars(model.model.layers[0].self_attn)
    return {"full": inst.state.full_state_dict(), "still_applied": still_applied}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_save_pretrained_writes_what_from_pretrained_loads(hf_checkpoint: Path,
                                                           tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    res = run_ranks(_export_worker, 2, str(hf_checkpoint), str(out))[0]
    assert res["still_applied"]
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(out)
    state = loaded.state_dict()
    for name, value in res["full"].items():
        if name in state:
            torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=name)
    trained = res["full"]["model.layers.0.mlp.up_proj.weight"]
    original = llama(**_overrides()).state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(trained, original), "the export holds the trained weights"


def _one_rank_export_worker(rank: int, world: int, out: str) -> str:
    model = llama(**_overrides())
    plan = compile_recipe(LLAMA, llama("meta", **_overrides()), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode="production")
    inst.collective_timeout_s = 2.0
    if rank == 0:
        try:
            inst.state.save_pretrained(out)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    import time

    time.sleep(4.0)  # rank 1 is busy elsewhere, as under `if rank == 0: save`
    return "skipped"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_save_pretrained_on_one_rank_fails_fast_instead_of_hanging(tmp_path: Path) -> None:
    msg = run_ranks(_one_rank_export_worker, 2, str(tmp_path / "x"), timeout_s=60)[0]
    assert msg.startswith("PlanMismatchError: TrainingState.save_pretrained() is a collective: "
                          "every rank must call it")


# -- FSDP2 over dp after apply on tp --------------------------------------------------------

DP_TP = str(ROOT / "recipes/llama-dp.yaml")


def _fsdp_applied(folder: str | None) -> tuple[nn.Module, Any, Any, int]:
    """Meta-applied dp=2 x tp=2 Llama, weights loaded (when ``folder``), then FSDP2 on dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meta = llama("meta", **_overrides())
    plan = compile_recipe(DP_TP, meta, {"dp": 2, "tp": 2})
    inst = apply(meta, plan, mesh, mode="production")
    if folder is not None:
        inst.state.load_weights(folder)
    for layer in meta.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(meta, mesh=mesh["dp"])
    return meta, inst, torch.optim.AdamW(meta.parameters(), lr=1e-2, weight_decay=0.1), \
        mesh.get_local_rank("dp")


def _fsdp_train(model: nn.Module, opt: torch.optim.Optimizer, dp: int, steps: range,
                inst: Any = None) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    losses, grads = [], None
    for step in steps:
        ids = _batch(step)[dp:dp + 1]  # each dp rank its half of the batch
        loss = _loss(model, ids)
        loss.backward()
        if step == 0 and inst is not None:
            grads = inst.full_grads()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, grads


def _fsdp_worker(rank: int, world: int, folder: str, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, inst, opt, dp = _fsdp_applied(folder)
    losses, grads = _fsdp_train(model, opt, dp, range(3), inst)
    dcp.save(inst.state.state_dict(opt), checkpoint_id=ckpt)
    model_sd, optim_sd = get_state_dict(model, opt)  # torch's own API, through the hooks
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt + "-torch-api")
    more, _ = _fsdp_train(model, opt, dp, range(3, 6))
    try:
        inst.state.load_weights(folder)
        refusal = "no error"
    except Exception as exc:  # noqa: BLE001
        refusal = f"{type(exc).__name__}: {exc}"
    return {"losses": losses + more, "grads": grads, "full": inst.state.full_state_dict(),
            "refusal": refusal}


def _fsdp_resume_worker(rank: int, world: int, ckpt: str, torch_api: bool) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, inst, opt, dp = _fsdp_applied(None)
    if torch_api:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=ckpt + "-torch-api")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        state = inst.state.state_dict(opt)
        dcp.load(state, checkpoint_id=ckpt)
        inst.state.load_state_dict(state, opt)
    return _fsdp_train(model, opt, dp, range(3, 6))[0]


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_fully_shard_on_dp_after_apply_trains_checkpoints_and_resumes_like_one_process(
        hf_checkpoint: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    """dp=2 x tp=2: FSDP2 shards the tensor-parallel shards over dp. The first step's gradients
    (gathered through FSDP's and the plan's layouts) equal one process on the whole batch to
    atol 2e-6; losses over six AdamW steps to 1e-5. The trained weights read back through
    full_state_dict() to atol 1e-3 only: AdamW divides by the root of the second moment, so a
    1e-7 reduction-order difference in a near-zero gradient moves a weight by up to ~1e-4 per
    few lr=1e-2 steps; what this part checks is that the weights are the trained ones (they
    moved by ~1e-2 from the start), not a stale copy.

    The DCP checkpoint written after step 3 (``TrainingState.state_dict(opt)``: FSDP's pieces
    of each tensor-parallel shard, stored as ``_StridedShard`` x ``Shard`` DTensors over the
    2-D mesh) resumes at tp=2 without FSDP, where the next three losses on the whole batch
    equal the uninterrupted one-process run's, and under FSDP again, where each dp rank's next
    three losses equal the uninterrupted dp x tp run's (1e-5). Were the pieces stored where
    they do not belong, or the moments dropped, the losses would differ (the tp-only resume
    test without optimizer state shows by how much). torch's ``get_state_dict`` /
    ``set_state_dict`` (through the production hooks) checkpoint and resume the same way, and
    saving leaves the live optimizer state as it was (training goes on after it)."""
    model = llama(**_overrides())
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for step in range(6):
        halves = [_loss(model, _batch(step)[i:i + 1]) for i in range(2)]
        loss = (halves[0] + halves[1]) / 2
        loss.backward()
        if step == 0:
            ref_grads = grads_of(model)
        opt.step()
        opt.zero_grad()
        ref_losses.append([float(h.detach()) for h in halves])
    ckpt = str(tmp_path / "dp-tp-step-3")
    results = run_ranks(_fsdp_worker, 4, str(hf_checkpoint), ckpt, timeout_s=300)
    for rank, res in enumerate(results):
        dp = rank // 2
        assert res["losses"] == pytest.approx([pair[dp] for pair in ref_losses], abs=LOSS_ATOL)
        assert res["refusal"].startswith("WeightLoadError: ") or res["refusal"].startswith(
            "PlanMismatchError: ")
        assert "made by a data-parallel wrapper on mesh ('dp',)" in res["refusal"]
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"step 0 grad {name}")
    full = results[0]["full"]
    for name, value in model.state_dict().items():
        if name in full:
            torch.testing.assert_close(full[name], value, atol=1e-3, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
    moved = (full["model.layers.0.mlp.up_proj.weight"]
             - start["model.layers.0.mlp.up_proj.weight"]).abs().max()
    assert moved > 5e-3

    for res in run_ranks(_resume_worker, 2, ckpt, "production"):
        assert res["unset"] == []
        assert res["losses"] == pytest.approx(reference_losses[3:], abs=LOSS_ATOL)
    for torch_api in (False, True):
        resumed = run_ranks(_fsdp_resume_worker, 4, ckpt, torch_api, timeout_s=300)
        for rank, losses in enumerate(resumed):
            assert losses == pytest.approx(results[rank]["losses"][3:], abs=LOSS_ATOL)


def _eval_loss(model: nn.Module, dp: int) -> float:
    model.eval()
    with torch.no_grad():
        loss = _loss(model, _batch(50)[dp:dp + 1])
    model.train()
    return float(loss)


def _eval_then_save_worker(rank: int, world: int, folder: str, ckpt: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model, inst, opt, dp = _fsdp_applied(folder)
    losses, _ = _fsdp_train(model, opt, dp, range(2))
    eval_loss = _eval_loss(model, dp)
    # the trap: FSDP2 does not reshard the root after a forward without backward, so the
    # root's parameters are the gathered plain tensors, not the optimizer's DTensor pieces
    gathered = not isinstance(model.model.norm.weight, DTensor)
    inst.state.save_checkpoint(ckpt, opt)
    saved = inst.state.full_state_dict()
    more, _ = _fsdp_train(model, opt, dp, range(2, 4))
    return {"losses": losses + more, "eval": eval_loss, "gathered": gathered, "saved": saved}


def _eval_resume_worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    model, inst, opt, dp = _fsdp_applied(None)
    _eval_loss(model, dp)  # an eval forward before loading, too
    inst.state.load_checkpoint(ckpt, opt)
    loaded = inst.state.full_state_dict()
    return {"losses": _fsdp_train(model, opt, dp, range(2, 4))[0], "loaded": loaded}


@pytest.mark.slow  # four ranks, twice (docs/benchmarks.md#test-suite)
def test_fully_shard_eval_forward_then_save_checkpoint_saves_and_resumes_like_one_process(
        hf_checkpoint: Path, tmp_path: Path) -> None:
    """dp=2 x tp=2 under FSDP2: two AdamW steps, an evaluation forward (eval(), no_grad, no
    backward: FSDP2 leaves the root's parameters gathered), then save_checkpoint at the same
    step. Before, the save refused ("the optimizer holds a parameter that is not one of the
    applied model's"); the state paths now put FSDP's shards back first. Against one process
    on the whole batch: the eval loss of each dp rank's half to 1e-5, the saved weights to
    atol 5e-4 (measured 1.04e-4 on one element; AdamW divides by the root of near-zero
    second moments, which amplifies 1e-7 reduction-order differences), the losses of the two steps after the save to 1e-5; a
    fresh dp=2 x tp=2 run (an eval forward before its load too) loads exactly the saved
    weights (atol 0) and its next two losses equal the uninterrupted run's to 1e-5."""
    model = llama(**_overrides())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(s: int) -> list[float]:
        halves = [_loss(model, _batch(s)[i:i + 1]) for i in range(2)]
        ((halves[0] + halves[1]) / 2).backward()
        opt.step()
        opt.zero_grad()
        return [float(h.detach()) for h in halves]

    ref = [step(s) for s in range(2)]
    ref_eval = [_eval_loss(model, dp) for dp in range(2)]
    ref_saved = {k: v.clone() for k, v in model.state_dict().items()}
    ref += [step(s) for s in range(2, 4)]

    ckpt = str(tmp_path / "eval-then-save")
    results = run_ranks(_eval_then_save_worker, 4, str(hf_checkpoint), ckpt, timeout_s=300)
    for rank, res in enumerate(results):
        dp = rank // 2
        assert res["gathered"], "the eval forward left the root gathered (the trap is set)"
        assert res["eval"] == pytest.approx(ref_eval[dp], abs=LOSS_ATOL)
        assert res["losses"] == pytest.approx([pair[dp] for pair in ref], abs=LOSS_ATOL)
    for name, value in ref_saved.items():  # every weight (the buffers are not trained)
        torch.testing.assert_close(results[0]["saved"][name], value, atol=5e-4, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    resumed = run_ranks(_eval_resume_worker, 4, ckpt, timeout_s=300)
    for rank, res in enumerate(resumed):
        assert res["losses"] == pytest.approx(results[rank]["losses"][2:], abs=LOSS_ATOL)
        for name, value in results[0]["saved"].items():
            torch.testing.assert_close(res["loaded"][name], value, atol=0, rtol=0)


def _sp_fsdp_worker(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = llama(**_overrides())
    plan = compile_recipe(str(ROOT / "tests/recipes/llama-sp-dp-tp.yaml"),
                          llama("meta", **_overrides()), {"dp": 2, "tp": 2})
    assert plan.grad_buckets, "the sequence-parallel norms reduce their gradients in buckets"
    inst = apply(model, plan, mesh, mode="production")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh.get_local_rank("dp")
    _loss(model, _batch(0)[dp:dp + 1]).backward()
    out = {}
    for name, call in (("step", opt.step), ("grads", inst.full_grads),
                       ("clip", lambda: inst.clip_grad_norm_(1.0))):
        try:
            call()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_fully_shard_over_gradient_buckets_is_refused_before_a_step_trains_on_partial_grads(
        ) -> None:
    """FSDP2 replaces the parameters whose gradients the plan reduces over tp in buckets (the
    sequence-parallel norms); the bucket hooks stay on the old objects and those gradients
    come out partial. The optimizer's step, full_grads() and clip_grad_norm_() refuse instead
    of training on them (before this check the run trained silently on gradients as large as
    their error), naming fully_shard_data_parallel and DDP over dp, never another recipe."""
    for res in run_ranks(_sp_fsdp_worker, 4, timeout_s=300):
        for name in ("step", "grads", "clip"):
            assert res[name].startswith("PlanMismatchError: "), res[name]
            assert "were replaced after apply (fully_shard?)" in res[name]
            assert "model.layers.0.input_layernorm.weight" in res[name] or "..." in res[name]
            # the way out it names is right for every model (Qwen3's per-head norms need
            # their buckets): DDP over dp through the buckets, never another recipe
            assert "hyperrecipe.runtime.fully_shard_data_parallel(inst, mesh['dp']" in res[name]
            assert "hyperrecipe.runtime.data_parallel(inst, mesh['dp'].get_group())" in res[name]
            assert "recipes/" not in res[name]


# -- fused (chunked) shards and validate mode -----------------------------------------------

GPT2 = str(ROOT / "recipes/gpt2.yaml")
TINY_GPT2 = json.loads((ROOT / "recipes/models/tiny-gpt2.json").read_text())


def _gpt2(device: str = "cpu") -> nn.Module:
    from hyperrecipe.model_tree import build_model

    torch.manual_seed(0)
    return build_model("hf:gpt2", TINY_GPT2, device=device)


def _gpt2_worker(rank: int, world: int, folder: str, ckpt: str, save: bool,
                 mode: str = "production") -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    meta = _gpt2("meta")
    plan = compile_recipe(GPT2, meta, {"tp": world})
    inst = apply(meta, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    if save:
        inst.state.load_weights(folder)
        strided = type(meta.state_dict()["transformer.h.0.attn.c_attn.weight"]).__name__
        dcp.save(inst.state.state_dict(), checkpoint_id=ckpt)
        return {"full": inst.state.full_state_dict(), "strided": strided}
    state = inst.state.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    inst.state.load_state_dict(state)
    return {"full": inst.state.full_state_dict()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_fused_qkv_loads_its_slices_and_reshards_through_dcp(tmp_path: Path, mode: str) -> None:
    """GPT-2's c_attn is shard(1, chunks=3): each rank reads its piece of q, k and v from the
    file, and the DCP checkpoint (stored whole for such layouts) loads at tp=1 and tp=4, in the
    other mode too (validate mode holds c_attn as a _StridedShard DTensor)."""
    folder = tmp_path / "hf-gpt2"
    original = _gpt2()
    original.save_pretrained(folder, max_shard_size="60KB")
    expected = original.state_dict()
    ckpt = str(tmp_path / "dcp")
    other = "production" if mode == "validate" else "validate"
    saved = run_ranks(_gpt2_worker, 2, str(folder), ckpt, True, mode)[0]
    assert saved["strided"] == "DTensor"
    for world, load_mode in ((1, mode), (4, other)):
        loaded = run_ranks(_gpt2_worker, world, str(folder), ckpt, False, load_mode)[0]
        for name, value in saved["full"].items():
            torch.testing.assert_close(loaded["full"][name], value, atol=0, rtol=0)
    for name, value in saved["full"].items():
        if name in expected:
            torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)


def _validate_worker(rank: int, world: int, folder: str, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    model, inst = _meta_applied(world, "validate")
    inst.state.load_weights(folder)
    dtensors = isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    dcp.save(inst.state.state_dict(), checkpoint_id=ckpt)
    return {"full": inst.state.full_state_dict(), "dtensors": dtensors}


def _production_reader(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, "production")
    inst.state.load_weights(ckpt)
    return {"full": inst.state.full_state_dict()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_validate_mode_loads_and_checkpoints_like_production(hf_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    ckpt = str(tmp_path / "dcp")
    res = run_ranks(_validate_worker, 2, str(hf_checkpoint), ckpt)[0]
    assert res["dtensors"]
    expected = llama(**_overrides()).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(res["full"][name], value, atol=0, rtol=0, msg=name)
    back = run_ranks(_production_reader, 1, ckpt)[0]
    for name, value in expected.items():
        torch.testing.assert_close(back["full"][name], value, atol=0, rtol=0, msg=name)


# -- the documented trainer, under torchrun -----------------------------------------------------


def _torchrun(nproc: int, *args: str) -> list[dict[str, float]]:
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         str(ROOT / "tools/train.py"), "--json", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # starts fresh interpreters under torchrun (docs/benchmarks.md#test-suite)
def test_documented_trainer_resumes_at_another_tp_size_and_exports(hf_checkpoint: Path,
                                                                    tmp_path: Path) -> None:
    """tools/train.py (docs/training.md) at tp=2 for 4 steps, checkpointing every 2; killed
    after step 2 (``--stop-after 2``: the cosine schedule still spans four steps) and resumed
    at tp=1 it prints the same losses and gradient norms; its export
    loads. The trainer clips every step (the norms are above its max_grad_norm 1.0), so a
    clip that saw only a rank's shards would change the tp=2 losses."""
    from transformers import AutoModelForCausalLM

    whole = _torchrun(2, "--weights", str(hf_checkpoint), "--out", str(tmp_path / "a"),
                      "--steps", "4", "--save-every", "2")
    assert len(whole) == 4
    first = _torchrun(2, "--weights", str(hf_checkpoint), "--out", str(tmp_path / "b"),
                      "--steps", "4", "--stop-after", "2", "--save-every", "2")
    resumed = _torchrun(1, "--weights", str(hf_checkpoint), "--out", str(tmp_path / "b"),
                        "--steps", "4", "--save-every", "2")
    assert [r["loss"] for r in first + resumed] == pytest.approx(
        [r["loss"] for r in whole], abs=LOSS_ATOL)
    assert [r["grad_norm"] for r in first + resumed] == pytest.approx(
        [r["grad_norm"] for r in whole], rel=1e-4)
    assert all(r["grad_norm"] > 1.0 for r in whole)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    assert exported.config.hidden_size == CFG["hidden_size"]


# -- a materialized model: originals dropped as shards appear, rollback still exact --------


def _shard_failure_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    import hyperrecipe.runtime.install as install_mod
    from hyperrecipe.errors import PlanMismatchError
    from tests.runtime.test_runtime_apply import same_state, snapshot_state, toy, toy_plan

    model = toy(tie=True)
    before = snapshot_state(model)
    real = install_mod.local_shard
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 4:  # rank 1 fails while sharding its 4th parameter
            raise MemoryError("injected")
        return real(*args, **kwargs)

    install_mod.local_shard = failing  # type: ignore[assignment]
    try:
        apply(model, toy_plan(str(ROOT / "tests/recipes/toy.yaml"), world, tie=True),
              mesh_1d(world), mode=mode)  # type: ignore[arg-type]
        error = "none"
    except MemoryError:
        error = "MemoryError"
    except PlanMismatchError as exc:
        error = f"PlanMismatchError: {exc}"
    finally:
        install_mod.local_shard = real
    return {"error": error, "unchanged": same_state(before, snapshot_state(model)),
            "tied": model.head.weight is model.embed.weight}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_failure_while_sharding_on_one_rank_rolls_every_rank_back_exactly(mode: str) -> None:
    """Originals give up their storage as soon as their shard exists; a rank that fails midway
    keeps its remaining originals, and every rank's rollback gathers the same tensors in the
    same order, so nobody hangs and every parameter object comes back with its exact value."""
    res = run_ranks(_shard_failure_worker, 2, mode, timeout_s=120)
    assert res[1]["error"] == "MemoryError"
    assert res[0]["error"].startswith("PlanMismatchError: applying plan 'toy' failed on rank(s) [1]")
    for r in res:
        assert r["unchanged"] and r["tied"]


def _single_file_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, "production")
    inst.state.load_weights(path)
    return {"full": inst.state.full_state_dict(),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_single_bf16_safetensors_file_loads_converted_to_the_models_dtype(
        tmp_path: Path) -> None:
    """One ``model.safetensors`` in bfloat16 (no index), given as the file itself; the fp32
    model gets each value converted; the tied-free lm_head and the rest all found."""
    source = llama(**_overrides()).to(torch.bfloat16)
    source.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    assert path.is_file() and not (tmp_path / "model.safetensors.index.json").exists()
    res = run_ranks(_single_file_worker, 2, str(path))[0]
    assert res["dtypes"] == ["torch.float32"]
    for name, value in source.state_dict().items():
        torch.testing.assert_close(res["full"][name], value.float(), atol=0, rtol=0, msg=name)


# -- activation checkpointing and torch.compile after apply ---------------------------------


def _after_apply_worker(rank: int, world: int, folder: str, how: str) -> dict[str, Any]:
    model, inst = _meta_applied(world, "production")
    inst.state.load_weights(folder)
    model.train()
    if how == "checkpointing":
        model.gradient_checkpointing_enable()
        step_model: Any = model
    else:
        step_model = torch.compile(model)
    loss = _loss(step_model, _batch(0))
    loss.backward()
    return {"loss": loss.detach(), "grads": inst.full_grads()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("how", ["checkpointing",
                                 pytest.param("compile", marks=pytest.mark.slow)])
def test_training_features_after_apply_match_one_process(hf_checkpoint: Path, how: str) -> None:
    """transformers' gradient checkpointing enabled after apply, or torch.compile of the applied
    model: loss and every gradient equal one process (fp32, atol 2e-6 / rtol 1e-5)."""
    ref = llama(**_overrides())
    ref.train()
    if how == "checkpointing":
        ref.gradient_checkpointing_enable()
    ref_loss = _loss(ref, _batch(0))
    ref_loss.backward()
    res = run_ranks(_after_apply_worker, 2, str(hf_checkpoint), how)[0]
    torch.testing.assert_close(res["loss"], ref_loss.detach(), atol=2e-6, rtol=1e-5)
    for name, g in grads_of(ref).items():
        assert_close(res["grads"][name], g, f"grad {name}")
