"""Integrity of the files training state is written to and read from: digests, commit
records, manifests and atomic writes, in one module.

Three records protect a folder against accidents (a truncated or corrupted file, a relabelled
header, files of two saves mixed in one folder); none of them protects against someone who can
rewrite the files *and* the record beside them, so their digests need not resist a forger:

- the export manifest (:data:`MANIFEST`, written last by ``save_pretrained``): each file's size
  and a digest of every byte. ``xxh3_128`` (the ``xxhash`` package) runs at about 9 GB/s on
  one core here, about ten times ``sha256`` even with the CPU's SHA instructions, so hashing
  no longer costs more than the write it sits beside (docs/benchmarks.md, "The export at the
  floor"). Manifests name their algorithm: ``hyperrecipe-export/2`` carries ``"digest"`` and
  each file's entry under that name; ``hyperrecipe-export/1`` (the first exports) is sha256
  throughout and still verifies. Without ``xxhash`` installed an export records sha256.
  Checking a folder against it is ``weights.verify_manifest``, which knows what loading reads.
- the DCP commit record (:data:`COMMIT`, around ``dcp.save`` in :func:`committed_dcp_save`):
  ``.metadata``'s sha256 and each storage file's size and sampled fingerprint
  (:func:`sampled_fingerprint`), checked by every DCP reader before it reads a tensor.
- the source digest (:func:`source_digest`): a sample of what ``load_weights`` is about to
  read, which the ranks compare before any of them loads.

Every record is written through :func:`replace_text` (temporary file, ``fsync``, rename) and
made durable with :func:`sync_folder`. What each weight file's own structure says (a
safetensors header against its bytes, a ``.bin``'s zip records) is checked where the file is
parsed, in :mod:`~hyperrecipe.runtime.state.checkpoint_files`. The ranks' agreements about
these records (comparing source digests, every rank's outcome of a check) live in
:mod:`~hyperrecipe.runtime.preflight.agreement`; the commit only gathers the fingerprints each
rank computed of its share.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from hyperrecipe._files import open_regular, read_regular_file
from hyperrecipe.errors import ExportError, WeightLoadError
from hyperrecipe.runtime.state.snapshot import Snapshot, borrowed

__all__ = ["COMMIT", "DIGESTS", "FINGERPRINT_SCHEME", "FORMATS", "MANIFEST", "MANIFEST_FORMAT",
           "MAX_METADATA_BYTES", "Hasher", "check_commit", "commit_of", "commit_record",
           "committed_dcp_save", "describe_failure", "digest_file", "fingerprint_share", "is_committed",
           "manifest_document", "new_hasher", "parse_manifest", "replace_text",
           "sampled_fingerprint", "source_digest", "sync_folder", "verify_fingerprints",
           "writing_digest"]

MAX_METADATA_BYTES = 1 << 30
"""The largest DCP ``.metadata`` read or digested (a 70B model's metadata is tens of MiB)."""


# -- digests and the export manifest ------------------------------------------------------

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


MANIFEST = "hyperrecipe.manifest.json"
"""Written last by an export: each weight file's size and digest (``load_weights`` checks them;
this module's docstring says which digest and why)."""
MANIFEST_FORMAT = FORMATS[-1]


# -- atomic writes -----------------------------------------------------------------------


def replace_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole or not at all: written to a temporary file in the
    same folder, flushed and synced, then renamed over it (a crash leaves the old file)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def sync_folder(folder: Path) -> None:
    """Make the renames durable (a folder's entries are synced through the folder itself)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- the source digest the ranks compare before loading -------------------------------------


_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|distcp)|.*\.index\.json|\.metadata")
_SAMPLE_BYTES = 1 << 16


def source_digest(source: str | os.PathLike[str] | Snapshot) -> str:
    """A digest of what ``load_weights(source)`` would read, for ranks to compare before they
    load: each weight file's name and size and three 64 KiB windows of its bytes (start,
    middle, end; a file up to 192 KiB whole), the index and DCP metadata included. Another
    checkpoint, another training step of the same one, or a truncated copy differ; a change
    that keeps the size and lies outside the windows does not (it is a sample, not a hash of
    everything: that would read every byte on every rank). Paths are not part of it, so ranks
    on different hosts may hold their own copies. Given the load's
    :class:`~hyperrecipe.runtime.state.snapshot.Snapshot`, the files are read through its
    descriptors, so two ranks that opened two exports of one folder (one before a re-export
    swapped it, one after) differ.

    Raises:
        WeightLoadError: a file cannot be read.
    """
    with borrowed(source) as snapshot:
        return _source_digest(snapshot)


def _source_digest(snapshot: Snapshot) -> str:
    digest = hashlib.sha256()
    if not snapshot.exists:
        return digest.hexdigest()  # loading says what is missing
    for name in snapshot.names():
        if snapshot.is_dir and not _WEIGHT_FILE.fullmatch(name):
            continue
        try:  # not blocking, checked on the descriptor: a FIFO is never waited on
            with snapshot.borrow(name) as fd:
                _sample(digest, name, fd)
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.EINVAL, errno.ENXIO):
                snapshot.open(name)  # raises, saying why (or that the folder was replaced)
                raise WeightLoadError(f"{snapshot.path(name)}: cannot be read: {exc}") from None
            digest.update(f"{name}\0not a regular file\0".encode())  # loading refuses it
    return digest.hexdigest()


def _sample(digest: Any, name: str, fd: int) -> None:
    """Add ``name``'s size and its three sample windows, read from ``fd``, to ``digest``."""
    size = os.fstat(fd).st_size
    digest.update(f"{name}\0{size}\0".encode())
    for offset in sorted({0, max(0, (size - _SAMPLE_BYTES) // 2),
                          max(0, size - _SAMPLE_BYTES)}):
        digest.update(os.pread(fd, _SAMPLE_BYTES, offset))


# -- the DCP commit record ------------------------------------------------------------------


COMMIT = "hyperrecipe.commit.json"
"""Written by ``TrainingState.save_checkpoint``: ``{"state": "writing"}`` before ``dcp.save``,
then ``committed`` with the ``.metadata``'s sha256, each storage file's size (``files``) and,
since records carry ``"fingerprint": FINGERPRINT_SCHEME``, each storage file's sampled
fingerprint (``fingerprints``). A record without ``fingerprint`` (written before it existed)
is checked as it always was: ``.metadata``'s sha256 and the sizes."""

FINGERPRINT_SCHEME = "sampled-sha256/1"
"""The fingerprint a commit record names: sha256 of the file's size, its first and last
:data:`_EDGE_BYTES` and :data:`_BLOCKS` blocks of :data:`_BLOCK_BYTES` evenly spaced between
them (the whole file when it is no longer than that: 4 MiB)."""

_EDGE_BYTES = 1 << 20
_BLOCK_BYTES = 64 << 10
_BLOCKS = 32


def sampled_fingerprint(path: Path) -> str:
    """The sampled fingerprint (:data:`FINGERPRINT_SCHEME`) of a storage file: 4 MiB read
    whatever its size, in 34 reads, so checking it costs about what opening the file does.

    What it catches: any change of size (a truncated or extended file), and any change of the
    bytes it samples: a file of another checkpoint, or the same file written again by a later
    ``dcp.save`` of a model that trained since (every weight and optimizer moment moved, so
    every sampled block differs). What it does not: a change confined to bytes between the
    samples, as a deliberate edit, or a save in which only a few small tensors changed (most
    parameters frozen), could make. The export manifest (``save_pretrained``) records a full
    digest of every byte for that.

    Raises:
        OSError: the file cannot be read.
    """
    with os.fdopen(open_regular(path), "rb", buffering=0) as handle:  # a FIFO: refused
        size = os.fstat(handle.fileno()).st_size
        digest = hashlib.sha256(f"{FINGERPRINT_SCHEME}\0{size}\0".encode())
        sampled = 2 * _EDGE_BYTES + _BLOCKS * _BLOCK_BYTES
        if size <= sampled:
            regions = [(0, size)]
        else:
            gap = size - 2 * _EDGE_BYTES - _BLOCK_BYTES
            regions = [(0, _EDGE_BYTES),
                       *((_EDGE_BYTES + gap * k // (_BLOCKS - 1), _BLOCK_BYTES)
                         for k in range(_BLOCKS)),
                       (size - _EDGE_BYTES, _EDGE_BYTES)]
        for offset, length in regions:
            data = os.pread(handle.fileno(), length, offset)
            digest.update(len(data).to_bytes(8, "little"))  # a short read differs too
            digest.update(data)
    return digest.hexdigest()


def _storage_files(folder: Path) -> list[str]:
    return sorted(f.name for f in folder.iterdir() if f.name.endswith(".distcp"))


def fingerprint_share(folder: Path, rank: int = 0, world: int = 1) -> dict[str, str]:
    """The sampled fingerprints of this rank's share of the folder's storage files (every
    ``world``-th in name order, from ``rank``), so that the ranks together read each once."""
    return {name: sampled_fingerprint(folder / name)
            for name in _storage_files(folder)[rank::world]}


def commit_record(folder: Path, fingerprints: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The committed record of a folder ``dcp.save`` just finished writing; ``fingerprints``
    (name -> :func:`sampled_fingerprint`, every storage file) as the ranks computed them, or
    computed here when not given."""
    data = read_regular_file(folder / ".metadata", limit=MAX_METADATA_BYTES)
    sizes = {f.name: f.stat().st_size for f in sorted(folder.iterdir())
             if f.name.endswith(".distcp")}
    if fingerprints is None:
        fingerprints = fingerprint_share(folder)
    return {"state": "committed", "metadata_sha256": hashlib.sha256(data).hexdigest(),
            "files": sizes, "fingerprint": FINGERPRINT_SCHEME,
            "fingerprints": dict(sorted(fingerprints.items()))}


def commit_of(base: Path) -> dict[str, Any] | None:
    """The folder's commit record (``None`` without one: another tool's folder passes),
    refused when it says its save did not finish."""
    path = base / COMMIT
    if not os.path.lexists(path):
        return None
    try:
        record = json.loads(read_regular_file(path, limit=1 << 24).decode("utf-8"))
        state = record["state"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise WeightLoadError(f"{path}: malformed ({exc!s:.200})") from None
    if state != "committed":
        raise WeightLoadError(f"{base}: not committed ({COMMIT} says {state!r:.40}): the "
                              f"save_checkpoint that wrote it did not finish, so its files may "
                              f"mix two saves; resume from an earlier checkpoint")
    if not isinstance(record, dict):
        raise WeightLoadError(f"{path}: malformed (not an object)")
    return record


def is_committed(folder: str | os.PathLike[str]) -> bool:
    """Whether ``save_checkpoint`` finished writing ``folder``: its commit record exists and
    says ``committed``. A save killed halfway leaves ``writing``; a trainer that resumes from
    the newest checkpoint skips such a folder for the one before (what ``load_checkpoint``
    then checks of the files themselves is :func:`check_commit`'s)."""
    try:
        return commit_of(Path(folder)) is not None
    except WeightLoadError:
        return False


def check_commit(base: Path, record: Mapping[str, Any], data: bytes,
                  sizes: Mapping[str, int]) -> None:
    """Refuse a committed folder written again since (a plain ``dcp.save`` into it) where
    ``.metadata`` or a size shows it, and a record whose fingerprints cannot be checked; the
    fingerprints themselves are read by :func:`verify_fingerprints`."""
    files = record.get("files")
    if record.get("metadata_sha256") != hashlib.sha256(data).hexdigest() or not isinstance(
            files, dict) or any(files.get(name) != size for name, size in sizes.items()):
        raise WeightLoadError(f"{base}: written again after it was committed (.metadata or a "
                              f"storage file is not what {COMMIT} records: a dcp.save into the "
                              f"same folder?); its files may mix two saves")
    if "fingerprint" not in record:
        return  # a record from before fingerprints: the checks above are all it allows
    scheme, prints = record["fingerprint"], record.get("fingerprints")
    if scheme != FINGERPRINT_SCHEME:
        raise WeightLoadError(f"{base / COMMIT}: fingerprint {scheme!r:.40} is not "
                              f"{FINGERPRINT_SCHEME!r}: written by a newer hyperrecipe? Load "
                              f"it with that version")
    if not isinstance(prints, dict) or not all(isinstance(v, str) for v in prints.values()):
        raise WeightLoadError(f"{base / COMMIT}: malformed (fingerprints is not an object of "
                              f"strings)")
    missing = sorted(set(sizes) - set(prints))
    if missing:
        raise WeightLoadError(f"{base}: written again after it was committed: {missing[0]} "
                              f"is not in {COMMIT}, which records {sorted(prints)[:8]}; its "
                              f"files may mix two saves. Save the checkpoint again")


def verify_fingerprints(folder: str | os.PathLike[str], metadata: Any, rank: int = 0,
                        world: int = 1) -> None:
    """Check this rank's share (every ``world``-th file in name order, from ``rank``) of the
    storage files ``metadata`` names against the sampled fingerprints the commit record holds
    (:func:`sampled_fingerprint`: what it catches and what it does not). Nothing to do for a
    folder without a record, or with one written before fingerprints. Call it after
    :func:`read_dcp_metadata` (which checks the record's state, ``.metadata`` and sizes).

    Raises:
        WeightLoadError: a storage file's bytes are not the ones committed, naming the folder,
            the file and what differs.
    """
    base = Path(folder)
    record = commit_of(base)
    if record is None or "fingerprint" not in record:
        return
    prints = record["fingerprints"]
    names = sorted({info.relative_path for info in metadata.storage_data.values()})
    for name in names[rank::world]:
        try:
            found = sampled_fingerprint(base / name)
        except OSError as exc:
            raise WeightLoadError(f"{base / name}: cannot be read: {exc.strerror or exc}") \
                from None
        if found != prints.get(name):
            size = os.stat(base / name).st_size
            msg = (f"{base}: written again after it was committed: {name} has the size "
                   f"{COMMIT} records ({size} bytes) but other bytes (sampled fingerprint "
                   f"{found[:16]}, committed {str(prints.get(name))[:16]}): a dcp.save into "
                   f"the same folder that did not finish, or a file of another checkpoint, "
                   f"so its files may mix two saves. Save the checkpoint again (or resume "
                   f"from an earlier one)")
            raise WeightLoadError(msg)


def describe_failure(failure: Any) -> str:
    exc = failure[0] if isinstance(failure, tuple) and failure else failure
    if isinstance(exc, BaseException):
        return f"{type(exc).__name__}: {exc!s:.300}"
    text = str(exc)
    return text.strip().splitlines()[-1][:300] if text.strip() else type(exc).__name__


def committed_dcp_save(state: dict[str, Any], folder: str | os.PathLike[str], rank: int, *,
                       view_problem: Callable[[Path], str | None] | None = None) -> None:
    """``dcp.save(state, checkpoint_id=folder)`` between two commit records: ``writing``
    before any rank writes (rank 0 writes it before entering ``dcp.save``, whose first step
    is a collective), ``committed`` after ``.metadata`` is written, with each storage file's
    sampled fingerprint (each rank computes its share, gathered in one exchange). A save that
    dies between the two leaves ``writing``, which every reader here refuses. ``view_problem``
    (the reader's :func:`~hyperrecipe.runtime.state.dcp_reader.storage_view_problem`) asks, on
    every rank in the same exchange, whether the rank sees the checkpoint whole: ``.metadata``
    and every storage file it names. Node-local folders fail it, and the save is refused on
    every rank, uncommitted, naming what each rank misses.

    Raises:
        ExportError: ``dcp.save`` failed on a rank, a rank does not see the checkpoint whole
            (node-local folders), or a rank could not read back its share of the files (the
            folder stays uncommitted).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    path = Path(folder)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        replace_text(path / COMMIT, json.dumps({"state": "writing"}) + "\n")
    try:
        dcp_save(state, checkpoint_id=str(path))
    except CheckpointException as exc:
        failures = getattr(exc, "failures", {}) or {}
        lines = [f"rank {r}: {describe_failure(e)}" for r, e in sorted(failures.items())]
        raise ExportError(f"save_checkpoint into {path} failed; the folder is marked "
                          f"uncommitted and will not load:\n  " + "\n  ".join(
                              lines or [str(exc)])) from None
    fingerprints = _fingerprints_together(path, rank, view_problem)
    if rank == 0:
        replace_text(path / COMMIT, json.dumps(commit_record(path, fingerprints), indent=2,
                                               sort_keys=True) + "\n")


def _fingerprints_together(path: Path, rank: int,
                           view_problem: Callable[[Path], str | None] | None = None
                           ) -> dict[str, str]:
    """Every storage file's sampled fingerprint, each rank reading its share once ``dcp.save``
    returned (its files written and synced), gathered on every rank, with each rank's view of
    the folder checked first (:func:`committed_dcp_save`).

    Raises:
        ExportError: a rank does not see the checkpoint whole, or could not read its share
            (the folder stays uncommitted).
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    share: dict[str, str] | str
    problem = view_problem(path) if view_problem is not None else None
    if problem is not None:
        share = f"rank {rank} does not see the checkpoint whole: {problem}"
    else:
        try:
            share = fingerprint_share(path, rank, world)
        except OSError as exc:
            share = f"rank {rank}: cannot read {exc.filename}: {exc.strerror or exc}"
    shares: list[dict[str, str] | str] = [share]
    if world > 1:
        shares = [{} for _ in range(world)]
        dist.all_gather_object(shares, share)
    failures = [s for s in shares if isinstance(s, str)]
    if failures:
        hint = ("\nEvery rank writes its storage files into the folder it sees, so the "
                "checkpoint needs a file system every rank shares (docs/multi-node.md): give "
                "--out / the folder on shared storage"
                if any("does not see the checkpoint whole" in f for f in failures) else "")
        raise ExportError(f"save_checkpoint into {path} failed; the folder is marked "
                          f"uncommitted and will not load:\n  " + "\n  ".join(failures) + hint)
    return {name: value for s in shares if isinstance(s, dict) for name, value in s.items()}
