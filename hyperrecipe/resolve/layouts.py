"""The declared layouts of one boundary: its inputs, outputs and inner-wrapper outputs.

Each becomes an :class:`~hyperrecipe.plan.ArgLayout` (name, position, ``src``, ``dst``; a side
not declared is replicated, an input's missing ``dst`` is its ``src``), and keeps the claims
that set it so a refusal further down (an impossible transition, a layout no kernel fits) can
name the recipe line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hyperrecipe.errors import RecipeError, SourceSpan, did_you_mean
from hyperrecipe.placement import REPLICATED, NamedPlacement, Partial, Shard
from hyperrecipe.plan import ArgLayout
from hyperrecipe.recipe.schema import LayoutKey
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import Claim, ResolveInput

__all__ = ["DeclaredLayouts", "declared_layouts", "output_name"]

LayoutSlot = tuple[str, str]
"""(stage: ``input`` / ``output`` / ``inner``, argument or output name)."""


@attrs.frozen(kw_only=True)
class DeclaredLayouts:
    """One boundary's declared layouts, and the claims behind each (``dst`` side first)."""

    fqn: str
    out_names: tuple[str, ...]
    inputs: tuple[ArgLayout, ...]
    outputs: tuple[ArgLayout, ...]
    inner_out: tuple[ArgLayout, ...]
    claims: Mapping[LayoutSlot, tuple[Claim, ...]]

    def span(self, stage: str, name: str, *, prefer: str = "dst"
             ) -> tuple[SourceSpan | None, str, int | None]:
        """Where the layout of one input (``stage="input"``) or output was written: the rule
        field (``in_dst`` before ``in_src`` by default), at the key when the rule wrote it."""
        prefix = "in" if stage == "input" else "out"
        order = ((f"{prefix}_grad",) if prefer == "grad" else
                 (f"{prefix}_{prefer}", f"{prefix}_{'src' if prefer == 'dst' else 'dst'}"))
        found = self.claims.get((stage, name), ())
        for field in order:
            for c in found:
                if getattr(c.rule.fields, field):
                    rule = c.rule
                    span = (rule.span(field, name, key=True) if field in rule.explicit
                            else rule.span("match"))
                    return span, f"{rule.json_path}.{field}.{name}", rule.index
        return None, "$", None


def output_name(pos: int, out_names: tuple[str, ...]) -> str:
    """An output's name: its ``out_names`` entry, else ``output`` / ``output<pos>``."""
    return out_names[pos] if pos < len(out_names) else ("output" if pos == 0 else f"output{pos}")


def declared_layouts(inp: ResolveInput, claims: ClaimTable, fqn: str) -> DeclaredLayouts:
    """The layouts the recipe declares for boundary ``fqn``.

    Raises:
        RecipeError: a placement on a mesh dim the mesh lacks, a partial other than sum, a
            chunked shard of an activation, or an output key that names no output.
    """
    module = inp.tree.module(fqn)
    found: dict[LayoutSlot, list[Claim]] = {}
    out_names_claim = claims.get(fqn, "out_names")
    out_names: tuple[str, ...] = out_names_claim.value if out_names_claim else ()
    in_src = claims.layout(fqn, "in_src")
    in_dst = claims.layout(fqn, "in_dst")
    positional = module.positional_args
    inputs: list[ArgLayout] = []
    for name in sorted(set(in_src) | set(in_dst), key=lambda n: (
            positional.index(n) if n in positional else len(positional), n)):
        src = _placed(inp, in_src.get(name), fqn, "in_src", name)
        dst = _placed(inp, in_dst.get(name), fqn, "in_dst", name) if name in in_dst else src
        found[("input", name)] = [c for c in (in_dst.get(name), in_src.get(name))
                                  if c is not None]
        inputs.append(ArgLayout(name=name, position=positional.index(name)
                                if name in positional else None, src=src, dst=dst))
    outputs = _outputs(inp, claims, found, fqn, "out_src", "out_dst", out_names)
    inner_out = _outputs(inp, claims, found, fqn, "inner_out_src", None, out_names)
    inputs = _with_grads(inp, claims, found, fqn, "input", inputs, out_names)
    outputs = _with_grads(inp, claims, found, fqn, "output", outputs, out_names)
    return DeclaredLayouts(fqn=fqn, out_names=out_names, inputs=tuple(inputs),
                           outputs=tuple(outputs), inner_out=tuple(inner_out),
                           claims={k: tuple(v) for k, v in found.items()})


def _with_grads(inp: ResolveInput, claims: ClaimTable, found: dict[LayoutSlot, list[Claim]],
                fqn: str, stage: str, args: list[ArgLayout], out_names: tuple[str, ...]
                ) -> list[ArgLayout]:
    """``args`` with the gradient layouts ``in_grad`` / ``out_grad`` declares for them.

    Raises:
        RecipeError: a gradient declared for a slot with no declared layout, or on a mesh dim
            where the value is sharded on the side its gradient arrives at.
    """
    field = "in_grad" if stage == "input" else "out_grad"
    table = claims.layout(fqn, field)
    if not table:
        return args
    by_name = {a.name: i for i, a in enumerate(args)}
    out = list(args)
    for key, claim in table.items():
        name = key if stage == "input" else output_name(
            _output_position(fqn, field, key, claim, out_names), out_names)
        rule = claim.rule
        span = rule.span(field, key, key=True) if field in rule.explicit else rule.span("match")
        if name not in by_name:
            declared = list(by_name)
            raise RecipeError(
                f"{field} names {stage} {name!r} of {fqn!r}, which has no declared layout"
                f"{did_you_mean(str(name), declared)}", span=span,
                path=f"{rule.json_path}.{field}.{key}", rule_index=rule.index,
                hint=f"declared {stage}s: {', '.join(declared) or 'none'}; declare its layout "
                     f"({'in_src' if stage == 'input' else 'out_src'}) as well")
        i = by_name[name]
        grad = _placed(inp, claim, fqn, field, key)
        for dim, _ in grad.dims:
            placed = out[i].dst.get(dim)
            if isinstance(placed, Shard):
                side = "in_dst" if stage == "input" else "out_dst"
                raise RecipeError(
                    f"{field}[{key}] of {fqn!r} declares the gradient on {dim}, where the "
                    f"{stage} is {placed} ({side}): a sharded value's gradient is sharded the "
                    f"same way, with nothing to declare", span=span,
                    path=f"{rule.json_path}.{field}.{key}", rule_index=rule.index,
                    hint=f"declare the gradient only on mesh dims where {name!r} is "
                         f"replicated ({side})")
        found.setdefault((stage, str(name)), []).append(claim)
        out[i] = attrs.evolve(out[i], grad=grad)
    return out


def _placed(inp: ResolveInput, claim: Claim | None, fqn: str, field: str,
            key: Any) -> NamedPlacement:
    if claim is None:
        return REPLICATED
    value: NamedPlacement = claim.value
    for dim, q in value.dims:
        if not inp.has(dim):
            raise RecipeError(
                f"{field}[{key}] of {fqn!r} is placed on mesh dim {dim!r}, which the mesh "
                f"lacks", span=claim.rule.span(field), path=f"{claim.rule.json_path}.{field}",
                rule_index=claim.rule.index,
                hint=f"mesh: {inp.mesh_text()}; add {dim}=1 or guard the rule with `when`")
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
    return value.canonical(inp.recipe.mesh)


def _outputs(inp: ResolveInput, claims: ClaimTable, found: dict[LayoutSlot, list[Claim]],
             fqn: str, src_field: str, dst_field: str | None,
             out_names: tuple[str, ...]) -> list[ArgLayout]:
    src = claims.layout(fqn, src_field)
    dst = claims.layout(fqn, dst_field) if dst_field else {}
    merged: dict[int, tuple[str, NamedPlacement, NamedPlacement]] = {}
    for field, table in ((src_field, src), (dst_field, dst)):
        for key, claim in table.items():
            pos = _output_position(fqn, field or src_field, key, claim, out_names)
            name = output_name(pos, out_names)
            placed = _placed(inp, claim, fqn, field or src_field, key)
            behind = found.setdefault(("output" if dst_field else "inner", name), [])
            behind.insert(0, claim) if field == dst_field else behind.append(claim)
            if pos in merged:
                n, s, d = merged[pos]
                merged[pos] = (n, s, placed) if field == dst_field else (n, placed, d)
            else:
                merged[pos] = (name, placed, placed) if field == src_field else (
                    name, REPLICATED, placed)
    return [ArgLayout(name=n, position=pos, src=s, dst=d)
            for pos, (n, s, d) in sorted(merged.items())]


def _output_position(fqn: str, field: str, key: LayoutKey, claim: Claim,
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
