"""Forward right, gradients wrong: a reduction missing, one too many, or parameters a rank
never used."""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.check.compare import ModeComparison, diff_tensors
from hyperrecipe.check.diagnose.causes import (
    GRADIENT_REDUCTION_MISSING,
    GRADIENT_REDUCTION_WRONG,
    PARAMS_UNUSED_ON_RANKS,
    DiagnosisContext,
    Suggestion,
    fmt_number,
)
from hyperrecipe.check.diagnose.values import sums_to_reference
from hyperrecipe.check.record import Trace

__all__ = ["gradient_evidence"]


def gradient_evidence(cmp: ModeComparison, reference: Trace, ranks: Sequence[Trace],
                       ctx: DiagnosisContext, atol: float, rtol: float) -> Suggestion:
    bad = cmp.diverged_gradients
    worst = max(bad, key=lambda g: g.diff.badness)
    metric = (f"max abs {fmt_number(worst.diff.max_abs)}" if worst.diff.max_abs is not None
              else worst.diff.problem)
    evidence = (f"all {cmp.events_compared} boundary values and the final output agree, but "
                f"{len(bad)} of {len(cmp.gradients)} gradients differ (worst {worst.name}, "
                f"{metric})")
    unused = [g for g in bad if g.diff.problem == "no gradient"]
    if unused:
        names = [g.name for g in unused]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        many = len(names) > 1
        return Suggestion(cause=PARAMS_UNUSED_ON_RANKS, evidence=(
            f"{evidence}; {shown} got no gradient on rank {unused[0].rank} (in the reference "
            f"{'they do' if many else 'it does'}): the sharded forward never used "
            f"{'them' if many else 'it'}, and computed what {'they' if many else 'it'} should "
            f"have with other parameters (another head's)"))
    partial: list[str] = []
    outside: list[tuple[str, str]] = []
    plans = {p.fqn: p for p in ctx.plan.params}
    for g in bad:
        ref = reference.grads.get(g.name)
        if ref is None:
            continue
        values = {r: t.grads[g.name] for r, t in zip(ctx.rank_ids, ranks) if g.name in t.grads}
        found = sums_to_reference(values, ref, ctx, atol, rtol)
        if found is not None:
            partial.append(f"{g.name} (over {found[0]})")
            p = plans.get(g.name)
            if p is not None and p.boundary is None:
                outside.append((p.module, found[0]))
    if partial:
        shown = ", ".join(partial[:3]) + (f" and {len(partial) - 3} more" if len(partial) > 3 else "")
        evidence += (f"; the ranks' gradients of {shown} sum to the reference: each rank holds a "
                     f"partial gradient that is never all-reduced")
        if outside:
            (module, dim), more = outside[0], len(outside) - 1
            evidence += (f"; {module}{f' (and {more} more)' if more else ''} lies outside every "
                         f"boundary and computes on values sharded over {dim} (a boundary handed "
                         f"them back sharded), with a replicated parameter no rule reduces: "
                         f"`style: sequence_parallel` on its rule for a norm on the "
                         f"sequence-sharded stream, or `reduce_grads` (validate mode refuses it "
                         f"by name)")
        return Suggestion(cause=GRADIENT_REDUCTION_MISSING, evidence=evidence)
    scaled: list[str] = []
    for g in bad:
        ref = reference.grads.get(g.name)
        if ref is None:
            continue
        grads = [t.grads[g.name] for t in ranks if g.name in t.grads]
        for dim, n in ctx.sizes.items():
            if n > 1 and grads and all(
                    v.shape == ref.shape and diff_tensors(v, n * ref, atol=atol * n, rtol=rtol).ok
                    for v in grads):
                scaled.append(f"{g.name} ({n} x, {dim})")
                break
    if scaled:
        shown = ", ".join(scaled[:3]) + (f" and {len(scaled) - 3} more" if len(scaled) > 3 else "")
        evidence += (f"; every rank's gradient of {shown} is the reference times the mesh dim's "
                     f"size: a whole gradient reduced once too often (a reduce_grads on a "
                     f"parameter whose gradient is already whole, or a declared input whose "
                     f"gradient is)")
        return Suggestion(cause=GRADIENT_REDUCTION_WRONG, evidence=evidence)
    evidence += ("; no rank's gradients sum to the reference. Validate mode checks each declared "
                 "replicated input's gradient against the reduction production gives it, and "
                 "names an input whose gradient is already whole, or an input or output whose "
                 "gradient arrives partial where the plan takes it whole (declare it with "
                 "in_grad / out_grad: a Mamba mixer's x_proj)")
    return Suggestion(cause=GRADIENT_REDUCTION_WRONG, evidence=evidence)
