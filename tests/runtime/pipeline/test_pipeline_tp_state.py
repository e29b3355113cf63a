"""``pipe.state`` beside tensor parallel: pp=2 x tp=2 on four gloo ranks, production mode.

Tiny Llama (``recipes/llama.yaml`` extended with a 1F1B pipeline of 4 microbatches):

- two AdamW steps, ``save_checkpoint``, two more (the run that never stopped); the checkpoint
  resumed into a fresh pp=2 x tp=2 pipeline, into ``apply`` of ``recipes/llama.yaml`` at tp=2
  on two ranks, and into one process by plain ``dcp.load`` of torch's flattened
  ``get_state_dict``: each continues two steps and is compared with the run that never stopped;
- ``save_pretrained`` writes one transformers checkpoint that ``from_pretrained`` loads to the
  logits of the trained model (also tied GPT-2, 1F1B, whose embedding and lm_head live on
  different stages);
- ``load_weights`` reads only the rank's stage's tensors, and of each only the rank's tp slice
  (elements read per key, counted in the safetensors reader).

Tolerances: losses 1e-6 relative; parameters 1e-3 of ``lr * 2`` (Adam moves an element by
about lr a step); pp=2 x tp=2 -> pp=2 x tp=2 is the same arithmetic, so exact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from tests.runtime.pipeline.test_pipeline_tp import _plan
from tests.support.pipeline_harness import EPS, batch_of, tiny

ROOT = Path(__file__).resolve().parents[3]
LR = 1e-3


def _pipe(family: str, *, zero: bool = False) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.runtime import build_pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = tiny(family)
    pipe = build_pipeline(model, _plan(family, "1F1B", 1, model), mesh, mode="production")
    if zero:
        with torch.no_grad():
            for p in pipe.parameters():
                p.zero_()
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)


def _train(step: Any, opt: Any, first: int, steps: int) -> list[float]:
    losses = []
    for k in range(first, first + steps):
        opt.zero_grad()
        ids, labels = batch_of(k)
        losses.append(step(ids, labels))
        opt.step()
    return losses


def _pipe_step(pipe: Any) -> Any:
    return lambda ids, labels: pipe.step(input_ids=ids, labels=labels).item()


def _model_step(model: Any) -> Any:
    def step(ids: torch.Tensor, labels: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return float(loss.item())

    return step


def _full(pipe: Any) -> dict[str, torch.Tensor]:
    """The full value of every parameter this rank's stages hold (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for inst in pipe.installations:
        for p in inst.plan.params:
            if p.tied_to is None:
                out[p.fqn] = inst.state.full_tensor(p.fqn)
    return out


def _flat(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """``inst.state.state_dict(opt)["optimizer"]`` in the pipelined (torch's flattened)
    layout, sharing its tensors."""
    flat: dict[str, Any] = {}
    for fqn, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            flat[f"state.{fqn}.{key}"] = value
    for group in optimizer_state["param_groups"]:
        for fqn in group["params"]:
            for key, value in group.items():
                if key != "params":
                    flat[f"param_groups.{fqn}.{key}"] = value
    return flat


def _nested(flat: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    state = {fqn: {key: flat[f"state.{fqn}.{key}"] for key in entry}
             for fqn, entry in like["state"].items()}
    groups = [{**{k: flat[f"param_groups.{g['params'][0]}.{k}"] for k in g if k != "params"},
               "params": g["params"]} for g in like["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    ckpt = os.path.join(root, "ckpt")
    pipe, opt = _pipe("llama")
    _train(_pipe_step(pipe), opt, 0, 2)
    pipe.state.save_checkpoint(ckpt, opt)
    go_on = _train(_pipe_step(pipe), opt, 2, 2)
    kept = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    out: dict[str, Any] = {"losses": go_on, "full": _full(pipe),
                           "local": sum(p.numel() for p in kept.values())}
    pipe.state.save_pretrained(os.path.join(root, "export"))
    out["status"] = [(r.fqn, r.what, r.state) for r in pipe.state.status()]

    # pp=2 x tp=2 -> pp=2 x tp=2: a fresh pipeline with zeroed weights resumes
    pipe2, opt2 = _pipe("llama", zero=True)
    pipe2.state.load_checkpoint(ckpt, opt2)
    again = _train(_pipe_step(pipe2), opt2, 2, 2)
    out["pp2_loss"] = max(abs(a - b) / abs(b) for a, b in zip(again, go_on, strict=True))
    out["pp2_param"] = max((p.detach() - kept[n]).abs().max().item()
                           for n, p in pipe2.named_parameters())
    dist.barrier()
    return out


def tp_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """The pp=2 x tp=2 checkpoint resumed by ``apply`` of ``recipes/llama.yaml`` at tp=2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import compile_recipe
    from hyperrecipe.runtime import apply
    from hyperrecipe.runtime.state.dcp_reader import trusted_reader

    torch.set_num_threads(1)
    model = tiny("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    plan = compile_recipe(str(ROOT / "recipes" / "llama.yaml"), model, {"tp": 2})
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    inst = apply(model, plan, mesh, mode="production")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    state = inst.state.state_dict(opt)
    like = state["optimizer"]
    staged = {"model": {k: v.detach().clone() for k, v in state["model"].items()},
              "optimizer": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                            for k, v in _flat(like).items()}}
    dcp.load(staged, storage_reader=trusted_reader(os.path.join(root, "ckpt")))
    inst.state.load_state_dict({"model": staged["model"],
                                "optimizer": _nested(staged["optimizer"], like)}, opt)
    losses = _train(_model_step(model), opt, 2, 2)
    full = inst.state.full_state_dict()
    return {"losses": losses, "full": {p.fqn: full[p.fqn] for p in plan.params}}


def _one_process(root: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """pp=1 on one process: plain ``dcp.load`` of torch's flattened ``get_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    from hyperrecipe.runtime.state.dcp_reader import trusted_reader

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    one = tiny("llama")
    opt = torch.optim.AdamW(one.parameters(), lr=LR, eps=EPS)
    msd, osd = get_state_dict(one, opt, options=flat)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, storage_reader=trusted_reader(os.path.join(root, "ckpt")))
    set_state_dict(one, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=flat)
    losses = _train(_model_step(one), opt, 2, 2)
    return losses, {n: p.detach().clone() for n, p in one.named_parameters()}


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() / (LR * 2) for n in a)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _logits_err(export: str, full: dict[str, torch.Tensor], family: str) -> float:
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(export)
    one = tiny(family)
    one.load_state_dict(full, strict=False)
    ids, _ = batch_of(7)
    with torch.no_grad():
        return float((back(input_ids=ids).logits - one(input_ids=ids).logits).abs().max())


@pytest.mark.slow  # four ranks, then two (docs/benchmarks.md#test-suite)
def test_pp2_tp2_checkpoint_resumes_at_pp2_tp2_tp2_and_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    by_rank = run_ranks(save_worker, 4, str(tmp_path), timeout_s=400)
    go_on = by_rank[0]["losses"]
    full = {**by_rank[0]["full"], **by_rank[2]["full"]}
    assert set(full) == {n for n, _ in tiny("llama").named_parameters()}
    for r in by_rank:
        assert r["losses"] == go_on
        assert r["pp2_loss"] == 0.0 and r["pp2_param"] == 0.0, r["pp2_loss"]
        assert r["local"] < 0.5 * sum(t.numel() for t in full.values())  # a stage's tp-th
    assert any(what == "weights" or "forward" in what for _, what, _ in by_rank[0]["status"])

    tp = run_ranks(tp_worker, 2, str(tmp_path), timeout_s=300)
    ones, one_full = _one_process(str(tmp_path))
    measured = {"tp2_loss": max(_rel(r["losses"], go_on) for r in tp),
                "tp2_param": max(_err(r["full"], full) for r in tp),
                "pp1_loss": _rel(ones, go_on), "pp1_param": _err(one_full, full)}
    print("pp2xtp2 resume", measured)
    for what, value in measured.items():
        assert value <= (1e-6 if what.endswith("loss") else 1e-3), (what, value)

    # save_pretrained after the 4 steps: one checkpoint, the trained model's logits
    export = str(tmp_path / "export")
    assert "hyperrecipe.manifest.json" in os.listdir(export)
    assert _logits_err(export, full, "llama") == 0.0


def export_worker(rank: int, world: int, family: str, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    pipe, opt = _pipe(family)
    _train(_pipe_step(pipe), opt, 0, 2)
    pipe.state.save_pretrained(os.path.join(root, "export"))
    return {"full": _full(pipe)}


@pytest.mark.slow  # four ranks
def test_pp2_tp2_save_pretrained_of_tied_gpt2(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    by_rank = run_ranks(export_worker, 4, "gpt2", str(tmp_path), timeout_s=300)
    full = {**by_rank[0]["full"], **by_rank[2]["full"]}
    assert "transformer.wte.weight" in by_rank[0]["full"]
    assert "lm_head.weight" in by_rank[2]["full"]
    assert torch.equal(full["transformer.wte.weight"], full["lm_head.weight"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # a tied weight is written once
    assert _logits_err(str(tmp_path / "export"), full, "gpt2") == 0.0


def weights_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hyperrecipe.runtime.state import checkpoint_files

    torch.set_num_threads(1)
    hf = os.path.join(root, "hf")
    source = tiny("llama")
    if rank == 0:
        source.save_pretrained(hf)
    dist.barrier()
    slices: dict[str, int] = {}
    elements: dict[str, int] = {}
    cls = checkpoint_files._SafetensorsFile  # noqa: SLF001 - counting the data reads
    get_slice, read_into = cls.get_slice, cls.read_into

    def counted_slice(self: Any, key: str) -> Any:
        slices[key] = slices.get(key, 0) + 1
        return get_slice(self, key)

    def counted_into(self: Any, key: str, block: Any, out: torch.Tensor) -> None:
        elements[key] = elements.get(key, 0) + out.numel()
        read_into(self, key, block, out)

    pipe, _ = _pipe("llama", zero=True)
    cls.get_slice, cls.read_into = counted_slice, counted_into  # type: ignore[method-assign]
    try:
        pipe.state.load_weights(hf)
    finally:
        cls.get_slice, cls.read_into = get_slice, read_into  # type: ignore[method-assign]
    want = dict(source.named_parameters())
    full = _full(pipe)
    local = {n: p.numel() for n, p in pipe.named_parameters()}
    return {"slices": slices, "elements": elements, "local": local,
            "err": max((full[n] - want[n]).abs().max().item() for n in full),
            "status": [(r.what, r.state) for r in pipe.state.status() if "weights" in r.what]}


@pytest.mark.slow  # four ranks
def test_pp2_tp2_load_weights_reads_only_the_stage_and_its_tp_slices(tmp_path: Path) -> None:
    by_rank = run_ranks(weights_worker, 4, str(tmp_path), timeout_s=300)
    for r in by_rank:
        assert r["err"] == 0.0
        # data is read only through read_into (get_slice hands out a lazy reader)
        assert set(r["elements"]) == set(r["local"]), sorted(set(r["elements"]) ^ set(r["local"]))
        assert set(r["slices"]) <= set(r["local"])
        for key, n in r["elements"].items():
            assert n == r["local"][key], (key, n, r["local"][key])  # the tp slice, once
        assert ("weights safetensors", "loaded") in r["status"], r["status"]
    assert not set(by_rank[0]["local"]) & set(by_rank[2]["local"])
