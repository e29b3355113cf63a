"""What the export's integrity costs: a staging folder, fsync, the switch and the manifest's digest.

First the digests this CPU offers, one core, on a 64 MiB buffer (MiB/s, median of 5): the
stdlib's ``sha256``, ``sha1``, ``md5``, ``blake2b``, ``zlib.crc32`` and ``zlib.adler32``, and
``xxhash.xxh3_128`` (what an export records). Then the same tensors (one process, no gather:
``gather`` returns a tensor already in memory) written four ways, interleaved (the order
rotates each round), into fresh folders on the same file system:

- ``plain``: what ``save_pretrained`` did before issue 28: open the final name ``"wb"``, write
  the header and each tensor's bytes, close;
- ``plain+fsync``: the same, synced before close (what durability alone costs): the floor;
- ``export``: :func:`hyperrecipe.runtime.state.export.write_safetensors` as it is now
  (a staging folder beside the target, the digest hashed beside the write, early writeback,
  fsync, the manifest, the exchange that switches it in) with its default digest (xxh3_128);
- ``export-sha256``: the same with the sha256 digest of the first manifests;
- ``dcp``: torch's ``dcp.save`` of the same tensors (one process: no process group), its own
  fsync of each file included (``FileSystemWriter(sync_files=True)``, torch's default);
- ``dcp+commit``: the same through
  :func:`hyperrecipe.runtime.state.integrity.committed_dcp_save` (what ``save_checkpoint``
  runs): a ``writing`` record before, the ``committed`` record with ``.metadata``'s sha256 and
  every file's size after.

Each write starts with no dirty pages (``os.sync()`` outside the timing): ``plain`` leaves 1 GiB
for the kernel to write back, which the next write's ``fsync`` paid for before. Figures are
medians over ``--repeat`` rounds; ratios are to ``plain+fsync``, and ``dcp+commit``
to ``dcp``. First, the switch alone (:func:`switch_ms`). Run::

    python tools/bench_export_integrity.py --gib 1 --repeat 5 [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch.distributed.checkpoint import save as dcp_save

from hyperrecipe.runtime.state.integrity import committed_dcp_save
from hyperrecipe.runtime.state.export import ExportItem, write_safetensors

KINDS = ("plain", "plain+fsync", "export", "export-sha256", "dcp", "dcp+commit")


def _items(gib: float) -> list[ExportItem]:
    per = 64 << 20  # 64 MiB tensors, like the large matrices of a 1-2 GB model
    count = max(1, int(gib * (1 << 30) / per))
    tensors = [torch.full((per // 4,), float(i)) for i in range(count)]
    return [ExportItem(name=f"w{i}", dtype=torch.float32, shape=tuple(t.shape),
                       gather=lambda t=t: t)  # type: ignore[misc]
            for i, t in enumerate(tensors)]


def _plain(folder: Path, items: list[ExportItem], sync: bool = False) -> None:
    folder.mkdir()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        header[item.name] = {"dtype": "F32", "shape": list(item.shape),
                             "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for item in items:
            f.write(item.gather().reshape(-1).view(torch.uint8).numpy().data)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def hash_speeds(repeat: int = 5) -> dict[str, int]:
    """MiB/s of each digest on one core over a 64 MiB buffer (median of ``repeat``)."""
    data = memoryview(os.urandom(1 << 20) * 64)
    fns: dict[str, Callable[[], object]] = {
        name: (lambda name=name: hashlib.new(name, data).digest())  # type: ignore[misc]
        for name in ("sha256", "sha1", "md5", "blake2b")}
    fns["crc32"] = lambda: zlib.crc32(data)
    fns["adler32"] = lambda: zlib.adler32(data)
    try:
        import xxhash

        fns["xxh3_128"] = lambda: xxhash.xxh3_128(data).digest()
    except ImportError:  # pragma: no cover - a dependency of hyperrecipe[torch]
        pass
    speeds = {}
    for name, fn in fns.items():
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        speeds[name] = round(64 / statistics.median(times))
    return speeds


def switch_ms(root: Path, repeat: int = 30) -> dict[str, float]:
    """The switch alone (:mod:`hyperrecipe.runtime.state.folder_switch`), in ms, median of
    ``repeat``: ``begin`` (finish leftovers, make the staging folder) and ``commit`` (carry the
    folder's other entries over, exchange, remove the earlier state) of a sharded export's six
    small files into a folder that also holds 20 files and a subfolder of the user's."""
    from hyperrecipe.runtime.state import folder_switch
    from hyperrecipe.runtime.state.export import owned_by_export

    target = root / "switch"
    target.mkdir()
    for i in range(20):
        (target / f"user-{i}.txt").write_text("mine")
    (target / "runs").mkdir()
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json", "config.json", "hyperrecipe.manifest.json"]
    begin, commit = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        staging = folder_switch.begin(target, owned_by_export)
        begin.append(time.perf_counter() - start)
        for name in names:
            (staging.path / name).write_bytes(b"0" * 1024)
        start = time.perf_counter()
        folder_switch.commit(staging, owned_by_export, last=["hyperrecipe.manifest.json"])
        commit.append(time.perf_counter() - start)
    return {"begin": round(statistics.median(begin) * 1e3, 2),
            "commit": round(statistics.median(commit) * 1e3, 2),
            "exchange": float(staging.exchange)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    speeds = hash_speeds()
    print("digest MiB/s (one core): " + ", ".join(f"{k} {v}" for k, v in speeds.items()))
    items = _items(args.gib)
    state = {i.name: i.gather() for i in items}
    size = sum(i.nbytes for i in items) / (1 << 30)
    root = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.dir))
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        switch = switch_ms(root)
        print(f"switch ({'exchange' if switch['exchange'] else 'file by file'}), median of 30: "
              f"begin {switch['begin']:.2f} ms, commit {switch['commit']:.2f} ms")
        for r in range(args.repeat):
            for kind in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
                folder = root / f"{kind}-{r}"
                os.sync()  # no kind pays for the dirty pages an earlier one left (plain's)
                start = time.perf_counter()
                if kind.startswith("plain"):
                    _plain(folder, items, sync=kind == "plain+fsync")
                elif kind == "dcp":
                    dcp_save(state, checkpoint_id=str(folder))
                elif kind == "dcp+commit":
                    committed_dcp_save(state, folder, rank=0)
                else:
                    write_safetensors(folder, items, writer=True, max_shard_bytes=1 << 40,
                                      model=nn.Module(),
                                      digest="sha256" if kind == "export-sha256" else None)
                times[kind].append(time.perf_counter() - start)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["plain+fsync"]
    ratios = {k: round(v / floor, 3) for k, v in med.items()}
    print(f"{size:.2f} GiB, median of {args.repeat}: " + ", ".join(
        f"{k} {med[k]:.2f} s" for k in KINDS) + f"; export / plain+fsync "
        f"{ratios['export']:.2f}x, export-sha256 / plain+fsync {ratios['export-sha256']:.2f}x, "
        f"dcp+commit / dcp {med['dcp+commit'] / med['dcp']:.2f}x")
    summary: dict[str, Any] = {"gib": size, "hash_mib_per_s": speeds,
                               "median_s": {k: round(v, 3) for k, v in med.items()},
                               "export_over_fsync": ratios["export"],
                               "export_sha256_over_fsync": ratios["export-sha256"],
                               "dcp_commit_over_dcp": round(med["dcp+commit"] / med["dcp"], 3),
                               "switch_ms": switch, "times": times}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
