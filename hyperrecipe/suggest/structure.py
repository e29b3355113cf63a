"""Plan entries read off the model's structure, for a family that declares no parallel plan.

GPT-Neo, BLOOM, MPT, StableLM and the other families transformers ships without a
``base_model_tp_plan`` still have the shape tensor parallelism is built on: inside each repeated
block (attention, MLP) column-wise projections from the hidden size and one row-wise projection
back to it. This module proposes, in transformers' plan vocabulary so that the translation and the
check treat them like a declared plan, for every module under a list of layers whose ``nn.Linear``
children are

- projections *from* the hidden size, registered first: ``colwise`` (a fused one, whose output
  is ``k`` times the row-wise projection's input and that the block's ``forward`` splits with
  ``split``/``chunk``, is ``packed_colwise`` in ``k`` chunks; one it views per head, as BLOOM's
  ``query_key_value`` is, stays plain ``colwise``: every head keeps its q, k and v together;
  fused parts of unequal widths, as multi-query attention packs them, are left out);
- the last projection *to* the hidden size, registered last and not called on the block's own
  input (BERT's ``value`` is square too, but reads the input): ``rowwise``;

and nothing else with parameters but 1-D ones (norms), plus the output embedding as the gathering
head. A block that does not fit (a Linear of another shape, a nested block with weights of its
own) is left out; whatever is proposed goes through ``check`` like a declared plan, and a rule it
rejects is narrowed, never written unverified.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

from torch import nn

from hyperrecipe.integrations.hf_plans import PlanEntry
from hyperrecipe.suggest.rules import STRUCTURE_SOURCE

__all__ = ["STRUCTURE_SOURCE", "blocks_the_plan_leaves_out", "structural_entries"]


_SPLITS = re.compile(r"\.(split|chunk|unbind)\(|torch\.(split|chunk)\(")


def _fold(fqn: str) -> str:
    return ".".join("*" if seg.isdigit() else seg for seg in fqn.split("."))


def _called(model: nn.Module, method: str) -> object:
    """``model.<method>()`` of a transformers model (``None`` for any other module)."""
    fn = getattr(type(model), method, None)
    return fn(model) if callable(fn) else None


def _hidden_size(model: nn.Module) -> int | None:
    embed = _called(model, "get_input_embeddings")
    if isinstance(embed, nn.Embedding):
        return int(embed.embedding_dim)
    return None


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


def _block_entries(fqn: str, block: nn.Module, hidden: int) -> list[PlanEntry] | None:
    linears = [(name, m) for name, m in block.named_children() if isinstance(m, nn.Linear)]
    if len(linears) < 2 or any(name.isdigit() for name, _ in linears):
        return None  # a Sequential's numbered children read as layer indices in a pattern
    for name, child in block.named_children():
        if isinstance(child, nn.Linear):
            continue
        if any(p.dim() > 1 for p in child.parameters()):
            return None  # a nested block with weights of its own: not one region
    rows = [i for i, (_, m) in enumerate(linears) if m.out_features == hidden]
    if not rows:
        return None
    row = rows[-1]
    cols = linears[:row]
    if (not cols or row != len(linears) - 1 or any(m.in_features != hidden for _, m in cols)
            or _reads_the_input(block, linears[row][0])):
        return None
    row_in = linears[row][1].in_features
    if len(cols) == 1 and cols[0][1].out_features % row_in:
        return None  # fused parts of unequal widths (one key/value head beside the queries)
    cls = type(block).__name__
    src = f"{STRUCTURE_SOURCE}: {cls} at {_fold(fqn)}"
    out: list[PlanEntry] = []
    for name, m in cols:
        chunks = m.out_features // row_in if m.out_features % row_in == 0 else 1
        style = ("packed_colwise" if len(cols) == 1 and chunks > 1 and _splits_its_output(block)
                 else "colwise")
        out.append(PlanEntry(pattern=f"{_fold(fqn)}.{name}", style=style, plan="tp",
                             source=src, chunks=chunks if style == "packed_colwise" else 0))
    name, _ = linears[row]
    out.append(PlanEntry(pattern=f"{_fold(fqn)}.{name}", style="rowwise", plan="tp", source=src))
    return out


def structural_entries(model: nn.Module) -> tuple[PlanEntry, ...]:
    """Tensor-parallel plan entries from ``model``'s module tree (see the module doc); ``()``
    where nothing fits."""
    hidden = _hidden_size(model)
    if hidden is None:
        return ()
    out: list[PlanEntry] = []
    seen: set[str] = set()
    for fqn, block in model.named_modules():
        folded = _fold(fqn)
        if "*" not in folded or folded in seen:
            continue
        seen.add(folded)
        entries = _block_entries(fqn, block, hidden)
        if entries:
            out.extend(entries)
    head = _called(model, "get_output_embeddings")
    if out and isinstance(head, nn.Linear):
        name = next((n for n, m in model.named_modules() if m is head), None)
        if name is not None:
            out.append(PlanEntry(pattern=name, style="colwise_gather_output", plan="tp",
                                 source=f"{STRUCTURE_SOURCE}: the output embedding",
                                 head=True))
    return tuple(out)


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
