"""torch's own checkpoint APIs on plans with fused (chunked) parameters, at tp=2 on gloo.

A trainer we did not write checkpoints with ``dcp.save(model.state_dict())`` or
``get_state_dict(model, opt)`` -> ``dcp.save`` -> ``dcp.load`` -> ``set_state_dict``. GPT-2's
``c_attn`` (``shard(1, chunks=3)``) and Phi-3's ``qkv_proj`` / ``gate_up_proj`` are chunked: each
rank holds its piece of every fused part, which DTensor writes as ``_StridedShard`` and DCP
refuses ("overlapping chunks"). Production mode's state-dict hooks hand those parameters, and
their optimizer state, out replicated, as ``TrainingState.state_dict()`` does, so the checkpoint
is right: resumed runs equal an uninterrupted one, and one process reads the full weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.model_tree import build_model
from tests.support.runtime_harness import ROOT, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

LOSS_ATOL = 1e-5
FAMILIES = ("gpt2", "phi3")


def _model(family: str, mode: str = "production") -> nn.Module:
    config = json.loads((ROOT / f"recipes/models/tiny-{family}.json").read_text())
    torch.manual_seed(0)
    return build_model(f"hf:{family}", config, device="cpu")


def _applied(family: str, world: int, mode: str) -> tuple[nn.Module, Any]:
    model = _model(family, mode)
    plan = compile_recipe(str(ROOT / f"recipes/{family}.yaml"), model, {"tp": world})
    return model, apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save_worker(rank: int, world: int, family: str, ckpt: str, mode: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(1)
    model, inst = _applied(family, world, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, range(3))
    dcp.save(model.state_dict(), checkpoint_id=ckpt + "/model")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt + "/both")
    full = inst.state.full_state_dict()
    return {"full": full, "losses": _train(model, opt, range(3, 6))}


def _resume_worker(rank: int, world: int, family: str, ckpt: str, mode: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    model, inst = _applied(family, world, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt + "/both")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"losses": _train(model, opt, range(3, 6))}


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("family", FAMILIES)
def test_torch_dcp_apis_checkpoint_fused_parameters_and_resume_like_one_run(
        tmp_path: Path, family: str, mode: str) -> None:
    """``dcp.save(model.state_dict())`` and ``get_state_dict`` / ``set_state_dict`` with the
    optimizer, production mode at tp=2: before, DCP refused the fused parameters
    (``_StridedShard``: "overlapping chunks"). Now three AdamW steps after ``set_state_dict``
    equal the uninterrupted run's and one process's (1e-5), and a one-process ``dcp.load`` of
    either checkpoint gives the full weights exactly. Validate mode (the model's own
    ``_StridedShard`` DTensors) the same."""
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_save_worker, 2, family, ckpt, mode)
    resumed = run_ranks(_resume_worker, 2, family, ckpt, mode)
    one = _model(family, mode)
    reference = _train(one, torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1),
                       range(6))[3:]
    assert saved[0]["losses"] == pytest.approx(reference, abs=LOSS_ATOL)
    for res in resumed:
        assert res["losses"] == pytest.approx(reference, abs=LOSS_ATOL)
        assert res["losses"] == pytest.approx(saved[0]["losses"], abs=LOSS_ATOL)
    full = saved[0]["full"]
    for sub, prefix in (("model", ""), ("both", "model.")):
        one = _model(family).state_dict()
        state = {prefix + k: v for k, v in one.items()}
        dcp.load(state, checkpoint_id=f"{ckpt}/{sub}")
        for name in one:
            if name in full:
                torch.testing.assert_close(state[prefix + name], full[name], atol=0, rtol=0,
                                           msg=f"{sub}: {name}")


def _one_rank_worker(rank: int, world: int, mode: str, what: str) -> str:
    import time

    torch.set_num_threads(1)
    model, inst = _applied("gpt2", world, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1))
    inst.collective_timeout_s = 2.0
    if rank == 0:
        try:
            model.state_dict() if what == "model" else opt.state_dict()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    time.sleep(4.0)  # rank 1 is elsewhere, as under `if rank == 0: torch.save(...)`
    return "skipped"


@pytest.mark.parametrize("what", ["model", "optimizer"])
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_state_dict_of_fused_parameters_on_one_rank_fails_fast_instead_of_hanging(
        mode: str, what: str) -> None:
    """Handing fused parameters (and their moments) out replicated gathers them, so the state
    dict is a collective on such a plan: called on rank 0 alone it is refused by name within
    ``collective_timeout_s`` rather than waiting in the gather. (Before, it handed out
    ``_StridedShard`` DTensors that DCP then refused.)"""
    msg = run_ranks(_one_rank_worker, 2, mode, what, timeout_s=120)[0]
    assert msg.startswith(f"PlanMismatchError: {what}.state_dict() is a collective on a plan "
                          f"with fused (chunked) parameters"), msg
    assert "every rank must call it" in msg
