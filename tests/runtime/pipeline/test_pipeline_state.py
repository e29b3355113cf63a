"""``pipe.state``: DCP checkpoints that resume across pipeline sizes, ``load_weights`` reading
only the rank's stage, and ``save_pretrained`` writing one transformers checkpoint.

Resume: two AdamW steps at pp=2, ``save_checkpoint``, then two more steps three ways (the
run that never stopped; a fresh pp=2 pipeline after ``load_checkpoint``; an unpipelined model
on one process after plain ``dcp.load`` of torch's flattened ``get_state_dict``) and pp=1 ->
pp=2 the other way round. Tolerances: losses 1e-6 relative, parameters 1e-6 of ``lr * steps``
(a resumed run does the same arithmetic as the one that never stopped; pp=1 against pp=2
differs by fp32 reassociation only: measured in the test's output).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from tests.support.pipeline_harness import EPS, LAYERS, batch_of, mesh, tiny
from tests.support.pipeline_plans import pipeline_plan

LR = 1e-3


def _pipe(family: str, *, zero: bool = False) -> Any:
    from hyperrecipe.runtime import build_pipeline

    model = tiny(family)
    plan = pipeline_plan(model, layers=LAYERS.get(family, "model.layers"), schedule="1F1B")
    pipe = build_pipeline(model, plan, mesh())
    if zero:
        with torch.no_grad():
            for p in pipe.parameters():
                p.zero_()
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)


def _train_pipe(pipe: Any, opt: Any, first: int, steps: int) -> list[float]:
    losses = []
    for k in range(first, first + steps):
        opt.zero_grad()
        ids, labels = batch_of(k)
        losses.append(pipe.step(input_ids=ids, labels=labels).item())
        opt.step()
    return losses


def _train_one(model: Any, opt: Any, first: int, steps: int) -> list[float]:
    losses = []
    for k in range(first, first + steps):
        opt.zero_grad()
        ids, labels = batch_of(k)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


def _flat_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() / (LR * 2) for n in a)


def resume_worker(rank: int, world: int, family: str, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hyperrecipe.runtime.state.dcp_reader import trusted_reader

    torch.set_num_threads(1)
    ckpt = os.path.join(root, "pp2")
    pipe, opt = _pipe(family)
    _train_pipe(pipe, opt, 0, 2)
    pipe.state.save_checkpoint(ckpt, opt)
    go_on = _train_pipe(pipe, opt, 2, 2)
    kept = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    out: dict[str, Any] = {"keys": sorted(pipe.state.state_dict()["model"])}

    # pp=2 -> pp=2: a fresh pipeline with zeroed weights resumes
    pipe2, opt2 = _pipe(family, zero=True)
    pipe2.state.load_checkpoint(ckpt, opt2)
    out["pp2_loss"] = max(abs(a - b) / abs(b) for a, b in zip(_train_pipe(pipe2, opt2, 2, 2),
                                                              go_on, strict=True))
    out["pp2_param"] = _err({n: p.detach() for n, p in pipe2.named_parameters()}, kept)

    # pp=2 -> pp=1: plain dcp.load into torch's flattened state dict of the whole model
    one = tiny(family)
    with torch.no_grad():
        for p in one.parameters():
            p.zero_()
    opt1 = torch.optim.AdamW(one.parameters(), lr=LR, eps=EPS)
    msd, osd = get_state_dict(one, opt1, options=_flat_options())
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, storage_reader=trusted_reader(ckpt))
    set_state_dict(one, opt1, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_flat_options())
    ones = _train_one(one, opt1, 2, 2)
    out["pp1_loss"] = max(abs(a - b) / abs(b) for a, b in zip(ones, go_on, strict=True))
    full = dict(one.named_parameters(remove_duplicate=False))
    out["pp1_param"] = _err({n: full[n].detach() for n in kept}, kept)

    # pp=1 -> pp=2: the one-process model's checkpoint (after 2 steps) resumes pipelined
    ref = tiny(family)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    _train_one(ref, ref_opt, 0, 2)
    msd, osd = get_state_dict(ref, ref_opt, options=_flat_options())
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(root, "pp1"))
    ref_losses = _train_one(ref, ref_opt, 2, 2)
    pipe3, opt3 = _pipe(family, zero=True)
    pipe3.state.load_checkpoint(os.path.join(root, "pp1"), opt3)
    out["from1_loss"] = max(abs(a - b) / abs(b) for a, b in zip(_train_pipe(pipe3, opt3, 2, 2),
                                                                ref_losses, strict=True))
    refs = dict(ref.named_parameters(remove_duplicate=False))
    out["from1_param"] = _err({n: p.detach() for n, p in pipe3.named_parameters()},
                              {n: refs[n].detach() for n, _ in pipe3.named_parameters()})
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoints_resume_across_pipeline_sizes(family: str, tmp_path: Path) -> None:
    results = run_ranks(resume_worker, 2, family, str(tmp_path), timeout_s=300)
    print(family, [{k: v for k, v in r.items() if k != "keys"} for r in results])
    for r in results:
        for what in ("pp2", "pp1", "from1"):
            assert r[f"{what}_loss"] <= 1e-6, (what, r)
            assert r[f"{what}_param"] <= 1e-3, (what, r)
        assert r["pp2_loss"] == 0.0 and r["pp2_param"] == 0.0, r  # same arithmetic
    if family == "gpt2":  # the tied pair: stage 0 holds wte, the last stage lm_head
        assert "transformer.wte.weight" in results[0]["keys"]
        assert "lm_head.weight" in results[1]["keys"]


def weights_worker(rank: int, world: int, family: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hyperrecipe.runtime.state import checkpoint_files

    torch.set_num_threads(1)
    hf = os.path.join(root, "hf")
    source = tiny(family)
    if rank == 0:
        source.save_pretrained(hf)
    dist.barrier()
    reads: dict[str, int] = {}
    cls = checkpoint_files._SafetensorsFile  # noqa: SLF001 - counting the data reads
    get_slice, read_into = cls.get_slice, cls.read_into

    def counted_slice(self: Any, key: str) -> Any:
        reads[key] = reads.get(key, 0) + 1
        return get_slice(self, key)

    def counted_into(self: Any, key: str, block: Any, out: torch.Tensor) -> None:
        reads[key] = reads.get(key, 0) + 1
        read_into(self, key, block, out)

    cls.get_slice, cls.read_into = counted_slice, counted_into  # type: ignore[method-assign]
    pipe, opt = _pipe(family, zero=True)
    pipe.state.load_weights(hf)
    cls.get_slice, cls.read_into = get_slice, read_into  # type: ignore[method-assign]
    full = dict(source.named_parameters(remove_duplicate=False))
    mine = dict(pipe.named_parameters())
    out: dict[str, Any] = {
        "read": sorted(reads), "mine": sorted(mine),
        "err": max((p.detach() - full[n].detach()).abs().max().item() for n, p in mine.items())}
    _train_pipe(pipe, opt, 0, 2)
    exported = os.path.join(root, "export")
    pipe.state.save_pretrained(exported)
    # the whole trained model, for the logits: a pp=1 load of the pipeline's own checkpoint
    pipe.state.save_checkpoint(os.path.join(root, "ck"))
    back = AutoModelForCausalLM.from_pretrained(exported)
    ids, _ = batch_of(7)
    one = tiny(family)
    import torch.distributed.checkpoint as dcp

    from hyperrecipe.runtime.state.dcp_reader import trusted_reader

    msd = {"model": one.state_dict()}
    dcp.load(msd, storage_reader=trusted_reader(os.path.join(root, "ck")))
    one.load_state_dict(msd["model"])
    with torch.no_grad():
        out["logits_err"] = (back(input_ids=ids).logits - one(input_ids=ids).logits
                             ).abs().max().item()
    out["files"] = sorted(os.listdir(exported))
    return out


@pytest.mark.slow  # launches ranks
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_load_weights_reads_only_the_stage_and_export_round_trips(family: str,
                                                                   tmp_path: Path) -> None:
    results = run_ranks(weights_worker, 2, family, str(tmp_path), timeout_s=300)
    for r in results:
        assert r["err"] == 0.0
        mine = set(r["mine"])
        if family == "gpt2" and "lm_head.weight" in mine:
            mine = (mine - {"lm_head.weight"}) | {"transformer.wte.weight"}  # stored tied
        assert set(r["read"]) == mine, (sorted(set(r["read"]) ^ mine))
        assert r["logits_err"] == 0.0
        assert "hyperrecipe.manifest.json" in r["files"]
    assert not set(results[0]["mine"]) & set(results[1]["mine"])
