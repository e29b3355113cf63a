"""Ranks that disagree raise PlanMismatchError on every rank, in bounded time (real gloo ranks).

Each case would leave rank 0 blocked in a collective until the process group's timeout if the
exchange were not fixed-size, over the world group, before anything mesh-specific, and bounded.
The launch's own ``timeout_s`` (60 s) is far below gloo's default 30 minutes, so a hang fails the
test instead of stalling it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import PlanMismatchError
from hyperrecipe.runtime import apply
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.runtime.preflight.agreement import TIMEOUT_ENV
from tests.support.recipe_text import resolve_only as compile_recipe
from tests.support.toy_models import Toy

RECIPE = str(Path(__file__).resolve().parents[2] / "tests" / "recipes" / "toy.yaml")


def _plan_and_model(hidden: int = 16) -> tuple[Any, Toy]:
    torch.manual_seed(0)
    model = Toy(hidden=hidden)
    with torch.device("meta"):
        plan = compile_recipe(RECIPE, Toy(), {"tp": 2})
    return plan, model


def _mesh(name: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=(name,))


def _outcome(fn: Any) -> str:
    try:
        fn()
    except PlanMismatchError as exc:
        return f"PlanMismatchError: {exc}"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "applied"


def _mesh_name_worker(rank: int, world: int) -> str:
    plan, model = _plan_and_model()
    mesh = _mesh("tp" if rank == 0 else "tq")
    return _outcome(lambda: apply(model, plan, mesh))


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_with_another_mesh_dim_name_fails_every_rank() -> None:
    r0, r1 = run_ranks(_mesh_name_worker, 2, timeout_s=60)
    assert r0 == ("PlanMismatchError: rank 0: the plan does not fit the model or mesh on rank(s) "
                  "[1] (see their errors); no rank applied it")
    assert r1.startswith("PlanMismatchError: plan 'toy' was compiled for mesh tp=2, but the "
                         "DeviceMesh is tq=2"), r1


def _model_config_worker(rank: int, world: int) -> str:
    plan, model = _plan_and_model()
    if rank == 1:
        model = Toy(hidden=32)  # another model config on one rank
    return _outcome(lambda: apply(model, plan, _mesh("tp")))


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_with_another_model_config_fails_every_rank() -> None:
    r0, r1 = run_ranks(_model_config_worker, 2, timeout_s=60)
    assert r0.startswith("PlanMismatchError: rank 0: the plan does not fit the model or mesh on "
                         "rank(s) [1]"), r0
    assert r1.startswith("PlanMismatchError: plan 'toy' does not fit this model: parameter "), r1


def _different_plan_worker(rank: int, world: int) -> str:
    plan, model = _plan_and_model()
    if rank == 1:
        with torch.device("meta"):
            plan = compile_recipe(RECIPE, Toy(hidden=32), {"tp": 2})
        model = Toy(hidden=32)  # fits its own plan, not rank 0's
    return _outcome(lambda: apply(model, plan, _mesh("tp")))


def test_ranks_holding_different_plans_fail_every_rank() -> None:
    r0, r1 = run_ranks(_different_plan_worker, 2, timeout_s=60)
    for rank, text in ((0, r0), (1, r1)):
        assert text.startswith(f"PlanMismatchError: ranks hold different plans or meshes: this "
                               f"rank (rank {rank}) has plan 'toy'"), text
        assert f"ranks [{1 - rank}] hold another" in text


def _interrupted_worker(rank: int, world: int) -> str:
    from hyperrecipe.runtime import install

    plan, model = _plan_and_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    if rank == 1:
        def interrupted(self: Any, tx: Any) -> None:
            raise KeyboardInterrupt

        install._Applier.install_boundaries = interrupted  # type: ignore[method-assign]
    outcome = _outcome(lambda: apply(model, plan, _mesh("tp")))
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return f"{outcome} | unchanged={unchanged}"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_interrupted_mid_apply_fails_every_rank_and_all_roll_back() -> None:
    r0, r1 = run_ranks(_interrupted_worker, 2, timeout_s=60)
    assert r0 == ("PlanMismatchError: applying plan 'toy' failed on rank(s) [1]; this rank "
                  "rolled back too (see the failing rank's error) | unchanged=True")
    assert r1 == "KeyboardInterrupt | unchanged=True"


def _absent_worker(rank: int, world: int) -> str:
    plan, model = _plan_and_model()
    mesh = _mesh("tp")
    if rank == 1:
        time.sleep(4)  # never calls apply (stopped, or running other code)
        return "absent"
    return _outcome(lambda: apply(model, plan, mesh))


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_that_never_arrives_fails_its_peer_after_the_agreement_timeout(
        monkeypatch: Any) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    r0, r1 = run_ranks(_absent_worker, 2, timeout_s=60)
    assert r0.startswith("PlanMismatchError: rank 0: not every rank reached the plan agreement "
                         "within 1 s"), r0
    assert r1 == "absent"


def _slow_worker(rank: int, world: int) -> str:
    from hyperrecipe.runtime import install

    plan, model = _plan_and_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    if rank == 1:
        original = install._Applier.install_boundaries

        def slow(self: Any, tx: Any) -> None:
            time.sleep(8)  # hung in its own code past the peers' wait
            original(self, tx)

        install._Applier.install_boundaries = slow  # type: ignore[method-assign]
    mesh = _mesh("tp")
    torch.distributed.barrier()  # both reach apply together: only the install is slow
    notes: list[str] = []

    def run() -> None:
        try:
            apply(model, plan, mesh)
        except Exception as exc:
            notes.extend(getattr(exc, "__notes__", []))
            raise

    outcome = _outcome(run)
    params = dict(model.named_parameters())
    # A parameter whose storage was released once sharded cannot be gathered back without
    # the late peer: it comes back on the meta device (loudly unusable), never with a wrong
    # value, and the error says to rebuild the model.
    wrong = [n for n, p in params.items() if not p.is_meta and not torch.equal(before[n], p)]
    lost = sorted(n for n, p in params.items() if p.is_meta)
    said = any("rebuild or reload the model" in note for note in notes)
    return f"{outcome} | wrong={wrong} lost={bool(lost)} said={said}"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_slower_than_the_wait_rolls_back_with_its_peers(monkeypatch: Any) -> None:
    """The late rank finds its peer's buffered "arrived" word but no vote: neither keeps the
    plan, neither hangs or aborts in the other's rollback, and no parameter keeps a wrong
    value (those that cannot be gathered back are on meta, and the error says so)."""
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    r0, r1 = run_ranks(_slow_worker, 2, timeout_s=90)
    assert r0.startswith("PlanMismatchError: rank 0: not every rank reached the vote after "
                         "installing within 3 s"), r0
    assert r1.startswith("PlanMismatchError: rank 1: not every rank reached the vote after "
                         "installing within 3 s"), r1
    for r in (r0, r1):
        assert "| wrong=[]" in r, r
        assert r.endswith("lost=False said=False") or r.endswith("lost=True said=True"), r
