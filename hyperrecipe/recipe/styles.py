"""Built-in styles: the parallel styles PyTorch and Hugging Face users already know by name.

Each style is nothing but a bundle of explicit rule fields; the table below is the single source
for the resolver, ``hyperrecipe schema`` and the docs, so what the docs say a style expands to is
what it expands to. Built-ins speak of the mesh dim ``tp``; write a recipe ``styles:`` entry to get
the same layout on another dim. Layout keys are positions: ``0`` is the first positional
argument of the forward (or its only / first output).
"""

from __future__ import annotations

from hyperrecipe.placement import REPLICATED, NamedPlacement, Partial, Shard
from hyperrecipe.recipe.schema import RuleFields, StyleDef

__all__ = ["BUILTIN_STYLES"]

_TP_COL = NamedPlacement.of({"tp": Shard(dim=0)})
_TP_ROW = NamedPlacement.of({"tp": Shard(dim=1)})
_TP_LAST = NamedPlacement.of({"tp": Shard(dim=-1)})
_TP_SEQ = NamedPlacement.of({"tp": Shard(dim=1)})
_TP_PARTIAL = NamedPlacement.of({"tp": Partial()})
_TP_FUSED_QKV = NamedPlacement.of({"tp": Shard(dim=0, chunks=3)})

_COLWISE = RuleFields(
    params=(("weight", _TP_COL), ("bias", _TP_COL)),
    boundary=True,
    in_src=((0, REPLICATED),),
    in_dst=((0, REPLICATED),),
    out_src=((0, _TP_LAST),),
    out_dst=((0, _TP_LAST),),
)

BUILTIN_STYLES: dict[str, StyleDef] = {
    s.name: s
    for s in (
        StyleDef(
            name="colwise",
            builtin=True,
            doc=(
                "Column-wise linear (PyTorch `ColwiseParallel`): weight and bias sharded on the "
                "output features; the input arrives replicated, the output leaves sharded on its "
                "last dim. The input's gradient comes back partial and is all-reduced."
            ),
            fields=_COLWISE,
        ),
        StyleDef(
            name="colwise_gather_output",
            builtin=True,
            doc=(
                "`colwise` whose output is all-gathered to replicate (PyTorch "
                "`ColwiseParallel(output_layouts=Replicate())`), e.g. an `lm_head` producing full "
                "logits."
            ),
            fields=RuleFields(out_dst=((0, REPLICATED),)).over(_COLWISE),
        ),
        StyleDef(
            name="rowwise",
            builtin=True,
            doc=(
                "Row-wise linear (PyTorch `RowwiseParallel`): weight sharded on the input "
                "features, bias replicated and deferred (added once, after the reduction); the "
                "input arrives sharded on its last dim, the partial output is all-reduced."
            ),
            fields=RuleFields(
                params=(("weight", _TP_ROW), ("bias", REPLICATED)),
                boundary=True,
                in_src=((0, _TP_LAST),),
                in_dst=((0, _TP_LAST),),
                out_src=((0, _TP_PARTIAL),),
                out_dst=((0, REPLICATED),),
                defer_bias=True,
            ),
        ),
        StyleDef(
            name="sequence_parallel",
            builtin=True,
            doc=(
                "Sequence parallel (PyTorch `SequenceParallel`), for norms and dropout: weights "
                "replicated, activations sharded on the sequence dim (1) in and out. The "
                "replicated weights' gradients are partial and get all-reduced over tp."
            ),
            fields=RuleFields(
                params=(("weight", REPLICATED), ("bias", REPLICATED)),
                boundary=True,
                in_src=((0, _TP_SEQ),),
                in_dst=((0, _TP_SEQ),),
                out_src=((0, _TP_SEQ),),
                out_dst=((0, _TP_SEQ),),
            ),
        ),
        StyleDef(
            name="vocab_parallel",
            builtin=True,
            doc=(
                "Vocab-parallel embedding (PyTorch `RowwiseParallel` on `nn.Embedding`): the "
                "table is sharded on the vocab dim, each rank looks up the ids it owns (others "
                "masked to zero) and the partial result is all-reduced."
            ),
            fields=RuleFields(
                params=(("weight", _TP_COL),),
                boundary=True,
                in_src=((0, REPLICATED),),
                in_dst=((0, REPLICATED),),
                out_src=((0, _TP_PARTIAL),),
                out_dst=((0, REPLICATED),),
            ),
        ),
        StyleDef(
            name="multihead_attention",
            builtin=True,
            doc=(
                "`torch.nn.MultiheadAttention` sharded by heads: `in_proj_weight` and "
                "`in_proj_bias` sharded in 3 chunks (each rank holds whole heads of q, k and v), "
                "the attention run on each rank's heads by the built-in inner wrapper "
                "`mha_heads`, the averaged attention weights (output 1) a partial sum reduced "
                "on the way out. Its `out_proj` needs a rule of its own with `style: rowwise` "
                "(docs/adapters.md#torchnnmultiheadattention-by-heads)."
            ),
            fields=RuleFields(
                params=(("in_proj_weight", _TP_FUSED_QKV), ("in_proj_bias", _TP_FUSED_QKV)),
                boundary=True,
                in_src=(("query", REPLICATED), ("key", REPLICATED), ("value", REPLICATED)),
                out_names=("attn_output", "attn_weights"),
                out_src=((0, REPLICATED), (1, _TP_PARTIAL)),
                out_dst=((0, REPLICATED), (1, REPLICATED)),
                inner_wrapper=("mha_heads",),
            ),
        ),
        StyleDef(
            name="replicate",
            builtin=True,
            doc="Parameters replicated on every rank; no boundary.",
            fields=RuleFields(params=(("weight", REPLICATED), ("bias", REPLICATED))),
        ),
    )
}
