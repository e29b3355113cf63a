"""``resolve_recipe``: (Recipe, ModelTree, mesh shape) → Plan, a pure function.

Stages, in order: check the mesh against the recipe; match every active rule to modules;
collect each rule's claims per (module, field, key), refusing two claims from the same recipe
file and letting an ``extends``-child refine its base; settle parameters (ties, defaults,
divisibility, local shapes); build boundaries (layout keys bound to the forward signature,
nesting, head counts); lower every transition; list the expected collectives. Same inputs give
the same plan, byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from hyperrecipe.collective import IDENTITY, CollectiveOp
from hyperrecipe.errors import RecipeError, SourceSpan, closest, did_you_mean
from hyperrecipe.model_tree import ModelTree, ModuleInfo, ParamInfo
from hyperrecipe.placement import (
    REPLICATED,
    NamedPlacement,
    Partial,
    Placement,
    Replicate,
    Shard,
)
from hyperrecipe.plan import (
    PLAN_FORMAT,
    AdapterPlan,
    ArgLayout,
    BoundaryPlan,
    HeadCount,
    ManifestEntry,
    MeshDim,
    ParamPlan,
    Plan,
    Provenance,
    RuleRef,
    Stage,
    Transition,
    compute_fingerprint,
)
from hyperrecipe.recipe.patterns import compile_pattern, generalize_fqn
from hyperrecipe.recipe.schema import (
    MAPPING_FIELDS,
    RULE_FIELD_NAMES,
    AdapterSpec,
    LayoutKey,
    Recipe,
    Rule,
)
from hyperrecipe.resolve.lowering import ImpossibleTransition, canonical_grad, lower_transition

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.wrappers import WrapperSpec

__all__ = ["resolve_recipe"]

@attrs.define
class _Claim:
    value: Any
    rule: Rule
    via: str
    through_alias: bool = False
    overridden: list[_Claim] = attrs.field(factory=list)


def _prov(rule: Rule, reason: str, *sub: str | int) -> Provenance:
    span = rule.span(*sub) if sub else rule.span()
    return Provenance(file=span.path, line=span.line, column=span.column, rule_index=rule.index,
                      reason=reason)


def _provs(claim: _Claim, what: str, *sub: str | int) -> tuple[Provenance, ...]:
    """Provenance of a claim and of the claims it overrode, pointing at the field when the rule
    wrote it itself (at the rule's `match` when it came from a style)."""
    def at(c: _Claim) -> tuple[str | int, ...]:
        return sub if sub and sub[0] in c.rule.explicit else ("match",)

    out = [_prov(c.rule, f"{what} {_fmt(c.value)} ({c.via}); overridden by rule "
                         f"{claim.rule.index} of {claim.rule.file}", *at(c))
           for c in claim.overridden]
    out.append(_prov(claim.rule, f"{what} {_fmt(claim.value)} ({claim.via})", *at(claim)))
    return tuple(out)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


class _Resolver:
    def __init__(self, recipe: Recipe, tree: ModelTree, mesh: Mapping[str, int]) -> None:
        self.recipe = recipe
        self.tree = tree
        self.mesh_in = dict(mesh)
        # (module fqn, field, key) -> claim; key is None for scalar fields
        self.claims: dict[tuple[str, str, Any], _Claim] = {}
        self.rule_refs: list[RuleRef] = []
        # (boundary, stage, arg/output name) -> the claims that set its src and dst
        self.layout_claims: dict[tuple[str, str, str], list[_Claim]] = {}
        self.order = {m.fqn: i for i, m in enumerate(tree.modules)}
        self._by_module: dict[str, list[tuple[str, Any, _Claim]]] | None = None
        self._region_members: dict[str | None, list[ModuleInfo]] | None = None

    # ------------------------------------------------------------------ mesh
    def check_mesh(self) -> tuple[MeshDim, ...]:
        r = self.recipe
        for name, size in self.mesh_in.items():
            if name not in r.mesh:
                raise RecipeError(
                    f"mesh dim {name!r} is not declared by recipe {r.name!r}", span=r.span("mesh"), path="$.mesh",
                    hint=f"declared: [{', '.join(r.mesh)}]; mesh: {_mesh_text(self.mesh_in)}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise RecipeError(f"mesh dim {name!r} has size {size!r}; sizes are integers >= 1",
                                  span=r.span("mesh"), path="$.mesh")
        order = [d for d in r.mesh if d in self.mesh_in]
        return tuple(MeshDim(name=d, size=self.mesh_in[d]) for d in order)

    def size(self, dim: str) -> int:
        return self.mesh_in.get(dim, 1)

    # ------------------------------------------------------------------ claims
    def match_rules(self) -> None:
        fqns = [m.fqn for m in self.tree.modules if m.fqn]
        for rule in self.recipe.rules:
            active = rule.active(self.mesh_in)
            matched: list[str] = []
            if active:
                rx = compile_pattern(rule.match)
                matched = [f for f in fqns if rx.fullmatch(f)]
                if not matched:
                    raise self._no_match(rule, fqns)
                for fqn in matched:
                    self._claim_all(rule, self.tree.module(fqn))
            span = rule.span()
            self.rule_refs.append(RuleRef(file=span.path, line=span.line, column=span.column,
                                          index=rule.index, match=rule.match, style=rule.style,
                                          active=active, matched=len(matched)))

    def _no_match(self, rule: Rule, fqns: Sequence[str]) -> RecipeError:
        general = sorted({generalize_fqn(f) for f in fqns})
        near = closest(rule.match, general, n=3) or closest(rule.match, fqns, n=3)
        hint = f"nearest module FQNs: {', '.join(near)}" if near else (
            f"module FQNs look like: {', '.join(general[:5])}")
        return RecipeError(f"{rule.label()} matches no module of the model", span=rule.span("match"),
                           path=f"{rule.json_path}.match", rule_index=rule.index, hint=hint)

    def _claim_all(self, rule: Rule, module: ModuleInfo) -> None:
        f = rule.fields
        for name in ("boundary", "out_names", "defer_bias", "inner_wrapper", "local_region",
                     "no_grad"):
            value = getattr(f, name)
            if value is not None:
                self._claim(rule, module, name, None, value)
        for name in (n for n in RULE_FIELD_NAMES if n in MAPPING_FIELDS):  # ordered: determinism
            for key, value in getattr(f, name) or ():
                if name == "params":
                    if module.param(key) is None:
                        if key in rule.explicit_params:
                            raise self._no_param(rule, module, key)
                        continue  # a style's bias on a bias-free module
                    pinfo = module.param(key)
                    assert pinfo is not None
                    self._claim_param(rule, module, pinfo, value)
                    continue
                if name == "reduce_grads":
                    pinfo = module.param(key)
                    if pinfo is None:
                        raise self._no_param(rule, module, key, field="reduce_grads")
                    self._claim(rule, module, name, key, value)
                    continue
                if name in ("in_src", "in_dst"):
                    key = self._input_key(rule, module, name, key)
                self._claim(rule, module, name, key, value)

    def _via(self, rule: Rule, field: str) -> str:
        if field in rule.explicit or not rule.style:
            return f"explicit {field}"
        return f"style {rule.style}"

    def _claim(self, rule: Rule, module: ModuleInfo, field: str, key: Any, value: Any) -> None:
        slot = (module.fqn, field, key)
        new = _Claim(value=value, rule=rule, via=self._via(rule, field))
        old = self.claims.get(slot)
        if old is not None:
            if old.rule.layer == rule.layer and old.rule.file == rule.file:
                what = f"{field}[{key}]" if key is not None else field
                raise RecipeError(
                    f"{what} of module {module.fqn!r} is decided by two rules: rule "
                    f"{old.rule.index} ({old.rule.span()}) and {rule.label()}",
                    span=rule.span(field) if field in rule.explicit else rule.span("match"),
                    path=f"{rule.json_path}.{field}", rule_index=rule.index,
                    hint="each decision belongs to one rule; narrow one of the patterns, or "
                         "refine it from a recipe that `extends` this one")
            new.overridden = [*old.overridden, old]
        self.claims[slot] = new

    def _claim_param(self, rule: Rule, module: ModuleInfo, p: ParamInfo, value: NamedPlacement) -> None:
        for dim, q in value.dims:
            if isinstance(q, Partial):
                raise RecipeError(
                    f"parameter {p.fqn!r} cannot be placed {q} on {dim}: parameters are "
                    f"sharded or replicated", span=rule.span("params", p.name),
                    path=f"{rule.json_path}.params.{p.name}", rule_index=rule.index)
        owner = p.tied_to or p.fqn
        slot = (owner, "params", None)
        via = ("explicit params" if p.name in rule.explicit_params or not rule.style
               else f"style {rule.style}")
        if p.tied_to:
            via += f", through {p.fqn} (tied to {p.tied_to})"
        new = _Claim(value=value, rule=rule, via=via, through_alias=p.tied_to is not None)
        old = self.claims.get(slot)
        if old is not None:
            same_layer = old.rule.layer == rule.layer and old.rule.file == rule.file
            tied = new.through_alias or old.through_alias
            differ = old.value.canonical(self.recipe.mesh) != value.canonical(self.recipe.mesh)
            span = (rule.span("params", p.name) if p.name in rule.explicit_params
                    else rule.span("match"))
            if differ and (same_layer or tied):
                kind = "tied parameter" if tied else "parameter"
                raise RecipeError(
                    f"{kind} {owner!r} is placed {old.value} by rule {old.rule.index} "
                    f"({old.rule.span()}) and {value} by {rule.label()}", span=span,
                    path=f"{rule.json_path}.params.{p.name}", rule_index=rule.index,
                    hint="tied parameters share one tensor and need one placement" if tied
                    else "a parameter belongs to exactly one rule")
            if same_layer and not tied:
                raise RecipeError(
                    f"parameter {owner!r} is claimed by two rules: rule {old.rule.index} "
                    f"({old.rule.span()}) and {rule.label()}", span=span,
                    path=f"{rule.json_path}.params.{p.name}", rule_index=rule.index,
                    hint="a parameter belongs to exactly one rule")
            new.overridden = [*old.overridden, old]
        self.claims[slot] = new

    def _no_param(self, rule: Rule, module: ModuleInfo, key: str,
                  field: str = "params") -> RecipeError:
        names = [p.name for p in module.params]
        return RecipeError(
            f"module {module.fqn!r} ({module.cls.rsplit('.', 1)[-1]}) has no parameter {key!r}"
            f"{did_you_mean(key, names)}", span=rule.span(field, key, key=True),
            path=f"{rule.json_path}.{field}.{key}", rule_index=rule.index,
            hint=f"its direct parameters: [{', '.join(names)}]")

    def _input_key(self, rule: Rule, module: ModuleInfo, field: str, key: LayoutKey) -> str:
        positional = module.positional_args
        names = [a.name for a in module.signature if a.kind not in ("var_positional", "var_keyword")]
        if isinstance(key, int):
            if key >= len(positional):
                raise RecipeError(
                    f"{field} position {key} is out of range for {module.fqn!r}.forward"
                    f"({', '.join(names)})", span=rule.span(field, key, key=True),
                    path=f"{rule.json_path}.{field}[{key}]", rule_index=rule.index,
                    hint=f"it takes {len(positional)} positional argument(s)")
            return positional[key]
        if key in names or any(a.kind == "var_keyword" for a in module.signature):
            return key
        raise RecipeError(
            f"{field} names argument {key!r}, which {module.fqn!r}.forward does not take"
            f"{did_you_mean(key, names)}", span=rule.span(field, key, key=True),
            path=f"{rule.json_path}.{field}.{key}", rule_index=rule.index,
            hint=f"forward({', '.join(names)})")

    def get(self, fqn: str, field: str, key: Any = None) -> _Claim | None:
        return self.claims.get((fqn, field, key))

    def claims_of(self, fqn: str) -> list[tuple[str, Any, _Claim]]:
        """(field, key, claim) of one module, in claim order; indexed once matching is done."""
        if self._by_module is None:
            index: dict[str, list[tuple[str, Any, _Claim]]] = {}
            for (f, field, key), c in self.claims.items():
                index.setdefault(f, []).append((field, key, c))
            self._by_module = index
        return self._by_module.get(fqn, [])

    def layout(self, fqn: str, field: str) -> dict[Any, _Claim]:
        return {k: c for fld, k, c in self.claims_of(fqn) if fld == field}

    # ------------------------------------------------------------------ params
    def params(self, deferred: dict[str, set[str]], regions: dict[str, str | None],
               sharded_regions: dict[str, set[str]]) -> tuple[ParamPlan, ...]:
        out: list[ParamPlan] = []
        unclaimed: list[str] = []
        owners: dict[str, ParamPlan] = {}
        for module in self.tree.modules:
            for p in module.params:
                owner = p.tied_to or p.fqn
                claim = self.get(owner, "params")
                if claim is None:
                    if self.recipe.unclaimed == "error":
                        unclaimed.append(p.fqn)
                    placement = REPLICATED
                    span = self.recipe.span("unclaimed")
                    provenance: tuple[Provenance, ...] = (Provenance(
                        file=span.path, line=span.line, column=span.column, rule_index=-1,
                        reason="claimed by no rule; unclaimed parameters are replicated"),)
                else:
                    placement = claim.value.canonical(self.recipe.mesh)
                    provenance = _provs(claim, "placed", "params", p.name)
                    self._check_param(claim, p, placement)
                if p.tied_to and p.tied_to in owners:
                    base = owners[p.tied_to]
                    out.append(attrs.evolve(base, fqn=p.fqn, module=module.fqn, name=p.name,
                                            tied_to=p.tied_to, grad_reduce=(),
                                            provenance=(*provenance, Provenance(
                                                file=provenance[-1].file,
                                                line=provenance[-1].line,
                                                column=provenance[-1].column,
                                                rule_index=provenance[-1].rule_index,
                                                reason=f"shares storage with {p.tied_to}"),)))
                    continue
                is_deferred = p.fqn in deferred
                grad_reduce = self._grad_reduce(p, module, placement, is_deferred, deferred, regions,
                                                sharded_regions)
                plan = ParamPlan(fqn=p.fqn, module=module.fqn, name=p.name, shape=p.shape,
                                 dtype=p.dtype, placement=placement,
                                 local_shape=self._local_shape(p.shape, placement),
                                 deferred=is_deferred, grad_reduce=grad_reduce,
                                 provenance=provenance)
                owners[p.fqn] = plan
                out.append(plan)
        if unclaimed:
            shown = ", ".join(unclaimed[:5]) + (f" and {len(unclaimed) - 5} more"
                                                if len(unclaimed) > 5 else "")
            raise RecipeError(f"{len(unclaimed)} parameter(s) claimed by no rule: {shown}",
                              span=self.recipe.span("unclaimed"), path="$.unclaimed",
                              hint="add rules for them, or set `unclaimed: replicate`")
        return tuple(out)

    def _grad_reduce(self, p: ParamInfo, module: ModuleInfo, placement: NamedPlacement,
                     deferred: bool, deferred_dims: dict[str, set[str]],
                     regions: dict[str, str | None],
                     sharded_regions: dict[str, set[str]]) -> tuple[CollectiveOp, ...]:
        region = regions.get(module.fqn)
        if deferred:
            # added after the reduction, to an output that may be sharded (sequence parallel):
            # then each rank's bias gradient covers only its slice and is partial
            dims = deferred_dims.get(p.fqn, set())
            return tuple(CollectiveOp(kind="all_reduce", mesh_dim=d)
                         for d in self.recipe.mesh if d in dims)
        dims = set(sharded_regions.get(region, set())) if region is not None else set()
        explicit = self.get(module.fqn, "reduce_grads", p.name)
        if explicit is not None:
            dim = explicit.value
            if not isinstance(placement.get(dim), Replicate):
                rule = explicit.rule
                raise RecipeError(
                    f"reduce_grads: parameter {p.fqn!r} is placed {placement}; only a replicated "
                    f"parameter's gradient is all-reduced over {dim}",
                    span=rule.span("reduce_grads", p.name, key=True),
                    path=f"{rule.json_path}.reduce_grads.{p.name}", rule_index=rule.index)
            dims.add(dim)
        return tuple(CollectiveOp(kind="all_reduce", mesh_dim=dim) for dim in self.recipe.mesh
                     if dim in dims and self.size(dim) > 1
                     and isinstance(placement.get(dim), Replicate))

    def _check_param(self, claim: _Claim, p: ParamInfo, placement: NamedPlacement) -> None:
        rule = claim.rule
        span = rule.span("params", p.name) if p.name in rule.explicit_params else rule.span("match")
        path = f"{rule.json_path}.params.{p.name}"
        per_dim: dict[int, list[tuple[str, Shard]]] = {}
        for dim, q in placement.dims:
            if dim not in self.mesh_in:
                raise RecipeError(
                    f"parameter {p.fqn!r} is placed on mesh dim {dim!r}, which the mesh lacks",
                    span=span, path=path, rule_index=rule.index,
                    hint=f"mesh: {_mesh_text(self.mesh_in)}; add {dim}=1 or guard the rule "
                         f"with `when`")
            if isinstance(q, Shard):
                nd = len(p.shape)
                d = q.dim + nd if q.dim < 0 else q.dim
                if not 0 <= d < nd:
                    raise RecipeError(
                        f"{q} on {dim} is out of range for parameter {p.fqn!r} of shape "
                        f"{list(p.shape)}", span=span, path=path, rule_index=rule.index,
                        hint=f"valid dims: {-nd}..{nd - 1}")
                per_dim.setdefault(d, []).append((dim, q))
        for d, entries in per_dim.items():
            size = p.shape[d]
            ways = 1
            for dim, q in entries:
                ways *= self.size(dim)
            q0 = entries[0][1]
            if q0.chunk_sizes and sum(q0.chunk_sizes) != size:
                raise RecipeError(
                    f"{q0} declares chunks summing to {sum(q0.chunk_sizes)}, but dim {d} of "
                    f"parameter {p.fqn!r} has size {size}", span=span, path=path,
                    rule_index=rule.index)
            if q0.chunks > 1 and not q0.chunk_sizes and size % q0.chunks:
                raise RecipeError(
                    f"dim {d} of parameter {p.fqn!r} (size {size}) is not divisible into "
                    f"{q0.chunks} equal chunks ({q0})", span=span, path=path,
                    rule_index=rule.index)
            dims_text = " x ".join(f"{dim}={self.size(dim)}" for dim, _ in entries)
            for part in q0.part_sizes(size):
                if part % ways:
                    what = f"chunk of size {part} of dim {d}" if q0.is_chunked else f"dim {d}"
                    raise RecipeError(
                        f"parameter {p.fqn!r}: {what} (size {size}) is not divisible by mesh dim "
                        f"{dims_text} ({q0})",
                        span=span, path=path, rule_index=rule.index,
                        hint=f"shape {list(p.shape)}; each rank must hold an equal slice")

    def _local_shape(self, shape: tuple[int, ...], placement: NamedPlacement) -> tuple[int, ...]:
        local = list(shape)
        for dim, q in placement.dims:
            if isinstance(q, Shard):
                d = q.dim + len(shape) if q.dim < 0 else q.dim
                local[d] //= self.size(dim)
        return tuple(local)

    # ------------------------------------------------------------------ boundaries
    def boundaries(self) -> tuple[list[str], dict[str, str | None]]:
        """Boundary FQNs in tree order, and for each module its nearest enclosing boundary."""
        is_boundary = {fqn for (fqn, field, _), c in self.claims.items()
                       if field == "boundary" and c.value is True}
        regions: dict[str, str | None] = {}
        for m in self.tree.modules:
            parent = m.fqn.rsplit(".", 1)[0] if "." in m.fqn else ("" if m.fqn else None)
            if m.fqn in is_boundary:
                regions[m.fqn] = m.fqn
            else:
                regions[m.fqn] = regions.get(parent) if parent is not None else None
        for (fqn, field, _), c in self.claims.items():
            if field in ("in_src", "in_dst", "out_src", "out_dst", "defer_bias", "out_names",
                         "local_region", "no_grad") and fqn not in is_boundary:
                raise RecipeError(
                    f"{c.rule.label()} sets {field} on {fqn!r}, which is not a boundary",
                    span=c.rule.span(field) if field in c.rule.explicit else c.rule.span("match"),
                    path=f"{c.rule.json_path}.{field}", rule_index=c.rule.index,
                    hint="add `boundary: true` (or use a style that declares one)")
        return [m.fqn for m in self.tree.modules if m.fqn in is_boundary], regions

    def sharded_dims(self, bfqn: str, regions: dict[str, str | None],
                     in_dst: Sequence[NamedPlacement]) -> tuple[set[str], set[str]]:
        """Mesh dims on which the boundary's own region (nested boundaries excluded) holds
        sharded parameters, and those on which its declared inputs arrive sharded."""
        if self._region_members is None:
            members: dict[str | None, list[ModuleInfo]] = {}
            for m in self.tree.modules:
                members.setdefault(regions.get(m.fqn), []).append(m)
            self._region_members = members
        params: set[str] = set()
        for m in self._region_members.get(bfqn, []):
            for p in m.params:
                claim = self.get(p.tied_to or p.fqn, "params")
                if claim is not None:
                    params.update(d for d, q in claim.value.dims if isinstance(q, Shard)
                                  and self.size(d) > 1)
        inputs: set[str] = set()
        for placement in in_dst:
            inputs.update(d for d, q in placement.dims if isinstance(q, Shard) and self.size(d) > 1)
        return params, inputs

    def build_boundary(self, fqn: str,
                       regions: dict[str, str | None]) -> tuple[BoundaryPlan, set[str]]:
        module = self.tree.module(fqn)
        provenance: list[Provenance] = []
        for field, key, c in self.claims_of(fqn):
            if field != "params":
                what = f"{field}[{key}]" if key is not None else field
                provenance.extend(_provs(c, f"set {what} to", field))
        out_names_claim = self.get(fqn, "out_names")
        out_names: tuple[str, ...] = out_names_claim.value if out_names_claim else ()
        in_src = self.layout(fqn, "in_src")
        in_dst = self.layout(fqn, "in_dst")
        positional = module.positional_args
        inputs: list[ArgLayout] = []
        for name in sorted(set(in_src) | set(in_dst), key=lambda n: (
                positional.index(n) if n in positional else len(positional), n)):
            src = self._placed(in_src.get(name), fqn, "in_src", name)
            dst = self._placed(in_dst.get(name), fqn, "in_dst", name) if name in in_dst else src
            self.layout_claims[(fqn, "input", name)] = [
                c for c in (in_dst.get(name), in_src.get(name)) if c is not None]
            inputs.append(ArgLayout(name=name, position=positional.index(name)
                                    if name in positional else None, src=src, dst=dst))
        outputs = self._outputs(fqn, "out_src", "out_dst", out_names)
        inner_out = self._outputs(fqn, "inner_out_src", None, out_names)
        parent = regions.get(fqn.rsplit(".", 1)[0]) if "." in fqn else regions.get("")
        depth, up = 0, parent
        while up is not None:
            depth += 1
            up_parent = up.rsplit(".", 1)[0] if "." in up else ""
            up = regions.get(up_parent) if up else None
        sharded_params, sharded_inputs = self.sharded_dims(fqn, regions, [a.dst for a in inputs])
        no_grad = self._no_grad(fqn, inputs)
        transitions = self._transitions(fqn, inputs, outputs, sharded_params, no_grad)
        deferred: list[str] = []
        defer = self.get(fqn, "defer_bias")
        if defer is not None and defer.value and module.param("bias") is not None:
            first = outputs[0] if outputs else None
            if first is None or any(isinstance(q, Partial) for _, q in first.dst.dims):
                c = defer
                raise RecipeError(
                    f"defer_bias on {fqn!r}: the bias is added after this boundary's reduction, "
                    f"but its first output leaves {first.dst if first else 'undeclared'}; "
                    f"reduce it here (out_dst replicate or shard) or do not defer the bias",
                    span=c.rule.span("defer_bias") if "defer_bias" in c.rule.explicit
                    else c.rule.span("match"), path=f"{c.rule.json_path}.defer_bias",
                    rule_index=c.rule.index)
            deferred.append("bias")
        local_region = self.get(fqn, "local_region")
        if local_region is not None and local_region.value and not outputs:
            c = local_region
            raise RecipeError(f"local_region on {fqn!r} needs out_src: a local region's outputs "
                              f"must declare their placement", span=c.rule.span("local_region"),
                              path=f"{c.rule.json_path}.local_region", rule_index=c.rule.index)
        wrapper = self.get(fqn, "inner_wrapper")
        if wrapper is not None:
            specs = self._check_wrappers(fqn, wrapper)
            if not inner_out:
                inner_out = self._declared_inner_out(fqn, wrapper, specs, out_names,
                                                     sharded_params | sharded_inputs)
                provenance.append(_prov(
                    wrapper.rule, f"set inner_out_src to the wrappers' declaration: "
                    f"{', '.join(f'{a.name} {a.src}' for a in inner_out)}",
                    *(("inner_wrapper",) if "inner_wrapper" in wrapper.rule.explicit else ())))
        plan = BoundaryPlan(
            fqn=fqn, module_class=module.cls, depth=depth, parent=parent, inputs=tuple(inputs),
            outputs=tuple(outputs), out_names=out_names, defer_bias=tuple(deferred),
            inner_wrapper=wrapper.value if wrapper else (),
            inner_out_src=tuple(inner_out), local_region=bool(local_region and local_region.value),
            no_grad=no_grad, transitions=transitions, provenance=tuple(provenance))
        return plan, sharded_inputs

    def _no_grad(self, fqn: str, inputs: Sequence[ArgLayout]) -> tuple[str, ...]:
        """The boundary's gradient-free inputs: declared ones (each must be a declared input,
        or there would be nothing to skip) and the integer inputs of torch's own modules."""
        claim = self.get(fqn, "no_grad")
        declared = [a.name for a in inputs]
        names: list[str] = list(claim.value) if claim else []
        for i, name in enumerate(names):
            if name not in declared:
                assert claim is not None
                sub: tuple[str | int, ...] = ("no_grad", i)
                span = (claim.rule.span(*sub) if "no_grad" in claim.rule.explicit
                        else claim.rule.span("match"))
                raise RecipeError(
                    f"no_grad names input {name!r} of {fqn!r}, which has no declared layout"
                    f"{did_you_mean(name, declared)}", span=span,
                    path=f"{claim.rule.json_path}.no_grad[{i}]", rule_index=claim.rule.index,
                    hint=f"declared inputs: {', '.join(declared) or 'none'}; no_grad only "
                         f"affects inputs named in in_src / in_dst")
        known = frozenset(self.tree.module(fqn).index_inputs)
        names += [n for n in declared if n in known and n not in names]
        return tuple(names)

    def _wrapper_span(self, claim: _Claim) -> tuple[SourceSpan, str]:
        rule = claim.rule
        span = rule.span("inner_wrapper") if "inner_wrapper" in rule.explicit else rule.span(
            "match")
        return span, f"{rule.json_path}.inner_wrapper"

    def _declared_inner_out(self, fqn: str, claim: _Claim, specs: Sequence[WrapperSpec],
                            out_names: tuple[str, ...], sharded: set[str]) -> list[ArgLayout]:
        """``inner_out_src`` from the chain's own declarations, when the recipe gives none.

        Every candidate must declare the same layout (whichever installs, validate mode wraps
        its results with the one plan entry), and the boundary must not be sharded on a mesh
        dim the declaration leaves out: a wrapper over ``cp`` cannot know that its inputs are
        also split over ``tp`` heads.
        """
        span, path = self._wrapper_span(claim)
        rule = claim.rule
        refs = list(claim.value)
        example = ("e.g. `inner_out_src: {0: {cp: shard(1)}}` for attention output "
                   "[batch, seq, heads, head_dim] over a sequence split on cp, or "
                   "`{0: replicate}`")
        layouts = {ref: spec.inner_out_src for ref, spec in zip(refs, specs, strict=True)}
        if not all(layouts.values()):
            missing = [r for r, lay in layouts.items() if not lay]
            raise RecipeError(
                f"inner wrapper {', '.join(map(repr, missing))} of {fqn!r} declares no output "
                f"layout, so the rule must give inner_out_src: the layout of the local tensors "
                f"the wrapper returns (validate mode wraps them with it)", span=span, path=path,
                rule_index=rule.index, hint=example)
        if len(set(layouts.values())) > 1:
            found = "; ".join(f"{r}: " + ", ".join(f"{k}: {v}" for k, v in lay)
                              for r, lay in layouts.items())
            raise RecipeError(
                f"the inner wrappers of {fqn!r} declare different output layouts ({found}); "
                f"give inner_out_src for the one plan entry whichever installs", span=span,
                path=path, rule_index=rule.index, hint=example)
        declared = layouts[refs[0]]
        named = {d for _, placement in declared for d in placement.mesh_dims}
        other = sorted(d for d in sharded if d not in named and self.size(d) > 1)
        if other:
            layout = ", ".join(f"{k}: {v}" for k, v in declared)
            raise RecipeError(
                f"inner wrapper {refs[0]!r} of {fqn!r} declares its output layout over "
                f"{', '.join(sorted(named)) or 'no mesh dim'} ({layout}), but {fqn!r} is also "
                f"sharded over {', '.join(other)}; give inner_out_src naming every dim",
                span=span, path=path, rule_index=rule.index,
                hint="e.g. `inner_out_src: {attn_output: {tp: shard(2), cp: shard(1)}}` for "
                     "attention heads over tp and the sequence over cp")
        out: list[ArgLayout] = []
        for pos, placement in declared:
            name = out_names[pos] if pos < len(out_names) else ("output" if pos == 0
                                                                else f"output{pos}")
            placed = placement.canonical(self.recipe.mesh)
            out.append(ArgLayout(name=name, position=pos, src=placed, dst=placed))
        return out

    def _check_wrappers(self, fqn: str, claim: _Claim) -> list[WrapperSpec]:
        """Every candidate of an inner-wrapper chain loads and finds its mesh dims; returns
        their specs.

        Loading imports the wrapper's module (built-ins live in the runtime; nothing runs but
        the decorator), so a typo in a custom reference fails here, not on a cluster.
        """
        from hyperrecipe.wrappers import load_wrapper

        specs: list[WrapperSpec] = []
        rule = claim.rule
        for i, ref in enumerate(claim.value):
            sub: tuple[str | int, ...] = ("inner_wrapper", i) if len(claim.value) > 1 else (
                "inner_wrapper",)
            span = rule.span(*sub) if "inner_wrapper" in rule.explicit else rule.span("match")
            path = f"{rule.json_path}.inner_wrapper"
            try:
                spec = load_wrapper(ref)
            except Exception as exc:  # noqa: BLE001 - user code: report it at the recipe line
                raise RecipeError(f"inner wrapper of {fqn!r}: {exc}", span=span, path=path,
                                  rule_index=rule.index) from None
            missing = [d for d in spec.mesh_dims if d not in self.mesh_in]
            if missing:
                raise RecipeError(
                    f"inner wrapper {ref!r} of {fqn!r} works over mesh dim(s) "
                    f"{', '.join(missing)}, which the mesh lacks", span=span, path=path,
                    rule_index=rule.index,
                    hint=f"mesh: {_mesh_text(self.mesh_in)}; declared by the wrapper: "
                         f"{list(spec.mesh_dims)}")
            specs.append(spec)
        return specs

    def _placed(self, claim: _Claim | None, fqn: str, field: str, key: Any) -> NamedPlacement:
        if claim is None:
            return REPLICATED
        value: NamedPlacement = claim.value
        for dim, q in value.dims:
            if dim not in self.mesh_in:
                raise RecipeError(
                    f"{field}[{key}] of {fqn!r} is placed on mesh dim {dim!r}, which the mesh "
                    f"lacks", span=claim.rule.span(field), path=f"{claim.rule.json_path}.{field}",
                    rule_index=claim.rule.index,
                    hint=f"mesh: {_mesh_text(self.mesh_in)}; add {dim}=1 or guard the rule with "
                         f"`when`")
            if isinstance(q, Partial) and q.reduce != "sum":
                raise RecipeError(
                    f"{field}[{key}] of {fqn!r}: {q} layouts are not supported; use partial (sum)",
                    span=claim.rule.span(field), path=f"{claim.rule.json_path}.{field}",
                    rule_index=claim.rule.index)
            if isinstance(q, Shard) and q.is_chunked:
                raise RecipeError(
                    f"{field}[{key}] of {fqn!r}: {q} describes fused parameters, not activations",
                    span=claim.rule.span(field), path=f"{claim.rule.json_path}.{field}",
                    rule_index=claim.rule.index)
        return value.canonical(self.recipe.mesh)

    def _outputs(self, fqn: str, src_field: str, dst_field: str | None,
                 out_names: tuple[str, ...]) -> list[ArgLayout]:
        src = self.layout(fqn, src_field)
        dst = self.layout(fqn, dst_field) if dst_field else {}
        merged: dict[int, tuple[str, NamedPlacement, NamedPlacement]] = {}
        for field, table in ((src_field, src), (dst_field, dst)):
            for key, claim in table.items():
                pos = self._output_position(fqn, field or src_field, key, claim, out_names)
                name = out_names[pos] if pos < len(out_names) else ("output" if pos == 0
                                                                    else f"output{pos}")
                placed = self._placed(claim, fqn, field or src_field, key)
                claims = self.layout_claims.setdefault((fqn, "output" if dst_field else "inner",
                                                        name), [])
                claims.insert(0, claim) if field == dst_field else claims.append(claim)
                if pos in merged:
                    n, s, d = merged[pos]
                    merged[pos] = (n, s, placed) if field == dst_field else (n, placed, d)
                else:
                    merged[pos] = (name, placed, placed) if field == src_field else (
                        name, REPLICATED, placed)
        return [ArgLayout(name=n, position=pos, src=s, dst=d)
                for pos, (n, s, d) in sorted(merged.items())]

    def _output_position(self, fqn: str, field: str, key: LayoutKey, claim: _Claim,
                         out_names: tuple[str, ...]) -> int:
        if isinstance(key, int):
            return key
        if key in out_names:
            return out_names.index(key)
        if key == "output" and not out_names:
            return 0
        raise RecipeError(
            f"{field} names output {key!r} of {fqn!r}, but "
            + (f"out_names are [{', '.join(out_names)}]{did_you_mean(key, out_names)}"
               if out_names else "the boundary declares no out_names"),
            span=claim.rule.span(field, key, key=True), path=f"{claim.rule.json_path}.{field}.{key}",
            rule_index=claim.rule.index,
            hint="name outputs with `out_names: [...]`, or use positions (0, 1, ...)")

    def _transitions(self, fqn: str, inputs: Sequence[ArgLayout], outputs: Sequence[ArgLayout],
                     sharded: set[str], no_grad: Sequence[str]) -> tuple[Transition, ...]:
        out: list[Transition] = []
        for stage, layouts in (("input", inputs), ("output", outputs)):
            for arg in layouts:
                for dim in self.recipe.mesh:
                    if dim not in self.mesh_in:
                        continue
                    s, d = arg.src.get(dim), arg.dst.get(dim)
                    t = self._lower(fqn, stage, arg.name, dim, s, d, sharded,  # type: ignore[arg-type]
                                    no_grad=stage == "input" and arg.name in no_grad)
                    if t is not None:
                        out.append(t)
        return tuple(out)

    def _lower(self, fqn: str, stage: Stage, name: str, dim: str, s: Placement, d: Placement,
               sharded: set[str], *, no_grad: bool = False) -> Transition | None:
        try:
            fwd = lower_transition(s, d, dim)
        except ImpossibleTransition as exc:
            claims = self.layout_claims.get((fqn, stage, name), [])
            claim = claims[0] if claims else None
            prefix = "in" if stage == "input" else "out"
            field = next((f for f in (f"{prefix}_dst", f"{prefix}_src")
                          if claim is not None and getattr(claim.rule.fields, f)), f"{prefix}_dst")
            rule = claim.rule if claim else None
            raise RecipeError(
                f"{fqn!r} {stage} {name!r} on {dim}: {exc}",
                span=(rule.span(field, key=True) if field in rule.explicit else rule.span("match"))
                if rule else None,
                path=f"{rule.json_path}.{field}" if rule else "$", rule_index=rule.index if rule
                else None) from None
        if no_grad:
            reason = f"{s} -> {d}, no gradient (no_grad): no backward collective"
            bwd = IDENTITY
        elif stage == "input":
            inner_grad = canonical_grad(d)
            reason = "input"
            if isinstance(d, Replicate) and dim in sharded and self.size(dim) > 1:
                inner_grad = Partial()
                reason = (f"replicated input consumed by parameters sharded on {dim}: its "
                          f"gradient is partial and is all-reduced (Megatron's f)")
            bwd = lower_transition(inner_grad, canonical_grad(s), dim)
        else:
            reason = "output"
            bwd = lower_transition(canonical_grad(d), canonical_grad(s), dim)
        if self.size(dim) == 1:
            fwd, bwd = (IDENTITY if fwd.communicates else fwd), (IDENTITY if bwd.communicates
                                                                  else bwd)
        if fwd == IDENTITY and bwd == IDENTITY:
            return None
        if reason in ("input", "output"):
            reason = ""
        return Transition(boundary=fqn, stage=stage, name=name, mesh_dim=dim, src=s, dst=d,
                          forward=fwd, backward=bwd, reason=reason)

    def head_counts(self) -> tuple[HeadCount, ...]:
        out: list[HeadCount] = []
        slots = sorted(((fqn, key), c) for (fqn, field, key), c in self.claims.items()
                       if field == "head_counts")
        for (fqn, attr), claim in sorted(slots, key=lambda s: (self.order[s[0][0]], s[0][1])):
            module = self.tree.module(fqn)
            dim = claim.value
            value = module.int_attr(attr)
            rule = claim.rule
            span = rule.span("head_counts", attr, key=True)
            path = f"{rule.json_path}.head_counts.{attr}"
            if value is None:
                names = [k for k, _ in module.int_attrs]
                raise RecipeError(
                    f"module {fqn!r} has no integer attribute {attr!r}{did_you_mean(attr, names)}",
                    span=span, path=path, rule_index=rule.index,
                    hint=f"its integer attributes: [{', '.join(names)}]")
            if dim not in self.mesh_in:
                raise RecipeError(f"head count {attr!r} is divided by mesh dim {dim!r}, which the "
                                  f"mesh lacks", span=span, path=path, rule_index=rule.index,
                                  hint=f"mesh: {_mesh_text(self.mesh_in)}")
            n = self.size(dim)
            if value % n:
                raise RecipeError(
                    f"head count {fqn}.{attr} = {value} is not divisible by mesh dim {dim} of "
                    f"size {n}", span=span, path=path, rule_index=rule.index,
                    hint="every rank must hold whole heads")
            out.append(HeadCount(module=fqn, attr=attr, mesh_dim=dim, global_value=value,
                                 local_value=value // n,
                                 provenance=_provs(claim, f"divide {attr} by", "head_counts")[-1]))
        return tuple(out)


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items()) or "(empty)"


def resolve_recipe(recipe: Recipe, tree: ModelTree, mesh_shape: Mapping[str, int]) -> Plan:
    """Resolve a recipe against a model structure and mesh shape.

    Args:
        recipe: from :func:`hyperrecipe.recipe.load_recipe`.
        tree: from :func:`hyperrecipe.model_tree.snapshot` (a model built on the meta device).
        mesh_shape: mesh dim name → size, e.g. ``{"dp": 2, "tp": 4}``; recipe dims not given
            have size 1 for ``when`` conditions and may not hold placements.

    Returns:
        The frozen plan. Pure: same inputs, same plan (and the same JSON bytes).

    Raises:
        RecipeError: any refusal, naming file:line:col, the rule and what was expected.
    """
    r = _Resolver(recipe, tree, mesh_shape)
    mesh = r.check_mesh()
    r.match_rules()
    names, regions = r.boundaries()
    boundaries: list[BoundaryPlan] = []
    sharded_regions: dict[str, set[str]] = {}
    deferred: dict[str, set[str]] = {}
    for fqn in names:
        b, sharded = r.build_boundary(fqn, regions)
        boundaries.append(b)
        sharded_regions[fqn] = sharded
        for name in b.defer_bias:
            deferred[f"{fqn}.{name}"] = {d for d, q in b.outputs[0].dst.dims
                                         if isinstance(q, Shard) and r.size(d) > 1}
    params = r.params(deferred, regions, sharded_regions)
    manifest: list[ManifestEntry] = []
    for b in sorted(boundaries, key=lambda b: r.order[b.fqn]):
        for t in b.transitions:
            for direction, op in (("forward", t.forward), ("backward", t.backward)):
                if op.communicates:
                    manifest.append(ManifestEntry(boundary=b.fqn, stage=t.stage, name=t.name,
                                                  mesh_dim=t.mesh_dim, direction=direction,  # type: ignore[arg-type]
                                                  op=op))
    for p in params:
        for op in p.grad_reduce:
            manifest.append(ManifestEntry(boundary=regions.get(p.module) or "", stage="param_grad",
                                          name=p.fqn, mesh_dim=op.mesh_dim, direction="backward",
                                          op=op))
    adapters = _adapter_plans(recipe, tree)
    model_digest = tree.digest()
    return Plan(
        format=PLAN_FORMAT, recipe=recipe.name, recipe_files=recipe.files,
        recipe_digest=recipe.digest, model_digest=model_digest, mesh=mesh,
        fingerprint=compute_fingerprint(recipe.digest, model_digest, mesh),
        rules=tuple(r.rule_refs), params=params, boundaries=tuple(boundaries),
        head_counts=r.head_counts(), manifest=tuple(manifest), adapters=adapters,
    ).sealed()


def _adapter_plans(recipe: Recipe, tree: ModelTree) -> tuple[AdapterPlan, ...]:
    """The recipe's adapters, one per target: a recipe that ``extends`` another may re-declare
    a base's adapter (its own entry wins, as its rules refine the base's); one file may not
    declare a target twice (the loader refuses it).

    Targets are not imported here: resolving stays free of import side effects, and the
    adapted package need not be installed where the plan is compiled. A target whose module
    the model already imported is checked, though, so a misspelt class or method of the model's
    own code fails at compile time with its recipe line; the rest are found by ``apply``.

    Raises:
        RecipeError: a target's module is imported and lacks the class or the method.
    """
    chosen: dict[str, AdapterPlan] = {}
    index_in_file: dict[str, int] = {}
    for a in recipe.adapters:
        i = index_in_file.get(a.file, 0)
        index_in_file[a.file] = i + 1
        reason = f"adapter {a.mode}" + (f" (output placement {a.out_src})" if a.out_src else "")
        earlier = chosen.get(a.target)
        if earlier is not None:
            reason += f"; overrides {earlier.provenance.file}:{earlier.provenance.line}"
        plan = AdapterPlan(target=a.target, mode=a.mode, out_src=a.out_src, provenance=Provenance(
            file=a.file, line=a.line, column=a.column, rule_index=-1, reason=reason),
            within=_adapter_within(a, tree, f"$.adapters[{i}].within"))
        _check_imported_target(plan, f"$.adapters[{i}].target")
        chosen.pop(a.target, None)
        chosen[a.target] = plan
    return tuple(chosen.values())


def _adapter_within(a: AdapterSpec, tree: ModelTree, path: str) -> tuple[str, ...]:
    """The FQNs a function adapter's ``within`` pattern matches (none for a method adapter).

    Raises:
        RecipeError: the pattern matches no module; the nearest FQNs are listed.
    """
    if a.within is None:
        return ()
    rx = compile_pattern(a.within)
    found = tuple(m.fqn for m in tree.modules if rx.fullmatch(m.fqn))
    if not found:
        near = did_you_mean(a.within, sorted({generalize_fqn(m.fqn) for m in tree.modules}))
        raise RecipeError(f"adapter {a.target!r}: within {a.within!r} matches no module of the "
                          f"model{near}", span=SourceSpan(path=a.file, line=a.line,
                                                          column=a.column), path=path)
    return found


def _check_imported_target(adapter: AdapterPlan, path: str) -> None:
    import sys

    module = sys.modules.get(adapter.module_name)
    if module is None:
        return
    prov = adapter.provenance
    span = SourceSpan(path=prov.file, line=prov.line, column=prov.column)
    owner: Any = module
    walked = adapter.module_name
    for part in (*adapter.class_path, adapter.method_name):
        if not hasattr(owner, part):
            names = [n for n in dir(owner) if not n.startswith("_")]
            raise RecipeError(f"adapter target {adapter.target!r}: {walked} has no attribute "
                              f"{part!r}{did_you_mean(part, names)}", span=span, path=path)
        owner = getattr(owner, part)
        walked = f"{walked}{':' if walked == adapter.module_name else '.'}{part}"
        if part != adapter.method_name and not isinstance(owner, type):
            raise RecipeError(f"adapter target {adapter.target!r}: {walked} is not a class",
                              span=span, path=path)
    if not callable(owner):
        raise RecipeError(f"adapter target {adapter.target!r} is not a method", span=span,
                          path=path)
