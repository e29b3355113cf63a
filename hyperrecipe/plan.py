"""The frozen plan: everything ``apply`` needs, decided ahead of time, with the reasons.

A :class:`Plan` is the output of the resolver and the only input of the runtime. It is made of
``attrs`` frozen classes, serialized by one cattrs converter to deterministic JSON (sorted keys,
placements written in the recipe's own syntax), and carries a fingerprint over the recipe
content, the model structure and the mesh shape so a trainer cannot apply it to the wrong thing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from collections.abc import Callable
import types
import typing
from typing import Any, Literal, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.json import make_converter

from hyperrecipe._files import read_regular_file
from hyperrecipe.collective import CollectiveOp
from hyperrecipe.errors import PlanFormatError, check_path_arg
from hyperrecipe.placement import (
    NamedPlacement,
    Placement,
    PlacementSyntaxError,
    parse_named_text,
    parse_placement,
)

__all__ = [
    "AdapterPlan",
    "ArgLayout",
    "BoundaryPlan",
    "ExpertParallel",
    "GradBucket",
    "HeadCount",
    "LossParallel",
    "ManifestEntry",
    "MeshDim",
    "ParamPlan",
    "Plan",
    "PLAN_FORMAT",
    "PipelinePlan",
    "PipelineStagePlan",
    "PlanVerification",
    "Provenance",
    "RuleRef",
    "TiedAcrossStages",
    "Transition",
    "compute_fingerprint",
    "converter",
]

PLAN_FORMAT = 4
"""Version of the plan's JSON shape. 2: parameters record their enclosing boundary and their
DTensor placement (or why they have none); boundaries record the vocab-parallel lookup and the
expert-parallel layout, so the runtime reads these decisions instead of re-deriving them.
3: the plan records the loss on vocab shards (``loss_parallel``), and the manifest lists the
loss's collective (stage ``loss``).
4: gradient reductions are bucketed (``Plan.grad_buckets``); the manifest lists one
``param_grad`` entry per bucket and op instead of one per parameter."""
T = TypeVar("T")
Stage = Literal["input", "output", "param_grad", "loss"]
Direction = Literal["forward", "backward"]


@attrs.frozen(kw_only=True)
class Provenance:
    """Why one decision was made: the rule (file, line, column, index in its file) and how."""

    file: str
    line: int
    column: int
    rule_index: int
    reason: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        rule = f"rule {self.rule_index}" if self.rule_index >= 0 else "no rule"
        return f"{where} ({rule}): {self.reason}"


@attrs.frozen(kw_only=True)
class RuleRef:
    """A rule of the (flattened) recipe, and whether it was active for this mesh."""

    file: str
    line: int
    column: int
    index: int
    match: str
    style: str | None
    active: bool
    matched: int


@attrs.frozen(kw_only=True)
class MeshDim:
    name: str
    size: int


@attrs.frozen(kw_only=True)
class ParamPlan:
    """How one parameter is laid out, and what its gradient needs.

    ``grad_reduce`` lists the backward collectives of a replicated parameter whose gradient is
    partial: one inside a boundary whose inputs arrive sharded (a sequence-parallel norm sees
    only its rank's tokens).

    ``boundary`` is the nearest boundary enclosing the parameter's module (the module itself
    when it is one), ``None`` outside every boundary. ``dtensor`` is the parameter's DTensor
    placement, one entry per mesh dim in mesh order (``replicate``, ``shard(d)``,
    ``strided_shard(d, k)`` for ``k`` equal chunks of dim ``d`` sharded in turn, or
    ``chunk_parts(0, [S1, ...])`` for unequal chunks of an ``nn.Linear``'s output features, one
    ``Shard(0)`` DTensor per part in validate mode); it is empty, and ``no_dtensor`` says why,
    when DTensor cannot represent the shard (other unequal chunks, or a chunked dim that
    another mesh dim shards too): production mode runs such a shard, validate mode refuses it.
    """

    fqn: str
    module: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: NamedPlacement
    local_shape: tuple[int, ...]
    tied_to: str | None = None
    deferred: bool = False
    grad_reduce: tuple[CollectiveOp, ...] = ()
    boundary: str | None = None
    dtensor: tuple[str, ...] = ()
    no_dtensor: str | None = None
    provenance: tuple[Provenance, ...] = ()


@attrs.frozen(kw_only=True)
class ArgLayout:
    """The layout of one input or output of a boundary.

    ``position`` is the positional index when known (inputs: the forward's parameter order;
    outputs: the index in a tuple output), ``None`` for keyword-only arguments.

    ``grad`` is the gradient layout the recipe declared (``in_grad`` / ``out_grad``), on the
    mesh dims where the value is replicated on the side the gradient arrives at (an input's
    ``dst``, an output's ``dst``); ``None`` when it declared none and the resolver's default
    holds. Left out of the JSON when ``None``, so plans of recipes without the field are the
    bytes they were.
    """

    name: str
    position: int | None
    src: NamedPlacement
    dst: NamedPlacement
    grad: NamedPlacement | None = None


@attrs.frozen(kw_only=True)
class Transition:
    """One lowered ``src -> dst`` step over one mesh dim, with its forward and backward ops."""

    boundary: str
    stage: Stage
    name: str
    mesh_dim: str
    src: Placement
    dst: Placement
    forward: CollectiveOp
    backward: CollectiveOp
    reason: str


@attrs.frozen(kw_only=True)
class HeadCount:
    """An integer attribute of a module divided by a mesh dim while the plan is applied in
    production mode (``head_counts: {num_heads: tp}``); restored with everything else."""

    module: str
    attr: str
    mesh_dim: str
    global_value: int
    local_value: int
    provenance: Provenance


@attrs.frozen(kw_only=True)
class ExpertParallel:
    """The expert-parallel kernel of a local-region boundary (a fused experts module whose 3-D
    expert tensors are sharded on dim 0 over ``mesh_dim``).

    ``kernel``: ``"partial"`` (tokens whole on ``mesh_dim``; each rank runs its experts on every
    token and the output is partial) or ``"dispatch"`` (tokens sharded on dim 0; each travels to
    its experts' rank and back). Rank ``r`` holds experts ``[r * local_experts,
    (r + 1) * local_experts)`` of ``experts``.
    """

    mesh_dim: str
    kernel: Literal["partial", "dispatch"]
    experts: int
    local_experts: int


@attrs.frozen(kw_only=True)
class BoundaryPlan:
    """A module whose inputs and outputs are converted between declared layouts.

    ``depth`` counts enclosing boundaries (0 = outermost); the runtime wraps deepest first.
    """

    fqn: str
    module_class: str
    depth: int
    parent: str | None
    inputs: tuple[ArgLayout, ...]
    outputs: tuple[ArgLayout, ...]
    out_names: tuple[str, ...]
    defer_bias: tuple[str, ...]
    inner_wrapper: tuple[str, ...]
    """The inner wrapper, or a fallback chain of them (first eligible wins); empty for none."""
    inner_out_src: tuple[ArgLayout, ...]
    local_region: bool
    no_grad: tuple[str, ...] = ()
    """Inputs that carry no gradient: no backward collective; the runtime refuses one that
    arrives requiring grad."""
    vocab_parallel: str | None = None
    """The mesh dim of a vocab-parallel lookup: an ``nn.Embedding`` boundary whose table is
    sharded on the vocab dim; production mode runs the masked local lookup."""
    expert_parallel: ExpertParallel | None = None
    """The expert-parallel kernel of a local region, when its experts are sharded."""
    transitions: tuple[Transition, ...]
    provenance: tuple[Provenance, ...]


@attrs.frozen(kw_only=True)
class GradBucket:
    """Parameters whose gradients are reduced together: one flat collective per op.

    Every parameter with a ``grad_reduce`` is in exactly one bucket; a bucket holds parameters
    with the same ``grad_reduce`` ops and dtype, in the order their gradients are expected to
    be ready (reverse parameter order), up to a size cap (one larger parameter is a bucket of
    its own). Buckets are listed, and their collectives issued, in ``index`` order on every
    rank. ``numel`` counts the local (per-rank) elements of the flattened gradients.
    """

    index: int
    ops: tuple[CollectiveOp, ...]
    dtype: str
    params: tuple[str, ...]
    numel: int

    @property
    def name(self) -> str:
        """How the manifest names the bucket: ``grad_buckets[INDEX]``."""
        return f"grad_buckets[{self.index}]"


@attrs.frozen(kw_only=True)
class LossParallel:
    """The loss computed on vocab shards: ``loss_parallel: true`` on the ``boundary`` (an
    ``lm_head``) whose first output, the logits, leaves sharded on its last dim over
    ``mesh_dim``. Rank ``r`` holds vocab entries ``[r * local_vocab, (r + 1) * local_vocab)``.

    ``owner`` is the module whose forward calls the boundary (``""``: the root). ``kind``:

    - ``"model"``: the owner's forward takes ``labels`` and computes its own loss (transformers'
      ``ForCausalLM``); that loss runs on the shards, and a call that computes no loss (no
      labels: inference, ``generate()``) gets the logits gathered with ``gather``.
    - ``"helper"``: the caller gets the vocab-sharded logits and computes the loss with
      ``hyperrecipe.vocab_parallel_cross_entropy``.

    ``loss_op`` is the one collective of the cross entropy's forward (its backward has none).
    """

    boundary: str
    output: str
    owner: str
    kind: Literal["model", "helper"]
    mesh_dim: str
    vocab: int
    local_vocab: int
    gather: tuple[Transition, ...]
    loss_op: CollectiveOp
    provenance: Provenance


@attrs.frozen(kw_only=True)
class ManifestEntry:
    """One collective a training step issues (forward or backward), as production runs it.

    A ``param_grad`` entry is one gradient bucket's op: ``name`` is the bucket's
    (``grad_buckets[INDEX]``) and ``boundary`` the boundary enclosing all of its parameters
    (``""`` when they lie in different ones or in none)."""

    boundary: str
    stage: Stage
    name: str
    mesh_dim: str
    direction: Direction
    op: CollectiveOp


@attrs.frozen(kw_only=True)
class AdapterPlan:
    """A third-party method or function the runtime adapts to DTensor arguments (``adapters:``).

    ``target`` is ``pkg.mod:Class.method`` (a nested class is ``Outer.Inner.method``) or
    ``pkg.mod:function``; ``out_src`` (``marshal`` only) is the placement of the tensor outputs,
    ``None`` for "those of the first DTensor argument". ``within`` (functions only) lists the
    FQNs of the modules whose forward sees the replacement, resolved from the recipe's pattern.
    """

    target: str
    mode: Literal["wrap", "marshal"]
    provenance: Provenance
    out_src: NamedPlacement | None = None
    within: tuple[str, ...] = ()

    @property
    def is_function(self) -> bool:
        """A module-level function (``pkg.mod:function``), not a method."""
        return "." not in self.target.partition(":")[2]

    @property
    def module_name(self) -> str:
        """``pkg.mod`` of the target."""
        return self.target.partition(":")[0]

    @property
    def class_path(self) -> tuple[str, ...]:
        """The class's qualified name, split (``("Outer", "Inner")``)."""
        return tuple(self.target.partition(":")[2].split(".")[:-1])

    @property
    def method_name(self) -> str:
        """The method's name (a function adapter's: the function's)."""
        return self.target.partition(":")[2].rsplit(".", 1)[-1]


@attrs.frozen(kw_only=True)
class PlanVerification:
    """That one training step of the plan ran on fake tensors, in each of ``modes``, at compile
    (:mod:`hyperrecipe.verify`), and what it ran on.

    ``apply`` trusts the record only where it still describes the run at hand: the same torch
    and transformers versions and the same model structure (``model_digest``); otherwise it
    verifies again first. ``notes`` say what the step could not show (a data-dependent op that
    fake tensors cannot run stops a mode early: values are ``check``'s to verify)."""

    torch: str
    transformers: str | None
    model_digest: str
    modes: tuple[str, ...]
    ranks: tuple[int, ...]
    """The ranks whose step ran; every other rank holds the same local shapes (even shards)."""
    inputs: str
    """What the step was fed (``token ids [2, 16] < 128``, with the model's own loss)."""
    notes: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class PipelineStagePlan:
    """One pipeline stage: the layers and modules it owns and the rank that runs it.

    A stage owns ``layers[start:stop]`` of the split list plus, on the first stage, the
    parameter-holding modules before the list (``PipelinePlan.first``) and, on the last stage,
    those after it (``PipelinePlan.last``). Modules without parameters (rotary tables,
    dropout) run on every stage, so masks and positions are recomputed from the model's own
    inputs instead of being sent.
    """

    index: int
    """The global stage index (0 = takes the model's inputs; ``stages - 1`` = computes the loss)."""
    rank: int
    """The coordinate on the pipeline mesh dim of the rank that runs this stage."""
    start: int
    stop: int
    """``layers[start:stop]`` of :attr:`PipelinePlan.layers` belong to this stage."""
    modules: tuple[str, ...]
    """FQNs of the parameter-holding modules outside the split list this stage owns."""
    params: tuple[str, ...]
    """Every parameter FQN this stage owns (a tied parameter is listed on each stage using it)."""
    param_bytes: int


@attrs.frozen(kw_only=True)
class TiedAcrossStages:
    """Parameter FQNs that share one tensor but are used on different stages (GPT-2's ``wte``
    and ``lm_head``): each stage holds a copy, and their gradients are summed over the ranks
    of ``stages`` after every step so the copies stay equal."""

    params: tuple[str, ...]
    stages: tuple[int, ...]


@attrs.frozen(kw_only=True)
class PipelinePlan:
    """Pipeline parallelism over one mesh dim: the split, the schedule, what crosses stages."""

    mesh_dim: str
    schedule: str
    """A :mod:`torch.distributed.pipelining` schedule, by its name (``GPipe``, ``1F1B``,
    ``Interleaved1F1B``, ...; :data:`hyperrecipe.pipeline.schedule.SCHEDULES`)."""
    microbatches: int
    stages_per_rank: int
    layers: str
    """FQN of the ``nn.ModuleList`` of repeated blocks the stages split."""
    num_layers: int
    first: tuple[str, ...]
    """Parameter-holding modules registered before :attr:`layers`: owned by stage 0."""
    last: tuple[str, ...]
    """Parameter-holding modules registered after :attr:`layers`: owned by the last stage."""
    stages: tuple[PipelineStagePlan, ...]
    tied: tuple[TiedAcrossStages, ...] = ()
    sends: str = ""
    """What crosses each stage boundary, in words (the hidden states into the next stage's first
    layer; the model's inputs are given to every stage and its masks recomputed there)."""
    split: str = ""
    """How the split was decided (``balanced by parameter bytes``, ``recipe: [2, 4]``)."""
    provenance: Provenance

    def stages_of_rank(self, rank: int) -> tuple[PipelineStagePlan, ...]:
        return tuple(s for s in self.stages if s.rank == rank)


@attrs.frozen(kw_only=True)
class Plan:
    """A compiled recipe for one model structure and one mesh shape."""

    format: int
    recipe: str
    recipe_files: tuple[str, ...]
    recipe_digest: str
    model_digest: str
    mesh: tuple[MeshDim, ...]
    fingerprint: str
    rules: tuple[RuleRef, ...]
    params: tuple[ParamPlan, ...]
    boundaries: tuple[BoundaryPlan, ...]
    head_counts: tuple[HeadCount, ...]
    manifest: tuple[ManifestEntry, ...]
    adapters: tuple[AdapterPlan, ...] = ()
    loss_parallel: LossParallel | None = None
    """The loss on vocab shards, when a boundary declares ``loss_parallel: true``."""
    grad_buckets: tuple[GradBucket, ...] = ()
    """The gradient reductions of ``params``, bucketed (:class:`GradBucket`), in launch order."""
    verification: PlanVerification | None = None
    """Set when the plan was verified at compile (:class:`PlanVerification`); ``None`` for a
    plan resolved only (``compile --no-verify``, ``verify=False``): ``apply`` verifies it first.
    Left out of the JSON when ``None``, so an unverified plan's bytes are the resolver's."""
    pipeline: PipelinePlan | None = None
    """Pipeline parallelism (:class:`PipelinePlan`) when the recipe has a ``pipeline`` section and
    its mesh dim is larger than 1; left out of the JSON when ``None``."""
    checksum: str = ""
    """sha256 of the plan's JSON with this field empty: catches hand edits of decisions, which
    the fingerprint (over what the plan was compiled *from*) cannot."""

    def sealed(self) -> Plan:
        """This plan with its checksum set (the resolver seals every plan it makes)."""
        return attrs.evolve(self, checksum=self.content_checksum())

    def content_checksum(self) -> str:
        body = converter.unstructure(attrs.evolve(self, checksum=""))
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {d.name: d.size for d in self.mesh}

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.mesh)

    @property
    def model_parallel_dims(self) -> tuple[str, ...]:
        """The mesh dims the plan splits something over (parameters, layouts, transitions,
        experts, the loss), in mesh order: the ranks along them hold one model replica and
        see the same batches; the other dims are data-parallel."""
        used: set[str] = set()
        for p in self.params:
            used.update(p.placement.mesh_dims)
        for b in self.boundaries:
            for layout in (*b.inputs, *b.outputs, *b.inner_out_src):
                used.update(layout.src.mesh_dims)
                used.update(layout.dst.mesh_dims)
            used.update(t.mesh_dim for t in b.transitions)
            if b.expert_parallel is not None:
                used.add(b.expert_parallel.mesh_dim)
        if self.loss_parallel is not None:
            used.add(self.loss_parallel.mesh_dim)
        if self.pipeline is not None:
            used.add(self.pipeline.mesh_dim)
        return tuple(d for d in self.mesh_dims if d in used)

    def param(self, fqn: str) -> ParamPlan:
        for p in self.params:
            if p.fqn == fqn:
                return p
        raise KeyError(fqn)

    def boundary(self, fqn: str) -> BoundaryPlan:
        for b in self.boundaries:
            if b.fqn == fqn:
                return b
        raise KeyError(fqn)

    def boundary_chain(self, boundary: str | None) -> tuple[str, ...]:
        """``boundary`` and every boundary enclosing it, innermost first (empty for ``None``):
        with a parameter's ``boundary``, every boundary the parameter lies in."""
        parents = {b.fqn: b.parent for b in self.boundaries}
        out: list[str] = []
        while boundary is not None:
            out.append(boundary)
            boundary = parents.get(boundary)
        return tuple(out)

    def to_json(self) -> str:
        """Deterministic JSON: same plan, same bytes."""
        return json.dumps(converter.unstructure(self), sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "<plan>") -> Plan:
        """Parse and verify a plan.

        A plan may come from someone else: whatever the text, this raises nothing but
        :class:`PlanFormatError` (nesting, integers and non-finite numbers are bounded before
        anything recurses over the data).

        Raises:
            PlanFormatError: not JSON, nested deeper than 64, an integer beyond 64 bits or a
                NaN/Infinity, wrong format version, a field missing or of the wrong type (path
                given as cattrs does), or a fingerprint that does not match.
        """
        try:
            raw = json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant,
                             object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"{source}: not JSON: {exc}") from None
        except (ValueError, RecursionError) as exc:
            problem = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
            raise PlanFormatError(f"{source}: not a plan: {problem}") from None
        too_deep = _deeper_than(raw, _MAX_PLAN_DEPTH)
        if too_deep is not None:
            raise PlanFormatError(f"{source}: not a plan: nested deeper than {_MAX_PLAN_DEPTH} "
                                  f"levels at {too_deep}")
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise PlanFormatError(f"{source}: plan format {found!r} is not {PLAN_FORMAT}; "
                                  f"recompile the recipe with this hyperrecipe")
        misshapen = shape_problem(raw, cls)
        if misshapen is not None:
            raise PlanFormatError(f"{source}: invalid plan: {misshapen}")
        try:
            plan = converter.structure(raw, cls)
        except cattrs.BaseValidationError as exc:
            details = "; ".join(cattrs.transform_error(exc))
            raise PlanFormatError(f"{source}: invalid plan: {details}") from None
        except (ValueError, TypeError, AttributeError, KeyError, IndexError,
                RecursionError) as exc:  # a hook meeting data no plan holds
            raise PlanFormatError(f"{source}: invalid plan: {type(exc).__name__}: "
                                  f"{str(exc)[:200]}") from None
        if plan.checksum != plan.content_checksum():
            raise PlanFormatError(f"{source}: checksum does not match the plan's content; the "
                                  f"file was edited by hand or corrupted (recompile instead)")
        expected = compute_fingerprint(plan.recipe_digest, plan.model_digest, plan.mesh)
        if plan.fingerprint != expected:
            raise PlanFormatError(f"{source}: fingerprint {plan.fingerprint[:12]} does not match "
                                  f"its recipe, model and mesh ({expected[:12]}); the file was "
                                  f"edited or corrupted")
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and verify a plan file (see :meth:`from_json`).

        Raises:
            PlanFormatError: unreadable, not UTF-8, or anything :meth:`from_json` refuses.
            UsageError: ``path`` is not a ``str`` or ``os.PathLike``.
        """
        check_path_arg(path, "load_plan: path")
        try:
            # a regular file of bounded size: a FIFO or /dev/zero is refused, not read
            text = read_regular_file(path, limit=MAX_PLAN_BYTES).decode("utf-8")
        except OSError as exc:
            raise PlanFormatError(f"{path}: cannot read plan: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise PlanFormatError(f"{path}: not a plan: not UTF-8 text ({exc.reason} at byte "
                                  f"{exc.start})") from None
        except ValueError as exc:  # a NUL byte in the path
            raise PlanFormatError(f"{path!r}: cannot read plan: {exc}") from None
        if Path(path).suffix.lower() in (".yaml", ".yml", ".toml"):
            try:
                return cls.from_json(text, source=str(path))
            except PlanFormatError as exc:
                raise PlanFormatError(f"{exc}; this looks like a recipe, and a plan is the JSON "
                                      f"that `hyperrecipe compile RECIPE ... -o plan.json` "
                                      f"writes") from None
        return cls.from_json(text, source=str(path))


_MAX_PLAN_DEPTH = 64
MAX_PLAN_BYTES = 512 * 2**20
"""Largest plan file read (a plan takes about 2 KB per parameter: 250,000 parameters)."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(int(text)) > 2**63 - 1:
        raise ValueError(f"integer {text[:20]}{'...' if len(text) > 20 else ''} is out of range")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: with a key given twice ``json`` keeps the
    last, so a reader of the file and the loader would see different plans."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:60]!r} is given twice in one object")
        out[key] = value
    return out


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number a plan holds")


def _deeper_than(data: Any, limit: int) -> str | None:
    """The JSON path of the first value nested deeper than ``limit``, or ``None`` (iterative)."""
    stack: list[tuple[str, Any, int]] = [("$", data, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > limit:
            return path
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}"[:200], v, depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]"[:200], v, depth + 1) for i, v in enumerate(value))
    return None


def shape_problem(raw: Any, cls: type) -> str | None:
    """The first value of ``raw`` (``json.loads`` output) whose JSON kind is not the one
    ``cls``' fields hold, as ``"expected a list, found a string of 2097152 characters @
    $.params[0].shape"``; ``None`` when every value has its kind, every object its required
    keys and no other.

    cattrs, structuring with ``detailed_validation``, iterates a string found where a tuple
    belongs and builds an exception for each character (about 3 KB and 0.15 ms each: a
    160,000-character string took 25 s and 500 MB), and likewise for each element of a long
    list of wrong kind. This walk visits each JSON value once, without recursion, and stops
    at the first misfit, so cattrs only ever sees data of the right shape; what is left to it
    is bounded per value (a literal's spelling, a placement's syntax)."""
    stack: list[tuple[Any, Any, str]] = [(raw, cls, "$")]
    while stack:
        value, tp, path = stack.pop()
        problem = _kind_problem(value, tp, path, stack)
        if problem is not None:
            return f"{problem} @ {path[:200]}"
    return None


def _kind_problem(value: Any, tp: Any, path: str,
                  stack: list[tuple[Any, Any, str]]) -> str | None:
    """Why ``value`` cannot be a ``tp``, or ``None``, pushing its members to check next."""
    if value is _MISSING:
        return "required field missing"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp == Placement or tp is NamedPlacement:  # stored in recipe syntax
        return None if isinstance(value, str) else f"expected a placement string, found {_kind(value)}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            stack.append((value, rest[0], path))
        return None  # unions of several kinds: cattrs tries each, once
    if origin is tuple:
        if not isinstance(value, list):
            return f"expected a list, found {_kind(value)}"
        items = (args[0],) * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            return f"expected a list of {len(items)}, found {len(value)} values"
        stack.extend((v, t, f"{path}[{i}]") for i, v, t in reversed(list(zip(
            range(len(value)), value, items))))
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"expected an object, found {_kind(value)}"
        stack.extend((v, args[1], f"{path}.{k}") for k, v in reversed(list(value.items())))
        return None
    if isinstance(tp, type) and attrs.has(tp):
        if not isinstance(value, dict):
            return f"expected an object, found {_kind(value)}"
        fields = _field_types(tp)
        extra = [k for k in value if k not in fields]
        if extra:
            return f"extra fields found ({', '.join(repr(k[:40]) for k in extra[:5])})"
        missing = next((n for n, (_, required) in fields.items()
                        if required and n not in value), None)
        if missing is not None:
            stack.append((_MISSING, tp, f"{path}.{missing}"))
            return None
        stack.extend((value[n], t, f"{path}.{n}") for n, (t, _) in reversed(fields.items())
                     if n in value)
        return None
    expected = {str: "a string", bool: "true or false", int: "an integer", float: "a number"}
    if tp in expected and not (type(value) is tp or tp is float and type(value) is int):
        return f"expected {expected[tp]}, found {_kind(value)}"
    return None


_MISSING = object()
"""Pushed for a required field that is absent, so that it is reported at its own path."""


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"a list of {len(value)} values"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[Any, bool]]:
    """Each field's name (the JSON key), its resolved type, and whether it is required."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default is attrs.NOTHING)
            for f in attrs.fields(cls) if f.init}


def compute_fingerprint(recipe_digest: str, model_digest: str, mesh: tuple[MeshDim, ...]) -> str:
    """Hash of what a plan was compiled from: recipe content, model structure, mesh shape."""
    h = hashlib.sha256()
    h.update(f"hyperrecipe-plan-{PLAN_FORMAT}\n".encode())
    h.update(recipe_digest.encode() + b"\n" + model_digest.encode() + b"\n")
    h.update(json.dumps([[d.name, d.size] for d in mesh]).encode())
    return h.hexdigest()


def _from_text(parse: Callable[[str], T]) -> Callable[[Any, Any], T]:
    """A cattrs structure hook for placements, which the plan stores in recipe syntax."""

    def structure(value: Any, _: Any) -> T:
        if not isinstance(value, str):
            raise ValueError(f"expected a placement string, found {value!r}")
        try:
            return parse(value)
        except PlacementSyntaxError as exc:
            raise ValueError(str(exc)) from None

    return structure


def _make_converter() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_unstructure_hook(NamedPlacement, str)
    conv.register_structure_hook(NamedPlacement, _from_text(parse_named_text))
    conv.register_unstructure_hook(Placement, str)
    conv.register_structure_hook(Placement, _from_text(parse_placement))
    conv.register_unstructure_hook(ArgLayout, make_dict_unstructure_fn(
        ArgLayout, conv, grad=override(omit_if_default=True)))
    conv.register_unstructure_hook(Plan, make_dict_unstructure_fn(
        Plan, conv, verification=override(omit_if_default=True),
        pipeline=override(omit_if_default=True)))
    return conv


converter: cattrs.Converter = _make_converter()
"""The one converter for plans (``forbid_extra_keys``, ``detailed_validation``)."""
