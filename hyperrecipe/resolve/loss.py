"""Stage 5b: the loss on vocab shards (``loss_parallel: true``), decided here so the runtime only
reads it.

A boundary that declares ``loss_parallel`` produces the logits and lets them leave sharded on
the vocab (last) dim; the cross entropy then runs on the shards (one small all-gather of
per-token statistics forward, nothing backward) instead of gathering ``[batch, seq, vocab]``
on every rank. What the runtime needs, and what is refused here with the recipe line:

- the boundary is an ``nn.Linear`` (its ``weight`` rows are the vocab), outermost (its caller
  computes the loss, so no enclosing boundary may convert the logits), and the only one;
- its ``weight`` is ``shard(0)`` on exactly one mesh dim and its output 0 leaves ``shard(-1)``
  on that dim and nothing else, so rank ``r``'s logits are vocab entries
  ``[r * V / n, (r + 1) * V / n)``;
- which loss runs: ``"model"`` when the module calling the boundary (its parent) has a forward
  that takes ``labels`` (transformers' ``ForCausalLM``: its own loss runs on the shards, and a
  call without labels gets gathered logits, lowered here), else ``"helper"`` (the caller uses
  ``hyperrecipe.vocab_parallel_cross_entropy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from hyperrecipe.collective import CollectiveOp
from hyperrecipe.errors import RecipeError
from hyperrecipe.placement import REPLICATE, Replicate, Shard
from hyperrecipe.plan import BoundaryPlan, LossParallel, ManifestEntry, Transition
from hyperrecipe.resolve.claims import ClaimTable
from hyperrecipe.resolve.context import Claim, ResolveInput, provenance
from hyperrecipe.resolve.lowering import lower_transition

__all__ = ["LINEAR", "loss_manifest", "plan_loss_parallel"]

LINEAR = "torch.nn.modules.linear.Linear"


def _refuse(claim: Claim, problem: str, hint: str) -> RecipeError:
    rule = claim.rule
    span = rule.span("loss_parallel") if "loss_parallel" in rule.explicit else rule.span("match")
    return RecipeError(problem, span=span, path=f"{rule.json_path}.loss_parallel",
                       rule_index=rule.index, hint=hint)


def plan_loss_parallel(inp: ResolveInput, claims: ClaimTable,
                       boundaries: Sequence[BoundaryPlan]) -> LossParallel | None:
    """The plan's loss on vocab shards, or ``None`` when no boundary declares one.

    Raises:
        RecipeError: more than one boundary declares it, or the one that does is not an
            outermost ``nn.Linear`` whose weight is ``shard(0)`` and whose output 0 leaves
            ``shard(-1)`` on that mesh dim alone.
    """
    declared = [(fqn, c) for (fqn, field, _), c in claims.slots.items()
                if field == "loss_parallel" and c.value is True]
    if not declared:
        _refuse_sharded_logits_without_loss(inp, claims, boundaries)
        return None
    declared.sort(key=lambda fc: inp.order[fc[0]])
    fqn, claim = declared[0]
    if len(declared) > 1:
        raise _refuse(declared[1][1], f"loss_parallel is declared on {fqn!r} and "
                      f"{declared[1][0]!r}; a plan computes one loss",
                      "declare it on the boundary that produces the logits (the lm_head)")
    boundary = next(b for b in boundaries if b.fqn == fqn)
    module = inp.tree.module(fqn)
    weight = module.param("weight")
    if not module.is_a(LINEAR) or weight is None or len(weight.shape) != 2:
        raise _refuse(claim, f"loss_parallel on {fqn!r} ({module.cls.rsplit('.', 1)[-1]}): the "
                      f"logits must come from an nn.Linear, whose weight rows are the vocab",
                      "declare it on the lm_head")
    if boundary.parent is not None:
        raise _refuse(claim, f"loss_parallel on {fqn!r}, which lies inside boundary "
                      f"{boundary.parent!r}: the loss is computed by the boundary's caller, so "
                      f"no enclosing boundary may convert the logits",
                      f"drop the boundary around {fqn!r}")
    placed = claims.get(weight.tied_to or weight.fqn, "params")
    placement = placed.value.canonical(inp.recipe.mesh) if placed is not None else None
    weight_dims = [(d, q) for d, q in (placement.dims if placement else ())
                   if isinstance(q, Shard) and inp.has(d)]
    if (len(weight_dims) != 1 or weight_dims[0][1].dim not in (0, -2)
            or weight_dims[0][1].is_chunked):
        raise _refuse(claim, f"loss_parallel on {fqn!r} needs its weight sharded on the vocab "
                      f"dim (0) over one mesh dim; found {placement or 'replicate'}",
                      "place the weight {tp: shard(0)} (as `style: colwise` does)")
    mesh_dim = weight_dims[0][0]
    output = next((a for a in boundary.outputs if a.position in (0, None)), None)
    want = f"{{0: {{{mesh_dim}: shard(-1)}}}}"
    if output is None:
        raise _refuse(claim, f"loss_parallel on {fqn!r}: output 0 (the logits) declares no "
                      f"layout", f"declare out_dst: {want}")
    sharded = [(d, q) for d, q in output.dst.dims if not isinstance(q, Replicate) and inp.has(d)]
    if sharded != [(mesh_dim, Shard(dim=-1))]:
        raise _refuse(claim, f"loss_parallel on {fqn!r}: the logits must leave sharded on the "
                      f"vocab dim (-1) over {mesh_dim!r} alone; out_dst is {output.dst}",
                      f"declare out_dst: {want}")
    owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    owner_info = inp.tree.module(owner)
    kind: Literal["model", "helper"] = (
        "model" if any(a.name == "labels" for a in owner_info.signature) else "helper")
    vocab = weight.shape[0]
    size = inp.size(mesh_dim)
    src = Shard(dim=-1)
    gather = Transition(boundary=fqn, stage="output", name=output.name, mesh_dim=mesh_dim,
                        src=src, dst=REPLICATE, forward=lower_transition(src, REPLICATE, mesh_dim),
                        backward=lower_transition(REPLICATE, src, mesh_dim),
                        reason="logits gathered for a call that computes no loss")
    reason = (f"loss on vocab shards over {mesh_dim} ({vocab} / {size}); "
              + ("the model's own labels= loss runs on the shards" if kind == "model" else
                 f"{owner or 'the model'}'s forward takes no labels: its caller computes the "
                 f"loss with vocab_parallel_cross_entropy"))
    return LossParallel(
        boundary=fqn, output=output.name, owner=owner, kind=kind, mesh_dim=mesh_dim,
        vocab=vocab, local_vocab=vocab // size, gather=(gather,) if kind == "model" else (),
        loss_op=CollectiveOp(kind="all_gather", mesh_dim=mesh_dim, gather_dim=-1),
        provenance=provenance(claim.rule, reason,
                              *(("loss_parallel",) if "loss_parallel" in claim.rule.explicit
                                else ())))


def _refuse_sharded_logits_without_loss(inp: ResolveInput, claims: ClaimTable,
                                        boundaries: Sequence[BoundaryPlan]) -> None:
    """An outermost ``nn.Linear`` boundary whose output leaves sharded on its last dim, called
    by a forward that takes ``labels`` (a transformers ``lm_head``), without ``loss_parallel``:
    the model's own loss would read ``[batch, seq, vocab / n]`` as if it were the whole vocab
    (``view(-1, vocab_size)`` regroups it silently). Refused."""
    for b in boundaries:
        if b.parent is not None or not b.outputs:
            continue
        module = inp.tree.module(b.fqn)
        owner = inp.tree.module(b.fqn.rsplit(".", 1)[0] if "." in b.fqn else "")
        if not module.is_a(LINEAR) or not any(a.name == "labels" for a in owner.signature):
            continue
        first = next((a for a in b.outputs if a.position in (0, None)), b.outputs[0])
        last = [d for d, q in first.dst.dims
                if isinstance(q, Shard) and q.dim == -1 and inp.size(d) > 1]
        if not last:
            continue
        dst, src = claims.layout(b.fqn, "out_dst"), claims.layout(b.fqn, "out_src")
        claim = next((c for c in (dst.get(0), dst.get(first.name), src.get(0),
                                  src.get(first.name)) if c is not None), None)
        rule = claim.rule if claim is not None else None
        field = "out_dst" if rule is not None and rule.fields.out_dst else "out_src"
        msg = (f"{b.fqn!r} hands {owner.fqn or 'the model'}'s forward, which computes the loss "
               f"from labels, logits sharded on the vocab dim ({first.dst}): its loss would "
               f"read a slice of the vocab as the whole")
        raise RecipeError(
            msg, span=(rule.span(field) if rule is not None and field in rule.explicit
                       else rule.span("match") if rule is not None else None),
            path=f"{rule.json_path}.{field}" if rule is not None else "$.rules",
            rule_index=rule.index if rule is not None else None,
            hint="declare `loss_parallel: true` on it (the loss then runs on the shards), or "
                 "gather the logits: out_dst: {0: replicate} (style colwise_gather_output)")


def loss_manifest(loss: LossParallel | None) -> tuple[ManifestEntry, ...]:
    """The loss's collective in a training step (its forward; its backward has none)."""
    if loss is None or not loss.loss_op.communicates:
        return ()
    return (ManifestEntry(boundary=loss.boundary, stage="loss", name="cross_entropy",
                          mesh_dim=loss.mesh_dim, direction="forward", op=loss.loss_op),)
