"""Every open of a state file is non-blocking and checked on its descriptor (issue 41).

``load_weights`` checks that each file is a regular file by its name, then opens it: a file
swapped for a FIFO in between made the open wait for a writer forever. Each reader is called
here on a real FIFO (``os.mkfifo``) at the point where the name was already checked, in a rank
process with a timeout, so a regression fails the test instead of hanging it. The DCP case is
end to end: a ``dcp.load`` planner (torch's own extension point) swaps a storage file for a
FIFO after the metadata and its storage files were checked, before the data is read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from tests.support.checkpoint_harness import save_dcp_worker

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

READERS = ["read_safetensors_header", "open_safetensors", "open_torch_file", "digest_file",
           "sampled_fingerprint", "source_digest", "read_regular_file"]


def _read_fifo(rank: int, world: int, reader: str, fifo: str) -> str:
    """What ``reader`` says about the FIFO ``fifo`` (it must not wait for a writer)."""
    from hyperrecipe._files import read_regular_file
    from hyperrecipe.runtime.state import checkpoint_files, integrity

    path = Path(fifo)
    calls: dict[str, Any] = {
        "read_safetensors_header": lambda: checkpoint_files.read_safetensors_header(path),
        "open_safetensors": lambda: checkpoint_files.open_safetensors(path),
        "open_torch_file": lambda: checkpoint_files.open_torch_file(path),
        "digest_file": lambda: integrity.digest_file(path, "sha256"),
        "sampled_fingerprint": lambda: integrity.sampled_fingerprint(path),
        "source_digest": lambda: integrity.source_digest(path),
        "read_regular_file": lambda: read_regular_file(path, limit=1 << 20),
    }
    try:
        value = calls[reader]()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return f"returned {value!r:.80}"


@pytest.mark.parametrize("reader", READERS)
def test_each_state_reader_refuses_a_fifo_without_waiting_for_a_writer(
        reader: str, tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    said = run_ranks(_read_fifo, 1, reader, str(fifo), timeout_s=60)[0]
    if reader == "source_digest":  # a digest, not a load: it records the file as not regular
        assert said.startswith("returned '"), said
    elif reader in ("digest_file", "sampled_fingerprint", "read_regular_file"):
        assert said == f"OSError: [Errno 22] not a regular file (a FIFO): '{fifo}'"
    else:
        assert said == f"WeightLoadError: {fifo}: cannot be read: not a regular file (a FIFO)"


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("dcp") / "step-1"
    run_ranks(save_dcp_worker, 2, str(ckpt))
    return ckpt


def _load_with_swap(rank: int, world: int, folder: str) -> str:
    """``dcp.load`` through :func:`trusted_reader`, with a planner that swaps ``__0_0.distcp``
    for a FIFO once the metadata (and every storage file named in it) has been checked."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from hyperrecipe.runtime.state.dcp_reader import trusted_reader

    class SwapAfterChecks(DefaultLoadPlanner):
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            storage = Path(folder) / "__0_0.distcp"
            storage.unlink()
            os.mkfifo(storage)

    state = {"model": {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}}
    try:
        dcp.load(state, storage_reader=trusted_reader(folder), planner=SwapAfterChecks())
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_dcp_storage_file_swapped_for_a_fifo_after_its_checks_is_refused(
        dcp_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(dcp_folder, folder)
    said = run_ranks(_load_with_swap, 1, str(folder), timeout_s=60)[0]
    assert f"not a regular file (a FIFO): '{folder / '__0_0.distcp'}'" in said, said
