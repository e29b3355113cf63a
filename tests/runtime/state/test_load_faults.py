"""Faults while ``load_weights`` copies, after every check passed (issue 28's "left alone").

A checkpoint file shortened after its checks (another process truncates it, a network
filesystem serves a shorter file) used to kill the process with SIGBUS through the memory-mapped
reader; now it is a short positional read, raised by name (file, tensor, byte). And one rank's
fault no longer leaves the ranks inconsistent: after the copy the ranks agree, and every rank
raises naming the failing rank, with what it wrote marked unset (``status()`` lists it).

Real files (``save_pretrained`` of a tiny Llama), truncated for real with ``os.truncate`` between
the load's checks and its reads; real gloo ranks at tp=2, each rank reading its own copy of the
folder (equal bytes, so the ranks' agreement before the load passes) so that only one rank's
copy is damaged.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import WeightLoadError
from tests.support.checkpoint_harness import applied

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.runtime_harness import llama

    folder = tmp_path_factory.mktemp("hf")
    llama().save_pretrained(folder)
    return folder


def _shorten_after_checks(folder: str, after: int) -> list[str]:
    """Make the next ``load_weights`` truncate ``folder``'s weight file once ``after``
    tensors were read (``model.safetensors`` to its header and 16 bytes of data, a
    ``pytorch_model.bin`` to its first quarter): between the checks (the plan) and the
    remaining reads, as another process would. Returns the FQNs read, in order (the last
    one is the tensor the short read hit)."""
    from hyperrecipe.runtime.state import weights

    plan = weights._Safetensors.plan  # the torch strategy inherits it
    reads: list[str] = []
    path = Path(folder) / "model.safetensors"
    if path.exists():
        (length,) = struct.unpack("<Q", path.read_bytes()[:8])
        keep = 8 + length + 16
    else:
        path = Path(folder) / "pytorch_model.bin"
        keep = path.stat().st_size // 4

    def shortening_plan(self: Any, *args: Any) -> Any:
        reader = plan(self, *args)

        def count(fqn: str) -> None:
            reads.append(fqn)
            if len(reads) == after + 1:
                os.truncate(path, keep)

        def read(target: Any, key: str | None = None) -> torch.Tensor:
            count(target.fqn)
            return reader.read(target, key)

        changes: dict[str, Any] = {"read": read}
        fill = getattr(reader, "fill", None)
        if fill is not None:  # the positional reader writes straight into the shard
            def fill_counted(target: Any, out: torch.Tensor) -> bool:
                count(target.fqn)
                return bool(fill(target, out))

            changes["fill"] = fill_counted
        return attrs.evolve(reader, **changes)

    weights._Safetensors.plan = shortening_plan  # type: ignore[method-assign]
    return reads


def _shortened_worker(rank: int, world: int, folders: list[str], faulty_rank: int) -> Any:
    model, inst = applied(world)
    inst.state.load_weights(folders[rank])
    # each rank's own shards (model.state_dict() would gather the full tensors)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    reads = _shorten_after_checks(folders[rank], 2) if rank == faulty_rank else []
    try:
        inst.state.load_weights(folders[rank])
    except WeightLoadError as exc:
        after = dict(model.named_parameters())
        changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
        return {"error": str(exc), "reads": reads, "changed": changed,
                "changed_are_nan": all(bool(torch.isnan(after[k]).all()) for k in changed),
                "unset": [r.error for r in inst.state.status() if r.state == "unset"]}
    return {"error": None, "reads": reads}


def _copies(folder: Path, tmp_path: Path, world: int) -> list[str]:
    return [str(shutil.copytree(folder, tmp_path / f"rank{r}")) for r in range(world)]


def test_a_file_shortened_after_its_checks_is_a_located_error_not_a_sigbus(
        hf_folder: Path, tmp_path: Path) -> None:
    """main's reader memory-mapped the file: the rank died with SIGBUS (run_ranks raised)."""
    folders = _copies(hf_folder, tmp_path, 1)
    res = run_ranks(_shortened_worker, 1, folders, 0)[0]
    error = res["error"]
    assert error is not None, "a shortened file loaded"
    hit = res["reads"][-1]
    path = Path(folders[0]) / "model.safetensors"
    assert f"reading {hit!r} failed after its checks passed" in error, error
    assert f"{path}: reading {hit!r}: " in error and "bytes from byte " in error, error
    size = os.path.getsize(path)
    assert f"but the file ends at byte {size}" in error, error
    assert "it was shortened after its header was checked" in error, error
    # the tensors this load wrote (and the one it was writing) are unset, the rest untouched
    written = set(res["reads"])
    assert res["changed"] and set(res["changed"]) <= {f"{k}" for k in written}, res["changed"]
    assert res["changed_are_nan"]
    assert res["unset"] and res["unset"][0].startswith(f"{len(written)} tensors have no value")


def test_a_pytorch_model_bin_shortened_after_its_checks_is_a_located_error_not_a_sigbus(
        hf_folder: Path, tmp_path: Path) -> None:
    """main mapped it through torch.load(mmap=True): the rank died with SIGBUS."""
    from tests.support.runtime_harness import llama

    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save(llama().state_dict(), folder / "pytorch_model.bin")
    res = run_ranks(_shortened_worker, 1, [str(folder)], 0)[0]
    error = res["error"]
    assert error is not None, "a shortened file loaded"
    hit = res["reads"][-1]
    path = folder / "pytorch_model.bin"
    assert f"reading {hit!r} failed after its checks passed" in error, error
    assert f"{path}: reading " in error, error
    assert f"but the file ends at byte {os.path.getsize(path)}" in error, error
    assert res["changed_are_nan"] and set(res["changed"]) <= set(res["reads"])


def test_one_rank_faulting_mid_copy_makes_every_rank_raise_with_what_it_wrote_unset(
        hf_folder: Path, tmp_path: Path) -> None:
    """main: rank 1 raised, rank 0 returned and trained on. Now both raise, rank 0 naming rank
    1 and its file, and every tensor either rank wrote in this load is unset on that rank."""
    folders = _copies(hf_folder, tmp_path, 2)
    ok, faulty = run_ranks(_shortened_worker, 2, folders, 1)
    assert faulty["error"] is not None
    assert "but the file ends at byte" in faulty["error"]
    assert ok["error"] is not None, "rank 0 went on while rank 1 raised"
    assert "rank(s) [1] failed while loading, after every check passed" in ok["error"]
    assert f"{Path(folders[1]) / 'model.safetensors'}: reading " in ok["error"], ok["error"]
    assert "tensors that held weights before this load are now unset" in ok["error"]
    for res in (ok, faulty):
        assert res["changed"] and res["changed_are_nan"]
        assert res["unset"], "status() does not list the unset tensors"
    # rank 0 finished its copy: every tensor it holds is unset, not only those rank 1 wrote
    assert len(ok["changed"]) == len(dict(_applied_names())) > len(faulty["changed"]) == 3
    assert ok["unset"][0].startswith(f"{len(ok['changed'])} tensors have no value")
    assert faulty["unset"][0].startswith("3 tensors have no value")


def _applied_names() -> list[tuple[str, Any]]:
    from tests.support.runtime_harness import llama

    return list(llama("meta").named_parameters())
