"""The local kernels a boundary's layout calls for, decided here so the runtime only reads them.

- :func:`vocab_parallel`: an ``nn.Embedding`` boundary whose table is sharded on the vocab dim
  over one mesh dim is looked up with production's masked local kernel; any other sharding of
  such a table has no kernel and is refused.
- :func:`refuse_whole_biases_of_split_experts`: tensor-parallel experts with a per-expert bias
  left whole over the weights' mesh dim are refused (every rank would add all of it).
- :func:`refuse_experts_split_outside_a_region`: experts sharded whole over a mesh dim in a
  module that is not a local region are refused (no kernel picks this rank's experts).
- :func:`expert_parallel`: a local region whose own per-expert tensors (3-D weights and
  ``[E, ...]`` biases) are sharded on dim 0 over one mesh dim runs the expert-parallel kernel the declared inputs call for (``partial``
  when they are whole on that dim, ``dispatch`` when they are all ``shard(0)``), and its first
  output must be declared as that kernel produces it.

Every refusal names the recipe line that placed the offending tensor or declared the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from hyperrecipe.errors import RecipeError, SourceSpan
from hyperrecipe.model_tree import ModuleInfo, ParamInfo
from hyperrecipe.placement import REPLICATED, NamedPlacement, Partial, Shard
from hyperrecipe.plan import ArgLayout, ExpertParallel
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import Claim, ResolveInput, span_of
from hyperrecipe.resolve.layouts import DeclaredLayouts

__all__ = ["EMBEDDING", "expert_parallel", "refuse_experts_split_outside_a_region",
           "refuse_whole_biases_of_split_experts", "vocab_parallel"]

EMBEDDING = "torch.nn.modules.sparse.Embedding"


def _param_span(claim: Claim, name: str) -> tuple[SourceSpan, str]:
    rule = claim.rule
    span = rule.span("params", name) if name in rule.explicit_params else rule.span("match")
    return span, f"{rule.json_path}.params.{name}"


def vocab_parallel(inp: ResolveInput, claims: ClaimTable, module: ModuleInfo) -> str | None:
    """The mesh dim of an ``nn.Embedding`` boundary's vocab-parallel lookup, or ``None``.

    Production mode computes a sharded table's lookup with a local kernel (each rank looks
    up the ids it owns); that kernel exists for the vocab dim sharded over one mesh dim.

    Raises:
        RecipeError: the table is sharded some other way (at the rule that placed it).
    """
    weight = module.param("weight")
    if not module.is_a(EMBEDDING) or weight is None:
        return None
    claim = claims.get(weight.tied_to or weight.fqn, "params")
    if claim is None:
        return None
    placement: NamedPlacement = claim.value.canonical(inp.recipe.mesh)
    sharded = [(d, q) for d, q in placement.dims if isinstance(q, Shard)]
    if not sharded:
        return None
    (dim, q), *rest = sharded
    if rest or q.dim not in (0, -2):
        span, path = _param_span(claim, weight.name)
        raise RecipeError(
            f"{module.fqn}: a vocab-parallel embedding shards the vocab dim (0) on one mesh "
            f"dim; found {placement}", span=span, path=path, rule_index=claim.rule.index,
            hint="shard the table's dim 0 over one mesh dim (as `style: vocab_parallel` "
                 "does), or replicate it")
    return dim


def expert_parallel(inp: ResolveInput, claims: ClaimTable, module: ModuleInfo, region: Claim,
                    layouts: DeclaredLayouts) -> ExpertParallel | None:
    """The expert-parallel kernel of a local region, or ``None`` when its experts are whole.

    Raises:
        RecipeError: 3-D parameters sharded on different mesh dims or only some of them,
            inputs that agree on neither kernel, an output layout the kernel does not
            produce, or a module without an integer ``num_experts``.
    """
    fqn = module.fqn
    experts = _per_expert(module)
    on: dict[str, set[str]] = {}
    placed: dict[str, NamedPlacement] = {}
    owners: dict[str, Claim] = {}
    for p in experts:
        claim = claims.get(p.tied_to or p.fqn, "params")
        placement = claim.value.canonical(inp.recipe.mesh) if claim else REPLICATED
        placed[p.name] = placement
        if claim is not None:
            owners[p.name] = claim
        on[p.name] = {d for d, q in placement.dims if isinstance(q, Shard)
                      and not q.is_chunked and q.dim in (0, -3)}
    dims: set[str] = set().union(*on.values()) if on else set()
    if not dims:
        return None
    if len(dims) > 1 or any(s != dims for s in on.values()):
        layout = ", ".join(f"{p.name}: {placed[p.name]}" for p in experts)
        odd = next((n for n, s in on.items() if s != dims), experts[-1].name)
        blamed = owners.get(odd) or next(iter(owners.values()))
        span, path = _param_span(blamed, odd)
        raise RecipeError(
            f"{fqn}: an expert-parallel region shards every per-expert tensor (the 3-D "
            f"weights and any [E, ...] bias) on dim 0 over one mesh dim; found {layout}",
            span=span, path=path, rule_index=blamed.rule.index,
            hint=f"give '{odd}' the same placement as the other expert tensors "
                 f"({{{next(iter(dims))}: shard(0)}}): a rank indexes it with its local expert "
                 f"ids, so a whole copy would hand its experts other experts' rows")
    ep_dim = dims.pop()
    kernel = _kernel(fqn, ep_dim, layouts)
    if module.int_attr("num_experts") is None:
        span, path = span_of(region, "local_region")
        raise RecipeError(
            f"{fqn}: an expert-parallel region needs the experts module's integer "
            f"'num_experts' attribute; {module.cls.rsplit('.', 1)[-1]} has none",
            span=span, path=path, rule_index=region.rule.index)
    _refuse_unrouted_forward(module, region)
    total = experts[0].shape[0]
    return ExpertParallel(mesh_dim=ep_dim, kernel=kernel, experts=total,
                          local_experts=total // inp.size(ep_dim))


_KERNEL_ARGS = 3
"""The expert-parallel kernels call the experts' forward as ``forward(hidden_states, expert ids,
routing weights, ...)``: transformers' fused experts (Mixtral's ``top_k_index, top_k_weights``,
GPT-OSS's ``router_indices, routing_weights``)."""


def _refuse_unrouted_forward(module: ModuleInfo, region: Claim) -> None:
    """An experts module whose forward takes no expert ids (Llama-4's
    ``Llama4TextExperts.forward(hidden_states)``: its MoE block routes and hands it every
    expert's tokens) cannot be told which experts are this rank's; the kernel would fail on the
    first call, and without a local region the module would read the expert count off its local
    weights, silently wrong."""
    if not module.signature:
        return  # the forward's signature could not be read: nothing to judge by
    positional = [a.name for a in module.signature
                  if a.kind in ("positional", "positional_only")]
    if len(positional) >= _KERNEL_ARGS or any(a.kind == "var_positional"
                                              for a in module.signature):
        return
    cls = module.cls.rsplit(".", 1)[-1]
    span, path = span_of(region, "local_region")
    raise RecipeError(
        f"{module.fqn}: the expert-parallel kernel calls the experts' forward as "
        f"forward(hidden_states, expert ids, routing weights) with this rank's ids; "
        f"{cls}.forward takes ({', '.join(positional)}): it is handed tokens already routed, so "
        f"no kernel can pick this rank's experts", span=span, path=path,
        rule_index=region.rule.index,
        hint="keep the experts whole on that mesh dim and shard them tensor-parallel on their "
             "intermediate dim instead (a fused gate/up dim with chunks=2), or "
             "expert-parallelize a module whose forward takes the router's ids")


def refuse_experts_split_outside_a_region(inp: ResolveInput, claims: ClaimTable,
                                          module: ModuleInfo) -> None:
    """Experts sharded whole over a mesh dim (3-D weights ``shard(0)``) in a module that is
    not a local region: only a local region runs the expert-parallel kernel, and without it the
    module computes with its local experts against the router's global ids (a model that reads
    the expert count off its weights raises nothing: production is silently wrong).

    Raises:
        RecipeError: at the rule that placed the first such weight.
    """
    experts = [p for p in _per_expert(module) if len(p.shape) == 3]
    if not experts:
        return
    region = claims.get(module.fqn, "local_region")
    if region is not None and region.value:
        return
    for p in experts:
        claim = claims.get(p.tied_to or p.fqn, "params")
        if claim is None:
            continue
        placement: NamedPlacement = claim.value.canonical(inp.recipe.mesh)
        ep = [d for d, q in placement.dims if isinstance(q, Shard) and not q.is_chunked
              and q.dim in (0, -3) and inp.size(d) > 1]
        if not ep:
            continue
        span, path = _param_span(claim, p.name)
        raise RecipeError(
            f"{module.fqn}: its experts are sharded whole over {ep[0]} ('{p.name}' "
            f"{placement}), but only an expert-parallel local region picks this rank's "
            f"experts; without one each rank computes with its {p.shape[0] // inp.size(ep[0])} "
            f"local experts against the router's global ids", span=span, path=path,
            rule_index=claim.rule.index,
            hint=f"make {module.fqn} a boundary with `local_region: true` and its in_src/out_src "
                 f"(docs/runtime.md#expert-parallel, recipes/mixtral-ep.yaml)")


def refuse_whole_biases_of_split_experts(inp: ResolveInput, claims: ClaimTable,
                                         module: ModuleInfo) -> None:
    """Tensor-parallel experts (3-D weights sharded on a dim other than 0) with a per-expert
    bias whole over that mesh dim: each rank adds the whole bias to its slice or partial sum
    (GPT-OSS's ``down_proj_bias`` after a down projection sharded on ``I``: counted tp times;
    ``gate_up_proj_bias`` next to a sliced ``gate_up_proj``: a shape error in production).

    Raises:
        RecipeError: at the rule that left the bias whole.
    """
    fqn = module.fqn
    experts = _per_expert(module)
    placed: dict[str, NamedPlacement] = {}
    owners: dict[str, Claim] = {}
    for p in experts:
        claim = claims.get(p.tied_to or p.fqn, "params")
        placed[p.name] = claim.value.canonical(inp.recipe.mesh) if claim else REPLICATED
        if claim is not None:
            owners[p.name] = claim
    if not owners:
        return
    split = {d for p in experts if len(p.shape) == 3
             for d, q in placed[p.name].dims if isinstance(q, Shard)}
    for p in experts:
        if len(p.shape) == 3 or not split:
            continue
        sharded = {d for d, q in placed[p.name].dims if isinstance(q, Shard)}
        whole = sorted(split - sharded)
        if not whole:
            continue
        owner = owners.get(p.name) or next(iter(owners.values()))
        span, path = _param_span(owner, p.name)
        raise RecipeError(
            f"{fqn}: the experts' weights are sharded over {whole[0]} but their per-expert "
            f"tensor '{p.name}' {list(p.shape)} is whole there: every rank would add all of it "
            f"to its own slice or partial sum", span=span, path=path,
            rule_index=owner.rule.index,
            hint="a bias added after a projection sharded on its output features is sharded "
                 "with them (GPT-OSS's gate_up_proj_bias: shard(1) with gate_up_proj's "
                 "shard(2)); one added after a projection sharded on its input features "
                 "(down_proj_bias) has no placement: shard the experts whole over an ep dim "
                 "instead (shard(0), docs/cookbook.md, 'Other MoE families')")


def _per_expert(module: ModuleInfo) -> list[ParamInfo]:
    """The module's per-expert tensors: its 3-D weights ``[E, ., .]`` and every other tensor of
    two or more dims whose dim 0 is ``E`` (GPT-OSS's ``gate_up_proj_bias [E, 2I]`` and
    ``down_proj_bias [E, H]``). The kernel indexes them all with local expert ids, so they are
    sharded together or not at all. torch's convolutions hold 3-D weights of another meaning
    (``[out_channels, in_channels / groups, kernel]``: a Mamba mixer's depthwise ``conv1d``),
    and are not experts."""
    if module.cls.startswith("torch.nn.modules.conv."):
        return []
    weights = [p for p in module.params if len(p.shape) == 3]
    if not weights:
        return []
    count = weights[0].shape[0]
    return [p for p in module.params
            if len(p.shape) == 3 or (len(p.shape) >= 2 and p.shape[0] == count)]


def _kernel(fqn: str, ep_dim: str, layouts: DeclaredLayouts) -> Literal["partial", "dispatch"]:
    inputs: Sequence[ArgLayout] = layouts.inputs
    outputs: Sequence[ArgLayout] = layouts.outputs
    sharded = {a.name: isinstance(a.dst.get(ep_dim), Shard) for a in inputs}
    if not sharded or not any(sharded.values()):
        kind: Literal["partial", "dispatch"] = "partial"
    elif all(sharded.values()) and all(a.dst.get(ep_dim) == Shard(dim=0) for a in inputs):
        kind = "dispatch"
    else:
        layout = ", ".join(f"{a.name}: {a.dst}" for a in inputs)
        odd = next(a.name for a in inputs if not sharded[a.name]
                   or a.dst.get(ep_dim) != Shard(dim=0))
        span, path, index = layouts.span("input", odd)
        raise RecipeError(
            f"{fqn}: an expert-parallel region takes its inputs either whole on {ep_dim} "
            f"(each rank runs its experts on every token) or all sharded on dim 0 (tokens "
            f"dispatched to their experts' ranks); found {layout}", span=span, path=path,
            rule_index=index)
    out = outputs[0].src.get(ep_dim) if outputs else None
    want = Partial() if kind == "partial" else Shard(dim=0)
    if out != want:
        span, path, index = layouts.span("output", outputs[0].name if outputs else "output",
                                         prefer="src")
        raise RecipeError(
            f"{fqn}: with inputs {'sharded' if kind == 'dispatch' else 'whole'} on {ep_dim} "
            f"the expert-parallel region produces {{{ep_dim}: {want}}} outputs; the recipe "
            f"declares out_src {{{ep_dim}: {out}}}", span=span, path=path, rule_index=index)
    return kind
