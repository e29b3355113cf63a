"""Sequence parallelism on top of the translated regions, as ``recipes/llama-sp.yaml`` does by
hand (Megatron-LM's sequence parallel): between blocks the residual stream is sharded on the
sequence dim, the norms run on 1/tp of the tokens, each region all-gathers the sequence on entry
and its row-wise projections reduce-scatter on exit, and the head all-gathers before the logits.

transformers' plans never declare it. It is proposed where every block of every decoder layer
(the layers' children, concrete: a dense MLP in the first layers and a MoE block after are two
kinds under one name) is one of

- a **norm** (1-D parameters only): it runs on this rank's tokens (``sequence_parallel``);
- a **region** (the translation's column-wise/row-wise pair): it gathers the sequence on entry
  and reduce-scatters on exit;
- a **token-local block**: every parameter in it replicated, except those of regions nested in
  it (a MoE block's shared experts), and its forward given the hidden states alone. It runs on this rank's tokens as a local region (MoE token
  dispatch is data-dependent); its replicated parameters then see only those tokens, so their
  gradients are all-reduced over tp, exactly as a norm's are (the resolver reduces every
  replicated parameter of a boundary whose input is sharded on a mesh dim). A nested region
  gathers the tokens of the block (the sequence dim is ``-2`` of both ``[batch, seq, hidden]``
  and the flattened ``[tokens, hidden]`` a MoE block hands its experts) and reduce-scatters
  them back. Whether the block really computes token by token (a router with capacity limits
  or a loss over all tokens does not; neither does a convolution over the sequence) is not
  read off the structure: ``check`` against one process decides, and a failure gives up
  sequence parallelism as a whole;

- a **gathered replicated block**: a block that mixes tokens (it holds a convolution, whose
  weight has three or more dims: a Mamba mixer, a short convolution, linear attention's), one
  given inputs beside the hidden states (an attention left replicated: its mask and rotary
  tensors are the whole sequence's, :func:`_other_inputs`), or one
  computed replicated around a projection the plan places outside a region (GLM's fused
  ``gate_up_proj`` whose output is gathered, OLMo-2's q/k/v under a norm over all heads). On
  this rank's tokens the first would be wrong and the second's collectives would mix the ranks'
  tokens, so it all-gathers the sequence on entry and slices it on exit, and every rank computes
  the same thing on the whole sequence: its replicated parameters' gradients are whole, not
  reduced, and the gather's backward is a slice, not a reduce-scatter (a reduce-scatter would
  count the whole gradient tp times). The resolver picks the slice where the block holds no
  sharded parameter; where it holds projections the plan places, the input's gradient is
  declared whole (``in_grad``) when they are all column-wise (their input gradient is
  all-reduced at their own boundary), and validate mode checks the declaration. Regions nested
  in it keep their translated layouts (replicated in and out). Its rules form a group of their
  own, given up with sequence parallelism as a whole (without them the block would run on this
  rank's tokens);

with at most one final norm beside the layer list and a gathering head (norms without
parameters, OLMo's, need no rule). The rules refine the translated
ones (mappings key by key) and form one group, so a check that fails on any of them gives up
sequence parallelism as a whole. A refinement of a rule with the same ``match`` is written into
that rule (:func:`hyperrecipe.suggest.render.merge_rules`). Pure: reads the module tree and the
translated rules.

A plan with no region at all (it gathers every column-wise output and splits every row-wise
input locally: Phi-3's fused projections, OLMoE's q/k/v under a norm over all heads) still gets
sequence parallelism: the layer list is read off the projections it places, and each block
holding them is a gathered replicated block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hyperrecipe.model_tree import ModuleInfo
from hyperrecipe.recipe.patterns import compile_pattern
from hyperrecipe.suggest.folding import Folding
from hyperrecipe.suggest.rules import SuggestedRule

__all__ = ["GATHERED_GROUP", "SEQUENCE_GROUP", "nested_group", "nested_region", "sequence_parallel_rules"]

SEQUENCE_GROUP = "sequence parallelism"
GATHERED_GROUP = f"{SEQUENCE_GROUP}: blocks computed replicated on the whole sequence"
"""The gathered replicated blocks' boundaries: given up with sequence parallelism as a whole."""
_LAST = 10**9
_NESTED_SEQ = "shard(-2)"
"""The token dim of an activation inside a token-local block: ``[batch, seq, hidden]`` and the
flattened ``[tokens, hidden]`` alike."""


def _is_norm(m: ModuleInfo) -> bool:
    return bool(m.params) and all(len(p.shape) == 1 for p in m.params)


def _is_conv(m: ModuleInfo) -> bool:
    """A ``torch.nn`` convolution (Mamba's ``conv1d``, LFM2's short convolution) with
    parameters. A MoE block's fused expert tensors are 3-D too, so the shape cannot tell."""
    return bool(m.params) and any(c.startswith("torch.nn.modules.conv.")
                                  for c in (m.cls, *m.torch_bases))


def _other_inputs(m: ModuleInfo) -> list[str]:
    """The inputs of ``m``'s forward beside its first (the hidden states), by name.

    A block the layer hands more than the hidden states (an attention's mask and rotary
    ``cos``/``sin``, a router's token ids, a position index) receives them for the whole
    sequence: no layout says which of their rows go with this rank's tokens, and the block may
    mix tokens through them (attention does). Run on this rank's tokens it would compare a
    ``seq/tp`` tensor it builds with a ``seq`` one it was given (``size of tensor a (4) must
    match ... b (8)``), or silently pair the wrong rows. So only a block whose forward takes
    the hidden states alone is token-local; a block with other inputs is gathered: computed on
    the whole sequence, where every input it is given is right as it is. ``**kwargs`` does not
    count (transformers passes the same keywords to every block)."""
    return [a.name for a in m.signature[1:] if a.kind not in ("var_keyword", "var_positional")]


_CONTAINERS = ("torch.nn.modules.container.ModuleList", "torch.nn.modules.container.ModuleDict")


def _blocks(tree: _Tree, layer: ModuleInfo) -> list[str]:
    """The blocks a decoder layer calls: its children, with a ``ModuleList`` or ``ModuleDict``
    child (LongCat-Flash's two attentions per layer, ``self_attn[0]`` and ``self_attn[1]``)
    replaced by what it holds. A container has no forward of its own: a boundary on it would
    name ``nn.Module``'s placeholder argument ``input``, and the layer never calls it."""
    out: list[str] = []
    for name in layer.children:
        child = tree.by_fqn[name]
        if any(child.is_a(c) for c in _CONTAINERS):
            out.extend(_blocks(tree, child))
        else:
            out.append(name)
    return out


def _first_arg(m: ModuleInfo) -> str | int:
    return m.signature[0].name if m.signature and m.signature[0].kind != "var_keyword" else 0


def _under(fqn: str, root: str) -> bool:
    return fqn == root or fqn.startswith(root + ".")


def _rule(match: str, fields: Mapping[str, object], source: str, i: int,
          group: str = SEQUENCE_GROUP) -> SuggestedRule:
    return SuggestedRule(match=match, fields=tuple(fields.items()), sources=(source,),
                         group=group, deeper=True, order=_LAST + i)


_NESTED = f"{SEQUENCE_GROUP} inside a token-local block: "


def nested_group(region_group: str) -> str:
    """The group of the layouts that let a region nested in a token-local block gather the
    block's tokens: given up with sequence parallelism, or with the region alone (then the
    whole block runs on this rank's tokens, the region's projections replicated)."""
    return _NESTED + region_group


def nested_region(group: str) -> str | None:
    """The region group a :func:`nested_group` is for, or ``None``."""
    return group.removeprefix(_NESTED) if group.startswith(_NESTED) else None


def _is_region(rule: SuggestedRule) -> bool:
    return bool(rule.sources) and rule.sources[0].startswith("region: ")


def _only_reduces(rule: SuggestedRule) -> bool:
    """A rule that places nothing: it only all-reduces replicated parameters' gradients."""
    return {k for k, _ in rule.fields} <= {"reduce_grads"}


def _pattern(fqns: Sequence[str], instances: Mapping[str, Sequence[ModuleInfo]],
             fold: Folding) -> str:
    """``a.*.b`` when ``fqns`` are all instances of their folded name, else the list."""
    folded = {fold(f) for f in fqns}
    if len(folded) == 1:
        key = folded.pop()
        if {m.fqn for m in instances.get(key, ())} == set(fqns):
            return key
    return fqns[0] if len(fqns) == 1 else "{" + ",".join(fqns) + "}"


class _Tree:
    """The concrete modules, and which rules match each."""

    def __init__(self, modules: Sequence[ModuleInfo], rules: Sequence[SuggestedRule]) -> None:
        self.by_fqn = {m.fqn: m for m in modules}
        self.order = [m.fqn for m in modules]
        self.instances: dict[str, list[ModuleInfo]] = {}
        self.fold = Folding.of_tree(modules)
        for m in modules:
            self.instances.setdefault(self.fold(m.fqn), []).append(m)
        self.rules = rules

    def matched(self, rule: SuggestedRule) -> list[str]:
        rx = compile_pattern(rule.match)
        return [f for f in self.order if rx.fullmatch(f)]

    def subtree(self, root: str) -> list[ModuleInfo]:
        return [self.by_fqn[f] for f in self.order if _under(f, root)]

    def placing(self, fqn: str) -> SuggestedRule | None:
        """A rule that places ``fqn`` (a style, parameters, a boundary), if any."""
        return next((r for r in self.rules if not _only_reduces(r)
                     and compile_pattern(r.match).fullmatch(fqn)), None)


def _classify(tree: _Tree, child: ModuleInfo, regions: Mapping[str, SuggestedRule],
              nested: dict[str, str]) -> str:
    """``"region"``, ``"norm"``, ``"token-local"``, ``"gathered"`` (``"gathered, whole"``: its
    input gradient is declared whole), or ``""`` (nothing to place). Regions nested in a
    token-local child are added to ``nested``."""
    if child.fqn in regions:
        return "region"
    inside = tree.subtree(child.fqn)
    if not any(m.params for m in inside):
        return ""
    if _is_norm(child) and len(inside) == 1:
        return "norm"
    held = [r for r in regions if _under(r, child.fqn)]
    styles = []
    for m in inside:
        if any(_under(m.fqn, r) for r in held):
            continue
        rule = tree.placing(m.fqn)
        if rule is not None:
            styles.append(str(dict(rule.fields).get("style", "a boundary")))
    if styles:  # replicated around a placed projection; whole where each hands back whole
        whole = all(s.startswith(("colwise", "rowwise")) for s in styles)
        return "gathered, whole" if whole else "gathered"
    if any(_is_conv(m) for m in inside if not any(_under(m.fqn, r) for r in held)):
        return "gathered"  # a convolution over the sequence mixes tokens: not token-local
    if _other_inputs(child):
        return "gathered"  # its other inputs (a mask, positions) span the whole sequence
    nested.update({r: child.fqn for r in held})
    return "token-local"


def sequence_parallel_rules(rules: Sequence[SuggestedRule], modules: Sequence[ModuleInfo],
                            dim: str) -> tuple[list[SuggestedRule], str]:
    """The rules that add sequence parallelism to ``rules``, or ``([], why not)``.

    Args:
        rules: the translated rules (regions, projections, head).
        modules: every module of the model, concrete FQNs, parents first.
        dim: the tensor-parallel mesh dim.
    """
    tree = _Tree(modules, rules)
    region_rules = [r for r in rules if _is_region(r)]
    heads = [r for r in rules if dict(r.fields).get("style") == "colwise_gather_output"
             and "*" not in r.match]
    if len(heads) != 1:
        return [], "no gathering head to build it around"
    regions = {f: r for r in region_rules for f in tree.matched(r)}
    layers, why_not = _layer_list(tree, regions, [r for r in rules if r is not heads[0]])
    if why_not:
        return [], why_not
    layer_instances = tree.instances.get(f"{layers}.*", [])
    if not layer_instances:
        return [], "the decoder layers are not found"
    kinds: dict[str, str] = {}
    nested: dict[str, str] = {}
    for layer in layer_instances:
        if layer.params:
            return [], f"{layer.fqn} holds parameters of its own, outside its blocks"
        for name in _blocks(tree, layer):
            kind = _classify(tree, tree.by_fqn[name], regions, nested)
            if kind:
                kinds[name] = kind
    gathered = [f for f, k in kinds.items() if k.startswith("gathered")]
    if not regions and not any(kinds[f] != "gathered" or _places(tree, f) for f in gathered):
        return [], "no region to build it around, nor a block around projections the plan places"
    inner = {f for f in regions if any(_under(f, g) for g in gathered)}
    stray = [f for f in regions if kinds.get(f) != "region" and f not in nested
             and f not in inner]
    if stray:
        return [], f"the region {stray[0]} is not a block of a decoder layer"
    norms = [f for f, k in kinds.items() if k == "norm"]
    base = layers.rsplit(".", 1)[0] if "." in layers else ""
    finals = [f for f, m in tree.by_fqn.items() if m.params and _is_norm(m)
              and (f.rsplit(".", 1)[0] if "." in f else "") == base and f != layers]
    if len(finals) > 1:  # norms without parameters (OLMo's) need no rule
        return [], f"more than one final norm beside {layers}: {', '.join(finals)}"
    arg = _first_arg(layer_instances[0])
    src = "deeper than the plan: sequence parallelism"
    seq = {dim: "shard(1)"}
    out: list[SuggestedRule] = [
        _rule(f"{layers}.0", {"boundary": True, "in_src": {arg: "replicate"},
                              "in_dst": {arg: seq}, "out_src": {0: seq}},
              f"{src}: the residual stream is sliced on the sequence where it enters layer 0 "
              f"(no communication)", 0),
    ]
    if norms or finals:
        out.append(_rule(_alternatives([*_folded(norms, tree), *finals]),
                         {"style": "sequence_parallel"},
                         f"{src}: the norms run on this rank's tokens; their gradients are "
                         f"all-reduced", 1))
    for block in _token_local_groups(kinds, tree):
        first = tree.by_fqn[block[0]]
        block_arg = _first_arg(first)
        match = _pattern(block, tree.instances, tree.fold)
        out.append(_rule(match, {"boundary": True, "local_region": True,
                                 "in_src": {block_arg: seq}, "in_dst": {block_arg: seq},
                                 "out_src": {0: seq}},
                         f"{src}: {match} computes token by token with replicated parameters: "
                         f"it runs on this rank's tokens and its parameters' gradients are "
                         f"all-reduced", len(out)))
    for block in _grouped(kinds, tree, "gathered"):
        first = tree.by_fqn[block[0]]
        block_arg = _first_arg(first)
        match = _pattern(block, tree.instances, tree.fold)
        block_fields: dict[str, object] = {"boundary": True, "in_src": {block_arg: seq},
                                           "in_dst": {block_arg: "replicate"},
                                           "out_src": {0: "replicate"}, "out_dst": {0: seq}}
        why = _gathered_why(block, tree)
        if kinds[block[0]] != "gathered" or any(
                tree.placing(m.fqn) for m in tree.subtree(first.fqn) if m.fqn != first.fqn):
            why = "computes replicated around projections the plan places"
        if kinds[block[0]] == "gathered, whole":
            block_fields["in_grad"] = {block_arg: "replicate"}
            why += (" (column-wise ones all-reduce their input's gradient, row-wise ones "
                    "all-gather it: the block's arrives whole)")
        out.append(_rule(match, block_fields,
                         f"{src}: {match} {why}: it all-gathers the sequence on entry and "
                         f"slices on exit, computed whole on every rank (its gradients whole, "
                         f"not reduced; the gather's backward a slice)", len(out),
                         GATHERED_GROUP))
    placed: dict[str, str] = {}  # region rule match -> the sequence dim of its tokens ("": none)
    for f, region in regions.items():
        where = "" if f in inner else "shard(1)" if f not in nested else _NESTED_SEQ
        if placed.setdefault(region.match, where) != where:
            return [], (f"the region {region.match} is a block of a layer in some layers and "
                        f"nested in a token-local or gathered block in others")
    groups = {r.match: r.group for r in region_rules}
    for region in region_rules:
        if placed[region.match] == "":
            continue  # inside a gathered block: replicated in and out, as translated
        tokens = {dim: placed[region.match]}
        fields = dict(region.fields)
        in_arg = next(iter(fields["in_src"]))
        first_out = "attn_output" if "out_names" in fields else 0
        how = "the sequence" if tokens == seq else "the block's tokens"
        out.append(_rule(region.match, {"in_src": {in_arg: tokens},
                                        "in_dst": {in_arg: "replicate"},
                                        "out_src": {first_out: tokens}},
                         f"{src}: {region.match} all-gathers {how} on entry and "
                         f"reduce-scatters on exit", len(out),
                         SEQUENCE_GROUP if tokens == seq else nested_group(region.group)))
    for row in rules:  # one refinement per row-wise rule, written into that rule
        if dict(row.fields).get("style") != "rowwise":
            continue
        owners = {regions[r].match for f in tree.matched(row) for r in regions
                  if f.startswith(r + ".")}
        if len({placed[o] for o in owners}) > 1:
            return [], f"{row.match} is under regions of both kinds"
        if owners and placed[next(iter(owners))] != "":
            owner = owners.pop()
            out.append(_rule(row.match, {"out_dst": {0: {dim: placed[owner]}}},
                             f"{src}: reduce-scatter instead of all-reduce", len(out),
                             SEQUENCE_GROUP if placed[owner] == "shard(1)"
                             else nested_group(groups[owner])))
    out.append(_rule(heads[0].match, {"in_src": {0: seq}, "in_dst": {0: "replicate"}},
                     f"{src}: the head all-gathers the sequence before the logits", len(out)))
    return out, ""


def _gathered_why(blocks: Sequence[str], tree: _Tree) -> str:
    """Why blocks without placed projections are gathered: a convolution, or inputs beside
    the hidden states (:func:`_other_inputs`); blocks of both kinds under one name say both."""
    whys: list[str] = []
    for f in blocks:
        if any(_is_conv(m) for m in tree.subtree(f)):
            why = "mixes tokens (a convolution)"
        else:
            why = (f"takes {', '.join(_other_inputs(tree.by_fqn[f]))} beside the hidden "
                   f"states, made for the whole sequence (a mask or positions: on this rank's "
                   f"tokens their sizes would not match)")
        if why not in whys:
            whys.append(why)
    return " or ".join(whys)


def _layer_list(tree: _Tree, regions: Mapping[str, SuggestedRule],
                rules: Sequence[SuggestedRule]) -> tuple[str, str]:
    """The list of decoder layers (``model.layers``) the blocks are read from, or ``("", why
    not)``. From the regions; where the plan makes none (it gathers every projection's output
    and splits every row-wise input locally: Phi-3's fused ``qkv_proj``, OLMoE's q/k/v under a
    norm over all heads), from the projections it places inside the layers: each block holding
    them is then a gathered replicated block."""
    if regions:
        lists = {tree.fold(f).split(".*.", 1)[0] for f in regions if ".*." in tree.fold(f)}
        if len(lists) != 1 or any(".*." not in tree.fold(f) for f in regions):
            return "", "the regions are not all under one list of decoder layers"
        return lists.pop(), ""
    placed = [tree.fold(f) for r in rules if not _only_reduces(r) for f in tree.matched(r)]
    lists = {f.split(".*.", 1)[0] for f in placed if ".*." in f}
    if not lists:
        return "", "no region to build it around, nor a projection the plan places in a layer"
    if len(lists) > 1:
        return "", "the projections the plan places are not all under one list of decoder layers"
    return lists.pop(), ""


def _places(tree: _Tree, block: str) -> bool:
    """Whether a rule places a module strictly inside ``block``."""
    return any(tree.placing(m.fqn) for m in tree.subtree(block) if m.fqn != block)


def _alternatives(patterns: Sequence[str]) -> str:
    return patterns[0] if len(patterns) == 1 else "{" + ",".join(patterns) + "}"


def _folded(fqns: Sequence[str], tree: _Tree) -> list[str]:
    """Concrete FQNs as few patterns: a folded name where every instance is in ``fqns``."""
    out: list[str] = []
    chosen = set(fqns)
    for f in fqns:
        key = tree.fold(f)
        whole = {m.fqn for m in tree.instances.get(key, ())} <= chosen
        name = key if whole else f
        if name not in out:
            out.append(name)
    return out


def _token_local_groups(kinds: Mapping[str, str], tree: _Tree) -> list[list[str]]:
    """Token-local blocks grouped by folded name and forward argument (one rule each)."""
    return _grouped(kinds, tree, "token-local")


def _grouped(kinds: Mapping[str, str], tree: _Tree, kind: str) -> list[list[str]]:
    """Blocks of ``kind`` (a prefix) grouped by folded name, kind and forward argument."""
    groups: dict[tuple[str, str, Any], list[str]] = {}
    for f, k in kinds.items():
        if k.startswith(kind):
            groups.setdefault((tree.fold(f), k, _first_arg(tree.by_fqn[f])), []).append(f)
    return list(groups.values())

