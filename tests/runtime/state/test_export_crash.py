"""An export killed or failing after the ranks agreed: transformers' own loader never sees a mix.

Issue 41 saw a writer killed at the second of four renames leave two exports' shards under one
index, which ``from_pretrained`` loaded without a word, with the old export gone; a kill while
``config.json`` was written left 40 bytes of invalid JSON; a killed writer's temporaries stayed
forever; and an error after the agreement reached the writer only (a bare ``OSError``, while
its peer returned normally). Each test here kills (SIGKILL, no cleanup runs) or fails the
writer at one precise point of the switch (runtime/state/folder_switch.py), by wrapping that
step in the writer's own forked process, then loads the folder with ``from_pretrained`` and
with our ``load_weights``, and compares every tensor with the export that must be there.

Real tiny Llama, real safetensors, real gloo ranks, real transformers.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import RankFailedError, run_ranks
from hyperrecipe.errors import ExportError
from hyperrecipe.runtime.state import folder_switch
from hyperrecipe.runtime.state.folder_lock import LOCK
from hyperrecipe.runtime.state.folder_switch import leftovers
from tests.support.checkpoint_harness import applied

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_around_exchange(when: str) -> None:
    real = folder_switch._exchange

    def exchange(a: Path, b: Path) -> int:
        if when == "before-exchange":
            _die()
        failed = real(a, b)
        if when == "after-exchange":
            _die()
        return failed

    folder_switch._exchange = exchange


def _kill_in_config() -> None:
    from transformers import PretrainedConfig

    def save_pretrained(self: Any, where: str | os.PathLike[str], **kwargs: Any) -> None:
        Path(where, "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hid')
        _die()

    PretrainedConfig.save_pretrained = save_pretrained  # type: ignore[method-assign]


def _fail_exchange(rank: int) -> None:
    if rank == 0:  # the writer: an I/O error at the switch, after every rank wrote its part
        folder_switch._exchange = lambda a, b: errno.EIO


_FAULTS: dict[str, Callable[[int], None]] = {
    "before-exchange": lambda rank: _kill_around_exchange("before-exchange"),
    "after-exchange": lambda rank: _kill_around_exchange("after-exchange"),
    "in-config": lambda rank: _kill_in_config(),
    "eio-at-switch": _fail_exchange,
}


def _export(rank: int, world: int, folder: str, scale: float,
            fault: str | None) -> dict[str, Any]:
    model, inst = applied(world)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    full = inst.state.full_state_dict()
    if fault is not None:
        _FAULTS[fault](rank)
    try:
        inst.state.save_pretrained(folder, max_shard_bytes=40_000)  # several files
    except ExportError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "full": full}
    return {"error": None, "full": full}


def _load(rank: int, world: int, folder: str) -> dict[str, Any]:
    _, inst = applied(world)
    inst.state.load_weights(folder)
    return inst.state.full_state_dict()


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock's (a killed writer's lock stays, and is taken over by
    the next save on this machine: test_one_writer.py)."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK}


def _assert_holds(folder: Path, full: dict[str, torch.Tensor]) -> None:
    """Both loaders read exactly ``full`` from the folder, every tensor bit for bit."""
    from transformers import AutoModelForCausalLM

    hf = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    ours = run_ranks(_load, 1, str(folder))[0]
    assert hf and set(hf) <= set(full)
    for name in hf:  # every parameter (the rotary buffer is not saved)
        torch.testing.assert_close(hf[name].detach(), full[name], atol=0, rtol=0, msg=name)
        torch.testing.assert_close(ours[name], full[name], atol=0, rtol=0, msg=name)


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A folder holding an export (sharded in several files, so that a per-file switch would
    have renames to be killed between) and what else a user keeps there."""
    folder = tmp_path / "export"
    res = run_ranks(_export, 1, str(folder), 1.0, None)[0]
    assert res["error"] is None
    (folder / "tokenizer.json").write_text('{"tok": 1}')
    (folder / "runs").mkdir()
    (folder / "runs" / "notes.txt").write_text("mine")
    return folder, res["full"]


def _scaled(full: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The parameters of an export of the same model scaled by ``scale`` (as ``_export``)."""
    return {k: v * scale for k, v in full.items()}


@pytest.mark.parametrize("fault", ["before-exchange", "in-config"])
def test_a_writer_killed_before_its_switch_leaves_the_old_export_byte_for_byte(
        fault: str, exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, old = exported
    before = _snapshot(folder)
    with pytest.raises(RankFailedError):
        run_ranks(_export, 1, str(folder), 3.0, fault)
    assert _snapshot(folder) == before
    _assert_holds(folder, old)
    assert leftovers(folder) == [folder.parent / ".export.hyperrecipe-new"]  # named...
    again = run_ranks(_export, 1, str(folder), 2.0, None)[0]  # ...and removed by the next save
    assert again["error"] is None and leftovers(folder) == []
    _assert_holds(folder, _scaled(old, 2.0))
    assert (folder / "tokenizer.json").read_text() == '{"tok": 1}'
    assert (folder / "runs" / "notes.txt").read_text() == "mine"


def test_a_writer_killed_right_after_its_switch_leaves_the_new_export_whole(
        exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, old = exported
    with pytest.raises(RankFailedError):
        run_ranks(_export, 1, str(folder), 3.0, "after-exchange")
    _assert_holds(folder, _scaled(old, 3.0))  # the new export, whole, config included
    assert (folder / "tokenizer.json").read_text() == '{"tok": 1}'  # linked before the switch
    # the subfolder was still in the previous state's folder: the next save moves it back
    assert not (folder / "runs").exists()
    again = run_ranks(_export, 1, str(folder), 2.0, None)[0]
    assert again["error"] is None and leftovers(folder) == []
    assert (folder / "runs" / "notes.txt").read_text() == "mine"
    _assert_holds(folder, _scaled(old, 2.0))


def test_an_error_at_the_switch_reaches_every_rank_as_the_same_export_error(
        exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, old = exported
    before = _snapshot(folder)
    results = run_ranks(_export, 2, str(folder), 3.0, "eio-at-switch")
    errors = [res["error"] for res in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith(f"ExportError: rank 0: save_pretrained into {folder} failed "
                                f"after every rank wrote its part, before the switch, so "
                                f"nothing was replaced"), errors[0]
    assert "Input/output error" in errors[0]
    assert _snapshot(folder) == before and leftovers(folder) == []
    _assert_holds(folder, old)


def _export_from_inside(rank: int, world: int, folder: str, scale: float) -> dict[str, Any]:
    os.chdir(folder)  # a folder that is the process's working folder is never exchanged away
    return _export(rank, world, folder, scale, None)


def test_where_no_exchange_is_possible_the_export_is_switched_file_by_file(
        exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """The per-file switch (weights, index and configs renamed into place, the earlier
    export's other shards removed, the manifest last) leaves one export both loaders read."""
    folder, old = exported
    res = run_ranks(_export_from_inside, 1, str(folder), 3.0)[0]
    assert res["error"] is None and leftovers(folder) == []
    _assert_holds(folder, _scaled(old, 3.0))
    assert (folder / "tokenizer.json").read_text() == '{"tok": 1}'
    assert (folder / "runs" / "notes.txt").read_text() == "mine"
