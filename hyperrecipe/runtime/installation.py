"""What ``apply`` returns: the installed plan's status, full views of a sharded model, restore.

Everything here that produces full tensors gathers shards, so it is a collective: call it on
every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ParamPlan, Plan
from hyperrecipe.rewriter import RewriteRecord, Rewritten
from hyperrecipe.runtime.features.inner import WrapperChoice
from hyperrecipe.runtime.state.checkpoint import (
    LiveParams,
    differing_ties,
    every_rank_entered,
    load_training_state,
    optimizer_state,
)
from hyperrecipe.runtime.grads.ddp_guard import install_ddp_guard
from hyperrecipe.runtime.preflight.first_forward import install_first_forward_checks
from hyperrecipe.runtime.state.export import (
    ExportItem,
    write_safetensors,
    writer_blocks,
    writer_gather,
)
from hyperrecipe.runtime.state.materialize import keep_non_persistent_buffers
from hyperrecipe.runtime.grads.grad_norm import (
    clip_grads_by_norm,
    per_parameter_grad_norms,
    total_grad_norm,
)
from hyperrecipe.runtime.grads.scaler_guard import guard_grad_scaler
from hyperrecipe.runtime.grads.torch_clip_guard import guard_torch_clipping
from hyperrecipe.runtime.mode import Mode, as_mode
from hyperrecipe.runtime.comm.sharding import local_shard
from hyperrecipe.runtime.state.state_hooks import (
    install_optimizer_hooks,
    install_state_hooks,
    replaced_bucket_params,
)
from hyperrecipe.runtime.state.weights import (
    LoadAttempt,
    WeightLoadError,
    persistent_buffers,
    load_weights,
    source_digest,
    verify_manifest,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.runtime.grads.grad_buckets import GradBucketReducer

__all__ = ["Installation", "StatusRow"]


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


def _barrier_group() -> Any:
    """The group whose ranks must all enter a collective state call (the world group), or
    None when there is nobody to wait for: one process, or torch's fake process group (a dry
    run, :mod:`hyperrecipe.simulate`), whose peers are imagined."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "fake":
        return None
    return dist.group.WORLD


class Installation:
    """A plan applied to a model on this rank.

    Everything that produces or consumes full tensors gathers or slices shards, so it is a
    collective: call it on every rank (a rank that does not would leave the others waiting).

    Attributes:
        mode: the :class:`~hyperrecipe.runtime.mode.Mode` it runs in (equal to its name,
            ``"production"`` or ``"validate"``).
        plan: the plan that was applied.
    """

    def __init__(self, *, model: nn.Module, plan: Plan, mode: Mode | str, rewritten: Rewritten,
                 mesh: DeviceMesh, wrapper_choices: Sequence[WrapperChoice] = (),
                 unloaded: Sequence[str] = (),
                 grad_reducer: GradBucketReducer | None = None) -> None:
        self.model = model
        self._grad_reducer = grad_reducer
        self.plan = plan
        self.mode = as_mode(mode)
        self.mesh = mesh
        self._rewritten = rewritten
        self._wrapper_choices = tuple(wrapper_choices)
        self._live = LiveParams(model, plan, mesh, self.mode)
        self._unloaded = set(unloaded)
        self._loads: list[LoadAttempt] = []
        # Parameters are looked up live (LiveParams), never kept: to_empty(), fully_shard and
        # load_state_dict(assign=True) replace them after apply.
        # Production reduces these parameters' gradients with hooks on the objects apply
        # installed; a wrapper that replaces them would leave the gradients partial.
        by_fqn = {p.fqn: p for p in plan.params}
        self._bucketed = {fqn: (by_fqn[fqn], self._live.param(by_fqn[fqn]))
                          for fqn in self.mode.hook_reduced_gradients(plan)}
        self._barrier_group: Any = None
        self._hooks: list[Any] = []

    @classmethod
    def attach(cls, *, model: nn.Module, plan: Plan, mode: Mode | str, rewritten: Rewritten,
               mesh: DeviceMesh, wrapper_choices: Sequence[WrapperChoice] = (),
               unloaded: Sequence[str] = (),
               grad_reducer: GradBucketReducer | None = None) -> Installation:
        """The handle ``apply`` returns once every rank committed, with what it documents
        beside the rewritten model: the group whose barrier refuses a collective entered on
        one rank only, and the hooks through which a trainer's own calls reach the plan
        (production: state dicts of local shards as DTensors; both: the optimizer's hooks,
        fused parameters' state replicated for DCP; validate: a step of torch's multi-tensor
        kernels over mixed DTensor / plain parameters refused by name; both:
        ``model.load_state_dict``'s checks, the DDP guard, the check that a model-parallel
        group's ranks were handed the same batch and draw the same dropout (once, at the first
        training forward, :mod:`~hyperrecipe.runtime.preflight.first_forward`) and, for a
        plan that shards, torch's ``clip_grad_norm_`` routed to :meth:`grad_norm`).
        ``restore()`` removes them.
        Constructing an :class:`Installation` itself changes nothing."""
        inst = cls(model=model, plan=plan, mode=mode, rewritten=rewritten, mesh=mesh,
                   wrapper_choices=wrapper_choices, unloaded=unloaded,
                   grad_reducer=grad_reducer)
        inst._barrier_group = _barrier_group()
        inst._hooks = [*install_state_hooks(model, inst._live, inst._mark_loaded,
                                            inst._enter_collective),
                       *install_optimizer_hooks(inst._live, inst._bucketed,
                                                inst._enter_collective),
                       *inst.mode.install_optimizer_checks(inst._live),
                       *inst.mode.keep_hooks_through_moves(model),
                       *inst.mode.watch_outside_boundaries(model, plan, mesh),
                       install_ddp_guard(model, plan, mesh, bucketed=tuple(inst._bucketed)),
                       *filter(None, [install_first_forward_checks(
                           model, mesh, plan.model_parallel_dims,
                           lambda: inst.collective_timeout_s)]),
                       keep_non_persistent_buffers(model)]  # to_empty() keeps rotary values
        if any(p.placement.mesh_dims for p in plan.params):  # torch's clip_grad_norm_ on shards
            inst._hooks.append(guard_torch_clipping(inst._live, inst._check_grads))
            inst._hooks.append(guard_grad_scaler(inst._live))  # and GradScaler's inf check
        return inst

    def _mark_loaded(self, fqns: set[str]) -> None:
        """``model.load_state_dict`` wrote these FQNs (a tied name counts for its owner)."""
        owners = {p.fqn: p.tied_to or p.fqn for p in self.plan.params}
        self._unloaded -= {owners.get(f, f) for f in fqns}

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
        adapters = {a.target: a.mode for a in self.plan.adapters}

        def what(r: RewriteRecord) -> str:
            if r.kind == "method" and r.fqn in adapters:
                return f"adapter {adapters[r.fqn]}"
            if r.kind == "function":
                return f"adapter {adapters[r.what]} {r.what}" if r.what in adapters else r.what
            return r.what if r.kind in ("forward", "method") else f"{r.kind} {r.what}"

        rows = [StatusRow(fqn=r.fqn, what=what(r), state=r.state, error=r.error)
                for r in self._rewritten.records]
        loss = self.plan.loss_parallel
        if loss is not None:
            how = ("the model's labels= loss runs on them; a call without labels gets the full "
                   "logits" if loss.kind == "model" else
                   "compute the loss with hyperrecipe.vocab_parallel_cross_entropy")
            rows.append(StatusRow(
                fqn=loss.boundary, what="loss on vocab shards",
                state="restored" if self.restored else "installed",
                note=f"its logits are this rank's {loss.local_vocab} of {loss.vocab} vocab entries "
                     f"over {loss.mesh_dim} and refuse torch ops; {how}"))
        rows.extend(StatusRow(fqn=c.fqn, what=f"inner wrapper {c.wrapper}",
                              state=c.state if not self.restored or c.state != "installed"
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

    def _own(self) -> list[ParamPlan]:
        return [p for p in self.plan.params if p.tied_to is None]

    def full_state_dict(self) -> dict[str, Tensor]:
        """FQN → full tensor for every parameter (tied names included) and buffer (a
        collective: call on every rank)."""
        self._check_live()
        self._enter_collective("full_state_dict")
        full = {p.fqn: self._live.full_of(p, self._live.param(p)) for p in self._own()}
        out: dict[str, Tensor] = {}
        for p in self.plan.params:
            out[p.fqn] = full[p.tied_to or p.fqn]
        for name, buf in self.model.named_buffers():
            out[name] = buf.detach().clone()
        return out

    def full_grads(self) -> dict[str, Tensor]:
        """FQN → full gradient, for parameters that have one (tied names included)."""
        self._check_grads("full_grads")
        grads: dict[str, Tensor] = {}
        for p in self._own():
            g = self._live.param(p).grad
            if g is not None:
                grads[p.fqn] = self._live.full_of(p, g)
        for p in self.plan.params:
            if p.tied_to is not None and p.tied_to in grads:
                grads[p.fqn] = grads[p.tied_to]
        return grads

    def grad_norm(self, norm_type: float = 2.0, *, foreach: bool | None = None) -> Tensor:
        """The norm of the model's full gradients, the same on every rank and equal to what
        ``torch.nn.utils.get_total_norm`` returns for the unsharded model in one process, in
        both modes (a collective: call on every rank).

        Each parameter's layout is read from the plan (and from ``fully_shard``'s split when a
        data-parallel wrapper holds it): each rank sums ``|g|^p`` of its pieces, the sums are
        all-reduced over the mesh dims that split them (max for ``inf``), and a replicated
        parameter counts once. Parameters without a gradient are skipped, tied ones counted
        once. torch's own ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` sees
        only this rank's shards in production mode; while this installation lives it is handed
        this norm instead (``runtime/grads/torch_clip_guard.py``; docs/training.md, "torch's
        own clip_grad_norm_ on shards").

        Args:
            norm_type: ``p`` of the p-norm (positive), or ``float("inf")`` / ``-inf``.
            foreach: use the ``torch._foreach_norm`` kernels (default: on CUDA).

        Returns:
            A float32 scalar tensor on the gradients' device.

        Raises:
            PlanMismatchError: a parameter with a gradient is not in the plan (added after
                apply), a gradient is partial, or its layout is neither the plan's nor a
                data-parallel wrapper's; a plan's gradient buckets lost to ``fully_shard``.
            ValueError: ``norm_type`` is not positive or ±inf.
        """
        self._check_grads("grad_norm")
        return total_grad_norm(self._live, norm_type, foreach)

    def grad_norms(self, norm_type: float = 2.0, *,
                   foreach: bool | None = None) -> dict[str, Tensor]:
        """Each parameter's full gradient norm, FQN → float32 scalar: what
        ``param.grad.norm(norm_type)`` gives on the unsharded model in one process, on every
        rank, in both modes (a collective: call on every rank). On production shards
        ``param.grad.norm()`` is this rank's shard's norm; Lightning's
        ``lightning.pytorch.utilities.grad_norm`` reads exactly that
        (``hyperrecipe.trainers.lightning.grad_norm`` reads this instead).

        Parameters without a gradient are left out; tied ones appear once, under the owner's
        FQN.

        Raises:
            PlanMismatchError, ValueError: as :meth:`grad_norm`.
        """
        self._check_grads("grad_norms")
        return per_parameter_grad_norms(self._live, norm_type, foreach)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the applied model, right in both modes: every
        gradient is scaled in place by ``max_norm / (norm + 1e-6)`` (when below 1), with the
        norm of :meth:`grad_norm`, so every rank clips by the same coefficient as one process
        would (a collective: call on every rank, where torch's call would be).

        Returns:
            The total norm before clipping (float32), the same on every rank.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
            PlanMismatchError, ValueError: as :meth:`grad_norm`.

        Example::

            loss.backward()
            norm = inst.clip_grad_norm_(1.0)   # not torch.nn.utils.clip_grad_norm_
            opt.step(); opt.zero_grad()
        """
        self._check_grads("clip_grad_norm_")
        return clip_grads_by_norm(self._live, max_norm, norm_type, error_if_nonfinite, foreach)

    def _check_grads(self, what: str) -> None:
        self._check_live()
        why = replaced_bucket_params(self._live, self._bucketed)
        if why is not None:
            raise PlanMismatchError(f"{what}(): {why}")

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy full tensors in; each rank keeps its own shard.

        Raises:
            PlanMismatchError: a parameter is missing or has the wrong shape; tied names hold
                different values.
        """
        self._check_live()
        why = differing_ties(self.plan, state_dict)
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
                    target.copy_(local_shard(full, p.placement, self.mesh, self.plan.mesh_dims))
            self._unloaded.discard(p.fqn)
        for name, buf in self.model.named_buffers():
            if name in state_dict:
                with torch.no_grad():
                    buf.copy_(state_dict[name])
                self._unloaded.discard(name)

    def load_weights(self, source: str | os.PathLike[str], *,
                     ignore_unexpected: Sequence[str] = ()) -> None:
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

        Before any rank reads, the ranks compare a digest of what each is about to read, and
        a folder that ``save_pretrained`` wrote is checked against its manifest (sizes, and
        sha256, each rank hashing its share): all ranks load, or all raise. The first strategy
        that can read the source is the only one tried; DCP metadata is read without running
        code (docs/security.md, "Checkpoints").

        Raises:
            WeightLoadError: the checkpoint does not fit (every missing, unexpected and
                mis-shaped tensor named, with its file; tied names holding different values),
                cannot be read, differs between ranks or from its manifest, or is refused (a
                FIFO, a path out of the folder, a pickle naming code); the model is left as it
                was before the call.
        """
        self._check_live()
        try:
            self._agree_on_source(source, "load_weights")
            attempts = load_weights(self._live, self.model, source, self._unloaded,
                                    tuple(ignore_unexpected), self._agree_on_outcome)
        except WeightLoadError as exc:
            self._loads = [LoadAttempt(strategy="*", source=str(source), state="failed",
                                       detail=str(exc))]
            raise
        self._loads = attempts

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

            dcp.save(inst.state_dict(opt), checkpoint_id=f"ckpt/{step}")
            # resume, on any mesh, reading the folder as data (torch's own reader unpickles
            # its .metadata); inst.save_checkpoint / inst.load_checkpoint do both with a
            # commit record:
            state = inst.state_dict(opt)
            dcp.load(state, storage_reader=trusted_reader("ckpt/100"))
            inst.load_state_dict(state, opt)

        Raises:
            PlanMismatchError: another rank did not call it within ``collective_timeout_s``
                (a lone ``dcp.save(inst.state_dict())`` would wait in DCP's collectives for
                the process group's timeout instead).
        """
        self._check_live()
        self._enter_collective("state_dict", _DCP_WHY, "each rank saves its own shards")
        own = {p.fqn: self._live.stored(p) for p in self._own()}
        model: dict[str, Any] = {p.fqn: own[p.tied_to or p.fqn] for p in self.plan.params}
        for name, buf in persistent_buffers(self.model):
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

    def load_checkpoint(self, folder: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume from a DCP folder written by ``dcp.save(inst.state_dict(optimizer))``, on any
        mesh: ``dcp.load`` into :meth:`state_dict` then :meth:`load_state_dict`, reading the
        folder as data (call on every rank).

        torch's own ``dcp.load`` unpickles ``.metadata`` and non-tensor entries with plain
        ``pickle``, so a folder someone else wrote can run code; this reads them through an
        allow-list (docs/security.md, "Checkpoints"). A trainer that calls ``dcp.load`` itself
        gets the same by passing ``storage_reader=hyperrecipe.runtime.state.dcp_reader.
        trusted_reader(folder)``.

        Raises:
            WeightLoadError: the folder is refused (a global outside DCP's metadata classes,
                non-tensor entries that are not plain data, storage files missing, truncated,
                not regular or outside the folder) or a rank failed reading it; nothing was
                written.
            PlanMismatchError: see :meth:`load_state_dict`.
        """
        from hyperrecipe.runtime.state.dcp_reader import trusted_dcp_load

        self._check_live()
        self._agree_on_source(folder, "load_checkpoint")
        state = self.state_dict(optimizer)
        staged = _staged(state)
        trusted_dcp_load(staged, folder, agree=self._agree)
        load_training_state(self._live, staged, optimizer, self._unloaded)

    def save_checkpoint(self, folder: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """``dcp.save(inst.state_dict(optimizer), checkpoint_id=folder)`` that marks the folder
        committed only when the save finished (call on every rank): a save that dies halfway
        (a full disk, a killed rank) leaves a folder that :meth:`load_checkpoint` and
        :meth:`load_weights` refuse instead of loading a mix of two saves, and a folder
        written again after its commit by a plain ``dcp.save`` is refused too.

        Raises:
            ExportError: ``dcp.save`` failed on a rank.
        """
        from hyperrecipe.runtime.state.dcp_reader import committed_dcp_save

        self._check_live()
        rank = dist.get_rank() if dist.is_initialized() else 0
        committed_dcp_save(self.state_dict(optimizer), folder, rank)

    def _agree(self, error: str | None, what: str) -> dict[int, str]:
        """Every rank's outcome of ``what`` (bounded by ``collective_timeout_s``)."""
        from hyperrecipe.runtime.preflight.agreement import agree_on_failure

        return agree_on_failure(error, what, self.collective_timeout_s)

    def _agree_on_outcome(self, error: str | None) -> dict[int, str]:
        """Every rank's outcome of a step of ``load_weights`` (bounded by
        ``collective_timeout_s``): a rank whose copy failed while the others finished must
        not leave them training on a model it does not hold."""
        from hyperrecipe.runtime.preflight.agreement import agree_on_failure

        return agree_on_failure(error, "the agreement in load_weights",
                                self.collective_timeout_s)

    def _agree_on_source(self, source: str | os.PathLike[str], what: str) -> None:
        """Every rank compares a digest of what it is about to read (``source_digest``) in
        one bounded exchange before any rank loads: ranks handed different checkpoints (or one
        a truncated copy) would otherwise each load their own and train on a mixture."""
        from hyperrecipe.runtime.preflight.agreement import agree_on_digest

        error: WeightLoadError | None = None
        digest: str | None = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            digest = source_digest(source)
            verify_manifest(source, rank, world)  # each rank hashes its share of the files
        except WeightLoadError as exc:
            error, digest = exc, None
        failed, differ = agree_on_digest(digest, f"the agreement before {what}")
        if error is not None:
            raise error
        if failed:
            raise WeightLoadError(f"rank {rank}: {what}({os.fspath(source)!r}) cannot read the "
                                  f"checkpoint on rank(s) {failed} (see their errors); no rank "
                                  f"loaded")
        if differ:
            assert digest is not None
            raise WeightLoadError(
                f"ranks read different checkpoints: this rank (rank {rank}) reads "
                f"{os.fspath(source)!r} (digest {digest[:12]}), rank(s) {differ} read other "
                f"contents (another checkpoint or step, or a truncated or partial copy); every "
                f"rank must {what} the same checkpoint; no rank loaded")

    def save_pretrained(self, folder: str | os.PathLike[str], *,
                        max_shard_bytes: int = 5 * 2**30, writer_rank: int = 0) -> None:
        """Write consolidated safetensors that ``from_pretrained`` loads (call on every rank).

        Each tensor is gathered in turn (a collective) and streamed by ``writer_rank`` into its
        file, so the extra memory is about one full tensor; files are split at
        ``max_shard_bytes`` with an index; the model's ``config`` is saved beside them. The model
        stays applied and keeps training. Tied parameters are written once, under their owner's
        name, as ``save_pretrained`` does.

        The files replace an earlier export in ``folder`` whole or not at all: they are
        written under temporary names and renamed into place once every rank got through, an
        earlier export's other files are removed, and ``hyperrecipe.manifest.json`` (each
        file's size and digest, xxh3_128 where ``xxhash`` is installed) is written last.

        Raises:
            PlanMismatchError: another rank did not call it (within ``collective_timeout_s``),
                instead of hanging until the process group's watchdog.
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
                     for name, buf in persistent_buffers(self.model))
        rank = dist.get_rank() if dist.is_initialized() else 0
        write_safetensors(folder, items, writer=rank == writer_rank,
                          max_shard_bytes=max_shard_bytes, model=self.model,
                          timeout_s=self.collective_timeout_s)

    collective_timeout_s: float = 60.0
    """How long a gathering call waits for every rank to enter it before refusing, and how long
    ``save_pretrained`` waits for a peer in any one gather (or the final agreement) before
    raising ``ExportAbortedError``."""

    def _enter_collective(self, what: str, why: str = "",
                          advice: str = "only one rank writes") -> None:
        """Every rank must call gathering methods; one that does not would leave the others
        waiting in the gather (or in DCP's exchanges) until the watchdog (minutes, then an
        opaque error). Every rank that called fails within ``collective_timeout_s`` instead,
        naming the missing ranks (:func:`every_rank_entered`)."""
        if self._barrier_group is None:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        label = what if "." in what else f"Installation.{what}"
        why_not = every_rank_entered(_get_default_store(), label, dist.get_rank(),
                                     dist.get_world_size(), self.collective_timeout_s)
        if why_not is not None:
            msg = (f"{label}() is a collective{why}: every rank must call it (rank "
                   f"{dist.get_rank()} waited {self.collective_timeout_s:g} s: {why_not}). Call "
                   f"it on every rank; {advice}")
            raise PlanMismatchError(msg)

    def data_parallel(self, group: Any, module: nn.Module | None = None,
                      **ddp_kwargs: Any) -> nn.Module:
        """``DistributedDataParallel`` over ``group``, a data dim of the mesh (ranks that hold
        the same shards), the way this plan's gradients need it. Use it instead of wrapping
        DDP yourself; the trainer integrations do.

        A plan that reduces some gradients over its model-parallel dims in buckets (production
        mode: sequence-parallel norms, ``reduce_grads``) cannot let DDP average those: DDP
        copies each gradient as it accumulates, before the bucket's reduction, and writes its
        average back over the reduced value (a sequence-parallel norm's gradient came out
        27-89 % off). So those parameters are left out of DDP (torch's
        ``_set_params_and_buffers_to_ignore_for_model``), the buckets average them over
        ``group`` after their own reduction, and their values are broadcast from ``group``'s
        first rank, as DDP broadcasts the others. Any other DDP over such a plan is refused at
        its first forward.

        Args:
            group: the data-parallel process group (``mesh.get_group("dp")``).
            module: what DDP wraps, when it is not the applied model itself (accelerate's
                prepared model); the applied model must be it or inside it.
            ddp_kwargs: passed to ``DistributedDataParallel``.

        Returns:
            The ``DistributedDataParallel`` module.

        Raises:
            UsageError: ``module`` does not hold the applied model.
        """
        from torch.nn.parallel import DistributedDataParallel

        from hyperrecipe.errors import UsageError

        wrapped = self.model if module is None else module
        prefix = next((f"{name}." if name else "" for name, m in wrapped.named_modules()
                       if m is self.model), None)
        if prefix is None:
            msg = (f"Installation.data_parallel: module ({type(wrapped).__name__}) does not hold "
                   f"the applied model ({type(self.model).__name__}); pass the module DDP "
                   f"wraps, with the applied model inside it")
            raise UsageError(msg)
        reducer = self._grad_reducer
        if reducer is not None and reducer.buckets and dist.get_world_size(group) > 1:
            mine = {id(p) for p in reducer.params}
            names = [prefix + fqn for fqn, p in self.model.named_parameters()
                     if id(p) in mine]
            ignored = set(getattr(wrapped, "_ddp_params_and_buffers_to_ignore", ()))
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
                wrapped, sorted(ignored | set(names)))
            first = dist.get_global_rank(group, 0)
            with torch.no_grad():
                for param in reducer.params:
                    dist.broadcast(param.data, src=first, group=group)
            reducer.average_over(group)
        ddp = DistributedDataParallel(wrapped, process_group=group, **ddp_kwargs)
        ddp._hyperrecipe_data_parallel = True  # type: ignore[assignment]
        return ddp

    def leave_together(self, what: str) -> None:
        """Return once every rank reached the end of ``what`` (a training loop's end), waiting
        at most ``collective_timeout_s``; a rank that does not arrive is warned about, not
        raised on (this rank's work is done). Call it on every rank before
        ``dist.destroy_process_group()``; the trainer integrations do.

        Why (torch's, found with a core dump): a group that outlives ``destroy_process_group``
        (a ``DeviceMesh``, an installation or a trainer still refers to it) keeps its gloo
        worker threads into interpreter teardown. A worker drops its last reference to a
        finished collective a moment after the caller's ``wait()`` returned; when the work's
        tensors belong to Python objects the caller already dropped, that drop takes the GIL,
        and once the interpreter is finalizing CPython ends such a thread with
        ``pthread_exit``, whose forced unwind through a C++ destructor is ``std::terminate``.
        The rank that leaves first is the one that aborts. Waiting here, through the store
        with the GIL released, gives the workers the moment they need. Not a barrier: with a
        ``dist.barrier()`` before ``destroy_process_group`` the early rank still aborted in 2
        of 22 runs of the reproduction, with this meeting in none of 20.
        """
        import warnings

        if not dist.is_initialized() or dist.get_world_size() == 1 \
                or dist.get_backend() == "fake":
            return
        from torch.distributed.distributed_c10d import _get_default_store

        why_not = every_rank_entered(_get_default_store(), what, dist.get_rank(),
                                     dist.get_world_size(), self.collective_timeout_s)
        if why_not is not None:
            warnings.warn(f"{what}: the ranks did not leave together ({why_not}); a rank that "
                          "failed says why", RuntimeWarning, stacklevel=2)

    def restore(self) -> None:
        """Put the original forwards back and full parameters in place of the shards
        (gathered: call on every rank), and restore rewritten attributes."""
        self._rewritten.restore()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def restored(self) -> bool:
        return self._rewritten.restored

    def _check_live(self) -> None:
        if self._rewritten.restored:
            raise PlanMismatchError("this installation was restored; its shards are gone")


_DCP_WHY = (" (so are dcp.save and dcp.load of what it returns, which would otherwise wait "
            "for the process group's timeout)")


def _staged(state: Any) -> Any:
    """``state`` with every tensor cloned: ``dcp.load`` writes into what it is given, and the
    state dict shares the live shards, so a load that fails halfway would leave a mixture."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, state)
