"""A reader during a re-export reads one export or refuses (issue 41, point 3).

1 of 53 ``load_weights`` calls run while another process re-exported into the same folder
returned 6 tensors of one export and 24 of the other: the manifest was hashed from files
opened by name, and the tensors were read from files opened by name again. Now a load opens
the folder and each file it reads once (:mod:`hyperrecipe.runtime.state.snapshot`), hashes and
reads through those descriptors, and checks them unchanged before it succeeds.

The quick tests drive the snapshot directly, between its open and its reads: a file renamed
over one it opened, a file written in place, the folder exchanged with another
(``renameat2(RENAME_EXCHANGE)``, as an export that swaps in a finished sibling folder does) and
its old copy deleted. The slow ones load into an applied model (one rank, then two ranks that
opened two exports of one folder) and run a writer re-exporting two exports alternately
against a reader loading again and again. Real files, written by our own export code.
"""

from __future__ import annotations

import ctypes
import errno
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import WeightLoadError
from hyperrecipe.runtime.state import weights
from hyperrecipe.runtime.state.export import ExportItem, write_safetensors
from hyperrecipe.runtime.state.integrity import MANIFEST
from hyperrecipe.runtime.state.snapshot import Snapshot
from hyperrecipe.runtime.state.weights import open_snapshot, verify_manifest

_TENSOR_BYTES = 64 * 64 * 4
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _tensors(scale: float) -> dict[str, Tensor]:
    """30 tensors, each filled with its own value times ``scale`` (two exports differ in
    every tensor)."""
    return {f"layer{i:02d}.weight": torch.full((64, 64), scale * (i + 1)) for i in range(30)}


def _export(folder: Path, tensors: dict[str, Tensor], per_file: int = 6) -> None:
    """``tensors`` exported by our own writer: ``per_file`` tensors a file, an index and the
    manifest, written last."""
    items = [ExportItem(name=k, dtype=v.dtype, shape=tuple(v.shape),
                        gather=lambda v=v: v)  # type: ignore[misc]
             for k, v in tensors.items()]
    write_safetensors(folder, items, writer=True, max_shard_bytes=_TENSOR_BYTES * per_file,
                      model=nn.Module())


def _age(folder: Path) -> None:
    """Date the folder's files a minute back, as an export written earlier: a write after the
    snapshot opened them then moves their times past the clock's granularity."""
    past = time.time() - 60
    for f in folder.iterdir():
        os.utime(f, (past, past))


@pytest.fixture
def exports(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    _export(a, _tensors(1.0))
    _export(b, _tensors(-1.0))
    _age(a)
    _age(b)
    return a, b


def _read_through(snapshot: Snapshot) -> dict[str, Tensor]:
    """What a load reads from ``snapshot``: the manifest checked, each tensor read whole by
    the safetensors strategy's own handles, the files checked unchanged afterwards."""
    verify_manifest(snapshot)
    fmt = weights._Safetensors(nn.Module(), snapshot)
    where = weights._key_files(fmt, snapshot)
    out = {k: fmt.open(p).get_slice(k)[(slice(None),)] for k, p in sorted(where.items())}
    snapshot.verify()
    return out


def _exchange(a: Path, b: Path) -> None:
    """``renameat2(a, b, RENAME_EXCHANGE)``: the two folders trade names in one step."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                      _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS):
            pytest.skip(f"renameat2(RENAME_EXCHANGE) is not supported here: {os.strerror(code)}")
        raise OSError(code, os.strerror(code), os.fspath(a))


def _assert_equal(found: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert sorted(found) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, atol=0, rtol=0, msg=key)


# -- the snapshot, between its open and its reads -------------------------------------------


def test_a_file_renamed_over_one_the_snapshot_opened_is_not_read_in_its_place(
        exports: tuple[Path, Path]) -> None:
    a, b = exports
    with open_snapshot(a) as snapshot:
        name = "model-00002-of-00005.safetensors"
        os.replace(b / name, a / name)  # another export's file, renamed into place
        _assert_equal(_read_through(snapshot), _tensors(1.0))
    with pytest.raises(WeightLoadError, match=f"{a / name}: its xxh3_128|{a / name}: its sha256"):
        verify_manifest(a)  # the folder by name now mixes two exports: refused


def test_a_file_written_in_place_after_the_snapshot_opened_it_is_refused_by_name(
        exports: tuple[Path, Path]) -> None:
    a, _ = exports
    name = "model-00003-of-00005.safetensors"
    with open_snapshot(a) as snapshot:
        data = (a / name).read_bytes()
        with open(a / name, "r+b") as f:  # the same bytes, written again by another tool
            f.write(data)
        with pytest.raises(WeightLoadError) as refused:
            _read_through(snapshot)
    assert (f"{a}: files changed while load_weights read them (another process wrote into "
            f"them)") in str(refused.value)
    assert f"{a / name}: written in place (its modification time moved)" in str(refused.value)


def test_a_file_without_a_manifest_written_in_place_is_refused_after_the_reads(
        exports: tuple[Path, Path]) -> None:
    """Another tool's folder has no manifest to hash; the descriptors' check still sees the
    write (here: other bytes of the same size, after the snapshot opened the file)."""
    a, _ = exports
    (a / MANIFEST).unlink()
    name = "model-00001-of-00005.safetensors"
    with open_snapshot(a) as snapshot:
        size = (a / name).stat().st_size
        with open(a / name, "r+b") as f:
            f.seek(size - 16)
            f.write(bytes(16))
        with pytest.raises(WeightLoadError, match="written in place") as refused:
            _read_through(snapshot)
    assert f"{a / name}: written in place" in str(refused.value)


def test_a_folder_exchanged_after_the_snapshot_opened_its_files_is_read_whole(
        exports: tuple[Path, Path]) -> None:
    """Every file is open before a byte is read: the old export is read whole even once its
    folder was swapped out and deleted."""
    a, b = exports
    with open_snapshot(a) as snapshot:
        _exchange(b, a)  # a now holds the other export
        shutil.rmtree(b)  # the old export, deleted as a swapping writer does
        assert snapshot.replaced()
        _assert_equal(_read_through(snapshot), _tensors(1.0))


def test_a_folder_exchanged_before_the_snapshot_opened_its_files_is_never_mixed(
        exports: tuple[Path, Path]) -> None:
    """The folder is held by its descriptor: exchanged (not deleted), the old folder is read
    at its new name, never the export now at the path."""
    a, b = exports
    with Snapshot(a) as snapshot:
        _exchange(b, a)
        _assert_equal(_read_through(snapshot), _tensors(1.0))


def test_a_file_opened_after_its_folder_was_replaced_and_deleted_is_a_named_refusal(
        exports: tuple[Path, Path]) -> None:
    a, b = exports
    with Snapshot(a) as snapshot:
        names = snapshot.names()
        _exchange(b, a)
        shutil.rmtree(b)
        with pytest.raises(WeightLoadError) as refused:
            snapshot.open(names[0])
    assert str(refused.value).startswith(
        f"{a}: the folder was replaced while load_weights read it (another export into the "
        f"same folder?): {a / names[0]} was gone when it was opened; nothing of the new "
        f"folder was read. Load again once the export has finished")


# -- load_weights into an applied model -------------------------------------------------------


def _same_model(model: nn.Module, before: dict[str, Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items()
               if isinstance(v, Tensor))


def _replaced_mid_load_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """One rank: export A and B (B = 2 * A); load A's snapshot while the folder is exchanged
    with B and the old copy deleted, once with every file already open, once with only the
    folder open; then a file written in place after the snapshot opened it."""
    from tests.support.checkpoint_harness import applied

    model, inst = applied(world)
    base = Path(root)
    a, b = base / "a", base / "b"
    inst.state.save_pretrained(a, max_shard_bytes=40_000)
    full_a = inst.state.full_state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    out: dict[str, Any] = {"files": len(list(a.glob("model-*.safetensors")))}

    def reset() -> None:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)
        inst.state.load_full_state_dict(full_a)
        inst.state.save_pretrained(a, max_shard_bytes=40_000)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)
        inst.state.save_pretrained(b, max_shard_bytes=40_000)  # the model holds B
        for folder in (a, b):
            _age(folder)

    reset()
    with open_snapshot(a) as snapshot:
        _exchange(b, a)
        shutil.rmtree(b)
        inst.state._load_snapshot(snapshot)
    full = inst.state.full_state_dict()
    out["opened"] = all(torch.equal(full[k], v) for k, v in full_a.items())

    reset()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Snapshot(a) as snapshot:
        _exchange(b, a)
        shutil.rmtree(b)
        try:
            inst.state._load_snapshot(snapshot)
            out["late"] = "loaded"
        except WeightLoadError as exc:
            out["late"] = str(exc)
    out["late_untouched"] = _same_model(model, before)

    reset()
    name = sorted(a.glob("model-*.safetensors"))[1]
    with open_snapshot(a) as snapshot:
        with open(name, "r+b") as f:
            f.write(name.read_bytes())
        try:
            inst.state._load_snapshot(snapshot)
            out["in_place"] = "loaded"
        except WeightLoadError as exc:
            out["in_place"] = str(exc)
    out["in_place_untouched"] = _same_model(model, before)
    out["in_place_file"] = str(name)
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_load_weights_while_its_folder_is_replaced_loads_the_old_export_or_refuses(
        tmp_path: Path) -> None:
    out = run_ranks(_replaced_mid_load_worker, 1, str(tmp_path))[0]
    assert out["files"] > 1, "the export must span several files"
    assert out["opened"], "every file was open: the old export loads whole"
    assert out["late"].startswith(f"{tmp_path / 'a'}: the folder was replaced while "
                                  f"load_weights read it"), out["late"]
    assert "Load again once the export has finished" in out["late"]
    assert out["late_untouched"], "a refused load leaves the model as it was"
    assert f"{out['in_place_file']}: written in place" in out["in_place"], out["in_place"]
    assert out["in_place_untouched"], "a refused load leaves the model as it was"


def _written_mid_copy_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Export, load it back; then load again while another tool rewrites a weight file in
    place once the copy has begun (after the checks before writing passed)."""
    import attrs

    from tests.support.checkpoint_harness import applied

    model, inst = applied(world)
    folder = Path(root) / "export"
    inst.state.save_pretrained(folder, max_shard_bytes=40_000)
    _age(folder)
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    plan = weights._Safetensors.plan

    def writing_plan(self: Any, *args: Any) -> Any:
        reader = plan(self, *args)
        fill = reader.fill
        written: list[bool] = []

        def fill_then_write(target: Any, out: Tensor) -> bool:
            if not written:  # once, as the first tensor is copied: the same bytes again
                written.append(True)
                with open(victim, "r+b") as f:
                    f.write(victim.read_bytes())
            return bool(fill(target, out))

        return attrs.evolve(reader, fill=fill_then_write)

    weights._Safetensors.plan = writing_plan  # type: ignore[method-assign]
    try:
        inst.state.load_weights(folder)
    except WeightLoadError as exc:
        unset = [r.error for r in inst.state.status() if r.state == "unset"]
        return {"error": str(exc), "victim": str(victim), "unset": unset,
                "nan": any(bool(torch.isnan(p).any()) for p in model.parameters())}
    finally:
        weights._Safetensors.plan = plan  # type: ignore[method-assign]
    return {"error": None}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_file_written_in_place_during_the_copy_is_refused_and_what_was_written_unset(
        tmp_path: Path) -> None:
    """The check before writing passed; the write lands while the tensors are copied, so the
    check after the copy refuses the load through the copy's fault path: the tensors written
    are marked unset (status() lists them), never left as a silent mix."""
    res = run_ranks(_written_mid_copy_worker, 1, str(tmp_path))[0]
    assert res["error"] is not None, "a file written during the copy loaded"
    assert "reading the checkpoint failed after its checks passed" in res["error"], res["error"]
    assert f"{res['victim']}: written in place" in res["error"], res["error"]
    assert res["unset"] and res["nan"], "what was written must be unset"


def _two_exports_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 opens the folder, then the folder is exchanged with another export, then rank
    1 opens it: each rank holds a whole export, not the same one."""
    import torch.distributed as dist

    from tests.support.checkpoint_harness import applied

    model, inst = applied(world)
    a, b = Path(root) / "a", Path(root) / "b"
    inst.state.save_pretrained(a)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    inst.state.save_pretrained(b)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = open_snapshot(a) if rank == 0 else None
    dist.barrier()
    if rank == 0:
        _exchange(b, a)
    dist.barrier()
    if snapshot is None:
        snapshot = open_snapshot(a)
    try:
        with snapshot:
            inst.state._load_snapshot(snapshot)
        error = None
    except WeightLoadError as exc:
        error = str(exc)
    return {"error": error, "untouched": _same_model(model, before)}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_ranks_that_opened_two_exports_of_one_folder_all_refuse(tmp_path: Path) -> None:
    results = run_ranks(_two_exports_worker, 2, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} loaded"
        assert "ranks read different checkpoints" in res["error"], res["error"]
        assert res["untouched"], f"rank {rank} wrote"
    assert "the folder was replaced while load_weights read it" in results[0]["error"]


# -- a writer re-exporting against a reader loading ---------------------------------------------


def _writer(folder: str, sources: list[str], how: str, stop: Any) -> None:
    """Re-export the tensors of ``sources`` into ``folder``, alternately, until ``stop``: in
    place (our export: temporary files renamed over the old ones, the manifest last) or by
    writing a sibling folder and exchanging it with ``folder``, then deleting the old one."""
    from safetensors.torch import load_file

    exports = []
    for source in sources:
        tensors: dict[str, Tensor] = {}
        for f in sorted(Path(source).glob("model*.safetensors")):
            tensors.update(load_file(f))
        exports.append(tensors)
    target = Path(folder)
    i = 0
    while not stop.is_set():
        tensors = exports[i % len(exports)]
        if how == "in place":
            _export(target, tensors, per_file=4)
        else:
            staging = target.with_name(f".{target.name}.staging")
            shutil.rmtree(staging, ignore_errors=True)
            _export(staging, tensors, per_file=4)
            _exchange(staging, target)
            shutil.rmtree(staging)
        i += 1


def _reader_worker(rank: int, world: int, folder: str, loads: int,
                   fulls: list[dict[str, Tensor]]) -> list[str]:
    """Load ``folder`` ``loads`` times: each outcome is ``export <i>`` (every tensor that
    export's), ``MIX`` (anything else) or the refusal's message."""
    from tests.support.checkpoint_harness import applied

    _, inst = applied(world, "meta")
    outcomes = []
    for _ in range(loads):
        try:
            inst.state.load_weights(folder)
        except WeightLoadError as exc:
            outcomes.append(f"refused: {exc}")
            continue
        full = inst.state.full_state_dict()
        which = [i for i, expected in enumerate(fulls)
                 if all(torch.equal(full[k], v) for k, v in expected.items())]
        outcomes.append(f"export {which[0]}" if which else "MIX")
    return outcomes


def _exports_worker(rank: int, world: int, root: str) -> list[dict[str, Tensor]]:
    from tests.support.checkpoint_harness import applied

    model, inst = applied(world)
    fulls = []
    for i, name in enumerate(("a", "b")):
        if i:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-2)
        inst.state.save_pretrained(Path(root) / name)
        fulls.append(inst.state.full_state_dict())
    return fulls


@pytest.mark.slow  # launches ranks and a writer process (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("how", ["in place", "exchange"])
def test_every_load_during_re_exports_is_one_export_or_a_named_refusal(
        how: str, tmp_path: Path) -> None:
    fulls = run_ranks(_exports_worker, 1, str(tmp_path))[0]
    folder = tmp_path / "live"
    shutil.copytree(tmp_path / "a", folder)
    stop = multiprocessing.get_context("fork").Event()
    writer = multiprocessing.get_context("fork").Process(
        target=_writer, args=(str(folder), [str(tmp_path / "a"), str(tmp_path / "b")], how,
                              stop))
    writer.start()
    try:
        outcomes = run_ranks(_reader_worker, 1, str(folder), 150, fulls, timeout_s=400)[0]
    finally:
        stop.set()
        writer.join(60)
    assert writer.exitcode == 0, f"the writer failed ({writer.exitcode})"
    mixed = [o for o in outcomes if o == "MIX"]
    assert not mixed, f"{len(mixed)} of {len(outcomes)} loads read a mix of two exports"
    loaded = [o for o in outcomes if o.startswith("export ")]
    assert loaded, f"no load succeeded: {outcomes[:3]}"
    for refusal in (o for o in outcomes if o.startswith("refused: ")):
        assert str(folder) in refusal, refusal  # named: the folder, or a file of it
    print(json.dumps({o if not o.startswith("refused") else o.split("\n")[0][:160]:
                      outcomes.count(o) for o in set(outcomes)}, indent=1))
