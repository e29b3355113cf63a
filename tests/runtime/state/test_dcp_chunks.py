"""A DCP ``.metadata`` is checked chunk by chunk before anything is read (issue 41).

torch reads what the metadata lists: a chunk left out keeps what the destination held, a
chunk pointed at another tensor's bytes loads those, a chunk past the tensor's end fails in
the middle of the copy. Each forged folder here is a real ``dcp.save`` of a tiny Llama at tp=2
(real gloo ranks) whose ``.metadata`` is read, edited and pickled again, as
``test_state_trust.py`` forges it; each load must refuse it by name with the model untouched,
through ``inst.state.load_checkpoint`` and through ``inst.state.load_weights``.
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import WeightLoadError
from tests.support.checkpoint_harness import applied, resume_worker, save_dcp_worker

Q = "model.model.layers.0.self_attn.q_proj.weight"
Q1 = "model.model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save(inst.state.state_dict(opt))`` at tp=2 after one AdamW step: q_proj (64 x 64) is
    stored as two row chunks, rows 0:32 and 32:64."""
    ckpt = tmp_path_factory.mktemp("dcp") / "step-1"
    run_ranks(save_dcp_worker, 2, str(ckpt))
    return ckpt


def _forged(src: Path, dst: Path, edit: Callable[[Any], None]) -> Path:
    from hyperrecipe.runtime.state.dcp_reader import read_dcp_metadata

    shutil.copytree(src, dst)
    metadata = read_dcp_metadata(dst)
    edit(metadata)
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return dst


def _second_chunk_left_out(metadata: Any) -> None:
    chunks = metadata.state_dict_metadata[Q].chunks
    assert [list(c.offsets) for c in chunks] == [[0, 0], [32, 0]]
    del chunks[1]  # the global size [64, 64] is kept


def _second_chunk_reads_layer_1(metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage = metadata.storage_data
    storage[MetadataIndex(Q, (32, 0))] = storage[MetadataIndex(Q1, (32, 0))]


def _second_chunk_past_the_end(metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    chunk = metadata.state_dict_metadata[Q].chunks[1]
    info = metadata.storage_data.pop(MetadataIndex(Q, (32, 0)))
    chunk.offsets = torch.Size([48, 0])
    metadata.storage_data[MetadataIndex(Q, (48, 0))] = info


def _relabelled_as_int32(metadata: Any) -> None:
    metadata.state_dict_metadata[Q].properties.dtype = torch.int32


FORGERIES = {
    "a chunk left out": (
        _second_chunk_left_out,
        f"{Q!r}: its chunks (offsets+sizes: [0, 0]+[32, 64]) cover less than the global size "
        f"[64, 64] (2048 of 4096 elements listed)"),
    "a chunk reading another layer's bytes": (
        _second_chunk_reads_layer_1,
        f"{Q!r} (offsets [32, 0]) and {Q1!r} (offsets [32, 0]) read the same bytes of "
        f"__1_0.distcp ("),
    "a chunk past the end": (
        _second_chunk_past_the_end,
        f"{Q!r}: chunk 1 (offsets [48, 0], sizes [32, 64]) reaches past the tensor's global "
        f"size [64, 64]"),
}


def _load_weights_worker(rank: int, world: int, source: str) -> dict[str, Any]:
    """``inst.state.load_weights(source)`` into a model that holds weights: the error, whether any
    tensor changed, and what ``status()`` lists as unset."""
    model, inst = applied(world)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        inst.state.load_weights(source)
        error = None
    except WeightLoadError as exc:
        error = str(exc)
    after = model.state_dict()
    return {"error": error,
            "changed": sorted(k for k in before if not torch.equal(before[k], after[k])),
            "unset": [r.error for r in inst.state.status() if r.state == "unset"]}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_chunks_are_refused_by_load_checkpoint_with_the_model_untouched(
        forgery: str, dcp_folder: Path, tmp_path: Path) -> None:
    edit, says = FORGERIES[forgery]
    bad = _forged(dcp_folder, tmp_path / "bad", edit)
    for res in run_ranks(resume_worker, 2, str(bad)):
        assert res["error"] is not None, "the forged checkpoint loaded"
        assert f"{bad / '.metadata'}: refused before reading" in res["error"]
        assert says in res["error"]
        assert res["unchanged"]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_chunks_are_refused_by_load_weights_with_nothing_written_or_unset(
        forgery: str, dcp_folder: Path, tmp_path: Path) -> None:
    edit, says = FORGERIES[forgery]
    bad = _forged(dcp_folder, tmp_path / "bad", edit)
    for res in run_ranks(_load_weights_worker, 2, str(bad)):
        assert res["error"] is not None, "the forged checkpoint loaded"
        assert f"{bad / '.metadata'}: refused before reading" in res["error"]
        assert says in res["error"]
        assert res["changed"] == [] and res["unset"] == []


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_dtype_relabelled_to_integers_is_refused_by_both_loads(dcp_folder: Path,
                                                                 tmp_path: Path) -> None:
    bad = _forged(dcp_folder, tmp_path / "bad", _relabelled_as_int32)
    for res in run_ranks(resume_worker, 2, str(bad)):
        assert f"{bad}: refused before reading: tensors stored as another kind" in res["error"]
        assert f"{Q!r}: stored as torch.int32, loads into torch.float32" in res["error"]
        assert res["unchanged"]
    for res in run_ranks(_load_weights_worker, 2, str(bad)):
        assert (f"{Q!r} in bad: stored as torch.int32, the model's "
                f"'model.layers.0.self_attn.q_proj.weight' is torch.float32") in res["error"]
        assert res["changed"] == [] and res["unset"] == []


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_the_unforged_checkpoint_still_loads_through_both(dcp_folder: Path) -> None:
    for res in run_ranks(_load_weights_worker, 2, str(dcp_folder)):
        assert res["error"] is None and res["unset"] == []
        assert res["changed"], "load_weights changed nothing: the test would prove nothing"
    for res in run_ranks(resume_worker, 2, str(dcp_folder)):
        assert res["error"] is None


# -- the tiling check on layouts dcp.save writes and ones it never does --------------------


def _metadata(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
              ) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                        MetadataIndex, TensorProperties,
                                                        TensorStorageMetadata)

    meta = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s in chunks])
    storage = {MetadataIndex("w", o): _StorageInfo("__0_0.distcp", 100 * n, 100)
               for n, (o, _) in enumerate(chunks)}
    return Metadata(state_dict_metadata={"w": meta}, storage_data=storage)


@pytest.mark.parametrize(("size", "chunks"), [
    ((8, 6), [((0, 0), (8, 6))]),
    ((8, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6))]),                      # rows
    ((8, 6), [((0, 0), (8, 3)), ((0, 3), (8, 3))]),                      # columns
    ((8, 6), [((r, c), (4, 3)) for r in (0, 4) for c in (0, 3)]),        # a 2-D grid
    ((7, 6), [((0, 0), (4, 6)), ((4, 0), (3, 6)), ((7, 0), (0, 6))]),    # uneven, one empty
    ((), [((), ())]),                                                     # a scalar
    ((0, 4), []),                                                         # an empty tensor
    ((6, 6), [((0, 0), (2, 4)), ((0, 4), (4, 2)), ((2, 0), (4, 2)),      # a pinwheel
              ((4, 2), (2, 4)), ((2, 2), (2, 2))]),
])
def test_chunks_that_tile_the_tensor_pass(size: tuple[int, ...],
                                          chunks: list[Any]) -> None:
    from hyperrecipe.runtime.state.dcp_reader import check_chunks

    check_chunks(Path("ckpt/.metadata"), _metadata(size, chunks))


@pytest.mark.parametrize(("size", "chunks", "says"), [
    ((8, 6), [((0, 0), (4, 6))], "cover less than the global size [8, 6] (24 of 48"),
    ((8, 6), [((0, 0), (4, 6)), ((2, 0), (6, 6))], "overlap in the global size [8, 6] (60 of"),
    ((8, 6), [((0, 0), (8, 3)), ((0, 2), (8, 3))],
     "overlap and leave gaps in the global size [8, 6] (48 of 48"),
    ((8, 6), [((0, 0), (4, 6)), ((4, 0), (5, 6))], "chunk 1 (offsets [4, 0], sizes [5, 6]) "
                                                   "reaches past"),
    ((8, 6), [((0, 0), (8,))], "chunk 0 is not 2 non-negative offsets and sizes"),
    ((), [((), ()), ((), ())], "overlap in the global size [] (2 of 1"),
    # a tiling, but no dcp.save writes it, and checking it would take quadratic time: 1500
    # full-height columns and 1500 one-row stripes beside them (each row slab holds 1501)
    ((1500, 1501), [((0, i), (1500, 1)) for i in range(1500)]
     + [((r, 1500), (1, 1)) for r in range(1500)],
     "its 3000 chunks are too irregular to check in bounded time (dcp.save writes a grid of "
     "shards: rows, columns or blocks); refused"),
])
def test_chunks_that_do_not_tile_the_tensor_are_refused_by_name(
        size: tuple[int, ...], chunks: list[Any], says: str) -> None:
    from hyperrecipe.runtime.state.dcp_reader import check_chunks

    with pytest.raises(WeightLoadError) as refused:
        check_chunks(Path("ckpt/.metadata"), _metadata(size, chunks))
    assert str(refused.value).startswith("ckpt/.metadata: refused before reading: the chunks")
    assert f"'w': " in str(refused.value) and says in str(refused.value)
