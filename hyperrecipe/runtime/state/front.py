"""The front of training state: ``inst.state``, the one object that moves state in and out.

An applied model's state goes in and out through one door, as torch's ``get_state_dict`` /
``set_state_dict`` and torchtitan's checkpointer give it one: full and sharded state dicts,
loading weights, DCP checkpoints with a commit record, the export to transformers' format, and
the status of what was installed and loaded. The :class:`~hyperrecipe.runtime.Installation`
keeps the model, plan, mode, mesh, gradients and ``restore()``; everything here reads the
installation's :class:`~hyperrecipe.runtime.state.live_params.LiveParams` and its entry check,
and never keeps a parameter.

Everything that produces or consumes full tensors gathers or slices shards, so it is a
collective: call it on every rank (a rank that does not would leave the others waiting; the
entry check refuses it within ``collective_timeout_s`` instead).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyperrecipe.errors import ExportError, HyperrecipeError, PlanMismatchError
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.runtime.comm.sharding import local_shard
from hyperrecipe.runtime.preflight.agreement import (
    EntryCheck,
    agree_on_failure,
    agree_on_source,
    every_rank_outcome,
)
from hyperrecipe.runtime.state.checkpoint import (
    differing_ties,
    load_training_state,
    optimizer_state,
    state_value_to_load,
    stored_state_value,
)
from hyperrecipe.runtime.state.export import (
    ExportItem,
    write_safetensors,
    writer_blocks,
    writer_gather,
)
from hyperrecipe.runtime.state.folder_lock import one_writer
from hyperrecipe.runtime.state.integrity import committed_dcp_save, source_digest
from hyperrecipe.runtime.state.live_params import LiveParams
from hyperrecipe.runtime.state.weights import (
    LoadAttempt,
    WeightLoadError,
    load_weights,
    open_snapshot,
    persistent_buffers,
    verify_manifest,
)
from hyperrecipe.runtime.state.snapshot import Snapshot

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.rewriter import RewriteRecord, Rewritten

__all__ = ["StatusRow", "TrainingState", "WrapperChoice"]


class WrapperChoice(Protocol):
    """One candidate of one boundary's inner-wrapper chain and what became of it
    (:class:`hyperrecipe.runtime.features.inner.WrapperChoice`, read here by shape: state sits
    below features)."""

    @property
    def fqn(self) -> str: ...

    @property
    def wrapper(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def reason(self) -> str | None: ...


@attrs.frozen(kw_only=True)
class StatusRow:
    """One install: which module, what was changed, and where it stands.

    ``error`` says why a row is not installed/loaded; ``note`` adds what a successful row did
    that a user should know (a checkpoint read through transformers' key conversion).
    """

    fqn: str
    what: str
    state: str
    error: str | None = None
    note: str | None = None


_LOCK_REPORT_BYTES = 4096
"""The most of the lock holder's report (its refusal, as JSON) every rank receives."""

_DCP_WHY = (" (so are dcp.save and dcp.load of what it returns, which would otherwise wait "
            "for the process group's timeout)")


class TrainingState:
    """State in and out of an applied model (``inst.state``): state dicts, weights,
    checkpoints, export and status.

    Built by the installation; it holds what it needs from it: the model, plan and mesh, the
    live parameters, the rewrite's records (for :meth:`status` and to refuse a restored
    model), the inner-wrapper choices, the tensors no load has written yet, and the entry check
    with the installation's ``collective_timeout_s``.
    """

    def __init__(self, *, model: nn.Module, plan: Plan, mesh: DeviceMesh, live: LiveParams,
                 rewritten: Rewritten, wrapper_choices: Sequence[WrapperChoice] = (),
                 unloaded: Sequence[str] = (), enter: EntryCheck,
                 timeout_s: Callable[[], float]) -> None:
        self._model = model
        self._plan = plan
        self._mesh = mesh
        self._live = live
        self._rewritten = rewritten
        self._wrapper_choices = tuple(wrapper_choices)
        self._unloaded = set(unloaded)
        self._loads: list[LoadAttempt] = []
        self._enter = enter
        self._timeout_s = timeout_s
        self._dcp_group: Any = None
        self._dcp_group_timeout = 0.0

    def _mark_loaded(self, fqns: set[str]) -> None:
        """``model.load_state_dict`` wrote these FQNs (a tied name counts for its owner)."""
        owners = {p.fqn: p.tied_to or p.fqn for p in self._plan.params}
        self._unloaded -= {owners.get(f, f) for f in fqns}

    def _check_live(self) -> None:
        if self._rewritten.restored:
            raise PlanMismatchError("this installation was restored; its shards are gone")
        # an evaluation forward (no backward) under FSDP2 leaves the root's parameters
        # gathered: every state path reads FSDP's shards, as the optimizer holds them
        self._live.reshard_wrappers()

    def _enter_collective(self, what: str, why: str = "",
                          advice: str = "only one rank writes") -> None:
        self._enter(f"TrainingState.{what}", why, advice)

    def _own(self) -> list[ParamPlan]:
        return [p for p in self._plan.params if p.tied_to is None]

    # -- status -----------------------------------------------------------------------------

    @property
    def wrapper_choices(self) -> tuple[WrapperChoice, ...]:
        """Every candidate of every inner-wrapper chain and what ``apply`` made of it
        (installed, ineligible with the reason, failed and rolled back, not tried): the
        structured form of the ``inner wrapper`` rows of :meth:`status`."""
        return self._wrapper_choices

    def status(self) -> list[StatusRow]:
        """A row per install: fqn, what (``forward``, ``parameter weight``, ``adapter
        marshal``…), state, error. A method adapter's fqn is its target,
        ``pkg.mod:Class.method``; a function adapter has a row per module it is scoped to (fqn:
        the module; what: ``adapter marshal pkg.mod:function``). Then a row per weight-loading
        strategy tried (``weights safetensors``: ``loaded``, ``ineligible``, ``failed``, ``not
        tried``) and, while a meta-built model has tensors with no value yet, one ``weights``
        row ``unset`` naming how many. A plan with the loss on vocab shards adds a row ``loss on
        vocab shards`` at the lm_head saying what its logits are."""
        adapters = {a.target: a.mode for a in self._plan.adapters}
        restored = self._rewritten.restored

        def what(r: RewriteRecord) -> str:
            if r.kind == "method" and r.fqn in adapters:
                return f"adapter {adapters[r.fqn]}"
            if r.kind == "function":
                return f"adapter {adapters[r.what]} {r.what}" if r.what in adapters else r.what
            return r.what if r.kind in ("forward", "method") else f"{r.kind} {r.what}"

        rows = [StatusRow(fqn=r.fqn, what=what(r), state=r.state, error=r.error)
                for r in self._rewritten.records]
        loss = self._plan.loss_parallel
        if loss is not None:
            how = ("the model's labels= loss runs on them; a call without labels gets the full "
                   "logits" if loss.kind == "model" else
                   "compute the loss with hyperrecipe.vocab_parallel_cross_entropy")
            rows.append(StatusRow(
                fqn=loss.boundary, what="loss on vocab shards",
                state="restored" if restored else "installed",
                note=f"its logits are this rank's {loss.local_vocab} of {loss.vocab} vocab entries "
                     f"over {loss.mesh_dim} and refuse torch ops; {how}"))
        rows.extend(StatusRow(fqn=c.fqn, what=f"inner wrapper {c.wrapper}",
                              state=c.state if not restored or c.state != "installed"
                              else "restored", error=c.reason)
                    for c in self._wrapper_choices)
        rows.extend(StatusRow(fqn=a.source, what=f"weights {a.strategy}", state=a.state,
                              error=None if a.state == "loaded" else a.detail,
                              note=a.detail if a.state == "loaded" else None)
                    for a in self._loads)
        if self._unloaded:
            names = sorted(self._unloaded)
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            rows.append(StatusRow(fqn="<model>", what="weights", state="unset",
                                  error=f"{len(names)} tensors have no value yet ({shown}); "
                                        f"call load_weights()"))
        return rows

    # -- full tensors -----------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Tensor]:
        """FQN → full tensor for every parameter (tied names included) and buffer (a
        collective: call on every rank)."""
        self._check_live()
        self._enter_collective("full_state_dict")
        full = {p.fqn: self._live.full_of(p, self._live.param(p)) for p in self._own()}
        out: dict[str, Tensor] = {}
        for p in self._plan.params:
            out[p.fqn] = full[p.tied_to or p.fqn]
        for name, buf in self._model.named_buffers():
            out[name] = buf.detach().clone()
        return out

    def full_tensor(self, fqn: str) -> Tensor:
        """The full value of parameter ``fqn`` (a name this front owns, not a tied alias): a
        collective over this installation's mesh, one tensor at a time (for a front spanning
        several of these: a pipelined rank's export)."""
        self._check_live()
        p = self._plan.param(fqn)
        return self._live.full_of(p, self._live.param(p))

    def optimizer_value(self, fqn: str, value: Any) -> Any:
        """An optimizer state value of parameter ``fqn`` as :meth:`state_dict` stores it (a
        parameter-shaped tensor, production-mode local shards included, as a DTensor with the
        parameter's placements), for a front that lays out the optimizer state itself."""
        return stored_state_value(self._live, self._plan.param(fqn), value)

    def optimizer_value_to_load(self, fqn: str, value: Any) -> Any:
        """A loaded optimizer state value of parameter ``fqn`` (a DTensor of any placement or
        a full tensor) as this rank's optimizer holds it: the rank's shard (a collective where
        it reshards)."""
        return state_value_to_load(self._live, self._plan.param(fqn), value)

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy full tensors in; each rank keeps its own shard.

        Raises:
            PlanMismatchError: a parameter is missing or has the wrong shape; tied names hold
                different values.
        """
        self._check_live()
        why = differing_ties(self._plan, state_dict)
        if why is not None:
            raise PlanMismatchError(f"load_full_state_dict: {why}")
        for p in self._own():
            if p.fqn not in state_dict:
                raise PlanMismatchError(f"load_full_state_dict: {p.fqn!r} is missing")
            full = state_dict[p.fqn]
            if tuple(full.shape) != p.shape:
                raise PlanMismatchError(f"load_full_state_dict: {p.fqn!r} has shape "
                                        f"{list(full.shape)}, the model {list(p.shape)}")
        for p in self._own():
            target = self._live.local(p)
            full = state_dict[p.fqn].to(target.device)
            with torch.no_grad():
                if tuple(target.shape) == p.shape:
                    target.copy_(full)
                else:
                    target.copy_(local_shard(full, p.placement, self._mesh,
                                             self._plan.mesh_dims))
            self._unloaded.discard(p.fqn)
        for name, buf in self._model.named_buffers():
            if name in state_dict:
                with torch.no_grad():
                    buf.copy_(state_dict[name])
                self._unloaded.discard(name)

    # -- weights ----------------------------------------------------------------------------

    def load_weights(self, source: str | os.PathLike[str], *,
                     ignore_unexpected: Sequence[str] = (),
                     aliases: Mapping[str, Sequence[str]] | None = None) -> None:
        """Load a checkpoint, each rank reading only its slices (call on every rank).

        ``source`` is a ``.safetensors`` file, a Hugging Face checkpoint folder (one file or an
        indexed ``model.safetensors.index.json``), or a ``torch.distributed.checkpoint`` folder
        (saved from :meth:`state_dict` or a model state dict, on any mesh). Strategies are tried
        in that order; :meth:`status` shows which loaded and why the others were skipped.
        Dtypes are converted to the model's; tied parameters load from whichever of their
        names the checkpoint holds (several names must hold one value).

        Args:
            source: the checkpoint file or folder.
            ignore_unexpected: regular expressions (``re.search``) naming checkpoint keys the
                model does not use and that may be skipped (extra heads, another model's
                parts). Buffers that older transformers versions saved and current models
                compute (``rotary_emb.inv_freq``, ``attn.masked_bias``) are skipped without
                being named, as ``from_pretrained`` does; any other unexpected key is refused.
            aliases: parameter FQN -> other checkpoint names that hold it: a pipeline stage's
                copy of a weight tied to another stage's (GPT-2's ``lm_head.weight``, stored as
                ``transformer.wte.weight``); ``pipe.state.load_weights`` passes them.

        Before any rank reads, the ranks compare a digest of what each is about to read, and
        a folder that ``save_pretrained`` wrote is checked against its manifest (sizes, and
        the digest it records, each rank hashing its share): all ranks load, or all raise.
        Each rank opens the folder and every file it reads once, before reading data
        (:mod:`~hyperrecipe.runtime.state.snapshot`): the digest, the manifest check and the
        tensors all come from those descriptors, a file changed in place meanwhile is
        refused by name, and a folder replaced while being read (a re-export into it) is
        refused saying so, never read as a mix of two exports. The first strategy that can
        read the source is the only one tried; DCP metadata is read without running code
        (docs/security.md, "Checkpoints").

        Raises:
            WeightLoadError: the checkpoint does not fit (every missing, unexpected and
                mis-shaped tensor named, with its file; tied names holding different values),
                cannot be read, differs between ranks or from its manifest, or is refused (a
                FIFO, a path out of the folder, a pickle naming code); the model is left as it
                was before the call.
        """
        self._check_live()
        try:
            with open_snapshot(source) as snapshot:
                attempts = self._load_snapshot(snapshot, tuple(ignore_unexpected), aliases)
        except WeightLoadError as exc:
            self._loads = [LoadAttempt(strategy="*", source=str(source), state="failed",
                                       detail=str(exc))]
            raise
        self._loads = attempts

    def _load_snapshot(self, snapshot: Snapshot,
                       ignore_unexpected: Sequence[str] = (),
                       aliases: Mapping[str, Sequence[str]] | None = None) -> list[LoadAttempt]:
        """:meth:`load_weights` of a source already opened (:func:`open_snapshot`): the ranks'
        digest, the manifest check and the load all read its descriptors. A refusal while
        the folder was being replaced says so (the error met is kept in the message)."""
        try:
            self._agree_on_source(snapshot, "load_weights")
            return load_weights(self._live, self._model, snapshot, self._unloaded,
                                ignore_unexpected, self._agree_on_outcome, aliases=aliases)
        except WeightLoadError as exc:
            if not snapshot.replaced():
                raise
            raise WeightLoadError(snapshot.replaced_message(str(exc))) from exc

    # -- sharded state dicts and DCP checkpoints --------------------------------------------

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Training state for ``torch.distributed.checkpoint``, in both modes (collective).

        Returns ``{"model": {fqn: DTensor}}`` (plus ``"optimizer"``: the optimizer's state keyed
        by FQN, when given). Every tensor is a DTensor with the plan's placements over this
        mesh, sharing the live shard's storage, so ``dcp.save`` stores each shard once and
        ``dcp.load`` into it reads a checkpoint saved on any mesh; chunked (fused) parameters,
        which DCP cannot store shard by shard, are gathered and stored replicated. Tied
        parameters appear under every name, as in ``model.state_dict()``; persistent buffers
        are plain tensors (the same on every rank).

        Example::

            dcp.save(inst.state.state_dict(opt), checkpoint_id=f"ckpt/{step}")
            # resume, on any mesh, reading the folder as data (torch's own reader unpickles
            # its .metadata); inst.state.save_checkpoint / load_checkpoint do both with a
            # commit record:
            state = inst.state.state_dict(opt)
            dcp.load(state, storage_reader=trusted_reader("ckpt/100"))
            inst.state.load_state_dict(state, opt)

        Raises:
            PlanMismatchError: another rank did not call it within ``collective_timeout_s``
                (a lone ``dcp.save(inst.state.state_dict())`` would wait in DCP's collectives
                for the process group's timeout instead).
        """
        self._check_live()
        self._enter_collective("state_dict", _DCP_WHY, "each rank saves its own shards")
        own = {p.fqn: self._live.stored(p) for p in self._own()}
        model: dict[str, Any] = {p.fqn: own[p.tied_to or p.fqn] for p in self._plan.params}
        for name, buf in persistent_buffers(self._model):
            model[name] = buf
        out: dict[str, Any] = {"model": model}
        if optimizer is not None:
            out["optimizer"] = optimizer_state(self._live, optimizer)
        return out

    def load_state_dict(self, state: Mapping[str, Any],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put back a :meth:`state_dict` (after ``dcp.load``, or full tensors): each rank keeps
        its shard of every parameter and of the optimizer's state (collective).

        Raises:
            PlanMismatchError: a parameter is missing or has another global shape; an
                optimizer was given but the state has none, or other parameter groups;
                another rank did not call it within ``collective_timeout_s``.
        """
        self._check_live()
        self._enter_collective("load_state_dict", _DCP_WHY, "each rank keeps its own shards")
        load_training_state(self._live, state, optimizer, self._unloaded)

    def save_checkpoint(self, folder: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """``dcp.save(inst.state.state_dict(optimizer), checkpoint_id=folder)`` that marks the
        folder committed only when the save finished (call on every rank): a save that dies
        halfway (a full disk, a killed rank) leaves a folder that :meth:`load_checkpoint` and
        :meth:`load_weights` refuse instead of loading a mix of two saves, and a folder
        written again after its commit by a plain ``dcp.save`` is refused too.

        Every rank must see the folder whole once ``dcp.save`` returns (``.metadata`` and every
        storage file it names): node-local folders on several nodes hold a checkpoint no
        single folder can load, and are refused here, uncommitted, on every rank.

        One job writes a folder at a time: rank 0 holds the folder's lock
        (``hyperrecipe.lock``, :mod:`~hyperrecipe.runtime.state.folder_lock`) while the ranks
        save, and a second job saving into it meanwhile is refused on every rank before any of
        them writes there.

        The new checkpoint is written into a staging folder beside ``folder`` and switched in
        whole once every rank's files are written and fingerprinted
        (:func:`~hyperrecipe.runtime.state.integrity.committed_dcp_save`): until then
        ``folder`` holds, byte for byte, what it held (a committed checkpoint there still
        loads), and a save killed before the switch leaves a staging folder that the next save
        removes. Every wait (DCP's collectives, on a gloo group of their own, and the ranks'
        exchanges) is bounded by ``collective_timeout_s``: a stopped or killed rank makes the
        others raise, naming it, instead of waiting for the process group's timeout.

        Raises:
            FolderLockedError: another job is writing the folder (the message names its
                host, pid and since when, and what to do); this job wrote nothing there.
            ExportError: on every rank that arrived, with the same message: ``dcp.save``
                failed on a rank, a rank does not see the checkpoint whole (the message names
                what it misses: checkpoints need shared storage), the staging folder could not
                be written, a rank did not arrive within ``collective_timeout_s`` (named), or
                the switch failed (the message says what the folder holds).
        """
        self._check_live()
        self.committed_save(self.state_dict(optimizer), folder)

    def committed_save(self, state: dict[str, Any], folder: str | os.PathLike[str]) -> None:
        """The body of :meth:`save_checkpoint` for a state dict already made: ``dcp.save`` into
        a staging folder under rank 0's lock, committed and switched in (call on every rank).
        For a front that spans several of these (a pipelined rank's stages: one state dict,
        one folder)."""
        from hyperrecipe.runtime.state.dcp_reader import storage_view_problem

        rank = dist.get_rank() if dist.is_initialized() else 0
        with self._one_writer(folder, "save_checkpoint", holder=rank == 0):
            group = self._bounded_group(ExportError, f"save_checkpoint into {folder}")
            try:
                committed_dcp_save(state, folder, rank, view_problem=storage_view_problem,
                                   process_group=group, meet=self._meet,
                                   timeout_s=self._timeout_s())
            except ExportError:
                self._dcp_group = None  # may hold an unfinished collective: never reused
                raise

    def load_checkpoint(self, folder: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume from a DCP folder written by :meth:`save_checkpoint` (or
        ``dcp.save(inst.state.state_dict(optimizer))``), on any mesh: ``dcp.load`` into
        :meth:`state_dict` then :meth:`load_state_dict`, reading the folder as data (call on
        every rank).

        torch's own ``dcp.load`` unpickles ``.metadata`` and non-tensor entries with plain
        ``pickle``, so a folder someone else wrote can run code; this reads them through an
        allow-list (docs/security.md, "Checkpoints"). A trainer that calls ``dcp.load`` itself
        gets the same by passing ``storage_reader=hyperrecipe.runtime.state.dcp_reader.
        trusted_reader(folder)``.

        ``dcp.load``'s collectives run on the gloo group :meth:`save_checkpoint` uses, with
        ``collective_timeout_s`` as its timeout, and the ranks report their outcome in one
        bounded exchange after it: a stopped or killed rank makes the others raise, naming
        it.

        Raises:
            WeightLoadError: the folder is refused (a global outside DCP's metadata classes,
                non-tensor entries that are not plain data, storage files missing, truncated,
                not regular or outside the folder), a rank failed reading it, or a rank did
                not arrive within ``collective_timeout_s`` (named); nothing was written.
            PlanMismatchError: see :meth:`load_state_dict`.
        """
        self._check_live()
        staged = self.trusted_load(self.state_dict(optimizer), folder)
        load_training_state(self._live, staged, optimizer, self._unloaded)

    def trusted_load(self, state: Any, folder: str | os.PathLike[str]) -> Any:
        """The read of :meth:`load_checkpoint`: the ranks agree on the folder, then
        ``dcp.load`` into a copy of ``state`` through the allow-list reader, every rank's
        outcome exchanged (call on every rank). Returns the copy; nothing live is written.
        For a front that spans several of these (a pipelined rank's stages)."""
        from hyperrecipe.runtime.state.dcp_reader import trusted_dcp_load

        self._agree_on_source(folder, "load_checkpoint")
        staged = _staged(state)
        group = self._bounded_group(WeightLoadError, f"load_checkpoint({os.fspath(folder)!r})")
        error: str | None = None
        try:
            trusted_dcp_load(staged, folder, process_group=group, agree=self._agree)
        except (WeightLoadError, PlanMismatchError) as exc:
            error = str(exc)
        self._loaded_together(folder, error)
        return staged

    def enter_collective(self, what: str) -> None:
        """The entry check of a collective call ``what`` made by a front spanning several of
        these: refuses within ``collective_timeout_s`` where a rank did not call it."""
        self._check_live()
        self._enter_collective(what)

    def one_writer(self, folder: str | os.PathLike[str], what: str, *,
                   holder: bool) -> contextlib.AbstractContextManager[None]:
        """The folder's lock held by the ``holder`` rank while the body writes (see
        :meth:`save_pretrained`), for a front spanning several of these."""
        return self._one_writer(folder, what, holder=holder)

    # -- export -----------------------------------------------------------------------------

    def save_pretrained(self, folder: str | os.PathLike[str], *,
                        max_shard_bytes: int = 5 * 2**30, writer_rank: int = 0) -> None:
        """Write consolidated safetensors that ``from_pretrained`` loads (call on every rank).

        Each tensor is gathered in turn (a collective) and streamed by ``writer_rank`` into its
        file, so the extra memory is about one full tensor; files are split at
        ``max_shard_bytes`` with an index; the model's ``config`` is saved beside them. The model
        stays applied and keeps training. Tied parameters are written once, under their owner's
        name, as ``save_pretrained`` does.

        The files replace an earlier export in ``folder`` whole or not at all: they are
        written into a staging folder beside it, with ``config.json`` and
        ``hyperrecipe.manifest.json`` (each file's size and digest, xxh3_128 where ``xxhash``
        is installed), and switched in by one atomic exchange once every rank got through
        (:mod:`~hyperrecipe.runtime.state.folder_switch`); the folder's other files are kept.
        ``writer_rank`` holds the folder's lock (``hyperrecipe.lock``) meanwhile: a second
        job exporting into it is refused on every rank before any of them writes there.

        Raises:
            PlanMismatchError: another rank did not call it (within ``collective_timeout_s``),
                instead of hanging until the process group's watchdog.
            FolderLockedError: another job is writing the folder (the message names its
                host, pid and since when, and what to do); this job wrote nothing there.
            ExportError: writing failed on a rank (every rank raises; the folder is unchanged).
            ExportAbortedError: a rank failed or stopped mid-gather: that rank raises at once,
                the others within ``collective_timeout_s`` (the folder is unchanged).
        """
        self._check_live()
        self._enter_collective("save_pretrained")
        items = [ExportItem(name=p.fqn, dtype=self._live.param(p).dtype, shape=p.shape,
                            gather=writer_gather(self._live, p, writer_rank),
                            blocks=writer_blocks(self._live, p, writer_rank))
                 for p in self._own()]
        items.extend(ExportItem(name=name, dtype=buf.dtype, shape=tuple(buf.shape),
                                gather=lambda buf=buf: buf)  # type: ignore[misc]
                     for name, buf in persistent_buffers(self._model))
        rank = dist.get_rank() if dist.is_initialized() else 0
        with self._one_writer(folder, "save_pretrained", holder=rank == writer_rank):
            write_safetensors(folder, items, writer=rank == writer_rank,
                              max_shard_bytes=max_shard_bytes, model=self._model,
                              timeout_s=self._timeout_s())

    # -- the ranks' agreements (bounded by collective_timeout_s) ----------------------------

    @contextlib.contextmanager
    def _one_writer(self, folder: str | os.PathLike[str], what: str, *,
                    holder: bool) -> Iterator[None]:
        """The folder's lock, held by the ``holder`` rank while the body writes, the ranks
        agreeing on its outcome within ``collective_timeout_s`` (:func:`one_writer`)."""

        def agree(report: str | None) -> dict[int, str]:
            return agree_on_failure(report, f"the lock on {os.fspath(folder)!r}",
                                    self._timeout_s(), max_bytes=_LOCK_REPORT_BYTES)

        with one_writer(folder, what, holder=holder, agree=agree):
            yield

    def _bounded_group(self, error: type[HyperrecipeError], what: str) -> Any:
        """The process group DCP's collectives run on: gloo over the world, its timeout this
        installation's ``collective_timeout_s`` (the default group's is torch's 30 minutes,
        and an NCCL group's cannot bound a rank stopped on the host). Made on first use,
        after the callers' entry check and lock agreement saw every rank arrive (making it is
        itself a collective, bounded by the same timeout), and again after a failure or a
        change of the timeout. ``None`` (the default group) without peers, on torch's fake
        group, or without gloo.

        Raises:
            ``error``: the group could not be made (a rank left meanwhile).
        """
        if not dist.is_initialized() or dist.get_world_size() == 1 \
                or dist.get_backend() == "fake" or not dist.is_gloo_available():
            return None
        timeout = self._timeout_s()
        if self._dcp_group is not None and self._dcp_group_timeout == timeout:
            return self._dcp_group
        try:
            group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - a peer gone: said with the call
            msg = (f"{what}: rank {dist.get_rank()} could not set up the gloo group DCP runs "
                   f"on within {timeout:g} s (collective_timeout_s): "
                   f"{type(exc).__name__}: {exc!s:.300}; a rank stopped or left: restart "
                   f"every rank")
            raise error(msg) from None
        self._dcp_group, self._dcp_group_timeout = group, timeout
        return group

    def _meet(self, outcome: str, what: str, broken: bool = False
              ) -> tuple[dict[int, str], list[int]]:
        """Every rank's ``outcome`` of a step of a save or load, within
        ``collective_timeout_s``: gathered on the gloo group of :meth:`_bounded_group` while
        it works (nothing is written to the store on the way of a save that succeeds: a
        ``FileStore`` is a file, and grows with every key), through the store
        (:func:`every_rank_outcome`, which names the ranks that did not arrive) once a
        collective failed on this rank (``broken``) or this gather does."""
        group = self._dcp_group
        if group is not None and not broken:
            everyone: list[Any] = [None] * dist.get_world_size()
            try:
                dist.all_gather_object(everyone, outcome, group=group)
            except Exception:  # noqa: BLE001 - a peer stopped or died: asked through the store
                self._dcp_group = None
            else:
                return dict(enumerate(everyone)), []
        return every_rank_outcome(outcome, what, self._timeout_s())

    def _loaded_together(self, folder: str | os.PathLike[str], error: str | None) -> None:
        """Every rank's outcome of ``dcp.load``, so that all raise or all go on: a rank that
        timed out in DCP's collectives (a peer stopped) names the peer that did not arrive.

        Raises:
            WeightLoadError: this or another rank failed, or a rank did not arrive.
        """
        outcomes, missing = self._meet(error or "", "the end of dcp.load", error is not None)
        errors: list[str] = []
        for _, text in sorted(outcomes.items()):
            if text and text not in errors:
                errors.append(text)
        if errors or missing:
            self._dcp_group = None  # may hold an unfinished collective: never reused
        if not missing and len(errors) == 1:
            raise WeightLoadError(errors[0])  # the same on every rank (DCP gathers failures)
        if missing:
            errors.append(f"rank(s) {missing} did not reach the end of dcp.load within "
                          f"{self._timeout_s():g} s (collective_timeout_s): stopped, hung or "
                          f"killed; restart every rank")
        if errors:
            raise WeightLoadError(f"load_checkpoint({os.fspath(folder)!r}) failed; nothing "
                                  f"was loaded:\n  " + "\n  ".join(errors))

    def _agree(self, error: str | None, what: str) -> dict[int, str]:
        """Every rank's outcome of ``what`` (bounded by ``collective_timeout_s``)."""
        return agree_on_failure(error, what, self._timeout_s())

    def _agree_on_outcome(self, error: str | None) -> dict[int, str]:
        """Every rank's outcome of a step of ``load_weights``: a rank whose copy failed while
        the others finished must not leave them training on a model it does not hold."""
        return agree_on_failure(error, "the agreement in load_weights", self._timeout_s())

    def _agree_on_source(self, source: str | os.PathLike[str] | Snapshot, what: str) -> None:
        """The ranks compare a digest of what each is about to read, each also checking its
        share of an export's manifest (:func:`agree_on_source`); given a snapshot, both read
        its descriptors, so ranks that opened different exports of one folder disagree."""

        def read_digest(rank: int, world: int) -> str:
            digest = source_digest(source)
            verify_manifest(source, rank, world)  # each rank hashes its share of the files
            return digest

        agree_on_source(source.source if isinstance(source, Snapshot) else source, what,
                        read_digest)


def _staged(state: Any) -> Any:
    """``state`` with every tensor cloned: ``dcp.load`` writes into what it is given, and the
    state dict shares the live shards, so a load that fails halfway would leave a mixture."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, state)
