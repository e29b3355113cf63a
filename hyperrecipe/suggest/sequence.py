"""Sequence parallelism on top of the translated regions, as ``recipes/llama-sp.yaml`` does by
hand (Megatron-LM's sequence parallel): between blocks the residual stream is sharded on the
sequence dim, the norms run on 1/tp of the tokens, each region all-gathers the sequence on entry
and its row-wise projections reduce-scatter on exit, and the head all-gathers before the logits.

transformers' plans never declare it. It is proposed only where the model's shape is the one it
is known for: every region under one list of decoder layers, the layers holding nothing with
parameters outside the regions but norms (1-D parameters only), a final norm beside the layer
list and a gathering head. The rules refine the translated ones (mappings key by key) and form
one group, so a check that fails on any of them gives up
sequence parallelism as a whole. A refinement of a rule with the same ``match`` is written into
that rule (:func:`hyperrecipe.suggest.render.merge_rules`). Pure: reads the folded module map
of the translation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hyperrecipe.model_tree import ModuleInfo
from hyperrecipe.suggest.rules import SuggestedRule

__all__ = ["SEQUENCE_GROUP", "sequence_parallel_rules"]

SEQUENCE_GROUP = "sequence parallelism"
_LAST = 10**9


def _is_norm(m: ModuleInfo) -> bool:
    return bool(m.params) and all(len(p.shape) == 1 for p in m.params)


def _first_arg(m: ModuleInfo) -> str | int:
    return m.signature[0].name if m.signature and m.signature[0].kind != "var_keyword" else 0


def _rule(match: str, fields: Mapping[str, object], source: str, i: int) -> SuggestedRule:
    return SuggestedRule(match=match, fields=tuple(fields.items()), sources=(source,),
                         group=SEQUENCE_GROUP, deeper=True, order=_LAST + i)


def sequence_parallel_rules(rules: Sequence[SuggestedRule], modules: Mapping[str, ModuleInfo],
                            dim: str) -> tuple[list[SuggestedRule], str]:
    """The rules that add sequence parallelism to ``rules``, or ``([], why not)``.

    Args:
        rules: the translated rules (regions, projections, head).
        modules: folded FQN -> module (layer indices as ``*``).
        dim: the tensor-parallel mesh dim.
    """
    regions = [r for r in rules if r.sources and r.sources[0].startswith("region: ")]
    heads = [r for r in rules if dict(r.fields).get("style") == "colwise_gather_output"
             and "*" not in r.match]
    if not regions or len(heads) != 1:
        return [], "no region, or no gathering head, to build it around"
    layer_lists = {r.match.split(".*.", 1)[0] for r in regions}
    if len(layer_lists) != 1 or any(".*." not in r.match for r in regions):
        return [], "the regions are not all under one list of decoder layers"
    layers = layer_lists.pop()
    layer = f"{layers}.*"
    region_fqns = {r.match for r in regions}
    norms: list[str] = []
    for fqn, m in modules.items():
        if not fqn.startswith(layer + ".") or any(fqn == r or fqn.startswith(r + ".")
                                                  for r in region_fqns):
            continue
        if m.params and _is_norm(m) and fqn.count(".") == layer.count(".") + 1:
            norms.append(fqn)
        elif m.params:
            return [], f"{fqn} holds parameters outside the regions"
    base = layers.rsplit(".", 1)[0] if "." in layers else ""
    finals = [f for f, m in modules.items() if "*" not in f and m.params and _is_norm(m)
              and f.rsplit(".", 1)[0] == base and f != layers]
    if not norms or len(finals) != 1:
        return [], "no norms between the blocks, or no single final norm"
    first = modules.get(f"{layers}.*")
    if first is None:
        return [], "the decoder layers are not found"
    arg = _first_arg(first)
    src = "deeper than the plan: sequence parallelism"
    seq = {dim: "shard(1)"}
    out: list[SuggestedRule] = [
        _rule(f"{layers}.0", {"boundary": True, "in_src": {arg: "replicate"},
                              "in_dst": {arg: seq}, "out_src": {0: seq}},
              f"{src}: the residual stream is sliced on the sequence where it enters layer 0 "
              f"(no communication)", 0),
        _rule("{" + ",".join([*norms, *finals]) + "}", {"style": "sequence_parallel"},
              f"{src}: the norms run on this rank's tokens; their gradients are all-reduced", 1),
    ]
    for i, region in enumerate(regions, start=2):
        fields = dict(region.fields)
        in_arg = next(iter(fields["in_src"]))
        first_out = "attn_output" if "out_names" in fields else 0
        out.append(_rule(region.match, {"in_src": {in_arg: seq}, "in_dst": {in_arg: "replicate"},
                                        "out_src": {first_out: seq}},
                         f"{src}: {region.match} all-gathers the sequence on entry and "
                         f"reduce-scatters on exit", i))
    for row in rules:  # one refinement per row-wise rule, written into that rule
        if dict(row.fields).get("style") == "rowwise" and any(
                row.match.startswith(g + ".") for g in region_fqns):
            out.append(_rule(row.match, {"out_dst": {0: seq}},
                             f"{src}: reduce-scatter instead of all-reduce", len(out)))
    out.append(_rule(heads[0].match, {"in_src": {0: seq}, "in_dst": {0: "replicate"}},
                     f"{src}: the head all-gathers the sequence before the logits", len(out)))
    return out, ""
