"""The export's pipeline (issues 28 and 29): the next tensor is gathered while the writer writes
the current one, never more than two in flight; the manifest's digest is named, and the first
exports' sha256 manifests still verify; a rank that fails mid-export makes every rank raise
within ``collective_timeout_s`` and leaves the previous export exactly as it was.

Real gloo ranks, a real tiny Llama, real files; the fault is raised in a rank's own gather.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import ExportError, WeightLoadError
from hyperrecipe.runtime.state.export import (
    MANIFEST,
    SMALL_BYTES,
    ExportItem,
    write_safetensors,
)
from hyperrecipe.runtime.state.folder_switch import leftovers
from tests.support.checkpoint_harness import applied
from tests.support.runtime_harness import ROOT, llama, mesh_1d

LLAMA = str(ROOT / "recipes/llama.yaml")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_the_next_gather_starts_only_once_the_tensor_before_the_last_is_written(
        tmp_path: Path) -> None:
    """At most two full tensors in flight: when tensor k is gathered, tensors up to k - 2 are
    in the file already (the writer may still be on k - 1). Tensors above ``SMALL_BYTES``: a
    smaller one is copied and written on the hashing thread, which bounds nothing by count."""
    folder = tmp_path / "export"
    on_disk: list[int] = []
    numel = SMALL_BYTES // 4 + 1024

    def gather(i: int) -> torch.Tensor:
        temps = list(folder.parent.glob(f".{folder.name}.hyperrecipe-new/model.safetensors"))
        on_disk.append(temps[0].stat().st_size if temps else 0)
        return torch.full((numel,), float(i))

    items = [ExportItem(name=f"w{i}", dtype=torch.float32, shape=(numel,),
                        gather=lambda i=i: gather(i))  # type: ignore[misc]
             for i in range(8)]
    write_safetensors(folder, items, writer=True, max_shard_bytes=1 << 40, model=nn.Module())
    raw = (folder / "model.safetensors").read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    for k, size in enumerate(on_disk):
        assert size >= (start + (k - 1) * numel * 4 if k >= 2 else 0), (k, on_disk)
    from safetensors.torch import load_file

    loaded = load_file(str(folder / "model.safetensors"))
    for i in range(8):
        torch.testing.assert_close(loaded[f"w{i}"], torch.full((numel,), float(i)), atol=0,
                                   rtol=0)


def _small_items() -> list[ExportItem]:
    """Large and small tensors in turn (the small ones go through the hashing thread)."""
    sizes = [SMALL_BYTES // 4 + 8, 1000, 3, SMALL_BYTES // 4 + 8, 7, 1000]
    return [ExportItem(name=f"w{i}", dtype=torch.float32, shape=(n,),
                       gather=lambda i=i, n=n: torch.arange(n, dtype=torch.float32) + i)
            for i, n in enumerate(sizes)]  # type: ignore[misc]


def _small_write_worker(rank: int, world: int, folder: str, limit: int | None) -> str | None:
    """One export of :func:`_small_items` under a file size limit (``ulimit -f``) of ``limit``
    bytes: the first write past it fails (EFBIG; Python ignores SIGXFSZ)."""
    import resource

    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        write_safetensors(folder, _small_items(), writer=True, max_shard_bytes=1 << 40,
                          model=nn.Module())
    except ExportError as exc:
        return str(exc)
    return None


def test_small_tensors_written_beside_the_writer_land_in_order_and_verify(
        tmp_path: Path) -> None:
    """Small tensors are hashed and written on the hashing thread while large ones are written
    on the writer's: every byte lands in its place and the manifest's digest is the file's."""
    from safetensors.torch import load_file

    from hyperrecipe.runtime.state.integrity import digest_file, parse_manifest

    folder = tmp_path / "export"
    assert write_safetensors(folder, _small_items(), writer=True, max_shard_bytes=1 << 40,
                             model=nn.Module())
    loaded = load_file(str(folder / "model.safetensors"))
    for item in _small_items():
        torch.testing.assert_close(loaded[item.name], item.gather(), atol=0, rtol=0)
    algorithm, files = parse_manifest(json.loads((folder / MANIFEST).read_text()))
    size, digest = files["model.safetensors"]
    assert size == (folder / "model.safetensors").stat().st_size
    assert digest == digest_file(folder / "model.safetensors", algorithm)


def test_small_tensors_waiting_for_the_hashing_thread_are_bounded_in_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hashing thread that falls behind (slowed here) holds at most ``SMALL_QUEUE_BYTES`` of
    small tensors' copies: past it the writer waits for the oldest, and every byte still lands
    in its place."""
    from safetensors.torch import load_file

    from hyperrecipe.runtime.state import export

    numel, count, allowed = 1000, 40, 3
    monkeypatch.setattr(export, "SMALL_QUEUE_BYTES", allowed * numel * 4)
    copies = {"made": 0, "written": 0, "most_waiting": 0}
    bytes_of, hash_and_write = export._bytes_of, export._hash_and_write

    def counted_copy(value: torch.Tensor, dtype: torch.dtype) -> bytes:
        copies["made"] += 1
        copies["most_waiting"] = max(copies["most_waiting"], copies["made"] - copies["written"])
        return bytes_of(value, dtype)

    def slow_write(*args: Any) -> None:
        time.sleep(0.005)
        hash_and_write(*args)
        copies["written"] += 1

    monkeypatch.setattr(export, "_bytes_of", counted_copy)
    monkeypatch.setattr(export, "_hash_and_write", slow_write)
    items = [ExportItem(name=f"w{i}", dtype=torch.float32, shape=(numel,),
                        gather=lambda i=i: torch.full((numel,), float(i)))  # type: ignore[misc]
             for i in range(count)]
    folder = tmp_path / "export"
    write_safetensors(folder, items, writer=True, max_shard_bytes=1 << 40, model=nn.Module())
    assert copies["made"] == count
    assert copies["most_waiting"] <= allowed + 1, copies  # the one being made, and the limit
    loaded = load_file(str(folder / "model.safetensors"))
    for i in range(count):
        torch.testing.assert_close(loaded[f"w{i}"], torch.full((numel,), float(i)), atol=0,
                                   rtol=0)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_small_tensor_that_cannot_be_written_fails_the_export_and_keeps_the_old_one(
        tmp_path: Path) -> None:
    """A write on the hashing thread that fails (a file size limit just past the first large
    tensor) fails the export like any other write: ``ExportError``, nothing replaced."""
    folder = tmp_path / "export"
    assert run_ranks(_small_write_worker, 1, str(folder), None)[0] is None
    before = _snapshot(folder)
    header = 8 + struct.unpack("<Q", (folder / "model.safetensors").read_bytes()[:8])[0]
    limit = header + (SMALL_BYTES + 32) + 100  # inside w1, the first small tensor
    message = run_ranks(_small_write_worker, 1, str(folder), limit)[0]
    assert message is not None, "an export past the file size limit succeeded"
    staged = f"{folder.parent}/.export.hyperrecipe-new/model.safetensors"
    assert message.startswith(f"save_pretrained into {folder} failed, so nothing was replaced "
                              f"and the folder holds what it held before:\n  rank 0: writing "
                              f"{staged}"), message
    assert "File too large" in message, message
    assert _snapshot(folder) == before
    assert not [f for f in folder.iterdir() if ".tmp-" in f.name]
    assert leftovers(folder) == []  # the staging folder is gone with the failed export


def test_the_manifest_names_its_digest_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    items = [ExportItem(name="w", dtype=torch.float32, shape=(8,),
                        gather=lambda: torch.ones(8))]
    write_safetensors(tmp_path / "a", items, writer=True, max_shard_bytes=1 << 40,
                      model=nn.Module())
    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert manifest["format"] == "hyperrecipe-export/2"
    assert manifest["digest"] == "xxh3_128"
    assert set(manifest["files"]["model.safetensors"]) == {"bytes", "xxh3_128"}
    with pytest.raises(ValueError, match="digest 'md5' is not one of"):
        write_safetensors(tmp_path / "b", items, writer=True, max_shard_bytes=1 << 40,
                          model=nn.Module(), digest="md5")
    assert not (tmp_path / "b").exists()


def _export_worker(rank: int, world: int, folder: str) -> None:
    model, inst = applied(world)
    inst.state.save_pretrained(folder)


def _load_weights_worker(rank: int, world: int, source: str) -> str | None:
    model, inst = applied(world, "meta")
    try:
        inst.state.load_weights(source)
    except WeightLoadError as exc:
        return str(exc)
    return None


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_first_format_sha256_manifest_still_verifies_and_refuses(tmp_path: Path) -> None:
    """A folder exported before the digest was named (``hyperrecipe-export/1``, sha256 per
    file) loads, and a changed byte is still refused by name."""
    folder = tmp_path / "export"
    run_ranks(_export_worker, 2, str(folder))
    files = json.loads((folder / MANIFEST).read_text())["files"]
    old = {"format": "hyperrecipe-export/1",
           "files": {name: {"bytes": entry["bytes"],
                            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest()}
                     for name, entry in files.items()}}
    (folder / MANIFEST).write_text(json.dumps(old))
    assert run_ranks(_load_weights_worker, 2, str(folder)) == [None, None]
    data = folder / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    error = run_ranks(_load_weights_worker, 1, str(folder))[0]
    assert error is not None and error.startswith(
        f"{data}: its sha256 is not the one in {MANIFEST} (same size, other bytes"), error



def _threads_after_export_worker(rank: int, world: int, folder: str) -> list[str]:
    import threading

    model, inst = applied(world)
    inst.state.save_pretrained(folder)
    return [t.name for t in threading.enumerate() if t.is_alive()]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_no_export_thread_outlives_a_finished_save_pretrained(tmp_path: Path) -> None:
    """A script may end right after its last export: a thread of ours still leaving (or in a
    torch call) while the interpreter shuts down is C++ teardown racing it. The gather thread
    is joined before ``save_pretrained`` returns (on every rank; it used to be left to end on
    its own after the queue's end marker)."""
    for rank, names in enumerate(run_ranks(_threads_after_export_worker, 2, str(tmp_path / "e"))):
        assert not [n for n in names if n.startswith("export-")], f"rank {rank}: {names}"

def _fault_worker(rank: int, world: int, folder: str, failing: int) -> tuple[str, str] | None:
    """Export other weights over the folder's export with the third gather of rank ``failing``
    raising. That rank then stays alive outside the collectives (as a rank handling its error
    would), longer than ``collective_timeout_s``: its peers must not wait for the process
    group's timeout."""
    model, inst = applied(world)
    inst.collective_timeout_s = 2.0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)  # other weights: they must not reach the folder
    if rank == failing:
        import hyperrecipe.runtime.state.export as export

        real = export.gather_to_writer
        real_blocks = export.own_blocks  # ranks on one host write their own blocks instead
        calls = 0

        def count() -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("injected fault in this rank's third gather")

        def gather_to_writer(*args: Any) -> torch.Tensor | None:
            count()
            return real(*args)

        def own_blocks(*args: Any) -> Any:
            count()
            return real_blocks(*args)

        export.gather_to_writer = gather_to_writer  # type: ignore[assignment]
        export.own_blocks = own_blocks
    try:
        inst.state.save_pretrained(folder)
    except ExportError as exc:
        outcome: tuple[str, str] | None = (type(exc).__name__, str(exc))
    else:
        outcome = None
    if rank == failing:
        time.sleep(8 * inst.collective_timeout_s)
    return outcome


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("failing", [0, 1], ids=["writer-fails", "peer-fails"])
def test_a_rank_failing_mid_export_makes_every_rank_raise_within_the_collective_timeout(
        failing: int, tmp_path: Path) -> None:
    folder = tmp_path / "export"
    run_ranks(_export_worker, 2, str(folder))
    before = _snapshot(folder)
    results = run_ranks(_fault_worker, 2, str(folder), failing, timeout_s=110)
    for rank, outcome in enumerate(results):
        assert outcome is not None, f"rank {rank} exported although rank {failing} failed"
        kind, message = outcome
        assert kind == "ExportAbortedError", outcome
        assert message.startswith(f"save_pretrained into {folder} stopped, so nothing was "
                                  f"replaced and the folder holds what it held before"), message
        if rank == failing:
            assert "failed: RuntimeError: injected fault in this rank's third gather" in message
        else:
            assert ("got no answer from the other ranks within 2 s (collective_timeout_s): a "
                    "rank failed or stopped mid-export") in message, message
        assert message.endswith("restart every rank"), message
    assert _snapshot(folder) == before


def _family_model(family: str, mode: str) -> nn.Module:
    from hyperrecipe.model_tree import build_model

    config = json.loads((ROOT / f"recipes/models/tiny-{family}.json").read_text())
    torch.manual_seed(0)
    return build_model(f"hf:{family}", config, device="cpu")


def _family_export_worker(rank: int, world: int, family: str, mode: str, folder: str) -> None:
    model = _family_model(family, mode)
    plan = compile_recipe(str(ROOT / f"recipes/{family}.yaml"), model, {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    inst.state.save_pretrained(folder, max_shard_bytes=200_000)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("family", ["phi3", "gpt2"])
def test_fused_and_row_parallel_tensors_reach_the_writer_byte_for_byte(
        family: str, mode: str, tmp_path: Path) -> None:
    """Fused parts (phi3's ``qkv_proj`` and ``gate_up_proj``, gpt2's ``c_attn``), row-parallel
    blocks (strided in the full tensor) and column-parallel ones travel point to point to the
    writer; the files hold the unapplied model's tensors exactly, whichever mode's parameters
    (plain shards or DTensors) they came from, and the manifest verifies."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "export"
    run_ranks(_family_export_worker, 2, family, mode, str(folder))
    expected = _family_model(family, mode).state_dict()
    written: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("model-*.safetensors")):
        written.update(load_file(str(file)))
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert written and set(written) <= set(expected)
    for name, value in written.items():
        assert torch.equal(value, expected[name]), name
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, value in loaded.items():
        if name in expected:
            assert torch.equal(value, expected[name]), name
    from hyperrecipe.runtime.state.weights import verify_manifest

    verify_manifest(folder)  # raises on any mismatch


def _bf16_trained_in_fp32_worker(rank: int, world: int, hub: str, out: str
                                 ) -> dict[str, Any]:
    """A model loaded in bf16 and trained in fp32 (``.float()``, weights moved off the bf16
    grid), exported at tp=``world``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.bfloat16)
    model.float()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    inst = apply(model, compile_recipe(LLAMA, llama("meta"), {"tp": world}), mesh_1d(world))
    inst.state.save_pretrained(out)
    return {"weights": weights, "live_dtype": str(model.config.dtype)}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_the_exported_config_names_the_dtype_written_and_the_architecture(
        tmp_path: Path) -> None:
    """``config.json`` as transformers' ``save_pretrained`` writes it: ``dtype`` that of the
    tensors written, ``architectures`` the model's class. Written as it stood, the config
    still said bfloat16 over fp32 weights, and ``from_pretrained``'s default ``dtype="auto"``
    reloaded the export rounded to bf16 (2.4e-4 off), silently. The live config is left as it
    was."""
    from transformers import AutoModelForCausalLM

    hub, out = tmp_path / "hub", tmp_path / "export"
    llama().save_pretrained(hub)
    res = run_ranks(_bf16_trained_in_fp32_worker, 2, str(hub), str(out), timeout_s=300)[0]
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert res["live_dtype"] == "torch.bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in reloaded.state_dict().items():
        if name in res["weights"]:
            assert tensor.dtype == torch.float32, name
            torch.testing.assert_close(tensor, res["weights"][name], atol=0, rtol=0)
