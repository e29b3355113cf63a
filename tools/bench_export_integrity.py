"""What the export's integrity costs: temporary files, fsync, renames and the sha256 manifest.

Writes the same tensors (one process, no gather: ``gather`` returns a tensor already in memory)
two ways, interleaved, into fresh folders on the same file system:

- ``plain``: what ``save_pretrained`` did before issue 28: open the final name ``"wb"``, write
  the header and each tensor's bytes, close;
- ``plain+fsync``: the same, synced before close (what durability alone costs);
- ``export``: :func:`hyperrecipe.runtime.state.export.write_safetensors` as it is now
  (temporary names, sha256 hashed beside the write, fsync, ``os.replace``, the manifest).

The plain write is not synced, so the page cache may hold it when the clock stops: the ratio is
an upper bound on what the export adds. Run::

    python tools/bench_export_integrity.py --gib 1 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from hyperrecipe.runtime.state.export import ExportItem, write_safetensors


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    items = _items(args.gib)
    size = sum(i.nbytes for i in items) / (1 << 30)
    root = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.dir))
    times: dict[str, list[float]] = {"plain": [], "plain+fsync": [], "export": []}
    try:
        for r in range(args.repeat):
            for kind in times:
                folder = root / f"{kind}-{r}"
                start = time.perf_counter()
                if kind.startswith("plain"):
                    _plain(folder, items, sync=kind == "plain+fsync")
                else:
                    write_safetensors(folder, items, writer=True, max_shard_bytes=1 << 40,
                                      model=nn.Module())
                times[kind].append(time.perf_counter() - start)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"{size:.2f} GiB, best of {args.repeat}: plain {best['plain']:.2f} s, plain+fsync "
          f"{best['plain+fsync']:.2f} s, export {best['export']:.2f} s; export / plain+fsync "
          f"{best['export'] / best['plain+fsync']:.2f}x")
    print(json.dumps({"gib": size, "times": times}))


if __name__ == "__main__":
    main()
