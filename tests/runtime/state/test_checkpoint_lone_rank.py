"""One rank alone in a collective state path, on real gloo ranks.

``dcp.save(inst.state.state_dict())`` is a collective twice over: DCP's own planning exchanges run on
the default process group, so a rank that calls it alone (``if rank == 0: dcp.save(...)``) used
to wait there for the process group's timeout (30 minutes by default) on a plan without fused
parameters, where ``state_dict()`` itself gathers nothing. Now the lone rank raises
``PlanMismatchError`` naming the call and the missing rank within ``collective_timeout_s``.
No wall-clock asserts: the launch's own limit (60 s, which is also the process group's
timeout here) is what a hang would hit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import ROOT, llama, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

LLAMA = str(ROOT / "recipes/llama.yaml")  # no fused parameters: state_dict() gathers nothing


def _lone_worker(rank: int, world: int, lone: int, call: str, folder: str) -> str:
    import torch.distributed.checkpoint as dcp

    model = llama()
    plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode="production")
    inst.collective_timeout_s = 1.0
    done = Path(folder) / f"done-{lone}-{call}"
    if rank != lone:  # never calls; stays alive (in no collective) until the lone rank is done
        deadline = time.monotonic() + 50
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "did not call"
    try:
        if call == "dcp.save":
            dcp.save(inst.state.state_dict(), checkpoint_id=str(Path(folder) / "ckpt"))
        elif call == "save_checkpoint":
            inst.state.save_checkpoint(Path(folder) / "ckpt")
        else:
            inst.state.load_state_dict({"model": {}})
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    done.touch()
    return outcome


@pytest.mark.parametrize(("lone", "call", "label"), [
    (0, "dcp.save", "TrainingState.state_dict()"),
    (1, "dcp.save", "TrainingState.state_dict()"),
    (0, "save_checkpoint", "TrainingState.state_dict()"),
    (1, "load_state_dict", "TrainingState.load_state_dict()"),
])
def test_a_lone_rank_in_a_state_collective_raises_by_name(tmp_path: Path, lone: int, call: str,
                                                          label: str) -> None:
    results: list[Any] = run_ranks(_lone_worker, 2, lone, call, str(tmp_path), timeout_s=60)
    assert results[1 - lone] == "did not call"
    msg = results[lone]
    assert msg.startswith(f"PlanMismatchError: {label} is a collective (so are dcp.save and "
                          f"dcp.load of what it returns"), msg
    assert f"every rank must call it (rank {lone} waited 1 s" in msg, msg
    assert str(1 - lone) in msg.split("waited 1 s", 1)[1], "names the rank that did not call"
    assert not (tmp_path / "ckpt" / ".metadata").exists(), "nothing was saved"
