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
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from hyperrecipe._files import open_regular, read_regular_file
from hyperrecipe._files import sync_folder
from hyperrecipe.errors import ExportError, SwitchIncompleteError, WeightLoadError
from hyperrecipe.runtime.state import folder_switch
from hyperrecipe.runtime.state.snapshot import Hasher, Snapshot, borrowed

__all__ = ["CHECKPOINT_FILES", "COMMIT", "DIGESTS", "FINGERPRINT_SCHEME", "FORMATS", "MANIFEST",
           "MANIFEST_FORMAT", "MAX_METADATA_BYTES", "Hasher", "Meet", "check_commit",
           "checkpoint_owns", "commit_of", "commit_record", "committed_dcp_save",
           "describe_failure", "digest_file", "fingerprint_share", "is_committed",
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
"""Written by ``TrainingState.save_checkpoint`` into its staging folder (which is switched in
for the target only once it holds ``committed``): ``{"state": "writing"}`` before ``dcp.save``,
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


CHECKPOINT_FILES = re.compile(r"(__\d+)?\.metadata(\.tmp)?|.*\.distcp|"
                              + re.escape(COMMIT) + r"|\." + re.escape(COMMIT) + r"\.tmp-\d+")
"""What a checkpoint's state is made of: what torch's ``FileSystemWriter`` writes (``.metadata``,
rank-local ``__<rank>.metadata``, their ``.tmp`` while written, ``*.distcp``) and the commit
record (with its temporary file). The next save replaces them; anything else in the folder is
the user's, carried over by the switch."""


def checkpoint_owns(name: str) -> bool:
    """Whether an entry of a checkpoint folder belongs to the saved state (the ``owned`` of
    :func:`~hyperrecipe.runtime.state.folder_switch.commit`)."""
    return CHECKPOINT_FILES.fullmatch(name) is not None


Meet = Callable[[str, str, bool], tuple[dict[int, str], list[int]]]
"""Every rank's outcome of a step, in one bounded exchange: ``meet(outcome, what, broken)``
returns ``({rank: outcome}, ranks that did not arrive)``; ``broken``: this rank's collectives
failed (a peer stopped or died), so the exchange must not be one
(``TrainingState._meet``)."""


def _alone(outcome: str, what: str, broken: bool) -> tuple[dict[int, str], list[int]]:
    del what, broken
    return {0: outcome}, []


@attrs.frozen(kw_only=True)
class _Save:
    """What every rank of one checkpoint save reports and raises with."""

    target: Path
    rank: int
    meet: Meet
    timeout_s: float

    def together(self, outcome: dict[str, Any], what: str, head: str,
                 broken: bool = False) -> dict[int, Any]:
        """Every rank's ``outcome`` of ``what``; the same :class:`ExportError` on every rank
        that arrived when a rank failed or did not arrive (``head`` says what became of the
        folder)."""
        texts, missing = self.meet(json.dumps(outcome, sort_keys=True), what, broken)
        outcomes = {r: json.loads(t) for r, t in texts.items()}
        errors: list[str] = []
        for r, o in sorted(outcomes.items()):
            error = o.get("error")
            if isinstance(error, str) and error not in errors:
                errors.append(error)
        if missing:
            errors.append(f"rank(s) {missing} did not reach {what} within {self.timeout_s:g} "
                          f"s (collective_timeout_s): stopped, hung or killed; restart every "
                          f"rank")
        if errors:
            hint = ("\nEvery rank writes its storage files into the folder it sees, so the "
                    "checkpoint needs a file system every rank shares (docs/multi-node.md): "
                    "give --out / the folder on shared storage"
                    if any("does not see the checkpoint whole" in e for e in errors) else "")
            raise ExportError(f"save_checkpoint into {self.target} failed; {head}:\n  "
                              + "\n  ".join(errors) + hint)
        return outcomes


_KEPT = "the folder holds what it held before (the new checkpoint was never switched in)"


def committed_dcp_save(state: dict[str, Any], folder: str | os.PathLike[str], rank: int, *,
                       view_problem: Callable[[Path], str | None] | None = None,
                       process_group: Any = None, meet: Meet | None = None,
                       timeout_s: float = 0.0) -> None:
    """``dcp.save(state)`` committed like a database's transaction: into a staging folder
    (:mod:`~hyperrecipe.runtime.state.folder_switch`), fingerprinted and given its commit
    record there, then switched in for ``folder`` in one step. A save that fails or is killed
    at any point before the switch leaves ``folder`` byte for byte as it was (a committed
    checkpoint there still loads), and its staging folder is removed by this save or the
    next.

    Three bounded exchanges (``meet``, :data:`Meet`), so that every rank that arrives raises
    the same :class:`ExportError`, naming the failing rank, its file and what did not
    arrive, or every rank returns:

    1. rank 0 (which holds the folder's lock) makes the staging folder and writes a
       ``writing`` record into it, and tells every rank where it is, *before* any rank enters
       ``dcp.save``: a full disk there used to leave rank 0 raising while its peers waited in
       DCP's first collective;
    2. after ``dcp.save`` (its collectives on ``process_group``, bounded by its timeout),
       every rank reports its outcome, whether it sees the checkpoint whole (``view_problem``,
       the reader's :func:`~hyperrecipe.runtime.state.dcp_reader.storage_view_problem`:
       node-local folders fail it) and the sampled fingerprints of its share of the storage
       files;
    3. rank 0 writes the committed record and switches the folder in, and reports that.

    Raises:
        ExportError: a rank failed or did not arrive at one of the steps (the message says
            whether the folder holds its old state, which it does unless the switch was
            reached).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    save = _Save(target=Path(folder), rank=rank, meet=meet or _alone, timeout_s=timeout_s)
    staging: folder_switch.Staging | None = None
    switching = False
    try:
        mine: dict[str, Any] = {}
        if rank == 0:
            staging, mine = _prepare(save.target)
        where = save.together(mine, "the start of the save", _KEPT)
        path = staging.path if staging is not None else _staging_of(save.target,
                                                                    where[0]["staging"])
        outcome: dict[str, Any]
        broken = False
        try:
            dcp_save(state, checkpoint_id=str(path), process_group=process_group)
        except CheckpointException as exc:
            failures = getattr(exc, "failures", {}) or {}
            lines = [f"rank {r}: dcp.save failed: {describe_failure(e)}"
                     for r, e in sorted(failures.items())]
            outcome = {"error": "\n  ".join(lines or [f"dcp.save failed: {exc}"])}
        except Exception as exc:  # noqa: BLE001 - a timed-out or broken collective: reported
            outcome = {"error": f"rank {rank}: dcp.save stopped: {describe_failure(exc)}"}
            broken = True
        else:
            outcome = _fingerprint_outcome(path, rank, view_problem)
        shares = save.together(outcome, "the end of dcp.save", _KEPT, broken)
        switching = True
        if staging is not None:
            fingerprints = {n: v for o in shares.values() for n, v in
                            o.get("fingerprints", {}).items()}
            outcome = _switch(save, staging, fingerprints)
        else:
            outcome = {}
        save.together(outcome, "the switch", "the folder holds the old checkpoint or the new "
                      "one (a loader refuses anything in between by its commit record)")
    except BaseException:
        if staging is not None and not switching:
            folder_switch.abandon(staging)
        elif rank != 0 and not switching:
            _forget_own_view(save.target)
        raise


def _prepare(target: Path) -> tuple[folder_switch.Staging | None, dict[str, Any]]:
    """Rank 0's staging folder with its ``writing`` record, and what it tells the other ranks
    in the first exchange: where the folder is, or why it could not be made."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        staging = folder_switch.begin(target, checkpoint_owns)
    except OSError as exc:
        return None, {"error": f"rank 0: cannot make the staging folder for {target} at "
                               f"{exc.filename or target}: {exc.strerror or exc}"}
    record = staging.path / COMMIT
    try:
        replace_text(record, json.dumps({"state": "writing"}) + "\n")
    except OSError as exc:
        folder_switch.abandon(staging)
        return None, {"error": f"rank 0: cannot write {record}: {exc.strerror or exc}"}
    return staging, {"staging": [staging.exchange, staging.path.name]}


def _staging_of(target: Path, where: Any) -> Path:
    """This rank's view of the staging folder rank 0 made (``[exchange, name]``): the
    target's sibling of that name, or the folder inside it."""
    exchange, name = where
    if exchange:
        return target.resolve().parent / str(name)
    return target / folder_switch.STAGING_SUFFIX


def _forget_own_view(target: Path) -> None:
    """On a rank other than 0 whose save failed: remove the staging folder it sees when rank
    0 did not make it (no record in it: node-local folders, where DCP made it on this node);
    rank 0 removes the one it made, or the next save does."""
    for path in (target.resolve().parent / f".{target.resolve().name}"
                                           f"{folder_switch.STAGING_SUFFIX}",
                 target / folder_switch.STAGING_SUFFIX):
        if path.is_dir() and not path.is_symlink() and not os.path.lexists(path / COMMIT):
            shutil.rmtree(path, ignore_errors=True)


def _fingerprint_outcome(path: Path, rank: int,
                         view_problem: Callable[[Path], str | None] | None) -> dict[str, Any]:
    """This rank's report after ``dcp.save`` returned (its files written and synced): whether
    it sees the checkpoint whole, then its share of the storage files' sampled
    fingerprints."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    problem = view_problem(path) if view_problem is not None else None
    if problem is not None:
        return {"error": f"rank {rank} does not see the checkpoint whole: {problem}"}
    try:
        return {"fingerprints": fingerprint_share(path, rank, world)}
    except OSError as exc:
        return {"error": f"rank {rank}: cannot read {exc.filename}: {exc.strerror or exc}"}


def _switch(save: _Save, staging: folder_switch.Staging,
            fingerprints: Mapping[str, str]) -> dict[str, Any]:
    """Rank 0: the committed record into the staging folder, then the switch. Its outcome,
    saying which checkpoint the folder holds when it failed."""
    record = json.dumps(commit_record(staging.path, fingerprints), indent=2,
                        sort_keys=True) + "\n"
    try:
        replace_text(staging.path / COMMIT, record)
    except OSError as exc:
        folder_switch.abandon(staging)
        return {"error": f"rank 0: cannot write {staging.path / COMMIT}: "
                         f"{exc.strerror or exc}; {_KEPT}"}
    try:
        folder_switch.commit(staging, checkpoint_owns, last=(COMMIT,))
    except OSError as exc:
        switched = _reads(save.target / COMMIT) == record
        if not switched and not isinstance(exc, SwitchIncompleteError):
            folder_switch.abandon(staging)  # the target never changed: nothing else in it
        state = ("the new checkpoint is committed there; the next save finishes moving "
                 f"back what {folder_switch.leftovers(save.target)} holds" if switched else
                 "the folder holds its old checkpoint, or a mix its commit record refuses")
        return {"error": f"rank 0: the switch failed at {exc.filename or save.target}: "
                         f"{exc.strerror or exc}; {state}"}
    return {}


def _reads(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
