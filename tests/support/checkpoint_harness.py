"""What the checkpoint tests share: a tiny Llama applied at tp=world, a DCP save of it, a
resume that reports whether a refused load left the model as it was, and a pickle that runs
code when read."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.errors import WeightLoadError
from tests.support.runtime_harness import ROOT, llama, mesh_1d

LLAMA = str(ROOT / "recipes/llama.yaml")


def applied(world: int, device: str = "cpu") -> tuple[nn.Module, Any]:
    """A tiny Llama (on ``device``) with ``recipes/llama.yaml`` applied at tp=``world``,
    production mode."""
    model = llama(device)
    plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
    return model, apply(model, plan, mesh_1d(world), mode="production")


def save_dcp_worker(rank: int, world: int, ckpt: str) -> None:
    """``dcp.save(inst.state.state_dict(opt))`` of the applied model after one AdamW step."""
    import torch.distributed.checkpoint as dcp

    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    opt.step()
    dcp.save(inst.state.state_dict(opt), checkpoint_id=ckpt)


def resume_worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """``inst.state.load_checkpoint(ckpt, opt)`` on this rank: the error and whether the model's
    tensors are unchanged, or the full state and the optimizer's entries."""
    model, inst = applied(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()
              if isinstance(v, torch.Tensor)}
    try:
        inst.state.load_checkpoint(ckpt, opt)
    except WeightLoadError as exc:
        after = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        same = all(torch.equal(before[k], after[k]) for k in before)
        return {"error": str(exc), "unchanged": same}
    return {"error": None, "full": inst.state.full_state_dict(), "opt": len(opt.state)}


class Hostile:
    """Unpickles to ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def resume_refused(run: Callable[[], Any], marker: Path) -> str:
    """``run()`` resumes from a checkpoint whose DCP ``.metadata`` runs code when unpickled:
    it must fail on every rank, by name, without running it. Returns the failure's text."""
    from hyperrecipe.check.launcher import RankFailedError

    with pytest.raises(RankFailedError) as failed:
        run()
    assert not marker.exists(), "resuming ran the checkpoint's code"
    return str(failed.value)
