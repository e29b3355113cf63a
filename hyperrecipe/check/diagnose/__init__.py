"""Likely causes of a divergence, offered only when a known pattern is actually seen.

The entry point :func:`suggest` is here; the causes and the context are in ``causes``, the
patterns by topic in ``values`` (numbers), ``structure`` (plan and model tree behind a
failure) and ``gradients``.

Each heuristic tests a pattern on the numbers (or on the failure and the plan) and, when it
holds, returns a :class:`Suggestion` whose ``evidence`` says what was measured. When nothing
fits, there is no suggestion: a guess without evidence would send users the wrong way.

When ``compile``'s verification step refuses the plan (``ctx.verification``: ``check``
resolves without verifying, so that one can see what a refused plan does), its finding goes
with the pattern that holds (``Suggestion.verification``: the recipe line and the fix); where
no pattern holds, the finding is the likely cause (:data:`VERIFICATION_FINDING`).

Patterns, in the order they are tried at the first divergence:

- **16-bit rounding of a 16-bit reference** (any divergence): the reference itself computed in
  bfloat16 or float16 while every parameter is float32 (its forward re-run under a dispatch
  mode: :mod:`hyperrecipe.check.precision`), and compared again at check's tolerances for a
  16-bit model (atol 1e-2, rtol 1e-2) every value, gradient and parameter agrees →
  :data:`REFERENCE_COMPUTES_IN_16_BIT`.
- **an attention whose heads cannot be divided** (a value or a failure): the blamed boundary is,
  holds or is inside a module :mod:`hyperrecipe.forward_hazards` reads as one (the width read
  off its input, heads fixed in an einops pattern, ``nn.MultiheadAttention``), and a parameter
  there is sharded and reaches its forward as a shard (not through a boundary that hands out
  whole values; any sharded one for ``nn.MultiheadAttention``, whose boundaries inside never
  run, as the evidence says); an einops call whose ``h=self.<attr>`` the plan divides is
  no such case → :data:`WIDTH_READ_OFF_INPUT`, :data:`HEADS_FIXED_IN_EINOPS`,
  :data:`MHA_READS_ITS_OWN_WEIGHTS`.
- **bias counted n times**: the error is the same vector at every position and equals an integer
  multiple ``k`` of a bias inside the blamed boundary (``k + 1`` = a mesh dim size is stated), or
  the whole output is ``n`` x the reference for a mesh dim of size ``n`` →
  :data:`BIAS_COUNTED_TP_TIMES`.
- **matches only after an all-reduce or a transpose**: summing the ranks' values over one mesh
  dim reproduces the reference, or the transposed value does → :data:`COLWISE_ROWWISE_SWAPPED`.
- **swapped layers seen in a failure**: a linear weight sharded on its input features received
  the full input (or one sharded on its output features received a sharded input), or a partial
  value reached a boundary that declares it whole while a row-wise weight inside the enclosing
  boundary has no boundary to reduce its output → :data:`COLWISE_ROWWISE_SWAPPED`.
- **undivided head count** (production mode, and local regions in validate mode; elsewhere
  validate mode computes with global shapes):
  a module in the blamed boundary has an integer attribute named like a head count
  (``num_heads``, ``n_head``, ``num_key_value_heads``, ``split_size``…) divisible by a mesh dim,
  the plan divides no such attribute, and a parameter there is sharded on that dim, seen either
  as wrong values or as a shape error in that boundary → :data:`HEAD_COUNT_UNDIVIDED`.
- **a whole parameter on a shard** (either mode): the module that raised a shape error holds a
  replicated parameter whose last dim is ``n`` x its input's, for a mesh dim of size ``n`` (a
  norm over all heads left whole after a column-wise projection) →
  :data:`WHOLE_PARAM_ON_SHARD`.
- **heads cut between ranks** (either mode): a shape error raised in forward by a module that
  states heads (a head size such as ``head_dim``, or an attribute named like a head count) while
  a parameter in it is sharded; the evidence lists the heads and each rank's
  share → :data:`HEADS_NOT_WHOLE`. Resolve refuses the splits it can see (a head size in the
  model tree); this names the ones it cannot (a head size the tree does not show).
- **a plain tensor meets a DTensor** (validate mode): a forward raised DTensor's "got mixed
  torch.Tensor and DTensor" (a tensor of the module's own that does not broadcast over the
  sharded dims, such as T5's bucket ids into a head-sharded ``relative_attention_bias``) →
  :data:`PLAIN_TENSOR_MEETS_DTENSOR`.
- **forward right, gradients wrong** → :data:`GRADIENT_REDUCTION_MISSING` when the ranks'
  gradients of a parameter sum to the reference (named), otherwise
  :data:`GRADIENT_REDUCTION_WRONG` (a reduction missing, or one too many); when parameters got
  no gradient on a rank at all → :data:`PARAMS_UNUSED_ON_RANKS` (a per-head ``ModuleList``
  indexed from head 0 on every rank, StableLM's ``q_layernorm``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
from torch import Tensor

from hyperrecipe.check.compare import ModeComparison
from hyperrecipe.check.diagnose.causes import (
    BIAS_COUNTED_TP_TIMES,
    COLWISE_ROWWISE_SWAPPED,
    GRADIENT_REDUCTION_MISSING,
    GRADIENT_REDUCTION_WRONG,
    HEAD_COUNT_UNDIVIDED,
    HEADS_FIXED_IN_EINOPS,
    HEADS_NOT_WHOLE,
    MHA_READS_ITS_OWN_WEIGHTS,
    OUTPUT_LEFT_SHARDED,
    PARAMS_UNUSED_ON_RANKS,
    PLAIN_TENSOR_MEETS_DTENSOR,
    REFERENCE_COMPUTES_IN_16_BIT,
    VERIFICATION_FINDING,
    WHOLE_PARAM_ON_SHARD,
    WIDTH_READ_OFF_INPUT,
    DiagnosisContext,
    Suggestion,
)
from hyperrecipe.check.diagnose.gradients import gradient_evidence
from hyperrecipe.check.diagnose.structure import (
    forward_hazard_in,
    heads_cut,
    swapped_from_placement,
    swapped_from_shapes,
    undivided_heads,
    whole_param_on_shard,
)
from hyperrecipe.check.diagnose.values import (
    after_all_reduce,
    after_transpose,
    bias_offset,
    rounding_in_16_bit,
    scaled,
)
from hyperrecipe.check.record import Trace

__all__ = [
    "BIAS_COUNTED_TP_TIMES",
    "COLWISE_ROWWISE_SWAPPED",
    "DiagnosisContext",
    "GRADIENT_REDUCTION_MISSING",
    "GRADIENT_REDUCTION_WRONG",
    "HEAD_COUNT_UNDIVIDED",
    "HEADS_FIXED_IN_EINOPS",
    "HEADS_NOT_WHOLE",
    "MHA_READS_ITS_OWN_WEIGHTS",
    "OUTPUT_LEFT_SHARDED",
    "PARAMS_UNUSED_ON_RANKS",
    "PLAIN_TENSOR_MEETS_DTENSOR",
    "REFERENCE_COMPUTES_IN_16_BIT",
    "VERIFICATION_FINDING",
    "WHOLE_PARAM_ON_SHARD",
    "WIDTH_READ_OFF_INPUT",
    "Suggestion",
    "suggest",
]

_SHAPE_ERROR = re.compile(r"shape|size|mat1 and mat2|dimension|must match|unpack|split",
                          re.IGNORECASE)



def _event_values(ranks: Sequence[Trace], ctx: DiagnosisContext, key: tuple[str, int, str, str]
                  ) -> dict[int, Tensor]:
    out: dict[int, Tensor] = {}
    for r, t in zip(ctx.rank_ids, ranks):
        for e in t.events:
            if e.key == key and e.value is not None:
                out[r] = e.value
    return out


def suggest(cmp: ModeComparison, reference: Trace, ranks: Sequence[Trace], ctx: DiagnosisContext,
            *, atol: float, rtol: float) -> Suggestion | None:
    """The likely cause of ``cmp``'s divergence, or ``None`` when no known pattern is seen."""
    found = _suggest(cmp, reference, ranks, ctx, atol=atol, rtol=rtol)
    if ctx.verification is None:
        return found
    if found is None:
        return Suggestion(cause=VERIFICATION_FINDING, evidence=ctx.verification)
    return attrs.evolve(found, verification=ctx.verification)


def _suggest(cmp: ModeComparison, reference: Trace, ranks: Sequence[Trace],
             ctx: DiagnosisContext, *, atol: float, rtol: float) -> Suggestion | None:
    found = rounding_in_16_bit(cmp, reference, ranks, ctx, atol, rtol)
    if found is not None:
        return found
    first = cmp.first
    if first is None:
        if cmp.forward_agrees and cmp.diverged_gradients:
            return gradient_evidence(cmp, reference, ranks, ctx, atol, rtol)
        return None
    if first.event_index is not None:
        event = reference.events[first.event_index]
        b = event.value
        assert b is not None
        values = _event_values(ranks, ctx, event.key)
        a = values.get(first.rank)
        hazard = forward_hazard_in(first.fqn, None, reference, ctx)
        if hazard is not None:
            return hazard
        if a is not None and a.shape == b.shape:
            for found in (bias_offset(a, b, first.fqn, ctx) if event.kind == "output" else None,
                          scaled(a, b, event.fqn, ctx),
                          after_all_reduce(values, b, event.fqn, ctx, atol, rtol),
                          after_transpose(a, b, event.fqn, atol, rtol)):
                if found is not None:
                    return found
        heads = undivided_heads(first.fqn, ctx)
        if heads is not None:
            shape = "" if a is None or a.shape == b.shape else (
                f"; the value has shape {list(a.shape)}, the reference {list(b.shape)}")
            return Suggestion(cause=HEAD_COUNT_UNDIVIDED, evidence=heads + shape)
        return None
    if first.fqn == "<output>":
        out, ref = None, reference.output
        for t in ranks:
            if t.output is not None:
                out = t.output
                break
        if out is not None and ref is not None and out.shape != ref.shape and out.ndim == ref.ndim:
            for dim, n in ctx.sizes.items():
                if n > 1 and any(o * n == r for o, r in zip(out.shape, ref.shape)):
                    return Suggestion(cause=OUTPUT_LEFT_SHARDED, evidence=(
                        f"the output has shape {list(out.shape)} on rank {first.rank}, the "
                        f"reference {list(ref.shape)}: one dim is 1/{n} of it ({dim} = {n})"))
        return None
    failure = cmp.failure
    if failure is None:
        return None
    found = forward_hazard_in(first.fqn, failure, reference, ctx)
    if found is not None:
        return found
    found = swapped_from_placement(failure, ctx)
    if found is not None:
        return found
    if failure.phase == "forward" and "got mixed torch.Tensor and DTensor" in failure.error:
        where = failure.module or first.fqn
        return Suggestion(cause=PLAIN_TENSOR_MEETS_DTENSOR, evidence=(
            f"{where} raised in forward ({failure.error}); a local region computes on local "
            f"tensors in both modes (validate mode takes a plain tensor as replicated only "
            f"where it broadcasts over every sharded dim, such as a causal mask beside "
            f"head-sharded scores; ids the model computes for a head-sharded embedding, or a "
            f"tensor with a sharded dim's size, could be one rank's piece)"))
    if failure.phase == "forward" and _SHAPE_ERROR.search(failure.error):
        heads = undivided_heads(first.fqn, ctx)
        if heads is not None:
            return Suggestion(cause=HEAD_COUNT_UNDIVIDED, evidence=f"{heads} ({failure.error})")
        return (swapped_from_shapes(failure, ctx) or whole_param_on_shard(failure, ctx)
                or heads_cut(first.fqn, failure, ctx))
    return None
