"""The state front of a pipelined model: ``pipe.state``, the pipelined twin of ``inst.state``.

A pipelined rank's state is the union of its stage models' states. Each stage model is given a
:class:`~hyperrecipe.runtime.state.front.TrainingState` of its own: the one of its
``Installation`` where it has one (pipeline x tensor parallel: its parameters are then
DTensors or shards, and the installation's state knows their placements), otherwise one built
here over the stage model and the part of the plan it owns. Everything below goes through
those fronts and the state room's shared code (DCP's committed save with its commit record and
fingerprints, the folder lock, the trusted DCP reader, the loaders' strategies, the export's
atomic switch and manifest), so the pipeline adds only what spans stages:

- a weight tied across stages (GPT-2's ``transformer.wte.weight`` on stage 0 and
  ``lm_head.weight`` on the last) is stored under both names, one per holding rank, with one
  value; its optimizer state under the name the unpipelined model's optimizer state uses (the
  tie's first name), so checkpoints move between pipeline sizes and to ``pp=1``;
- the optimizer state is torch's flattened layout (``state.<fqn>.<key>``,
  ``param_groups.<fqn>.<key>``: ``StateDictOptions(flatten_optimizer_state_dict=True)``), in
  which every key belongs to one parameter, so ranks holding different stages never write
  different values under one key;
- the export gathers each tensor from its owning pipeline rank to the writer, in the
  unpipelined model's order, into one consolidated checkpoint.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ParamPlan, PipelinePlan, Plan
from hyperrecipe.runtime.preflight.agreement import EntryCheck
from hyperrecipe.runtime.state.checkpoint import init_optimizer_state
from hyperrecipe.runtime.state.export import ExportItem, write_safetensors
from hyperrecipe.runtime.state.front import StatusRow, TrainingState
from hyperrecipe.runtime.state.live_params import LiveParams
from hyperrecipe.runtime.state.weights import persistent_buffers

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.rewriter import Rewritten

__all__ = ["PipelineState", "stage_plan"]

_TIMEOUT_S = 60.0
"""``collective_timeout_s`` of the stage fronts built here (an Installation's own applies to
the stages that have one)."""


_FRONTS: weakref.WeakKeyDictionary[object, PipelineState] = weakref.WeakKeyDictionary()


def stage_plan(plan: Plan, owned: Sequence[str]) -> Plan:
    """The plan restricted to one stage's parameters ``owned``, as a front over the stage model
    reads it. A tie whose first name lives on another stage becomes a tie the other way round:
    the stage's copy (``lm_head.weight``) owns it, and the other names stay as its aliases, so
    the stage loads from whichever name a checkpoint holds and stores under both."""
    mine = set(owned)
    by_fqn = {p.fqn: p for p in plan.params}
    params: list[ParamPlan] = []
    for p in plan.params:
        owner = p.tied_to or p.fqn
        if p.fqn in mine:
            tied = owner if owner != p.fqn and owner in mine else None
            params.append(attrs.evolve(p, tied_to=tied))
        elif owner in mine or (p.tied_to is None and any(
                q.tied_to == p.fqn and q.fqn in mine for q in plan.params)):
            holder = owner if owner in mine else next(q.fqn for q in plan.params
                                                      if q.tied_to == p.fqn and q.fqn in mine)
            params.append(attrs.evolve(by_fqn[p.fqn], tied_to=holder))
    pipeline = plan.pipeline
    mesh = tuple(d for d in plan.mesh if pipeline is None or d.name == pipeline.mesh_dim)
    return attrs.evolve(plan, params=tuple(params), mesh=mesh)


def _canonical(plan: Plan) -> dict[str, str]:
    """Each parameter FQN → the name the unpipelined model's optimizer state uses for it."""
    return {p.fqn: p.tied_to or p.fqn for p in plan.params}


class PipelineState:
    """State in and out of a pipelined rank (``pipe.state``): state dicts, weights,
    checkpoints and export, over every stage model this rank holds.

    Every method is a collective over the whole world (every rank of every stage calls it);
    the entry check refuses one called on one rank only within ``collective_timeout_s``.
    """

    def __init__(self, *, models: Sequence[nn.Module], stage_params: Sequence[Sequence[str]],
                 plan: Plan, mesh: DeviceMesh, group: Any, rewritten: Rewritten,
                 installations: Sequence[Any | None] = ()) -> None:
        self._models = tuple(models)
        self._plan = plan
        pipeline = plan.pipeline
        assert pipeline is not None
        self._pipeline: PipelinePlan = pipeline
        self._mesh = mesh
        self._group = group
        self._canonical = _canonical(plan)
        insts = list(installations) + [None] * (len(self._models) - len(installations))
        self.collective_timeout_s = _TIMEOUT_S
        enter = EntryCheck.for_world(lambda: self.collective_timeout_s)
        self._fronts: list[TrainingState] = []
        self._owned: list[frozenset[str]] = []
        self._installed: list[bool] = []
        for model, owned, inst in zip(self._models, stage_params, insts, strict=True):
            self._owned.append(frozenset(owned))
            self._installed.append(inst is not None)
            if inst is not None:  # pp x tp: the stage's own installation knows its shards
                self._fronts.append(inst.state)
                continue
            sub = stage_plan(plan, owned)
            live = LiveParams(model, sub, mesh, "production")
            self._fronts.append(TrainingState(
                model=model, plan=sub, mesh=mesh, live=live, rewritten=rewritten, enter=enter,
                timeout_s=lambda: self.collective_timeout_s))

    @classmethod
    def of(cls, pipe: object, *, plan: Plan, modules: Sequence[Any], group: Any,
           device: torch.device, rewritten: Rewritten,
           installations: Sequence[Any] = ()) -> PipelineState:
        """``pipe``'s front, made on first use. ``modules`` are its stage modules (``.model``,
        ``.index``); ``installations`` (pipeline beside tensor parallel: the Installation of
        ``apply`` on each stage model, in the same order) are the stages' fronts."""
        front = _FRONTS.get(pipe)
        if front is None:
            from torch.distributed.device_mesh import DeviceMesh

            pipeline = plan.pipeline
            assert pipeline is not None
            mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=(pipeline.mesh_dim,))
            front = cls(models=[m.model for m in modules],
                        stage_params=[pipeline.stages[m.index].params for m in modules],
                        plan=plan, mesh=mesh, group=group, rewritten=rewritten,
                        installations=list(installations))
            _FRONTS[pipe] = front
        return front

    @property
    def fronts(self) -> tuple[TrainingState, ...]:
        """The state front of each stage model this rank holds, in stage order."""
        return tuple(self._fronts)

    def status(self) -> list[StatusRow]:
        """``inst.state.status()`` of every stage model this rank holds, in stage order (a row
        the stages share, such as the pipeline's own rewrite, once): what each install did,
        which weight-loading strategy loaded each stage, and the tensors with no value yet.
        Local: no collective."""
        rows: list[StatusRow] = []
        seen: set[StatusRow] = set()
        for front in self._fronts:
            for row in front.status():
                if row not in seen:
                    seen.add(row)
                    rows.append(row)
        return rows

    def _front_of(self, fqn: str) -> TrainingState | None:
        """The installation front (pp x tp) that owns parameter ``fqn`` on this rank, or
        ``None`` where the stage has none (pipeline parallelism alone)."""
        for front, owned, installed in zip(self._fronts, self._owned, self._installed,
                                           strict=True):
            if installed and fqn in owned:
                return front
        return None

    # -- state dicts -----------------------------------------------------------------------

    def _named_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for model in self._models:
            for fqn, p in model.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield fqn, p

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """``{"model": {fqn: DTensor}, "optimizer": {flat key: value}}`` for
        ``torch.distributed.checkpoint`` (collective): the model part is the union of the stage
        fronts' ``state_dict()["model"]`` (a tied weight's names all present on each holder),
        the optimizer part torch's flattened layout keyed by the unpipelined model's names."""
        model: dict[str, Any] = {}
        for front in self._fronts:
            model.update(front.state_dict()["model"])
        out: dict[str, Any] = {"model": model}
        if optimizer is not None:
            out["optimizer"] = self._optimizer_state(optimizer)
        return out

    def _optimizer_names(self, optimizer: torch.optim.Optimizer
                         ) -> list[list[tuple[str, str]]]:
        """Per group, each parameter's (name on this rank, name in the optimizer state)."""
        names = {id(p): (fqn, self._canonical.get(fqn, fqn)) for fqn, p in self._named_params()}
        groups: list[list[tuple[str, str]]] = []
        for group in optimizer.param_groups:
            row = []
            for p in group["params"]:
                if id(p) not in names:
                    msg = ("the optimizer holds a parameter that is not one of this rank's "
                           "stage parameters; build it from pipe.parameters()")
                    raise PlanMismatchError(msg)
                row.append(names[id(p)])
            groups.append(row)
        return groups

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        groups = self._optimizer_names(optimizer)
        init_optimizer_state(optimizer)
        flat: dict[str, Any] = {}
        for group, names in zip(optimizer.param_groups, groups, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p, (local, fqn) in zip(group["params"], names, strict=True):
                front = self._front_of(local)
                for key, value in optimizer.state.get(p, {}).items():
                    flat[f"state.{fqn}.{key}"] = (self._as_stored(fqn, value) if front is None
                                                  else front.optimizer_value(local, value))
                for key, value in hyper.items():
                    flat[f"param_groups.{fqn}.{key}"] = value
        return flat

    def _as_stored(self, fqn: str, value: Any) -> Any:
        """An optimizer state tensor as DCP stores it: a parameter-shaped plain tensor becomes
        a replicated DTensor like its parameter (pipeline parallelism alone)."""
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(value, Tensor) and value.dim() > 0 and not isinstance(value, DTensor):
            return DTensor.from_local(value.detach(), self._mesh,
                                      tuple(Replicate() for _ in range(self._mesh.ndim)),
                                      run_check=False)
        return value

    def load_state_dict(self, state: Mapping[str, Any],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put back a :meth:`state_dict` (after ``dcp.load``, or full tensors, as saved at any
        pipeline size or by plain ``get_state_dict(model, opt, options=StateDictOptions(
        flatten_optimizer_state_dict=True))`` on one process); collective.

        Raises:
            PlanMismatchError: a parameter or an optimizer entry is missing or has another
                shape; nothing was written then.
        """
        model = state.get("model")
        if not isinstance(model, Mapping):
            raise PlanMismatchError("load_state_dict: the state has no 'model' entry")
        to_load = None
        if optimizer is not None:
            if not isinstance(state.get("optimizer"), Mapping):
                raise PlanMismatchError("load_state_dict: an optimizer was given but the "
                                        "state holds none")
            to_load = self._optimizer_to_load(optimizer, state["optimizer"])
        for front in self._fronts:
            front.load_state_dict({"model": model})
        if to_load is not None:
            optimizer.load_state_dict(to_load)  # type: ignore[union-attr]

    def _optimizer_to_load(self, optimizer: torch.optim.Optimizer,
                           flat: Mapping[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        groups = self._optimizer_names(optimizer)
        init_optimizer_state(optimizer)
        out_state: dict[int, dict[str, Any]] = {}
        out_groups: list[dict[str, Any]] = []
        index = 0
        for group, names in zip(optimizer.param_groups, groups, strict=True):
            numbers = []
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p, (local, fqn) in zip(group["params"], names, strict=True):
                front = self._front_of(local)
                entry: dict[str, Any] = {}
                for key, mine in optimizer.state.get(p, {}).items():
                    name = f"state.{fqn}.{key}"
                    if name not in flat:
                        raise PlanMismatchError(f"load_state_dict: the optimizer state has no "
                                                f"{name!r}")
                    value = flat[name]
                    if front is not None:  # pp x tp: the rank's shard, as the stage holds it
                        value = front.optimizer_value_to_load(local, value)
                    elif isinstance(value, DTensor) and not isinstance(mine, DTensor):
                        value = value.full_tensor()
                    if isinstance(value, Tensor) and isinstance(mine, Tensor) \
                            and value.shape != mine.shape:
                        raise PlanMismatchError(f"load_state_dict: {name!r} has shape "
                                                f"{list(value.shape)}, the optimizer's "
                                                f"{list(mine.shape)}")
                    entry[key] = value
                out_state[index] = entry
                for key in hyper:
                    name = f"param_groups.{fqn}.{key}"
                    if name in flat:
                        hyper[key] = flat[name]
                numbers.append(index)
                index += 1
            out_groups.append({**hyper, "params": numbers})
        return {"state": out_state, "param_groups": out_groups}

    # -- DCP checkpoints -------------------------------------------------------------------

    def save_checkpoint(self, folder: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """:meth:`state_dict` saved with ``dcp.save`` and committed as
        ``inst.state.save_checkpoint`` commits (staging folder, fingerprints and commit record,
        atomic switch, one writer per folder, bounded waits); each rank writes only its stages'
        tensors (call on every rank). Loadable at another pipeline size, at ``pp=1`` by
        ``inst.state.load_checkpoint`` or plain ``dcp.load`` of a model's state dict."""
        self._fronts[0].committed_save(self.state_dict(optimizer), folder)

    def load_checkpoint(self, folder: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume from a DCP folder saved at any pipeline size (or at ``pp=1`` by
        ``inst.state.save_checkpoint`` / ``dcp.save`` of a model and flattened optimizer state
        dict), reading it as data, as ``inst.state.load_checkpoint`` does (call on every
        rank). Nothing is written unless every rank read its part."""
        state = self.state_dict(optimizer)
        staged = self._fronts[0].trusted_load(state, folder)
        self.load_state_dict(staged, optimizer)

    # -- weights and export ----------------------------------------------------------------

    def load_weights(self, source: str | os.PathLike[str], *,
                     ignore_unexpected: Sequence[str] = ()) -> None:
        """Load a transformers checkpoint (safetensors file or folder, or a DCP folder), each
        stage reading only its own tensors through its front's ``load_weights`` (the other
        stages' keys are expected and skipped unread); call on every rank."""
        every = {name for p in self._plan.params for name in (p.fqn,)}
        pipeline = self._plan.pipeline
        assert pipeline is not None
        for front, owned in zip(self._fronts, self._owned, strict=True):
            mine = {p.fqn for p in front._plan.params} | owned  # noqa: SLF001
            # a copy of a weight tied across stages may be stored under another stage's name
            aliases = {f: tuple(o for o in tie.params if o != f)
                       for tie in pipeline.tied for f in tie.params if f in mine}
            readable = mine | {o for names in aliases.values() for o in names}
            others = sorted(every - readable)
            pattern = ("^(?:" + "|".join(re.escape(k) for k in others) + ")$") if others else None
            front.load_weights(source, ignore_unexpected=[*ignore_unexpected,
                                                          *([pattern] if pattern else [])],
                               aliases=aliases)

    def save_pretrained(self, folder: str | os.PathLike[str], *,
                        max_shard_bytes: int = 5 * 2**30, writer_rank: int = 0) -> None:
        """One consolidated transformers checkpoint of the whole model (call on every rank):
        each tensor is sent by its pipeline rank to ``writer_rank``, which streams it into the
        files; written and switched in whole with a manifest, as ``inst.state.save_pretrained``
        does. A tied weight is written once, under its first name.

        Raises:
            PlanMismatchError: another rank did not call it within ``collective_timeout_s``.
            ExportError / ExportAbortedError / FolderLockedError: as
                ``inst.state.save_pretrained``.
        """
        front = self._fronts[0]
        front.enter_collective("save_pretrained")
        rank = dist.get_rank() if dist.is_initialized() else 0
        ranks = dist.get_process_group_ranks(self._group)
        mine = self._sources()
        table: list[Any] = [None] * len(ranks)
        dist.all_gather_object(table, {k: m for k, (m, _) in mine.items()}, group=self._group)
        owner: dict[str, int] = {}
        meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for pp_rank, held in enumerate(table):
            for name, m in held.items():
                owner.setdefault(name, pp_rank)
                meta.setdefault(name, m)
        me = dist.get_group_rank(self._group, rank)
        order = [p.fqn for p in self._plan.params if p.tied_to is None]
        order += sorted(n for n in meta if n not in set(order))
        involved = writer_rank in ranks
        items = [ExportItem(name=name, dtype=getattr(torch, meta[name][0].split(".")[-1]),
                            shape=meta[name][1],
                            gather=self._gather(mine[name][1] if owner[name] == me else None,
                                                ranks[owner[name]], writer_rank, rank,
                                                involved, meta[name]))
                 for name in order if name in meta]
        model = self._models[0]
        with front.one_writer(folder, "save_pretrained", holder=rank == writer_rank):
            write_safetensors(folder, items, writer=rank == writer_rank,
                              max_shard_bytes=max_shard_bytes, model=model,
                              timeout_s=self.collective_timeout_s)

    def _sources(self) -> dict[str, tuple[tuple[str, tuple[int, ...]], Callable[[], Tensor]]]:
        """This rank's tensors the export writes, under the unpipelined model's first names
        (ties once), with dtype and full shape, and how to get the full tensor: owned
        parameters and persistent buffers. Beside tensor parallel a parameter is gathered by
        its stage's installation (``inst.state.full_tensor``: a collective over the stage's
        tensor-parallel ranks, which all hold the same names), one tensor at a time."""
        out: dict[str, tuple[tuple[str, tuple[int, ...]], Callable[[], Tensor]]] = {}

        def kept(value: Tensor) -> Callable[[], Tensor]:
            return lambda: value.detach()

        def gathered(front: TrainingState, fqn: str) -> Callable[[], Tensor]:
            return lambda: front.full_tensor(fqn)

        for model, front, installed in zip(self._models, self._fronts, self._installed,
                                           strict=True):
            if installed:
                params = dict(model.named_parameters(remove_duplicate=False))
                for p in front._plan.params:  # noqa: SLF001 - the stage's own names
                    name = self._canonical.get(p.fqn, p.fqn)
                    if p.tied_to is None and name not in out:
                        dtype = str(params[p.fqn].dtype)
                        out[name] = ((dtype, tuple(p.shape)), gathered(front, p.fqn))
            else:
                seen: set[int] = set()
                for fqn, q in model.named_parameters():
                    name = self._canonical.get(fqn, fqn)
                    if id(q) not in seen and name not in out:
                        seen.add(id(q))
                        out[name] = ((str(q.dtype), tuple(q.shape)), kept(q))
        for model in self._models:
            for name, buf in persistent_buffers(model):
                if name not in out:
                    out[name] = ((str(buf.dtype), tuple(buf.shape)), kept(buf))
        return out

    @staticmethod
    def _gather(fetch: Callable[[], Tensor] | None, owner: int, writer: int, rank: int,
                involved: bool, meta: tuple[str, tuple[int, ...]]) -> Callable[[], Tensor]:
        """One item's gather: every rank of the owning stage fetches the full tensor (beside
        tensor parallel a collective among them); the owner in the writer's pipeline column
        sends it to the writer."""
        dtype = getattr(torch, meta[0].split(".")[-1])

        def gather() -> Tensor:
            value = fetch() if fetch is not None else None
            if not involved or rank not in (owner, writer):
                return torch.empty(0, dtype=dtype)
            if owner == writer:
                assert value is not None
                return value
            if rank == owner:
                assert value is not None
                dist.send(value.contiguous(), dst=writer)
                return torch.empty(0, dtype=dtype)
            out = torch.empty(meta[1], dtype=dtype, device=_device())
            dist.recv(out, src=owner)
            return out

        return gather


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    from hyperrecipe.runtime.state.checkpoint import init_optimizer_state

    init_optimizer_state(optimizer)


def _device() -> torch.device:
    """Where a receiving rank puts a tensor it is sent (NCCL needs it on the rank's GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
