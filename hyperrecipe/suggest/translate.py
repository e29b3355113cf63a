"""transformers' plan entries plus the model's structure, into suggested rules.

A transformers plan names styles per projection; our format also needs the *region* around
them. Where a parent module holds column-wise and row-wise projections (``self_attn``: q/k/v and
o; ``mlp``: gate/up and down), the parent becomes a boundary with replicated input and output
(Megatron's *f* and *g*, one all-reduce each way per block), the column-wise projections are
placed inside it without boundaries of their own, and the row-wise ones keep theirs. Every other
parameter inside such a region sees a per-rank slice or a partial gradient, so it gets
``reduce_grads`` (transformers' ``replicated_with_grad_allreduce`` says so for per-head norms;
learnable activation scalars are what its plans leave out). A style with no translation is left
replicated and recorded in :class:`~hyperrecipe.suggest.rules.Narrowed`.

Pure: reads a :class:`~hyperrecipe.model_tree.ModelTree`, no torch module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from hyperrecipe.models.hf_plans import PlanEntry
from hyperrecipe.model_tree import ModelTree, ModuleInfo
from hyperrecipe.suggest.folding import Folding
from hyperrecipe.suggest.rules import (DIVIDED_COUNTS, MHA_STYLE, STRUCTURE_SOURCE, Correction,
                                      Narrowed, SuggestedRule)
from hyperrecipe.suggest.sequence import SEQUENCE_GROUP, sequence_parallel_rules

__all__ = ["EP_DIM", "LOSS_GROUP", "is_region", "Translation", "TranslateOptions", "translate"]

_LINEAR = "torch.nn.modules.linear.Linear"
_EMBEDDING = "torch.nn.modules.sparse.Embedding"

_COLWISE = frozenset({"colwise", "unit_colwise", "packed_colwise"})
_ROWWISE = frozenset({"rowwise"})
_GATHER = frozenset({"colwise_gather_output", "colwise_rep"})
_SPLIT_INPUT = frozenset({"rowwise_split_input", "rowwise_rep"})
_LINEAR_STYLES = _COLWISE | _ROWWISE | _GATHER | _SPLIT_INPUT
_UNTRANSLATED = {
    "mla_kv_a_proj": "multi-head latent attention's joint kv_a projection (a shared rope part "
                     "beside per-head parts) has no translation",
    "local_params": "transformers computes this module on the local shards of its own per-head "
                    "parameters (attention sinks); that has no translation",
    "moe_tp_experts": "tensor-parallel experts (each expert's matrices split over tp) have no "
                      "translation; shard whole experts over an ep mesh dim instead",
    "packed_rowwise": "a packed row-wise projection has no translation",
    "embedding_colwise": "an embedding sharded on its hidden dim has no translation",
}
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
               "n_heads", "n_kv_heads")
"""Integer attributes of an attention module that count heads: each rank has its share."""
_STRUCTURE_HEAD_ATTRS = DIVIDED_COUNTS
"""The same for a region read off the structure, which also takes OpenAI-GPT's ``n_head`` (its
``split_heads`` views the local width as ``n_head`` heads), litgpt's ``n_query_groups`` and
lucidrains' ``heads`` (``rearrange(..., h=self.heads)``).
Not for plan families: a field is added there only with a family that needs it, since some
read counts as global sizes."""


@attrs.frozen(kw_only=True)
class TranslateOptions:
    """What to add beyond the source plan (each can be turned off).

    Attributes:
        dim: the tensor-parallel mesh dim.
        embedding: shard the input embedding on the vocab (its gradient too) when the plan
            does not.
        reduce_reached: all-reduce the gradients of every replicated parameter inside a region.
        loss_parallel: keep the logits sharded on the vocab for the model's own loss.
        sequence_parallel: shard the residual stream on the sequence between regions
            (:mod:`hyperrecipe.suggest.sequence`).
        structure: where the plan names no projection of a block (a plan that shards only the
            embedding and the head), read the block's projection pair off the model's structure
            (:func:`hyperrecipe.suggest.structure.blocks_the_plan_leaves_out`).
    """

    dim: str = "tp"
    embedding: bool = True
    reduce_reached: bool = True
    loss_parallel: bool = True
    sequence_parallel: bool = True
    structure: bool = True


@attrs.frozen(kw_only=True)
class Translation:
    rules: tuple[SuggestedRule, ...]
    narrowed: tuple[Narrowed, ...]
    corrections: tuple[Correction, ...]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    return re.compile("\\.".join("[^.]+" if seg == "*" else re.escape(seg)
                                 for seg in pattern.split(".")))


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _leaf(fqn: str) -> str:
    return fqn.rsplit(".", 1)[-1]


def _under(fqn: str, root: str) -> bool:
    return not root or fqn == root or fqn.startswith(root + ".")


def _rel(fqn: str, parent: str) -> str:
    """``fqn``'s path below ``parent`` (``ff.0.0`` for a Linear in a block's Sequential)."""
    return fqn[len(parent) + 1:] if parent and fqn.startswith(parent + ".") else _leaf(fqn)


def _alternatives(parent: str, fqns: Sequence[str]) -> str:
    if len(fqns) == 1:
        return fqns[0]
    return f"{parent}.{{{','.join(_rel(f, parent) for f in fqns)}}}"


def _placement(dim: str, text: str) -> dict[str, str]:
    return {dim: text}


class _Builder:
    def __init__(self, tree: ModelTree, options: TranslateOptions) -> None:
        self.options = options
        self.modules: dict[str, ModuleInfo] = {}
        self.order: dict[str, int] = {}
        self.instances: dict[str, list[ModuleInfo]] = {}
        self.fold = Folding.of_tree(tree.modules)
        for i, m in enumerate(tree.modules):
            key = self.fold(m.fqn)
            self.instances.setdefault(key, []).append(m)
            if key not in self.modules:
                self.modules[key] = m
                self.order[key] = i
        self.fqns = {m.fqn for m in tree.modules}
        self.tree = tree
        #: folded region -> the concrete modules that are the region (all, or a kind of layer)
        self.region_instances: dict[str, list[str]] = {}
        self.rules: list[SuggestedRule] = []
        self.narrowed: list[Narrowed] = []
        self.corrections: list[Correction] = []
        self.claimed: set[str] = set()  # folded module FQNs whose params a rule places
        #: module -> its own per-head parameters a plan shards column-wise (attention sinks)
        self.head_params: dict[str, dict[str, PlanEntry]] = {}
        self.sharded_heads: set[str] = set()

    def add(self, match: str, fields: Mapping[str, Any], sources: Iterable[str], group: str,
            anchor: str, *, deeper: bool = False) -> None:
        self.rules.append(SuggestedRule(match=match, fields=tuple(fields.items()),
                                        sources=tuple(sources), group=group, deeper=deeper,
                                        order=self.order.get(anchor, 0)))

    def matches(self, pattern: str) -> list[str]:
        rx = _pattern_regex(pattern)
        return [f for f in self.modules if rx.fullmatch(f)]

    def is_linear(self, fqn: str, *, transposed: bool = False) -> bool:
        """An ``nn.Linear`` with a 2-D weight, or (``transposed``) a projection the structure
        found storing its 2-D weight ``[in, out]``."""
        m = self.modules[fqn]
        w = m.param("weight")
        return (transposed or m.is_a(_LINEAR)) and w is not None and len(w.shape) == 2


def _holders(b: _Builder, folded: str, name: str) -> list[str]:
    """The instances of ``folded`` that hold a direct parameter ``name``."""
    return [m.fqn for m in b.instances.get(folded, ()) if m.param(name) is not None]


def _entry_text(e: PlanEntry) -> str:
    return f"{e.source}: {e.pattern}: {e.style}"


def is_region(rule: SuggestedRule) -> bool:
    """A boundary this translation put around a column-wise and row-wise pair."""
    return bool(rule.sources) and rule.sources[0].startswith("region: ")


def _region_fields(m: ModuleInfo, dim: str, *, widths: bool = False) -> dict[str, Any]:
    first = m.signature[0].name if m.signature and m.signature[0].kind != "var_keyword" else 0
    fields: dict[str, Any] = {"boundary": True, "in_src": {first: "replicate"}}
    if "Attention" in m.cls.rsplit(".", 1)[-1]:
        # eager attention returns per-head weights beside the output: sharded by head
        fields["out_names"] = ["attn_output", "attn_weights"]
        fields["out_src"] = {"attn_output": "replicate",
                             "attn_weights": _placement(dim, "shard(1)")}
    else:
        fields["out_src"] = {0: "replicate"}
    names = _STRUCTURE_HEAD_ATTRS if widths else _HEAD_ATTRS
    heads = {name: dim for name, _ in m.int_attrs if name in names}
    ints = dict(m.int_attrs)
    width, per_head = ints.get("embed_dim"), ints.get("head_dim")
    count = next((ints[n] for n in ("num_heads", "num_attention_heads") if n in ints), None)
    if widths and heads and width and per_head and count and width == count * per_head:
        # the width of the heads it holds (XGLM reshapes its output to embed_dim): each rank
        # holds its share of them, as it does of the heads. Only for a plan read off the
        # structure: the families transformers' plans are written for read their widths from
        # the local tensors, and one that reads embed_dim (CodeGen) cuts its fused projection
        # into groups by the global width.
        heads["embed_dim"] = dim
    if widths and not heads:
        # counts its forward reads off a config object of its own (litgpt's attention:
        # self.config.n_head): divided on the module's copy of it (head_counts' config.)
        heads = {f"config.{name}": dim for name, _ in m.config_ints
                 if name in _STRUCTURE_HEAD_ATTRS}
    if heads:
        fields["head_counts"] = heads
    return fields


def _translate_regions(b: _Builder, linear: dict[str, tuple[str, PlanEntry]]) -> None:
    dim = b.options.dim
    by_parent: dict[str, dict[str, list[tuple[str, PlanEntry]]]] = {}
    for fqn, (kind, entry) in linear.items():
        by_parent.setdefault(entry.region or _parent(fqn), {}).setdefault(kind, []).append(
            (fqn, entry))
    for parent, kinds in sorted(by_parent.items(), key=lambda kv: b.order.get(kv[0], 0)):
        cols, rows = kinds.get("col", []), kinds.get("row", [])
        if cols and rows and parent in b.modules and _never_called(b.modules[parent]):
            _add_pair(b, parent, cols, rows)
            continue
        if cols and rows and parent in b.modules:
            _add_region(b, parent, cols, rows)
            continue
        for fqn, entry in cols:  # a column-wise output with nothing under its parent to take
            b.add(fqn, {"style": "colwise_gather_output"}, [_entry_text(entry)], fqn, fqn)
            b.claimed.add(fqn)
            b.corrections.append(Correction(
                what=fqn, detail=f"{entry.source} makes {fqn} {entry.style} (output left sharded) "
                                 f"with no row-wise projection under {parent or 'the model'} to "
                                 f"take it back; its output is gathered instead"))
        for fqn, entry in rows:
            b.add(fqn, {"style": "rowwise", "in_src": {0: "replicate"}}, [_entry_text(entry)],
                  fqn, fqn)
            b.claimed.add(fqn)
            b.corrections.append(Correction(
                what=fqn, detail=f"{entry.source} makes {fqn} rowwise (input expected sharded) "
                                 f"with no column-wise projection under {parent or 'the model'} "
                                 f"to shard it; its input is split locally instead"))
    del dim


_CONTAINERS = frozenset({"torch.nn.modules.container.ModuleDict",
                         "torch.nn.modules.container.ModuleList"})


def _never_called(m: ModuleInfo) -> bool:
    """A container whose forward is never called (minGPT's MLP, an ``nn.ModuleDict`` its block
    calls through a lambda over the children): no boundary can sit on it."""
    return m.cls in _CONTAINERS


def _add_pair(b: _Builder, parent: str, cols: list[tuple[str, PlanEntry]],
              rows: list[tuple[str, PlanEntry]]) -> None:
    """The column-wise and row-wise projections of a block no boundary can sit on, each with
    its own (``colwise``: replicated in, sharded out; ``rowwise``: sharded in, reduced out),
    as one group that narrowing gives up together. A packed or transposed projection needs the
    enclosing region; it is not proposed here."""
    plain = all(e.style == "colwise" and not e.transposed for _, e in cols) and not any(
        e.transposed for _, e in rows)
    if not plain:
        b.corrections.append(Correction(what=parent, detail=(
            f"{parent} is a container its forward never calls, so no boundary can hold its "
            f"packed or transposed projections: they are left replicated")))
        return
    note = f" (its block {parent} is a container its forward never calls: no region)"
    for fqn, entry in cols:
        b.add(fqn, {"style": "colwise"}, [_entry_text(entry) + note], parent, fqn)
    for fqn, entry in rows:
        b.add(fqn, {"style": "rowwise"}, [_entry_text(entry) + note], parent, fqn)
    b.claimed.update(f for f, _ in cols)
    b.claimed.update(f for f, _ in rows)


def _add_region(b: _Builder, parent: str, cols: list[tuple[str, PlanEntry]],
                rows: list[tuple[str, PlanEntry]]) -> None:
    dim = b.options.dim
    leaves = [_rel(f, parent) for f, _ in (*cols, *rows)]
    holding = [m for m in b.instances[parent]
               if all(f"{m.fqn}.{leaf}" in b.fqns for leaf in leaves)]
    region = holding[0] if holding else b.modules[parent]
    # layers of two kinds under one name (a dense MLP in the first layers, MoE after): the
    # region is only the ones holding the projections
    b.region_instances[parent] = [m.fqn for m in holding] or [region.fqn]
    match = parent if len(holding) == len(b.instances[parent]) else (
        holding[0].fqn if len(holding) == 1 else "{" + ",".join(m.fqn for m in holding) + "}")
    names = ", ".join(_rel(f, parent) for f, _ in cols)
    outs = ", ".join(_rel(f, parent) for f, _ in rows)
    fields = _region_fields(region, dim,
                            widths=cols[0][1].source.startswith(STRUCTURE_SOURCE))
    split = {s: dim for _, e in cols for s in e.split_sizes if region.int_attr(s) is not None}
    if split:  # the forward splits a packed output by a global width: each rank has its share
        fields["head_counts"] = {**fields.get("head_counts", {}), **split}
    sources = [f"region: {match} holds the column-wise {names} and the row-wise {outs} of "
               f"{cols[0][1].source}; replicated in and out, one all-reduce each way"]
    own = b.head_params.pop(parent, {})
    region_fqns = b.region_instances[parent]
    some = {p: e for p, e in own.items()
            if set(_holders(b, parent, p)) >= set(region_fqns)}
    if own:
        b.sharded_heads.add(parent)
    if some:
        fields["params"] = {p: _placement(dim, "shard(0)") for p in some}
        sources += [_entry_text(e) + " (a parameter per head: sharded with the heads)"
                    for e in some.values()]
    b.add(match, fields, sources, parent, parent)
    for p, e in own.items():
        if p not in some:  # held by some layers only (MiMo's sinks, in its sliding layers)
            held = [f for f in _holders(b, parent, p) if f in region_fqns]
            if not held:
                continue
            b.add(held[0] if len(held) == 1 else "{" + ",".join(held) + "}",
                  {"params": {p: _placement(dim, "shard(0)")}},
                  [_entry_text(e) + " (a parameter per head in the layers that hold it: "
                                    "sharded with the heads)"], parent, parent)
    plain = [(f, e) for f, e in cols if e.style != "packed_colwise" and not e.transposed]
    if plain:
        b.add(_alternatives(parent, [f for f, _ in plain]),
              {"style": "colwise", "boundary": False},
              [_entry_text(e) for _, e in plain], parent, plain[0][0])
    for fqn, entry in cols:
        if entry.style == "packed_colwise":
            parts = len(entry.chunk_sizes) or entry.chunks or 2
            b.add(fqn, _column_fields(b, fqn, entry, parts),
                  [_entry_text(entry) + f" ({parts} packed parts, each sharded: "
                                        f"chunks={parts})"],
                  parent, fqn)
        elif entry.transposed:
            b.add(fqn, _column_fields(b, fqn, entry, 0),
                  [_entry_text(entry) + _TRANSPOSED], parent, fqn)
    for fqn, entry in rows:
        row: dict[str, Any] = {"style": "rowwise"}
        if entry.transposed:  # the style speaks of nn.Linear's [out, in]: the input dim is 0
            b.add(fqn, {**row, "params": {"weight": _placement(dim, "shard(0)")}},
                  [_entry_text(entry) + _TRANSPOSED], parent, fqn)
        else:
            b.add(fqn, row, [_entry_text(entry)], parent, fqn)
    b.claimed.update(f for f, _ in cols)
    b.claimed.update(f for f, _ in rows)


_TRANSPOSED = " (weight stored [in, out]: its output dim is 1)"


def _multihead_attention(b: _Builder, fqn: str, entry: PlanEntry) -> None:
    """An ``nn.MultiheadAttention`` by heads: the built-in ``multihead_attention`` style on it
    (``in_proj`` in 3 chunks, the ``mha_heads`` inner wrapper) and its ``out_proj`` row-wise,
    which that wrapper calls as a nested boundary. One group: given up together."""
    b.add(fqn, {"style": MHA_STYLE}, [_entry_text(entry) + " (in_proj in 3 chunks, each "
                                      "rank's heads run by the mha_heads inner wrapper)"],
          fqn, fqn)
    b.add(f"{fqn}.out_proj", {"style": "rowwise"},
          [_entry_text(entry) + " (out_proj: row-wise, reduced once)"], fqn, fqn)
    b.claimed.update((fqn, f"{fqn}.out_proj"))


def _column_fields(b: _Builder, fqn: str, entry: PlanEntry, parts: int) -> dict[str, Any]:
    """The parameters of a column-wise projection without the ``colwise`` style: packed in
    ``parts`` chunks, or stored ``[in, out]`` (then the weight's output dim is 1 and the
    integer attributes holding its output width are divided too)."""
    dim = b.options.dim
    chunks = f", chunks={parts}" if parts else ""
    if entry.chunk_sizes:
        chunks = f", chunks=[{', '.join(map(str, entry.chunk_sizes))}]"
    out_dim = 1 if entry.transposed else 0
    params: dict[str, Any] = {"weight": _placement(dim, f"shard({out_dim}{chunks})")}
    if b.modules[fqn].param("bias") is not None:
        params["bias"] = _placement(dim, f"shard(0{chunks})")
    fields: dict[str, Any] = {"params": params}
    if entry.sizes:
        fields["head_counts"] = {s: dim for s in entry.sizes}
    return fields


def _reached(b: _Builder, regions: Sequence[str], planned: Mapping[str, PlanEntry]) -> None:
    """``reduce_grads`` for the replicated parameters inside each region."""
    dim = b.options.dim
    for region in regions:
        for fqn, m in b.modules.items():
            if fqn == region or not _under(fqn, region) or not m.params:
                continue
            if any(_under(fqn, c) for c in b.claimed):
                continue
            inside = b.region_instances.get(region, [])
            if not all(any(_under(i.fqn, r) for r in inside) for i in b.instances[fqn]):
                continue  # some of its instances lie outside the region (another kind of layer)
            reduce = {p.name: dim for p in m.params if p.tied_to is None}
            if not reduce:
                continue
            entry = planned.get(fqn)
            if entry is not None:
                b.add(fqn, {"reduce_grads": reduce}, [_entry_text(entry)], region, fqn)
            elif b.options.reduce_reached:
                b.add(fqn, {"reduce_grads": reduce},
                      [f"deeper than the plan: {fqn} is inside the region {region}, where its "
                       f"gradient is per-rank partial"], region, fqn, deeper=True)
                b.corrections.append(Correction(
                    what=fqn, detail=f"transformers' plan leaves {fqn} "
                                     f"({', '.join(reduce)}) unreduced: inside {region} its "
                                     f"gradient would be partial"))
            else:
                continue
            b.claimed.add(fqn)


def _input_embedding(b: _Builder) -> str | None:
    for fqn, m in b.modules.items():
        if m.is_a(_EMBEDDING) and "*" not in fqn:
            return fqn
    return None


def _embedding_and_head(b: _Builder, vocab: Mapping[str, PlanEntry],
                        gather: Mapping[str, PlanEntry]) -> None:
    dim = b.options.dim
    embed = next(iter(vocab), None)
    embed_src = [_entry_text(vocab[embed])] if embed is not None else []
    if embed is None and b.options.embedding:
        embed = _input_embedding(b)
        embed_src = [f"deeper than the plan: {embed} is the input embedding; vocab-parallel, so "
                     f"its table and gradient are sharded too"] if embed else []
    head = next(iter(gather), None)
    tied = False
    if head is not None and embed is not None:
        w = b.modules[head].param("weight")
        tied = w is not None and w.tied_to == f"{embed}.weight"
    both = f"{embed} and the tied {head}"
    group = both if tied else (embed or "")
    if embed is not None:
        b.add(embed, {"style": "vocab_parallel"}, embed_src, group, embed,
              deeper=embed not in vocab)
        b.claimed.add(embed)
    if head is not None:
        b.add(head, {"style": "colwise_gather_output"}, [_entry_text(gather[head])],
              both if tied else head, head)
        b.claimed.add(head)
        if b.options.loss_parallel:
            b.rules.append(SuggestedRule(
                match=head, fields=(("out_dst", {0: _placement(dim, "shard(-1)")}),
                                    ("loss_parallel", True)),
                sources=("deeper than the plan: the logits stay sharded on the vocab for the "
                         "model's own loss (a call without labels still gets them whole)",),
                group=LOSS_GROUP, deeper=True, order=2 * 10**9))


LOSS_GROUP = "loss on vocab shards"
EP_DIM = "ep"
"""The mesh dim experts are sharded over."""


def _expert_entry(b: _Builder, entry: PlanEntry, mesh: Mapping[str, int]) -> None:
    """transformers' ``ep_dispatch_experts`` on a fused experts module: every expert whole on
    one rank of ``ep``, computed in a local region (token dispatch is data-dependent), each rank
    adding its experts' share of every token, all-reduced once at the region's exit."""
    if entry.style == "grouped_gemm":
        return  # a parameter of the experts module: placed with it
    if EP_DIM not in mesh:
        b.narrowed.append(Narrowed(what=entry.pattern, why=(
            f"{entry.source} says {entry.style}; the mesh has no {EP_DIM!r} dim, so the experts "
            f"stay whole on every rank (give --mesh ...,{EP_DIM}=N to shard them)")))
        return
    found = b.matches(entry.pattern)
    if entry.style != "ep_dispatch_experts" or not found:
        why = ("matches no module of this model" if not found
               else f"style {entry.style!r} of the expert-parallel plan has no translation")
        b.narrowed.append(Narrowed(what=entry.pattern, why=f"{entry.source} says {entry.style}: "
                                                           f"{why}; left replicated"))
        return
    for fqn in found:
        m = b.modules[fqn]
        # the kernel calls forward(hidden states, expert ids, routing weights) positionally:
        # Mixtral's (hidden_states, top_k_index, top_k_weights), GPT-OSS's (hidden_states,
        # router_indices, routing_weights)
        args = m.positional_args
        three_d = [p for p in m.params if len(p.shape) == 3]
        experts = three_d[0].shape[0] if three_d else 0
        if len(args) < 3 or not experts:
            b.narrowed.append(Narrowed(what=fqn, why=(
                f"{entry.source} says ep_dispatch_experts, but {fqn} is not a fused experts "
                f"module called as experts(hidden states, expert ids, routing weights) with "
                f"3-D per-expert parameters; left replicated")))
            continue
        params = {p.name: {EP_DIM: "shard(0)"} for p in m.params
                  if p.shape and p.shape[0] == experts}
        b.add(fqn, {"boundary": True, "local_region": True,
                    "in_src": {args[0]: "replicate", args[2]: "replicate"},
                    "out_src": {0: {EP_DIM: "partial"}}, "out_dst": {0: "replicate"},
                    "params": params},
              [_entry_text(entry) + f" ({experts} experts, each whole on one rank of "
                                    f"{EP_DIM}; each rank adds its experts' share of every token, "
                                    f"all-reduced at the exit)"], fqn, fqn)
        b.claimed.add(fqn)


def translate(entries: Sequence[PlanEntry], tree: ModelTree, mesh: Mapping[str, int],
              options: TranslateOptions | None = None) -> Translation:
    """Suggested rules for ``tree`` from transformers' plan ``entries`` (see the module doc).

    Args:
        entries: the model's plan entries (:func:`~hyperrecipe.models.hf_plans.read_plans`).
        tree: the model's structure.
        mesh: mesh dim -> size; the tensor-parallel dim is ``options.dim``.
        options: what to add beyond the plan.
    """
    opts = options or TranslateOptions()
    b = _Builder(tree, opts)
    linear: dict[str, tuple[str, PlanEntry]] = {}
    vocab: dict[str, PlanEntry] = {}
    gather: dict[str, PlanEntry] = {}
    planned: dict[str, PlanEntry] = {}
    local: dict[str, PlanEntry] = {}
    # transformers applies the expert-parallel plan *instead of* the tensor-parallel one, so a
    # family's ep plan repeats the tp entries of its dense projections (Gemma 4's mlp): those
    # are placed by the tp entry, not given up as an expert style with no translation
    tp_entries = {(e.pattern, e.style) for e in entries if e.plan == "tp"}
    for entry in entries:
        if entry.plan == "ep" and (entry.pattern, entry.style) in tp_entries:
            continue
        if entry.plan == "ep":
            _expert_entry(b, entry, mesh)
            continue
        if entry.plan != "tp" or opts.dim not in mesh:
            continue
        found = b.matches(entry.pattern)
        owner = b.matches(_parent(entry.pattern)) if not found else []
        if not found and entry.style == "colwise" and owner and all(
                _holders(b, o, _leaf(entry.pattern)) for o in owner):
            for o in owner:  # a per-head parameter of its own (attention sinks): by head
                b.head_params.setdefault(o, {})[_leaf(entry.pattern)] = entry
            continue
        if not found:
            if entry.style not in ("replicate",):
                b.narrowed.append(Narrowed(what=entry.pattern, why=(
                    f"{entry.source} says {entry.style}, but the pattern matches no module of "
                    f"this model (a parameter, or a module this config does not build)")))
            continue
        for fqn in found:
            style = entry.style
            if style in _LINEAR_STYLES and not b.is_linear(fqn, transposed=entry.transposed):
                b.narrowed.append(Narrowed(what=fqn, why=(
                    f"{entry.source} says {style}, but {fqn} is a "
                    f"{b.modules[fqn].cls.rsplit('.', 1)[-1]}, not an nn.Linear with a 2-D "
                    f"weight; left replicated")))
            elif style in _COLWISE:
                linear[fqn] = ("col", entry)
            elif style in _ROWWISE:
                linear[fqn] = ("row", entry)
            elif style in _GATHER:
                gather[fqn] = entry
            elif style in _SPLIT_INPUT:
                b.add(fqn, {"style": "rowwise", "in_src": {0: "replicate"}},
                      [_entry_text(entry)], fqn, fqn)
                b.claimed.add(fqn)
            elif style == "embedding_rowwise" and b.modules[fqn].is_a(_EMBEDDING):
                vocab[fqn] = entry
            elif style in ("replicated_with_grad_allreduce", "replicate"):
                planned[fqn] = entry
            elif style == MHA_STYLE:
                _multihead_attention(b, fqn, entry)
            elif style == "local_params":
                local[fqn] = entry  # fine where its per-head parameters go with a region
            else:
                why = _UNTRANSLATED.get(style, f"style {style!r} has no translation")
                b.narrowed.append(Narrowed(what=fqn, why=f"{entry.source} says {style}: {why}; "
                                                         f"left replicated"))
    _translate_regions(b, linear)
    for fqn, entry in local.items():
        if fqn not in b.sharded_heads:
            b.narrowed.append(Narrowed(what=fqn, why=(
                f"{entry.source} says local_params: {_UNTRANSLATED['local_params']}; left "
                f"replicated")))
    for fqn, own in b.head_params.items():
        for name, entry in own.items():
            b.narrowed.append(Narrowed(what=f"{fqn}.{name}", why=(
                f"{entry.source} says {entry.style} for a parameter of {fqn}, which holds no "
                f"column-wise and row-wise projections to shard it with; left replicated")))
    for fqn, entry in gather.items():
        if not entry.source.endswith("._tp_plan") and not entry.head:  # the head: below
            b.add(fqn, {"style": "colwise_gather_output"}, [_entry_text(entry)], fqn, fqn)
            b.claimed.add(fqn)
    if opts.dim in mesh:
        _embedding_and_head(b, vocab, {f: e for f, e in gather.items() if f not in b.claimed})
    regions = [r.group for r in b.rules if is_region(r)]
    _reached(b, regions, planned)
    for fqn, entry in planned.items():
        if fqn not in b.claimed and entry.style == "replicated_with_grad_allreduce":
            b.corrections.append(Correction(what=fqn, detail=(
                f"{entry.source} asks to all-reduce the gradient of {fqn}, but no column-wise "
                f"projection shards what it sees here: left replicated without a reduction")))
    if opts.sequence_parallel and opts.dim in mesh:
        extra, why_not = sequence_parallel_rules(b.rules, b.tree.modules, opts.dim)
        b.rules += extra
        if why_not:
            b.narrowed.append(Narrowed(what=SEQUENCE_GROUP, why=f"not proposed: {why_not}"))
    rules = sorted(b.rules, key=lambda r: r.order)
    return Translation(rules=tuple(rules), narrowed=tuple(b.narrowed),
                       corrections=tuple(b.corrections))
