"""``hyperrecipe.runtime.leave_together`` on real gloo ranks: a rank returns only once every rank got
there, and a rank that never comes is warned about within ``collective_timeout_s``, not waited
for. No wall-clock asserts: order is read off files the ranks write, and the launch's own
limit is what a hang would hit.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.runtime import leave_together
from tests.support.runtime_harness import ROOT, llama, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

LLAMA = str(ROOT / "recipes/llama.yaml")


def _late_worker(rank: int, world: int, folder: str) -> bool:
    """Rank 0 arrives a second late (still writing, say); every other rank must find rank 0's
    marker once its own call returned."""
    model = llama()
    inst = apply(model, compile_recipe(LLAMA, llama("meta"), {"tp": world}), mesh_1d(world))
    marker = Path(folder) / "rank0-arrived"
    if rank == 0:
        time.sleep(1.0)
        marker.touch()
    leave_together(inst, "test loop")
    return marker.is_file()


def test_every_rank_returns_only_after_the_last_arrived(tmp_path: Path) -> None:
    assert run_ranks(_late_worker, 2, str(tmp_path), timeout_s=300) == [True, True]


def _absent_worker(rank: int, world: int, folder: str) -> str:
    """Rank 1 never calls; rank 0 must come back with a warning naming the call."""
    model = llama()
    inst = apply(model, compile_recipe(LLAMA, llama("meta"), {"tp": world}), mesh_1d(world))
    inst.collective_timeout_s = 1.0
    done = Path(folder) / "rank0-done"
    if rank == 1:
        deadline = time.monotonic() + 50
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "did not call"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        leave_together(inst, "test loop")
    done.touch()
    return "; ".join(f"{w.category.__name__}: {w.message}" for w in caught)


def test_a_rank_that_never_comes_is_warned_about_not_waited_for(tmp_path: Path) -> None:
    first, second = run_ranks(_absent_worker, 2, str(tmp_path), timeout_s=300)
    assert second == "did not call"
    assert first == ("RuntimeWarning: test loop: the ranks did not leave together (rank(s) [1] "
                     "did not enter it within 1 s); a rank that failed says why")
