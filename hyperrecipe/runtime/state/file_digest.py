"""The digest an export's manifest records per file, and the manifest's shape.

The manifest (``hyperrecipe.manifest.json``) protects against accidents: a truncated or
corrupted file, a relabelled header, files of two exports mixed in one folder. It does not
protect against someone who can rewrite the files *and* the manifest beside them, so the
digest need not resist a forger; it needs to see every byte at the speed the bytes are
written. ``xxh3_128`` (the ``xxhash`` package) runs at about 9 GB/s on one core here, about
ten times ``sha256`` even with the CPU's SHA instructions, so hashing no longer costs more
than the write it sits beside (docs/benchmarks.md, "The export at the floor").

Manifests name their algorithm: ``hyperrecipe-export/2`` carries ``"digest"`` and each file's
entry under that name; ``hyperrecipe-export/1`` (the first exports) is sha256 throughout and
still verifies. Without ``xxhash`` installed an export records sha256.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from hyperrecipe._files import open_regular

__all__ = ["DIGESTS", "FORMATS", "Hasher", "digest_file", "manifest_document", "new_hasher",
           "parse_manifest", "writing_digest"]

FORMATS = ("hyperrecipe-export/1", "hyperrecipe-export/2")
"""Manifest formats that loads accept: ``/1`` is sha256 only, ``/2`` names its digest."""
DIGESTS = ("xxh3_128", "sha256")
"""Algorithms a ``/2`` manifest may name, fastest first."""


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def _xxhash_available() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


def writing_digest() -> str:
    """The algorithm a new export records: ``xxh3_128`` where ``xxhash`` is installed."""
    return "xxh3_128" if _xxhash_available() else "sha256"


def new_hasher(algorithm: str) -> Hasher:
    """An incremental hasher for ``algorithm`` (one of :data:`DIGESTS`). Both release the GIL
    on large buffers, so hashing in a thread overlaps the write.

    Raises:
        ValueError: an unknown algorithm, or ``xxh3_128`` without ``xxhash`` installed.
    """
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            msg = ("the manifest's digest is xxh3_128, which needs the xxhash package: "
                   "pip install xxhash (or pip install 'hyperrecipe[torch]')")
            raise ValueError(msg) from None
        return xxhash.xxh3_128()
    raise ValueError(f"digest {algorithm!r} is not one of {list(DIGESTS)}")


def manifest_document(fmt: str, algorithm: str, files: Mapping[str, tuple[int, str]]) -> Any:
    """The manifest's JSON object for ``files`` (name -> (bytes, hex digest))."""
    return {"format": fmt, "digest": algorithm,
            "files": {n: {"bytes": size, algorithm: hexdigest}
                      for n, (size, hexdigest) in files.items()}}


def parse_manifest(manifest: Any) -> tuple[str, dict[str, tuple[int, str]]]:
    """``(algorithm, {name: (bytes, hex digest)})`` of a manifest as ``json.loads`` read it.

    Raises:
        ValueError: not a manifest of a format in :data:`FORMATS`.
        KeyError, TypeError, AttributeError: malformed (the caller reports it as such).
    """
    fmt = manifest.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"not a {' or '.join(FORMATS)} manifest")
    algorithm = "sha256" if fmt == FORMATS[0] else manifest["digest"]
    if algorithm not in DIGESTS:
        raise ValueError(f"digest {algorithm!r:.40} is not one of {list(DIGESTS)}")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
            isinstance(n, str) and isinstance(e, dict) and isinstance(e.get("bytes"), int)
            and isinstance(e.get(algorithm), str) for n, e in files.items()):
        raise ValueError(f"not a {fmt} manifest")
    new_hasher(algorithm)  # xxh3_128 without xxhash installed: said before any file is read
    return algorithm, {n: (e["bytes"], e[algorithm]) for n, e in files.items()}


def digest_file(path: Path, algorithm: str) -> str:
    """The hex digest of the file's bytes, read in 8 MiB chunks into one reused buffer (a
    fresh 8 MiB ``bytes`` per chunk cost a page fault per 4 KiB on every chunk)."""
    hasher = new_hasher(algorithm)
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with os.fdopen(open_regular(path), "rb", buffering=0) as handle:  # a FIFO: refused
        while n := handle.readinto(view):
            hasher.update(view[:n])
    return hasher.hexdigest()
