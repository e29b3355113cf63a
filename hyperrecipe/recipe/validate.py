"""Turning one parsed recipe document into validated schema objects, or a precise RecipeError.

Every check here is local to the file: keys, types, placement syntax, style names, patterns.
Whether a pattern matches the model or a dim divides is the resolver's business. The field table
:data:`RULE_FIELD_SPECS` drives validation, the JSON Schema and the reference docs alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from hyperrecipe.errors import RecipeError, did_you_mean
from hyperrecipe.placement import (
    NamedPlacement,
    Partial,
    PlacementSyntaxError,
    Shard,
    parse_named_placement,
    parse_placement,
)
from hyperrecipe.recipe.patterns import PatternError, compile_pattern
from hyperrecipe.recipe.schema import (
    AdapterSpec,
    Condition,
    Layout,
    LayoutKey,
    Rule,
    RuleFields,
    StyleDef,
)
from hyperrecipe.recipe.pipeline import (
    MAX_MICROBATCHES,
    MAX_STAGES_PER_RANK,
    PIPELINE_FIELD_SPECS,
    PIPELINE_KEYS,
    PipelineSpec,
    SplitSpec,
)
from hyperrecipe.recipe.source import Document, PathKey, Positions, format_path
from hyperrecipe.wrappers import BUILTIN_WRAPPERS

__all__ = [
    "FieldSpec",
    "RULE_FIELD_SPECS",
    "TOP_LEVEL_SPECS",
    "ADAPTER_KEYS",
    "INNER_WRAPPERS",
    "FileContent",
    "validate_document",
    "validate_rules",
    "validate_styles",
]

INNER_WRAPPERS: dict[str, str] = {name: d.summary for name, d in BUILTIN_WRAPPERS.items()}
"""Built-in inner wrappers, by registry name, with their summaries (read from the wrapper
registry, :data:`hyperrecipe.wrappers.BUILTIN_WRAPPERS`; implemented by the runtime)."""

_CALLABLE_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*\Z")
_IDENT = re.compile(r"^[A-Za-z_]\w*\Z")
_HEAD_COUNT = re.compile(r"^(config\.)?[A-Za-z_]\w*\Z")
"""A head count: a module attribute, or a field of the module's own ``config``."""
_CONDITION = re.compile(r"^\s*(>=|<=|==|!=|>|<)?\s*([0-9]{1,18})\s*$", re.ASCII)


@attrs.frozen(kw_only=True)
class FieldSpec:
    """One recipe key: what it holds (for the schema and docs) and what it means."""

    name: str
    kind: str
    doc: str
    required: bool = False


RULE_FIELD_SPECS: tuple[FieldSpec, ...] = (
    FieldSpec(name="match", kind="pattern", required=True,
              doc="Module FQN pattern. Glob: `*` one path segment, `**` any number of segments, "
                  "`{a,b}` alternatives; or `re:` followed by a regular expression matched against "
                  "the whole FQN. A pattern that matches no module is an error."),
    FieldSpec(name="when", kind="conditions",
              doc="Mesh conditions, e.g. `{cp: \">1\"}`; the rule is skipped unless all hold. "
                  "A mesh dim missing from the mesh has size 1."),
    FieldSpec(name="style", kind="style",
              doc="A built-in or recipe style whose fields this rule starts from; explicit fields "
                  "refine it (mappings merge key by key)."),
    FieldSpec(name="params", kind="param_placements",
              doc="Placement of each direct parameter of the matched modules, e.g. "
                  "`{weight: {tp: shard(0)}, bias: replicate}`. A parameter named by a style but "
                  "absent from the module (a `bias` of a bias-free linear) is ignored; one named "
                  "explicitly must exist."),
    FieldSpec(name="boundary", kind="bool",
              doc="Whether the matched modules are boundaries, where layouts are declared and "
                  "converted. `boundary: false` keeps a style's parameter placements and drops "
                  "its layouts."),
    FieldSpec(name="in_src", kind="layout",
              doc="How each input arrives, by argument name or position (`0`)."),
    FieldSpec(name="in_dst", kind="layout",
              doc="How the forward needs each input; defaults to `in_src`."),
    FieldSpec(name="out_src", kind="layout",
              doc="How the forward produces each output, by name (see `out_names`) or position."),
    FieldSpec(name="out_dst", kind="layout",
              doc="How the caller gets each output; defaults to `out_src`."),
    FieldSpec(name="in_grad", kind="grad_layout",
              doc="How each declared input's gradient comes back from the forward, on the mesh "
                  "dims where the input is replicated inside (`in_dst`): `partial` (the forward "
                  "spreads it over sharded compute; backward all-reduces it, or reduce-scatters "
                  "it onto a sharded `in_src`: Megatron's *f*) or `replicate` (whole on every "
                  "rank: backward does nothing, or slices it onto a sharded `in_src`), e.g. "
                  "`{hidden_states: replicate}` for a block that computes replicated under "
                  "sequence parallelism. Default: partial where the boundary's own region holds "
                  "parameters sharded on that dim, whole elsewhere. Validate mode checks it "
                  "against the gradient DTensor computes."),
    FieldSpec(name="out_grad", kind="grad_layout",
              doc="How each declared output's gradient comes back from the caller, on the mesh "
                  "dims where the output leaves replicated (`out_dst`): `partial` (the caller "
                  "feeds it to sharded compute that is no boundary, e.g. a Mamba mixer's "
                  "`x_proj` output read by the per-channel selective scan: backward all-reduces "
                  "it, Megatron's *f* on an output) or `replicate` (whole: the default). "
                  "Validate mode checks it against the gradient DTensor computes."),
    FieldSpec(name="out_names", kind="names",
              doc="Names for the positions of a tuple output, e.g. `[attn_output, attn_weights]`."),
    FieldSpec(name="defer_bias", kind="bool",
              doc="Keep the `bias` out of the forward and add it once after the output's "
                  "reduction (rowwise: otherwise it is counted once per rank)."),
    FieldSpec(name="head_counts", kind="head_counts",
              doc="Integer attributes of the module divided by a mesh dim's size while the plan "
                  "is applied in production mode, e.g. `{num_heads: tp}`; each must divide. "
                  "`config.NAME` divides a field of the module's `config` (a forward that reads "
                  "`self.config.num_attention_heads`): the module gets its own copy of the "
                  "config with the divided value."),
    FieldSpec(name="reduce_grads", kind="reduce_grads",
              doc="Replicated parameters that only see this rank's slice of the data (a per-head "
                  "`q_norm` after a column-wise `q_proj`), mapped to the mesh dim their gradient "
                  "is all-reduced over in production mode, e.g. `{weight: tp}`. Sequence-parallel "
                  "norms and deferred biases on sharded outputs are found without it."),
    FieldSpec(name="inner_wrapper", kind="wrapper",
              doc=f"A wrapper replacing the module's inner computation (for transformers' "
                  f"attention modules: the attention function; otherwise the module's compute), "
                  f"run on local tensors in both modes: a registry name "
                  f"({', '.join(sorted(INNER_WRAPPERS))}) or `pkg.mod:callable` made with "
                  f"`@hyperrecipe.wrappers.inner_wrapper`, or a list of them: a fallback chain, of "
                  f"which the first whose requirements hold and that installs is used."),
    FieldSpec(name="inner_out_src", kind="layout",
              doc="Layout of what the inner wrapper returns (by output position or name), e.g. "
                  "`{0: {cp: shard(1)}}` for attention output `[batch, seq, heads, head_dim]`; "
                  "validate mode wraps the wrapper's local results with it. Outputs it does not "
                  "name are replicated. Default: the layout the wrappers declare "
                  "(`@inner_wrapper(inner_out_src=...)`; the context-parallel built-ins declare "
                  "`{0: {cp: shard(1)}}`, `mha_heads` `{0: replicate, 1: {tp: partial}}`), refused when candidates disagree or the boundary is "
                  "also sharded on a dim the declaration does not name."),
    FieldSpec(name="local_region", kind="bool",
              doc="Run the module's forward on local tensors in both modes (data-dependent code "
                  "such as MoE token dispatch); requires `out_src`."),
    FieldSpec(name="no_grad", kind="names",
              doc="Declared inputs that never carry a gradient (rotary `position_embeddings`, "
                  "an `attention_mask`, routing indices), e.g. `[position_embeddings]`: their "
                  "layout changes get no backward collective in the plan, and applying the plan "
                  "fails loudly if one arrives requiring grad. Integer inputs of torch's "
                  "`Embedding` and `EmbeddingBag` are known without it."),
    FieldSpec(name="loss_parallel", kind="bool",
              doc="The boundary's first output is the logits, and they stay sharded on the vocab "
                  "(last) dim for the loss: an outermost `nn.Linear` boundary (an `lm_head`) "
                  "whose `weight` is `shard(0)` and whose output 0 leaves `shard(-1)` on the same "
                  "mesh dim (`out_dst: {0: {tp: shard(-1)}}`). A transformers model's own "
                  "`labels=` loss then runs on the shards, and a call without labels gets the "
                  "full logits; a model whose forward takes no `labels` hands its caller the "
                  "vocab-sharded logits, for `hyperrecipe.vocab_parallel_cross_entropy`. See "
                  "docs/training.md#loss-on-vocab-shards."),
    FieldSpec(name="note", kind="string", doc="Free text, shown by `compile --explain`."),
)

TOP_LEVEL_SPECS: tuple[FieldSpec, ...] = (
    FieldSpec(name="recipe", kind="string", required=True, doc="The recipe's name."),
    FieldSpec(name="version", kind="version", required=True, doc="Format version; must be 1."),
    FieldSpec(name="mesh", kind="mesh_dims", required=True,
              doc="The mesh dim names this recipe speaks of, e.g. `[dp, tp]`."),
    FieldSpec(name="description", kind="string", doc="Free text."),
    FieldSpec(name="extends", kind="string",
              doc="A recipe file path (relative to this file) or a shipped recipe's name; its "
                  "rules come first and this recipe's rules refine them."),
    FieldSpec(name="unclaimed", kind="unclaimed",
              doc="What happens to a parameter no rule claims: `replicate` (default; listed in "
                  "the compile summary) or `error`."),
    FieldSpec(name="styles", kind="styles",
              doc="Recipe styles: name → rule fields (and optionally a base `style`)."),
    FieldSpec(name="rules", kind="rules", required=True, doc="Ordered rules."),
    FieldSpec(name="adapters", kind="adapters",
              doc="Adapters for third-party methods and functions that validate mode cannot "
                  "run on DTensors as they are: a list of `{target: pkg.mod:Class.method, mode: "
                  "wrap|marshal, out_src: placement}`, or for a module-level function "
                  "`{target: pkg.mod:function, within: module pattern, ...}` (the function is "
                  "replaced while the matching modules run). `wrap` (default) makes plain tensor "
                  "arguments replicated DTensors when another argument is a DTensor; `marshal` "
                  "runs the method on the local tensors of its DTensor arguments and wraps its "
                  "tensor outputs with `out_src` (default: the first DTensor argument's "
                  "placements). Without DTensor arguments (production mode) both run the method "
                  "untouched. See docs/adapters.md."),
    FieldSpec(name="pipeline", kind="pipeline",
              doc="Pipeline parallelism: which `nn.ModuleList` the stages split (`layers`), "
                  "the `schedule` and its `microbatches`, and optionally `mesh_dim` (default "
                  "`pp`), `stages_per_rank`, `split`, `first`, `last`. Active when the mesh dim "
                  "is larger than 1. See [Pipeline section](#pipeline-section) and "
                  "docs/pipeline.md."),
)

ADAPTER_KEYS = ("target", "mode", "out_src", "within")
_RULE_KEYS = tuple(s.name for s in RULE_FIELD_SPECS)
_STYLE_KEYS = tuple(s.name for s in RULE_FIELD_SPECS if s.name not in ("match", "when")) + ("doc",)
_TOP_KEYS = tuple(s.name for s in TOP_LEVEL_SPECS)


class _Ctx:
    """Positions of one document, and helpers that raise RecipeErrors pointing into it."""

    def __init__(self, positions: Positions, rule_index: int | None = None) -> None:
        self.positions = positions
        self.rule_index = rule_index

    def fail(self, problem: str, path: PathKey, *, key: bool = False, hint: str = "") -> RecipeError:
        return RecipeError(
            problem,
            span=self.positions.span(path, key=key),
            path=format_path(path),
            rule_index=self.rule_index,
            hint=hint,
        )

    def check_keys(self, data: Mapping[Any, Any], allowed: tuple[str, ...], path: PathKey,
                   what: str) -> None:
        for k in data:
            if k not in allowed:
                hint = f"expected one of: {', '.join(allowed)}"
                raise self.fail(f"unknown key {k!r} in {what}{did_you_mean(str(k), allowed)}",
                                (*path, k), key=True, hint=hint)

    def want(self, value: Any, types: type | tuple[type, ...], path: PathKey, expected: str) -> Any:
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in
                                               (types if isinstance(types, tuple) else (types,)))
        if not ok:
            raise self.fail(f"expected {expected}, found {_describe(value)}", path)
        return value


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


@attrs.frozen(kw_only=True)
class FileContent:
    """The validated top level of one file, before ``extends`` is followed."""

    name: str
    version: int
    mesh: tuple[str, ...]
    description: str
    extends: str | None
    unclaimed: str | None
    raw_styles: Mapping[str, Any]
    raw_rules: list[Any]
    adapters: tuple[AdapterSpec, ...]
    pipeline: PipelineSpec | None = None


def validate_document(doc: Document) -> FileContent:
    """Check the top level of a document: keys, version, mesh, and the shape of lists.

    Raises:
        RecipeError: on the first problem, naming file, line, column and path.
    """
    ctx = _Ctx(doc.positions)
    data = doc.data
    if not isinstance(data, dict):
        raise ctx.fail(f"a recipe must be a mapping at the top level, found {_describe(data)}", ())
    ctx.check_keys(data, _TOP_KEYS, (), "the recipe")
    for spec in TOP_LEVEL_SPECS:
        if spec.required and spec.name not in data:
            raise ctx.fail(f"required field missing: {spec.name!r}", (),
                           hint=spec.doc)
    name = ctx.want(data["recipe"], str, ("recipe",), "a string (the recipe's name)")
    version = data["version"]
    if version != 1 or isinstance(version, bool):
        raise ctx.fail(f"unsupported recipe version {version!r}; expected 1", ("version",))
    mesh_raw = ctx.want(data["mesh"], list, ("mesh",), "a list of mesh dim names")
    mesh: list[str] = []
    for i, d in enumerate(mesh_raw):
        ctx.want(d, str, ("mesh", i), "a mesh dim name")
        if not _IDENT.match(d):
            raise ctx.fail(f"mesh dim name {d!r} is not an identifier", ("mesh", i))
        if d in mesh:
            raise ctx.fail(f"mesh dim {d!r} listed twice", ("mesh", i))
        mesh.append(d)
    description = ctx.want(data.get("description", ""), str, ("description",), "a string")
    extends = data.get("extends")
    if extends is not None:
        ctx.want(extends, str, ("extends",), "a recipe path or shipped recipe name")
    unclaimed = data.get("unclaimed")
    if unclaimed is not None and unclaimed not in ("replicate", "error"):
        raise ctx.fail(f"unclaimed must be 'replicate' or 'error', found {_describe(unclaimed)}",
                       ("unclaimed",))
    styles = data.get("styles", {})
    ctx.want(styles, dict, ("styles",), "a mapping of style name to fields")
    rules = ctx.want(data["rules"], list, ("rules",), "a list of rules")
    adapters = _validate_adapters(ctx, data.get("adapters", []), tuple(mesh))
    pipeline = (_validate_pipeline(ctx, data["pipeline"], tuple(mesh))
                if "pipeline" in data else None)
    return FileContent(name=name, version=1, mesh=tuple(mesh), description=description,
                       extends=extends, unclaimed=unclaimed, raw_styles=styles, raw_rules=rules,
                       adapters=adapters, pipeline=pipeline)


def _validate_pipeline(ctx: _Ctx, raw: Any, mesh: tuple[str, ...]) -> PipelineSpec:
    path: PathKey = ("pipeline",)
    file = ctx.positions.span(path).path
    ctx.want(raw, dict, path, "a mapping (layers, schedule, microbatches, ...)")
    ctx.check_keys(raw, PIPELINE_KEYS, path, "pipeline")
    for name, _, required, doc in PIPELINE_FIELD_SPECS:
        if required and name not in raw:
            raise ctx.fail(f"pipeline: required field missing: {name!r}", path, hint=doc)
    layers = ctx.want(raw["layers"], str, (*path, "layers"), "a module FQN (`model.layers`)")
    schedule = ctx.want(raw["schedule"], str, (*path, "schedule"), "a schedule name")
    microbatches = _bounded_int(ctx, raw["microbatches"], (*path, "microbatches"),
                                MAX_MICROBATCHES)
    mesh_dim = ctx.want(raw.get("mesh_dim", "pp"), str, (*path, "mesh_dim"), "a mesh dim name")
    if mesh_dim not in mesh:
        near = did_you_mean(mesh_dim, mesh) if "mesh_dim" in raw else ""
        raise ctx.fail(f"pipeline mesh dim {mesh_dim!r} is not declared in mesh{near}",
                       (*path, "mesh_dim") if "mesh_dim" in raw else path,
                       hint=f"declared: [{', '.join(mesh)}]; add {mesh_dim!r} to mesh")
    stages_per_rank = None
    if "stages_per_rank" in raw:
        stages_per_rank = _bounded_int(ctx, raw["stages_per_rank"], (*path, "stages_per_rank"),
                                       MAX_STAGES_PER_RANK)
    split: SplitSpec = "balanced"
    if "split" in raw:
        value = raw["split"]
        if isinstance(value, str):
            if value not in ("balanced", "even"):
                raise ctx.fail(f"pipeline split must be 'balanced', 'even' or a list of layer "
                               f"indices, found {_describe(value)}"
                               f"{did_you_mean(value, ('balanced', 'even'))}", (*path, "split"))
            split = "balanced" if value == "balanced" else "even"
        else:
            ctx.want(value, list, (*path, "split"),
                     "'balanced', 'even' or a list of layer indices")
            if not value:
                raise ctx.fail("pipeline split is an empty list; give the index where each "
                               "stage after the first starts", (*path, "split"))
            starts = [_bounded_int(ctx, v, (*path, "split", i), 1 << 20)
                      for i, v in enumerate(value)]
            for i in range(1, len(starts)):
                if starts[i] <= starts[i - 1]:
                    raise ctx.fail(f"pipeline split must increase: {starts[i]} after "
                                   f"{starts[i - 1]}", (*path, "split", i))
            split = tuple(starts)
    first = _fqn_list(ctx, raw, path, "first")
    last = _fqn_list(ctx, raw, path, "last")
    return PipelineSpec(mesh_dim=mesh_dim, layers=layers, schedule=schedule,
                        microbatches=microbatches, stages_per_rank=stages_per_rank, split=split,
                        first=first, last=last, file=file, positions=ctx.positions, path=path)


def _bounded_int(ctx: _Ctx, value: Any, path: PathKey, limit: int) -> int:
    ctx.want(value, int, path, "an integer")
    if not 1 <= value <= limit:
        raise ctx.fail(f"expected an integer from 1 to {limit}, found {value}", path)
    return int(value)


def _fqn_list(ctx: _Ctx, raw: Mapping[str, Any], path: PathKey, key: str
              ) -> tuple[str, ...] | None:
    if key not in raw:
        return None
    items = ctx.want(raw[key], list, (*path, key), "a list of module FQNs")
    for i, item in enumerate(items):
        ctx.want(item, str, (*path, key, i), "a module FQN")
        if item in items[:i]:
            raise ctx.fail(f"module {item!r} listed twice", (*path, key, i))
    return tuple(items)


def _validate_adapters(ctx: _Ctx, raw: Any, mesh: tuple[str, ...]) -> tuple[AdapterSpec, ...]:
    ctx.want(raw, list, ("adapters",), "a list of adapters")
    out: list[AdapterSpec] = []
    for i, item in enumerate(raw):
        path: PathKey = ("adapters", i)
        ctx.want(item, dict, path, "a mapping with target and mode")
        ctx.check_keys(item, ADAPTER_KEYS, path, "an adapter")
        if "target" not in item:
            raise ctx.fail("required field missing: 'target'", path)
        target = ctx.want(item["target"], str, (*path, "target"), "`pkg.mod:Class.method`")
        if not _CALLABLE_REF.match(target):
            raise ctx.fail(f"adapter target {target!r} is not `pkg.mod:Class.method` or "
                           f"`pkg.mod:function`", (*path, "target"))
        function = "." not in target.split(":", 1)[1]
        within = None
        if function and "within" not in item:
            raise ctx.fail(f"adapter target {target!r} is a function: give `within`, the "
                           f"modules whose forward calls it (a pattern, as in `match`)", path)
        if "within" in item:
            if not function:
                raise ctx.fail("within applies to a function target (`pkg.mod:function`); a "
                               "method adapter patches its class", (*path, "within"), key=True)
            within = ctx.want(item["within"], str, (*path, "within"), "a module pattern")
            try:
                compile_pattern(within)
            except PatternError as exc:
                raise ctx.fail(f"within: {exc}", (*path, "within")) from None
        first = next((a for a in out if a.target == target), None)
        if first is not None:
            raise ctx.fail(f"adapter target {target!r} is listed twice (first at line "
                           f"{first.line}); one method takes one adapter", (*path, "target"))
        mode = item.get("mode", "wrap")
        if mode not in ("wrap", "marshal"):
            raise ctx.fail(f"adapter mode must be 'wrap' or 'marshal', found {_describe(mode)}",
                           (*path, "mode"))
        out_src = None
        if "out_src" in item:
            if mode != "marshal":
                raise ctx.fail("out_src applies to mode 'marshal' only (a 'wrap' adapter returns "
                               "the method's outputs as they are)", (*path, "out_src"), key=True)
            out_src = _placement(ctx, item["out_src"], (*path, "out_src"), mesh)
            if any(isinstance(q, Shard) and q.is_chunked for _, q in out_src.dims):
                raise ctx.fail(f"adapter out_src {out_src} is a chunked shard, which has no "
                               f"DTensor placement", (*path, "out_src"))
        span = ctx.positions.span(path)
        out.append(AdapterSpec(target=target, mode=mode, file=span.path, line=span.line,
                               column=span.column, out_src=out_src, within=within))
    return tuple(out)


# ----------------------------------------------------------------------------- fields


def _placement(ctx: _Ctx, value: Any, path: PathKey, mesh: tuple[str, ...]) -> NamedPlacement:
    if isinstance(value, dict):  # parse entry by entry so errors point at the entry
        for dim, text in value.items():
            if isinstance(text, str):
                try:
                    parse_placement(text)
                except PlacementSyntaxError as exc:
                    raise ctx.fail(str(exc), (*path, dim)) from None
    try:
        p = parse_named_placement(value)
    except PlacementSyntaxError as exc:
        raise ctx.fail(str(exc), path) from None
    for dim in p.mesh_dims:
        if dim not in mesh:
            raise ctx.fail(
                f"placement names mesh dim {dim!r}, which the recipe does not declare"
                f"{did_you_mean(dim, mesh)}",
                (*path, dim), key=True, hint=f"declared mesh dims: [{', '.join(mesh)}]",
            )
    return p


def _layout(ctx: _Ctx, value: Any, path: PathKey, mesh: tuple[str, ...]) -> Layout:
    ctx.want(value, dict, path, "a mapping of argument name or position to placement")
    out: list[tuple[LayoutKey, NamedPlacement]] = []
    for k, v in value.items():
        key: LayoutKey
        if isinstance(k, int) and not isinstance(k, bool):
            key = k
        elif isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9:
            key = int(k)
        elif isinstance(k, str) and _IDENT.match(k):
            key = k
        else:
            raise ctx.fail(f"layout key {k!r} is neither an argument name nor a position",
                           (*path, k), key=True)
        if isinstance(key, int) and not 0 <= key < 10**9:
            raise ctx.fail(f"layout position {key} is negative or too large", (*path, k),
                           key=True)
        out.append((key, _placement(ctx, v, (*path, k), mesh)))
    return tuple(out)


def _grad_layout(ctx: _Ctx, value: Any, path: PathKey, mesh: tuple[str, ...]) -> Layout:
    """A layout of gradients: on each mesh dim whole (``replicate``) or ``partial`` (sum); a
    shard says where a value lies, and a sharded value's gradient is sharded as it is."""
    out = _layout(ctx, value, path, mesh)
    for raw_key, (_, placed) in zip(value, out):
        for dim, q in placed.dims:
            if not isinstance(q, Partial) or q.reduce != "sum":
                raise ctx.fail(
                    f"a gradient layout is replicate (whole) or partial on each mesh dim, found "
                    f"{q} on {dim}", (*path, raw_key, dim),
                    hint="a sharded value's gradient is sharded the same way without a "
                         "declaration; write {DIM: partial} or replicate")
    return out


def _bool(ctx: _Ctx, value: Any, path: PathKey) -> bool:
    return bool(ctx.want(value, bool, path, "true or false"))


def _conditions(ctx: _Ctx, value: Any, path: PathKey, mesh: tuple[str, ...]) -> tuple[Condition, ...]:
    ctx.want(value, dict, path, 'a mapping of mesh dim to condition, e.g. {cp: ">1"}')
    out: list[Condition] = []
    for dim, cond in value.items():
        if dim not in mesh:
            raise ctx.fail(f"condition on mesh dim {dim!r}, which the recipe does not declare"
                           f"{did_you_mean(str(dim), mesh)}", (*path, dim), key=True,
                           hint=f"declared mesh dims: [{', '.join(mesh)}]")
        text = str(cond) if isinstance(cond, int) and not isinstance(cond, bool) else cond
        m = _CONDITION.match(text) if isinstance(text, str) else None
        if m is None:
            shown = repr(cond) if len(repr(cond)) <= 80 else repr(str(cond)[:77] + "...")
            raise ctx.fail(f"condition {shown} is not one of >N, >=N, <N, <=N, ==N, !=N or N",
                           (*path, dim))
        out.append(Condition(mesh_dim=dim, op=m.group(1) or "==",  # type: ignore[arg-type]
                             value=int(m.group(2))))
    return tuple(out)


def _fields(ctx: _Ctx, data: Mapping[str, Any], path: PathKey, mesh: tuple[str, ...]) -> RuleFields:
    """The explicit fields written in a rule or style (not including its style)."""
    values: dict[str, Any] = {}
    for spec in RULE_FIELD_SPECS:
        if spec.name not in data or spec.name in ("match", "when", "style", "note"):
            continue
        raw = data[spec.name]
        fpath = (*path, spec.name)
        parser = _FIELD_PARSERS[spec.kind]
        values[spec.name] = parser(ctx, raw, fpath, mesh)
    return RuleFields(**values)


def _params(ctx: _Ctx, raw: Any, path: PathKey, mesh: tuple[str, ...]) -> tuple[tuple[str, NamedPlacement], ...]:
    ctx.want(raw, dict, path, "a mapping of parameter name to placement")
    out = []
    for k, v in raw.items():
        if not isinstance(k, str) or not _IDENT.match(k):
            raise ctx.fail(f"parameter name {k!r} is not an identifier (params name the matched "
                           f"module's direct parameters)", (*path, k), key=True)
        out.append((k, _placement(ctx, v, (*path, k), mesh)))
    return tuple(out)


def _names(ctx: _Ctx, raw: Any, path: PathKey, mesh: tuple[str, ...]) -> tuple[str, ...]:
    ctx.want(raw, list, path, "a list of output names")
    seen: list[str] = []
    for i, n in enumerate(raw):
        ctx.want(n, str, (*path, i), "an output name")
        if not _IDENT.match(n):
            raise ctx.fail(f"output name {n!r} is not an identifier", (*path, i))
        if n in seen:
            raise ctx.fail(f"output name {n!r} listed twice", (*path, i))
        seen.append(n)
    return tuple(seen)


def _names_to_mesh_dims(subject: str, verb: str, example: str, key: re.Pattern[str] = _IDENT,
                        key_form: str = "an identifier"
                        ) -> Callable[[_Ctx, Any, PathKey, tuple[str, ...]], Any]:
    """A parser for ``{name: mesh_dim}`` fields (``head_counts``, ``reduce_grads``)."""

    def parse(ctx: _Ctx, raw: Any, path: PathKey,
              mesh: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
        ctx.want(raw, dict, path, f"a mapping of {subject} to mesh dim, e.g. {example}")
        out = []
        for k, v in raw.items():
            if not isinstance(k, str) or not key.match(k):
                raise ctx.fail(f"{subject} {k!r} is not {key_form}", (*path, k), key=True)
            ctx.want(v, str, (*path, k), "a mesh dim name")
            if v not in mesh:
                raise ctx.fail(f"{verb} mesh dim {v!r}, which the recipe does not declare"
                               f"{did_you_mean(v, mesh)}", (*path, k),
                               hint=f"declared mesh dims: [{', '.join(mesh)}]")
            out.append((k, v))
        return tuple(out)

    return parse


_head_counts = _names_to_mesh_dims("attribute name", "head count divided by",
                                   "{num_heads: tp}", _HEAD_COUNT,
                                   "an identifier or `config.` and an identifier")
_reduce_grads = _names_to_mesh_dims("parameter name", "gradient reduced over", "{weight: tp}")


def _wrapper(ctx: _Ctx, raw: Any, path: PathKey, mesh: tuple[str, ...]) -> tuple[str, ...]:
    """One wrapper, or a fallback chain of them (the first eligible one is installed)."""
    what = "a wrapper registry name or `pkg.mod:callable`, or a list of them (a fallback chain)"
    items = raw if isinstance(raw, list) else [raw]
    if isinstance(raw, list) and not raw:
        raise ctx.fail("an inner wrapper chain needs at least one wrapper", path, hint=what)
    out: list[str] = []
    for i, item in enumerate(items):
        where: PathKey = (*path, i) if isinstance(raw, list) else path
        ctx.want(item, str, where, what)
        if not (item in INNER_WRAPPERS or _CALLABLE_REF.match(item)):
            raise ctx.fail(f"unknown inner wrapper {item!r}{did_you_mean(item, INNER_WRAPPERS)}",
                           where, hint=f"expected one of {', '.join(sorted(INNER_WRAPPERS))} or "
                                       f"`pkg.mod:callable`")
        if item in out:
            raise ctx.fail(f"inner wrapper {item!r} appears twice in the chain", where)
        out.append(str(item))
    return tuple(out)


_FIELD_PARSERS: dict[str, Callable[[_Ctx, Any, PathKey, tuple[str, ...]], Any]] = {
    "param_placements": _params,
    "bool": lambda ctx, raw, path, mesh: _bool(ctx, raw, path),
    "layout": _layout,
    "grad_layout": _grad_layout,
    "names": _names,
    "head_counts": _head_counts,
    "reduce_grads": _reduce_grads,
    "wrapper": _wrapper,
}


# ----------------------------------------------------------------------------- styles


def validate_styles(doc: Document, content: FileContent, inherited: Mapping[str, StyleDef]) -> dict[str, StyleDef]:
    """The styles visible to this file's rules: inherited ones plus its own, expanded.

    Raises:
        RecipeError: unknown keys, a cycle between styles, a redefined built-in.
    """
    ctx = _Ctx(doc.positions)
    visible: dict[str, StyleDef] = dict(inherited)
    raw = content.raw_styles
    expanding: list[str] = []

    def expand(name: str) -> StyleDef:
        if name in visible and name not in raw:
            return visible[name]
        if name in expanding:
            cycle = " -> ".join([*expanding[expanding.index(name):], name])
            raise ctx.fail(f"styles form a cycle: {cycle}", ("styles", name), key=True)
        body = raw[name]
        path: PathKey = ("styles", name)
        ctx.want(body, dict, path, "a mapping of rule fields")
        ctx.check_keys(body, _STYLE_KEYS, path, f"style {name!r}")
        expanding.append(name)
        fields = _fields(ctx, body, path, content.mesh)
        base_name = body.get("style")
        if base_name is not None:
            ctx.want(base_name, str, (*path, "style"), "a style name")
            if base_name not in visible and base_name not in raw:
                known = sorted({*visible, *raw})
                raise ctx.fail(f"unknown style {base_name!r}{did_you_mean(base_name, known)}",
                               (*path, "style"), hint=f"expected one of: {', '.join(known)}")
            fields = _drop_layouts_if_not_boundary(ctx, path, fields.over(expand(base_name).fields),
                                                   explicit=fields)
        expanding.pop()
        doc_text = body.get("doc", "")
        ctx.want(doc_text, str, (*path, "doc"), "a string")
        span = ctx.positions.span(path, key=True)
        style = StyleDef(name=name, fields=fields, doc=doc_text, file=span.path, line=span.line)
        visible[name] = style
        return style

    for name in raw:
        if not isinstance(name, str) or not _IDENT.match(name):
            raise ctx.fail(f"style name {name!r} is not an identifier", ("styles", name), key=True)
        if name in inherited and inherited[name].builtin:
            raise ctx.fail(f"style {name!r} is built in and cannot be redefined; choose another "
                           f"name", ("styles", name), key=True)
        expand(name)
    return visible


# ----------------------------------------------------------------------------- rules


def validate_rules(doc: Document, content: FileContent, styles: Mapping[str, StyleDef], *,
                   layer: int) -> tuple[Rule, ...]:
    """Validate each rule and expand its style.

    Raises:
        RecipeError: the first bad rule, with its index and location.
    """
    out: list[Rule] = []
    for i, raw in enumerate(content.raw_rules):
        ctx = _Ctx(doc.positions, rule_index=i)
        path: PathKey = ("rules", i)
        ctx.want(raw, dict, path, "a rule (a mapping with at least `match`)")
        ctx.check_keys(raw, _RULE_KEYS, path, f"rule {i}")
        if "match" not in raw:
            raise ctx.fail(f"required field missing: 'match' in rule {i}", path)
        match = ctx.want(raw["match"], str, (*path, "match"), "an FQN pattern")
        try:
            compile_pattern(match)
        except PatternError as exc:
            raise ctx.fail(f"invalid pattern {match!r}: {exc}", (*path, "match")) from None
        when = _conditions(ctx, raw["when"], (*path, "when"), content.mesh) if "when" in raw else ()
        explicit = _fields(ctx, raw, path, content.mesh)
        style_name = raw.get("style")
        fields = explicit
        chain: tuple[str, ...] = ()
        if style_name is not None:
            ctx.want(style_name, str, (*path, "style"), "a style name")
            if style_name not in styles:
                raise ctx.fail(f"unknown style {style_name!r}{did_you_mean(style_name, styles)}",
                               (*path, "style"), hint=f"expected one of: {', '.join(sorted(styles))}")
            style = styles[style_name]
            for dim in _mesh_dims_of(style.fields):
                if dim not in content.mesh:
                    raise ctx.fail(
                        f"style {style_name!r} places tensors on mesh dim {dim!r}, which the "
                        f"recipe does not declare", (*path, "style"),
                        hint=f"declared mesh dims: [{', '.join(content.mesh)}]")
            fields = explicit.over(style.fields)
            chain = (style_name,)
        fields = _drop_layouts_if_not_boundary(ctx, path, fields, explicit=explicit)
        note = raw.get("note", "")
        ctx.want(note, str, (*path, "note"), "a string")
        out.append(Rule(
            file=doc.positions.file, index=i, layer=layer, match=match, when=when,
            style=style_name, style_chain=chain, fields=fields,
            explicit=frozenset(explicit.set_fields()),
            explicit_params=frozenset(k for k, _ in explicit.params or ()), note=note,
            positions=doc.positions, path=path,
        ))
    return tuple(out)


_BOUNDARY_ONLY = ("in_src", "in_dst", "out_src", "out_dst", "out_names", "defer_bias",
                  "no_grad", "loss_parallel", "in_grad", "out_grad")


def _drop_layouts_if_not_boundary(ctx: _Ctx, path: PathKey, fields: RuleFields, *,
                                  explicit: RuleFields) -> RuleFields:
    """``boundary: false`` keeps a style's parameter placements and drops its layouts; written
    next to it, a layout field is a mistake."""
    if explicit.boundary is not False:
        return fields
    for f in _BOUNDARY_ONLY:
        if getattr(explicit, f) is not None:
            raise ctx.fail(f"{f} has no effect with boundary: false", (*path, f), key=True)
    return attrs.evolve(fields, **{f: None for f in _BOUNDARY_ONLY})


def _mesh_dims_of(fields: RuleFields) -> set[str]:
    dims: set[str] = set()
    for name in ("params", "in_src", "in_dst", "out_src", "out_dst", "inner_out_src", "in_grad",
                 "out_grad"):
        value = getattr(fields, name)
        for _, p in value or ():
            dims.update(p.mesh_dims)
    for _, d in (*(fields.head_counts or ()), *(fields.reduce_grads or ())):
        dims.add(d)
    return dims
