"""Stage 1: match every active rule to modules and collect its claims into a :class:`ClaimTable`.

A claim is one rule's value for one slot: ``(module FQN, field, key)`` (``key`` is ``None`` for
scalar fields such as ``boundary``; a parameter's slot is its owner's, so tied parameters share
one). Two claims on one slot from the same recipe file are refused; a claim from a recipe that
``extends`` another refines its base's and keeps it as ``overridden`` provenance. Each name of a
tied parameter keeps its own latest claim, and those must agree once every rule is matched: a
recipe that ``extends`` another may re-place a tied parameter by placing all its names the same
way, and placing one name differently from another is refused naming both rules. Layout keys are
bound to the forward's argument names here (``in_src: {0: ...}`` becomes the first positional
argument), so later stages see names only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from hyperrecipe.errors import RecipeError, SourceSpan, closest, did_you_mean
from hyperrecipe.model_tree import ModuleInfo, ParamInfo
from hyperrecipe.placement import NamedPlacement, Partial
from hyperrecipe.plan import RuleRef
from hyperrecipe.recipe.patterns import compile_pattern, generalize_fqn
from hyperrecipe.recipe.schema import MAPPING_FIELDS, RULE_FIELD_NAMES, LayoutKey, Rule
from hyperrecipe.resolve.context import Claim, ResolveInput

__all__ = ["ClaimTable", "Slot", "match_rules"]

Slot = tuple[str, str, Any]
"""(module FQN, field, key)."""

_SCALAR_FIELDS = ("boundary", "out_names", "defer_bias", "inner_wrapper", "local_region",
                  "no_grad", "loss_parallel")


@attrs.frozen(kw_only=True)
class ClaimTable:
    """Every claim of the active rules, by slot, in claim order; and every rule's reference."""

    slots: Mapping[Slot, Claim]
    rules: tuple[RuleRef, ...]
    _by_module: Mapping[str, tuple[tuple[str, Any, Claim], ...]] = attrs.field(
        init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        index: dict[str, list[tuple[str, Any, Claim]]] = {}
        for (fqn, field, key), c in self.slots.items():
            index.setdefault(fqn, []).append((field, key, c))
        object.__setattr__(self, "_by_module", {k: tuple(v) for k, v in index.items()})

    def get(self, fqn: str, field: str, key: Any = None) -> Claim | None:
        return self.slots.get((fqn, field, key))

    def of(self, fqn: str) -> tuple[tuple[str, Any, Claim], ...]:
        """(field, key, claim) of one module, in claim order."""
        return self._by_module.get(fqn, ())

    def layout(self, fqn: str, field: str) -> dict[Any, Claim]:
        """A mapping field of one module (``in_src``, ``out_dst``, ...), by key."""
        return {k: c for fld, k, c in self.of(fqn) if fld == field}


def match_rules(inp: ResolveInput) -> ClaimTable:
    """Match every active rule and collect its claims.

    Raises:
        RecipeError: a rule matching no module (the nearest FQNs named), a parameter or
            argument the module does not have, a partial parameter, or two claims on one slot
            from one recipe file.
    """
    matcher = _Matcher(inp)
    refs: list[RuleRef] = []
    fqns = [m.fqn for m in inp.tree.modules if m.fqn]
    for rule in inp.recipe.rules:
        active = rule.active(dict(inp.mesh_shape))
        matched: list[str] = []
        if active:
            rx = compile_pattern(rule.match)
            matched = [f for f in fqns if rx.fullmatch(f)]
            if not matched:
                raise _no_match(rule, fqns)
            for fqn in matched:
                matcher.claim_all(rule, inp.tree.module(fqn))
        span = rule.span()
        refs.append(RuleRef(file=span.path, line=span.line, column=span.column, index=rule.index,
                            match=rule.match, style=rule.style, active=active,
                            matched=len(matched)))
    matcher.check_ties()
    return ClaimTable(slots=dict(matcher.slots), rules=tuple(refs))


def _no_match(rule: Rule, fqns: Sequence[str]) -> RecipeError:
    general = sorted({generalize_fqn(f) for f in fqns})
    near = closest(rule.match, general, n=3) or closest(rule.match, fqns, n=3)
    hint = f"nearest module FQNs: {', '.join(near)}" if near else (
        f"module FQNs look like: {', '.join(general[:5])}")
    return RecipeError(f"{rule.label()} matches no module of the model", span=rule.span("match"),
                       path=f"{rule.json_path}.match", rule_index=rule.index, hint=hint)


def no_param(rule: Rule, module: ModuleInfo, key: str, field: str = "params") -> RecipeError:
    """A rule names a parameter the module does not have directly."""
    names = [p.name for p in module.params]
    return RecipeError(
        f"module {module.fqn!r} ({module.cls.rsplit('.', 1)[-1]}) has no parameter {key!r}"
        f"{did_you_mean(key, names)}", span=rule.span(field, key, key=True),
        path=f"{rule.json_path}.{field}.{key}", rule_index=rule.index,
        hint=f"its direct parameters: [{', '.join(names)}]")


class _Matcher:
    """Collects the claims of one resolve (its slots are the stage's output)."""

    def __init__(self, inp: ResolveInput) -> None:
        self.inp = inp
        self.slots: dict[Slot, Claim] = {}
        # tied parameters: owner FQN -> each name's latest claim (most recently claimed last)
        self.names: dict[str, dict[str, Claim]] = {}

    def claim_all(self, rule: Rule, module: ModuleInfo) -> None:
        f = rule.fields
        for name in _SCALAR_FIELDS:
            value = getattr(f, name)
            if value is not None:
                self._claim(rule, module, name, None, value)
        for name in (n for n in RULE_FIELD_NAMES if n in MAPPING_FIELDS):  # ordered: determinism
            for key, value in getattr(f, name) or ():
                if name == "params":
                    pinfo = module.param(key)
                    if pinfo is None:
                        if key in rule.explicit_params:
                            raise no_param(rule, module, key)
                        continue  # a style's bias on a bias-free module
                    self._claim_param(rule, module, pinfo, value)
                    continue
                if name == "reduce_grads":
                    if module.param(key) is None:
                        raise no_param(rule, module, key, field="reduce_grads")
                    self._claim(rule, module, name, key, value)
                    continue
                if name in ("in_src", "in_dst", "in_grad"):
                    key = _input_key(rule, module, name, key)
                self._claim(rule, module, name, key, value)

    @staticmethod
    def _via(rule: Rule, field: str) -> str:
        if field in rule.explicit or not rule.style:
            return f"explicit {field}"
        return f"style {rule.style}"

    def _claim(self, rule: Rule, module: ModuleInfo, field: str, key: Any, value: Any) -> None:
        slot = (module.fqn, field, key)
        new = Claim(value=value, rule=rule, via=self._via(rule, field))
        old = self.slots.get(slot)
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
            new = attrs.evolve(new, overridden=(*old.overridden, old))
        self.slots[slot] = new

    def _claim_param(self, rule: Rule, module: ModuleInfo, p: ParamInfo,
                     value: NamedPlacement) -> None:
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
        new = Claim(value=value, rule=rule, via=via, through_alias=p.tied_to is not None)
        names = self.names.setdefault(owner, {})
        same_name = names.pop(p.fqn, None)
        if same_name is not None and (same_name.rule.layer == rule.layer
                                      and same_name.rule.file == rule.file):
            mesh = self.inp.recipe.mesh
            differ = same_name.value.canonical(mesh) != value.canonical(mesh)
            what = f"is placed {same_name.value} by" if differ else "is claimed by two rules:"
            later = f"and {value} by" if differ else "and"
            raise RecipeError(
                f"parameter {p.fqn!r} {what} rule {same_name.rule.index} "
                f"({same_name.rule.span()}) {later} {rule.label()}", span=self._span(rule, p),
                path=f"{rule.json_path}.params.{p.name}", rule_index=rule.index,
                hint="a parameter belongs to exactly one rule")
        names[p.fqn] = new
        old = self.slots.get(slot)
        if old is not None:
            new = attrs.evolve(new, overridden=(*old.overridden, old))
        self.slots[slot] = new

    @staticmethod
    def _span(rule: Rule, p: ParamInfo) -> SourceSpan:
        return rule.span("params", p.name) if p.name in rule.explicit_params else rule.span("match")

    def check_ties(self) -> None:
        """Every name of a tied parameter ends with one placement.

        Raises:
            RecipeError: at the later of two rules that leave the names placed differently,
                naming both.
        """
        mesh = self.inp.recipe.mesh
        for owner, names in self.names.items():
            latest = list(names.items())
            if len(latest) < 2:
                continue
            b_name, b = latest[-1]
            for a_name, a in latest[:-1]:
                if a.value.canonical(mesh) == b.value.canonical(mesh):
                    continue
                p_name = b_name.rpartition(".")[2]
                module = self.inp.tree.module(b_name.rpartition(".")[0])
                p = module.param(p_name)
                assert p is not None
                layered = (a.rule.layer, a.rule.file) != (b.rule.layer, b.rule.file)
                hint = "tied parameters share one tensor and need one placement"
                if layered:
                    hint += (f": {b.rule.file} places {b_name} and leaves {a_name} as "
                             f"{a.rule.file} placed it; place both names the same way there")
                raise RecipeError(
                    f"tied parameter {owner!r} is placed {a.value} by rule {a.rule.index} "
                    f"({a.rule.span()}) and {b.value} by {b.rule.label()}",
                    span=self._span(b.rule, p), path=f"{b.rule.json_path}.params.{p.name}",
                    rule_index=b.rule.index, hint=hint)


def _input_key(rule: Rule, module: ModuleInfo, field: str, key: LayoutKey) -> str:
    """The argument name a layout key (a name or a position) stands for."""
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
