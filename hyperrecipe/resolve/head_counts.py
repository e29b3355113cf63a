"""Stage 4: heads. Integer module attributes divided by a mesh dim in production mode
(``head_counts: {num_heads: tp}``), checked for existence and divisibility; and every sharded
parameter of an attention kept on whole heads (:func:`check_whole_heads`).

Heads are read from the model tree, not from a list of families: an attention module is one
with an integer head size (``head_dim``, ``head_size``, ...; or a width and a head count such as
``embed_dim`` and ``num_heads``), and the parameters it holds or its direct children hold (the
q/k/v/o projections, fused ones too) are cut in units of that size.
"""

from __future__ import annotations

from hyperrecipe.errors import RecipeError, did_you_mean
from hyperrecipe.model_tree import ModuleInfo
from hyperrecipe.placement import Shard
from hyperrecipe.plan import HeadCount, ParamPlan
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import ResolveInput, provenance_of
from hyperrecipe.resolve.kernels import EMBEDDING

__all__ = ["HEAD_SIZE_ATTRS", "check_whole_heads", "divide_head_counts", "head_size_of"]

HEAD_SIZE_ATTRS = ("head_dim", "head_size", "attention_head_size", "d_head", "dim_per_head")
"""Integer attributes that hold one head's width (Llama, Qwen, Mistral, Mixtral, Phi-3, GPT-2
and ``nn.MultiheadAttention`` say ``head_dim``; GPT-NeoX ``head_size``; BERT
``attention_head_size``)."""

_WIDTH_ATTRS = ("embed_dim", "hidden_size", "d_model", "dim")
_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")


def head_size_of(module: ModuleInfo) -> tuple[int, str] | None:
    """One head's width in ``module`` and where it was read (``"self_attn.head_dim"``,
    ``"attn.embed_dim // attn.num_heads"``); ``None`` when the module states no heads."""
    where = module.fqn or "<root>"
    for attr in HEAD_SIZE_ATTRS:
        value = module.int_attr(attr)
        if value is not None and value > 0:
            return value, f"{where}.{attr}"
    for width_attr in _WIDTH_ATTRS:
        width = module.int_attr(width_attr)
        for count_attr in _COUNT_ATTRS:
            count = module.int_attr(count_attr)
            if width and count and count > 0 and width % count == 0:
                return width // count, f"{where}.{width_attr} // {where}.{count_attr}"
    return None


def _attention_of(inp: ResolveInput, module: str) -> tuple[str, int, str] | None:
    """The attention module a parameter's module belongs to: the module itself or its parent
    when that states a head size (only one level: a head size on a decoder layer or the model
    says nothing about its MLP)."""
    own = inp.tree.get(module)
    if own is None or own.is_a(EMBEDDING):
        return None  # a table's dims are vocab and width, never heads
    parent = module.rpartition(".")[0]
    # the root is no attention's parent: a head size stated on a whole model says nothing
    # about its lm_head
    for fqn in (module, parent) if parent else (module,):
        info = inp.tree.get(fqn)
        if info is None:
            continue
        found = head_size_of(info)
        if found is not None:
            return fqn, found[0], found[1]
    return None


def check_whole_heads(inp: ResolveInput, claims: ClaimTable,
                      params: tuple[ParamPlan, ...]) -> None:
    """Refuse a sharded parameter of an attention that would split a head between ranks.

    For each parameter of an attention module or of its direct children, each sharded dim whose
    size is a whole number of heads (every fused part's size, for a chunked shard) must give
    every rank whole heads. A K/V projection of 2 heads of 16 on ``tp=4`` (8 rows per rank)
    compiles otherwise and fails at the first ``view(..., head_dim)`` in both modes.

    Raises:
        RecipeError: at the rule that placed the parameter, naming the module, the heads, the
            head size and the mesh dims, and what keeps heads whole.
    """
    for p in params:
        if p.tied_to is not None:
            continue
        per_dim: dict[int, list[tuple[str, Shard]]] = {}
        for dim, q in p.placement.dims:
            if isinstance(q, Shard) and inp.size(dim) > 1:
                d = q.dim + len(p.shape) if q.dim < 0 else q.dim
                per_dim.setdefault(d, []).append((dim, q))
        if not per_dim:
            continue
        attention = _attention_of(inp, p.module)
        if attention is None:
            continue
        attn, head, head_src = attention
        for d, entries in sorted(per_dim.items()):
            ways = 1
            for dim, _ in entries:
                ways *= inp.size(dim)
            q0 = entries[0][1]
            parts = q0.part_sizes(p.shape[d])
            for i, part in enumerate(parts):
                if part % head or (part // ways) % head == 0:
                    continue  # not a dim of heads, or whole heads per rank
                claim = claims.get(p.fqn, "params")
                assert claim is not None  # a sharded parameter was placed by a rule
                rule = claim.rule
                span = (rule.span("params", p.name) if p.name in rule.explicit_params
                        else rule.span("match"))
                heads = part // head
                dims_text = " x ".join(f"{dim}={inp.size(dim)}" for dim, _ in entries)
                what = (f"part {i + 1} of {len(parts)} of dim {d}" if len(parts) > 1
                        else f"dim {d}")
                mesh_dim = entries[0][0]
                fits = [n for n in range(2, ways) if heads % n == 0]
                smaller = (f"use a smaller {mesh_dim} that divides {heads} heads "
                           f"({', '.join(f'{mesh_dim}={n}' for n in fits)}), or " if fits
                           and len(entries) == 1 else "")
                msg = (f"module {p.module!r}: {what} of parameter {p.name!r} holds {heads} "
                       f"head(s) of head_dim {head} ({head_src}); mesh dim {dims_text} would "
                       f"split it mid-head ({part // ways} of {head} per rank, {q0})")
                raise RecipeError(
                    msg, span=span, path=f"{rule.json_path}.params.{p.name}",
                    rule_index=rule.index,
                    hint=f"every rank must hold whole heads: {smaller}replicate "
                         f"{p.module!r} instead of sharding it (with the projections of "
                         f"{attn!r} whose heads pair with its heads); where query heads stay "
                         f"sharded, declare reduce_grads over {mesh_dim} on what you replicate "
                         f"(its gradient is then partial)")


def divide_head_counts(inp: ResolveInput, claims: ClaimTable) -> tuple[HeadCount, ...]:
    """Every claimed head count, in module order then attribute name.

    Raises:
        RecipeError: the module has no such integer attribute, the mesh lacks the dim, or the
            value is not divisible by the dim's size.
    """
    out: list[HeadCount] = []
    slots = sorted(((fqn, key), c) for (fqn, field, key), c in claims.slots.items()
                   if field == "head_counts")
    for (fqn, attr), claim in sorted(slots, key=lambda s: (inp.order[s[0][0]], s[0][1])):
        module = inp.tree.module(fqn)
        dim = claim.value
        value = module.int_attr(attr)
        rule = claim.rule
        span = rule.span("head_counts", attr, key=True)
        path = f"{rule.json_path}.head_counts.{attr}"
        if value is None:
            names = module.int_attr_names(attr)
            raise RecipeError(
                f"module {fqn!r} has no integer attribute {attr!r}{did_you_mean(attr, names)}",
                span=span, path=path, rule_index=rule.index,
                hint=f"its integer attributes: [{', '.join(names)}]")
        if not inp.has(dim):
            raise RecipeError(f"head count {attr!r} is divided by mesh dim {dim!r}, which the "
                              f"mesh lacks", span=span, path=path, rule_index=rule.index,
                              hint=f"mesh: {inp.mesh_text()}")
        n = inp.size(dim)
        if value % n:
            raise RecipeError(
                f"head count {fqn}.{attr} = {value} is not divisible by mesh dim {dim} of "
                f"size {n}", span=span, path=path, rule_index=rule.index,
                hint="every rank must hold whole heads")
        out.append(HeadCount(module=fqn, attr=attr, mesh_dim=dim, global_value=value,
                             local_value=value // n,
                             provenance=provenance_of(claim, f"divide {attr} by",
                                                      "head_counts")[-1]))
    return tuple(out)
