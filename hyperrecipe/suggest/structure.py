"""Plan entries read off the model's structure, for a family that declares no parallel plan.

GPT-Neo, BLOOM, MPT, StableLM and the other families transformers ships without a
``base_model_tp_plan`` still have the shape tensor parallelism is built on: inside each repeated
block (attention, MLP) column-wise projections from the hidden size and one row-wise projection
back to it. This module proposes, in transformers' plan vocabulary so that the translation and the
check treat them like a declared plan, for every module under a list of layers whose projection
children are

- projections *from* the hidden size, registered first: ``colwise`` (a fused one, whose output
  is ``k`` times the row-wise projection's input and that the block's ``forward`` splits with
  ``split``/``chunk``, is ``packed_colwise`` in ``k`` chunks; one it views per head, as BLOOM's
  ``query_key_value`` is, stays plain ``colwise``: every head keeps its q, k and v together;
  fused parts of unequal widths, as multi-query attention packs them, are left out);
- the last projection *to* the hidden size, registered last and not called on the block's own
  input (BERT's ``value`` is square too, but reads the input): ``rowwise``;

and nothing else with parameters but 1-D ones (norms), plus the output embedding as the gathering
head. A projection is an ``nn.Linear``, or a leaf module whose class stores its weight ``[in, out]``
(transformers' ``Conv1D`` in GPT-2, GPT-SW3 and OpenAI-GPT), told by what its forward does with
an empty input on a non-square instance, never by its name: its entries say ``transposed`` (the
column-wise weight dim is 1, the row-wise one 0), name the integer attributes holding its global
output width (``nf``) and, for a packed one, the block's attributes its forward splits the
output by (GPT-2's ``split_size``), which each rank then holds its share of.

The hidden size is a transformers model's input embedding width, or for any other
``nn.Module`` the width most projections inside its blocks read (:func:`hidden_size`), so that a
model of one's own (nanoGPT, litgpt, a ViT on patch embeddings) is read the same way; its output
head is the one ``nn.Linear`` outside the blocks to an embedding's vocabulary.

A block that does not fit (a projection of another shape, a nested block with weights of its
own) is left out. So is one that fits but whose heads cannot be divided, and that is reported
with the reason (:func:`read_structure`): an attention whose forward reads the width off its
input (nanoGPT's ``C // self.n_head``) and one whose einops pattern fixes the head count (told
by :mod:`hyperrecipe.forward_hazards`, which ``check`` reads too to name them at a divergence).
An ``nn.MultiheadAttention`` (whose q, k and v are one ``in_proj_weight`` of its own, and whose
forward never calls ``out_proj``) is proposed whole, in the recipe's own vocabulary: style
``multihead_attention`` (the ``mha_heads`` inner wrapper on each rank's heads) and its
``out_proj`` row-wise; one with separate q/k/v weights, ``add_bias_kv`` or ``add_zero_attn`` is
left replicated with the reason. Whatever is proposed goes through ``check`` like a declared plan, and
a rule it rejects is narrowed, never written unverified.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Sequence

import attrs
import torch
from torch import nn

from hyperrecipe.forward_hazards import (einops_count_attrs, heads_fixed_in_einops,
                                         width_read_off_the_input)
from hyperrecipe.models.hf_plans import PlanEntry
from hyperrecipe.suggest.folding import Folding
from hyperrecipe.suggest.rules import DIVIDED_COUNTS, MHA_STYLE, STRUCTURE_SOURCE, Narrowed

__all__ = ["MHA_STYLE", "STRUCTURE_SOURCE", "WIDTH_FIELDS", "blocks_the_plan_leaves_out", "hidden_size",
           "read_structure", "structural_entries"]


_SPLITS = re.compile(r"\.(split|chunk|unbind)\(|torch\.(split|chunk)\(")
_SPLIT_BY = re.compile(r"\.split\(\s*self\.(\w+)|torch\.split\([^,()]+,\s*self\.(\w+)")


def _called(model: nn.Module, method: str) -> object:
    """``model.<method>()`` of a transformers model (``None`` for any other module)."""
    fn = getattr(type(model), method, None)
    return fn(model) if callable(fn) else None


def _splits_its_output(block: nn.Module) -> bool:
    try:
        source = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return False
    return bool(_SPLITS.search(source))


def _reads_the_input(block: nn.Module, name: str) -> bool:
    """Whether the block's ``forward`` calls ``self.<name>`` on its own first argument: such a
    projection is one *from* the block's input (BERT's ``value``), not the one back out."""
    try:
        source = inspect.getsource(type(block).forward)
        params = list(inspect.signature(type(block).forward).parameters)
    except (OSError, TypeError, ValueError):
        return False
    if len(params) < 2:
        return False
    arg = re.escape(params[1])
    call = re.search(rf"self\.{re.escape(name)}\(\s*{arg}\s*[,)]", source)
    if call is None:
        return False
    # ``hidden_states = ...`` before the call: the name no longer holds the block's input
    rebound = re.search(rf"^\s*{arg}\s*(,[^=]*)?=(?!=)", source, re.MULTILINE)
    return rebound is None or call.start() < rebound.start()


@attrs.frozen(kw_only=True)
class _Projection:
    """A linear projection child: ``nn.Linear``, or a leaf module whose weight is stored
    ``[in, out]`` (transformers' ``Conv1D``, told by what its forward does, not by name)."""

    name: str
    module: nn.Module
    in_features: int
    out_features: int
    transposed: bool


def _leaf_weight(module: nn.Module) -> torch.Tensor | None:
    """The 2-D ``weight`` of a leaf module whose only other parameter is a 1-D ``bias``."""
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (weight is None or weight.dim() != 2 or set(params) - {"weight", "bias"}
            or (bias is not None and tuple(bias.shape) != (weight.shape[1],))):
        return None
    return weight


def _stores_in_out(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether ``module`` maps ``[..., weight.shape[0]]`` to ``[..., weight.shape[1]]``: its
    weight is ``[in, out]``. Probed with an empty input on the weight's device (meta for a model
    built on meta); a square weight cannot tell, so its class is judged by a non-square one."""
    rows, cols = weight.shape
    try:
        with torch.no_grad():
            out = module(torch.empty(2, rows, device=weight.device, dtype=weight.dtype))
    except Exception:  # noqa: BLE001 - any forward that refuses the probe is not a projection
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, cols)


def transposed_classes(model: nn.Module) -> frozenset[type[nn.Module]]:
    """Classes of leaf modules that store their weight ``[in, out]`` and compute ``x @ W (+ b)``,
    judged on a non-square instance of each (GPT-2's ``c_attn`` tells for its square ``c_proj``)."""
    judged: dict[type[nn.Module], bool] = {}
    for module in model.modules():
        cls = type(module)
        if cls in judged or isinstance(module, nn.Linear):
            continue
        weight = _leaf_weight(module)
        if weight is not None and weight.shape[0] != weight.shape[1]:
            judged[cls] = _stores_in_out(module, weight)
    return frozenset(c for c, yes in judged.items() if yes)


def _projections(block: nn.Module, transposed: frozenset[type[nn.Module]],
                 prefix: str = "") -> list[_Projection]:
    """The block's projections in registration order: its children, and the children of a
    plain ``nn.Sequential`` or ``nn.ModuleList`` child holding no parameter of its own, named
    by their path from the block (``ff.0.0``, ``net.1``: x-transformers and vit-pytorch keep
    their MLPs' Linears in one). A subclass of ``nn.Sequential`` (torchvision's ``MLPBlock``)
    is a block of its own, read where it is."""
    out: list[_Projection] = []
    for child, m in block.named_children():
        name = f"{prefix}{child}"
        if isinstance(m, nn.Linear):
            out.append(_Projection(name=name, module=m, in_features=m.in_features,
                                   out_features=m.out_features, transposed=False))
        elif type(m) in transposed:
            weight = _leaf_weight(m)
            if weight is not None:
                out.append(_Projection(name=name, module=m, in_features=int(weight.shape[0]),
                                       out_features=int(weight.shape[1]), transposed=True))
        elif type(m) in (nn.Sequential, nn.ModuleList) and not any(
                True for _ in m.parameters(recurse=False)):
            out += _projections(m, transposed, f"{name}.")
    return out


WIDTH_FIELDS = ("hidden_size", "n_embd", "dim", "d_model", "embed_dim")
"""Integer fields (of the model's ``config``, or of the model itself) that name the hidden size:
used only to break a tie between the widths the blocks read (:func:`hidden_size`)."""


def _block_projections(model: nn.Module, transposed: frozenset[type[nn.Module]]
                       ) -> list[_Projection]:
    """Every projection inside a repeated block: under a list of layers (its folded name has a
    ``*``), where the blocks are."""
    out: dict[int, _Projection] = {}
    fold = Folding.of_module(model)
    for fqn, block in model.named_modules():
        if "*" in fold(fqn):
            # a Linear in a plain Sequential is seen from the block and from the Sequential
            out.update((id(p.module), p) for p in _projections(block, transposed)
                       if id(p.module) not in out)
    return list(out.values())


def _declared_widths(model: nn.Module) -> set[int]:
    """Widths the model names for its hidden size: its embeddings' widths and the
    :data:`WIDTH_FIELDS` of its ``config`` and of itself."""
    found = {int(m.embedding_dim) for m in model.modules() if isinstance(m, nn.Embedding)}
    for holder in (getattr(model, "config", None), model):
        for name in WIDTH_FIELDS:
            value = getattr(holder, name, None)
            if type(value) is int and value > 0:
                found.add(value)
    return found


def hidden_size(model: nn.Module,
                transposed: frozenset[type[nn.Module]] | None = None) -> int | None:
    """The width the model's blocks read and write back, read off its structure; ``None`` where
    the structure does not say.

    A transformers model says it: its ``get_input_embeddings()`` width. Any other module is
    read by its blocks: the hidden size is the ``in_features`` most projections inside repeated
    blocks (modules under a list of layers) have, because every projection of a transformer
    block but the one(s) back to the residual stream reads it (q, k, v or a fused qkv, gate and
    up; only the attention's output and the MLP's down projection read another width, and
    the attention's output reads the hidden size too where the heads fill it). This needs no
    embedding (a ViT's patches come from a convolution) and no config. Where two widths are
    read equally often (a block of just an MLP), the one the model also names is taken: an
    ``nn.Embedding``'s width or a :data:`WIDTH_FIELDS` field of its ``config`` or of itself;
    where that does not decide either, ``None``.
    """
    embed = _called(model, "get_input_embeddings")
    if isinstance(embed, nn.Embedding):
        return int(embed.embedding_dim)
    if transposed is None:
        transposed = transposed_classes(model)
    votes = Counter(p.in_features for p in _block_projections(model, transposed))
    if not votes:
        return None
    most = max(votes.values())
    tied = sorted(w for w, n in votes.items() if n == most)
    if len(tied) == 1:
        return tied[0]
    named = [w for w in tied if w in _declared_widths(model)]
    return named[0] if len(named) == 1 else None


def _output_sizes(p: _Projection) -> tuple[str, ...]:
    """Integer attributes of a transposed projection equal to its output width (``nf``): its
    forward shapes the output with them."""
    if not p.transposed:
        return ()
    return tuple(sorted(k for k, v in vars(p.module).items()
                        if not k.startswith("_") and type(v) is int and v == p.out_features))


def _split_sizes(block: nn.Module, part: int) -> tuple[str, ...]:
    """Integer attributes of ``block`` its forward splits a fused output by (``.split(self.X``),
    holding one part's global width."""
    try:
        source = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return ()
    names = {n for found in _SPLIT_BY.findall(source) for n in found if n}
    return tuple(sorted(n for n in names
                        if type(getattr(block, n, None)) is int and getattr(block, n) == part))


def _block_entries(fqn: str, block: nn.Module, hidden: int,
                   transposed: frozenset[type[nn.Module]], fold: Folding) -> list[PlanEntry] | None:
    linears = _projections(block, transposed)
    folded = fold(fqn)
    if len(linears) < 2 or any(
            "*" in fold(f"{fqn}.{p.name}")[len(folded) + 1:].split(".") for p in linears):
        # numbered projections that fold to one pattern (a Sequential of Linears only) cannot
        # be told apart; numbered steps of mixed modules (Linear, GELU, ..., Linear) keep
        # their numbers (hyperrecipe.suggest.folding)
        return None
    held = {id(w) for p in linears for w in p.module.parameters()}
    if any(w.dim() > 1 and id(w) not in held for child in block.children()
           for w in child.parameters()):
        return None  # a nested block with weights of its own: not one region
    rows = [i for i, p in enumerate(linears) if p.out_features == hidden]
    if not rows:
        return None
    row = rows[-1]
    back = [i for i in rows if linears[i].in_features != hidden]
    if len(rows) == 1 and back and all(p.in_features == hidden
                                       for i, p in enumerate(linears) if i != row):
        # the one projection back from another width, wherever it is registered (Meta's
        # Llama and torchtitan register w1, w2, w3: w2 is the row-wise one)
        linears = [p for i, p in enumerate(linears) if i != row] + [linears[row]]
        row = len(linears) - 1
    cols = linears[:row]
    if (not cols or row != len(linears) - 1 or any(p.in_features != hidden for p in cols)
            or _reads_the_input(block, linears[row].name)):
        return None
    row_in = linears[row].in_features
    parts = _grouped_parts(block, cols[0].out_features, row_in) if len(cols) == 1 else ()
    if len(cols) == 1 and not parts and cols[0].out_features % row_in:
        return None  # fused parts of unequal widths its head counts do not explain
    cls = type(block).__name__
    src = f"{STRUCTURE_SOURCE}: {cls} at {folded}"
    out: list[PlanEntry] = []
    for p in cols:
        chunks = len(parts) if parts else (
            p.out_features // row_in if p.out_features % row_in == 0 else 1)
        style = ("packed_colwise" if len(cols) == 1 and chunks > 1 and _splits_its_output(block)
                 else "colwise")
        if parts and style != "packed_colwise":
            return None  # q, k and v of unequal widths that the forward does not split
        packed = style == "packed_colwise"
        out.append(PlanEntry(pattern=f"{folded}.{p.name}", style=style, plan="tp",
                             source=src, chunks=chunks if packed else 0,
                             transposed=p.transposed, sizes=_output_sizes(p),
                             split_sizes=_split_sizes(block, row_in) if packed else (),
                             chunk_sizes=parts, region=folded))
    last = linears[row]
    out.append(PlanEntry(pattern=f"{folded}.{last.name}", style="rowwise", plan="tp",
                         source=src, transposed=last.transposed, region=folded))
    out += [PlanEntry(pattern=f"{folded}.{name}", style="colwise", plan="tp",
                      source=f"{src} (a parameter per head)", region=folded)
            for name in _per_head_params(block, row_in)]
    return out


_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_query_groups")
_HEAD_SIZES = ("head_dim", "head_size")


def _count(block: nn.Module, names: Sequence[str]) -> int | None:
    """The first of ``names`` that is a positive integer on ``block``, else on its
    ``config`` (litgpt's attention reads ``self.config.n_head``)."""
    for holder in (block, getattr(block, "config", None)):
        for name in names:
            value = getattr(holder, name, None)
            if type(value) is int and value > 0:
                return value
    return None


def _grouped_parts(block: nn.Module, fused: int, row_in: int) -> tuple[int, ...]:
    """The widths of a fused q, k, v with fewer key/value heads than query heads but more than
    one (grouped-query attention, stored ``[q | k | v]``): ``(heads * size, groups * size, groups *
    size)`` where the block's (or its config's) counts say so and they add up to the fused
    width, the queries alone filling the row-wise projection's input. ``()`` otherwise. A
    layout the counts fit but the forward reads otherwise (q, k, v interleaved per group) is
    caught by ``check`` and narrowed, never written unverified."""
    heads, groups = _count(block, _COUNTS), _count(block, _KV_COUNTS)
    if heads is None or groups is None or not 1 < groups < heads or row_in % heads:
        return ()  # one key/value head (multi-query) cannot be divided between ranks
    size = _count(block, _HEAD_SIZES) or row_in // heads
    if heads * size != row_in or fused != (heads + 2 * groups) * size:
        return ()
    return (heads * size, groups * size, groups * size)


def _per_head_params(block: nn.Module, row_in: int) -> list[str]:
    """Direct 1-D parameters of ``block`` with one value per head (GPT-OSS's attention sinks):
    their length is the block's head count, or the row-wise projection's input width over the
    block's ``head_dim``. With the heads sharded, each rank holds its heads' values, as
    transformers' plans say for the families that name them (``sinks: colwise``); left whole,
    the forward broadcasts all of them against this rank's heads and fails."""
    counts = {v for k in _COUNTS if type(v := getattr(block, k, None)) is int and v > 1}
    head_dim = getattr(block, "head_dim", None)
    if type(head_dim) is int and 1 < head_dim < row_in and row_in % head_dim == 0:
        counts.add(row_in // head_dim)
    return [name for name, p in block.named_parameters(recurse=False)
            if p.dim() == 1 and p.shape[0] in counts and p.shape[0] != row_in]


def _mha_refusal(block: nn.MultiheadAttention) -> str | None:
    """Why ``mha_heads`` cannot shard ``block`` (it refuses the same at compile time), or
    ``None``."""
    if getattr(block, "in_proj_weight", None) is None:
        why = (f"its kdim ({block.kdim}) or vdim ({block.vdim}) differs from embed_dim "
               f"({block.embed_dim}), so q, k and v are separate q_proj_weight, k_proj_weight "
               f"and v_proj_weight")
    elif block.bias_k is not None:
        why = "add_bias_kv=True appends one learned key/value over every head"
    elif block.add_zero_attn:
        why = "add_zero_attn=True appends a zero key/value over every head"
    else:
        return None
    return (f"{why}, which the multihead_attention style (mha_heads) does not shard: left "
            f"replicated (docs/bring-your-own-model.md)")


def _left_out(block: nn.Module) -> str | None:
    """Why a block that fits the projection pair is left replicated all the same (see the
    module doc), or ``None``. Heads fixed in an einops call by ``h=self.<count>`` are no reason:
    the region divides that count (vit-pytorch's ``h=self.heads``)."""
    hazard = width_read_off_the_input(block) or heads_fixed_in_einops(block)
    if hazard is not None and hazard.kind == "einops":
        counts = einops_count_attrs(block)
        if counts and counts <= set(DIVIDED_COUNTS):
            return None
    if hazard is None:
        return None
    return (f"{hazard.why}: its heads cannot be divided between ranks, so it is left replicated "
            f"(docs/bring-your-own-model.md)")


def read_structure(model: nn.Module) -> tuple[tuple[PlanEntry, ...], tuple[Narrowed, ...]]:
    """Tensor-parallel plan entries from ``model``'s module tree (see the module doc), and the
    blocks left replicated for a reason the user should read (a width read off the input, heads
    fixed in einops, an ``nn.MultiheadAttention`` that ``mha_heads`` cannot shard). ``((), ())`` where the hidden size cannot be
    read (:func:`hidden_size`)."""
    transposed = transposed_classes(model)
    hidden = hidden_size(model, transposed)
    if hidden is None:
        return (), ()
    found: list[tuple[frozenset[int], list[PlanEntry], Narrowed | None]] = []
    seen: set[str] = set()
    fold = Folding.of_module(model)
    for fqn, block in model.named_modules():
        folded = fold(fqn)
        if "*" not in folded or folded in seen:
            continue
        seen.add(folded)
        if isinstance(block, nn.MultiheadAttention):
            refusal = _mha_refusal(block)
            found.append((frozenset({id(block)}), [] if refusal is not None else [PlanEntry(
                pattern=folded, style=MHA_STYLE, plan="tp",
                source=f"{STRUCTURE_SOURCE}: nn.MultiheadAttention at {folded}")],
                None if refusal is None else Narrowed(
                    what=f"{folded} (nn.MultiheadAttention)", why=refusal)))
            continue
        entries = _block_entries(fqn, block, hidden, transposed, fold)
        if not entries:
            continue
        ids = frozenset(id(p.module) for p in _projections(block, transposed))
        why = _left_out(block)
        found.append((ids, [] if why else entries, None if why is None else Narrowed(
            what=f"{folded} ({type(block).__name__})", why=why)))
    # the innermost block holding a projection pair is the region: a plain Sequential MLP
    # rather than the layer that also adds its residual (modules come parents first)
    claimed: set[int] = set()
    kept: list[tuple[list[PlanEntry], Narrowed | None]] = []
    for ids, entries, note in reversed(found):
        if ids & claimed:
            continue
        claimed |= ids
        kept.append((entries, note))
    out = [e for entries, _ in reversed(kept) for e in entries]
    notes = [note for _, note in reversed(kept) if note is not None]
    name = _output_head(model, hidden) if out else None
    if name is not None:
        out.append(PlanEntry(pattern=name, style="colwise_gather_output", plan="tp",
                             source=f"{STRUCTURE_SOURCE}: the output embedding", head=True))
    return tuple(out), tuple(notes)


def _output_head(model: nn.Module, hidden: int) -> str | None:
    """The output embedding's name: a transformers model's ``get_output_embeddings()``; for any
    other module the one ``nn.Linear`` outside the blocks from the hidden size to the vocabulary
    of an ``nn.Embedding`` of the hidden size (nanoGPT's and litgpt's ``lm_head``, tied to the
    token embedding or not). A classifier head (a ViT's, to its classes) is none: it stays
    replicated."""
    if callable(getattr(type(model), "get_output_embeddings", None)):
        head = _called(model, "get_output_embeddings")
        return next((n for n, m in model.named_modules() if m is head), None) if isinstance(
            head, nn.Linear) else None
    vocab = {int(m.num_embeddings) for m in model.modules()
             if isinstance(m, nn.Embedding) and m.embedding_dim == hidden}
    fold = Folding.of_module(model)
    found = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and "*" not in fold(n) and m.in_features == hidden
             and m.out_features in vocab]
    return found[0] if len(found) == 1 else None


def structural_entries(model: nn.Module) -> tuple[PlanEntry, ...]:
    """The plan entries of :func:`read_structure`; ``()`` where nothing fits."""
    return read_structure(model)[0]


def blocks_the_plan_leaves_out(plan: Sequence[PlanEntry], structural: Sequence[PlanEntry]
                               ) -> tuple[PlanEntry, ...]:
    """The entries of ``structural`` for blocks of the decoder layers that no tensor-parallel
    entry of ``plan`` names (neither the block nor anything in it), and its head where the plan
    has none.

    Some plans shard only the embedding and the head (DiffLlama, HunYuan, LFM2) or only the
    experts (GPT-OSS): their attention and MLP blocks are a projection pair all the same. A
    block the plan does name is left as the plan says (it may gather on purpose: a norm over
    every head, a fused projection). Only blocks that are children of a layer of the list the
    plan's own entries are under (or of the one list there is, where the plan names none) are
    taken: a block nested in another (a MoE block's shared experts, called on flattened tokens)
    or in another list of layers (a vision tower's) is left as the plan leaves it.
    """
    planned = [e.pattern for e in plan if e.plan == "tp"]
    has_head = any(e.head or ("*" not in e.pattern and e.style == "colwise_gather_output")
                   for e in plan if e.plan == "tp")
    lists = {p.split(".*.", 1)[0] for p in planned if ".*." in p}
    blocks: list[tuple[str, PlanEntry]] = []
    for e in structural:
        block = e.pattern.rsplit(".", 1)[0]
        parts = block.split(".*.")
        if e.head or len(parts) != 2 or "." in parts[1] or any(
                p == block or p.startswith(block + ".") or block.startswith(p + ".")
                for p in planned):
            continue
        blocks.append((parts[0], e))
    found = {layer_list for layer_list, _ in blocks}
    keep = lists if lists else (found if len(found) == 1 else set())
    out = [e for layer_list, e in blocks if layer_list in keep]
    if out and not has_head:
        out += [e for e in structural if e.head]
    return tuple(out)
