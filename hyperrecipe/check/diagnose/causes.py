"""The causes ``hyperrecipe check`` can name, and what every heuristic may consult."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from torch import Tensor

from hyperrecipe.check.precision import HalfPrecision
from hyperrecipe.forward_hazards import ForwardHazard
from hyperrecipe.model_tree import ModelTree
from hyperrecipe.plan import Plan

__all__ = [
    "BIAS_COUNTED_TP_TIMES",
    "VERIFICATION_FINDING",
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
    "WHOLE_PARAM_ON_SHARD",
    "WIDTH_READ_OFF_INPUT",
    "Suggestion",
    "fmt_number",
    "within",
]

VERIFICATION_FINDING = ("what verification at compile refused (shapes and placements alone show "
                        "it; docs/verification.md)")
BIAS_COUNTED_TP_TIMES = "a bias (or partial value) counted tp times: defer_bias / rowwise"
HEAD_COUNT_UNDIVIDED = "a head count left undivided (head_counts)"
WHOLE_PARAM_ON_SHARD = ("a whole (replicated) parameter meets a sharded activation: gather "
                        "around it, or shard it like its input")
HEADS_NOT_WHOLE = ("heads cut between ranks: a head count the mesh does not divide, or a "
                   "sharded dim that is not whole heads per rank")
COLWISE_ROWWISE_SWAPPED = "colwise/rowwise swapped"
GRADIENT_REDUCTION_MISSING = ("a gradient reduction missing (replicated input consumed by "
                              "sharded parameters, reduce_grads)")
GRADIENT_REDUCTION_WRONG = ("a gradient reduced wrongly: a reduction missing (reduce_grads), or one "
                            "too many (a declared replicated input that bypasses the sharded "
                            "parameters, such as a residual)")
PARAMS_UNUSED_ON_RANKS = ("parameters a rank never used: per-head modules indexed from the first "
                          "head on every rank (a ModuleList of one module per head); gather the "
                          "heads around that module, as for norms over all heads")
OUTPUT_LEFT_SHARDED = "the model's output is left sharded (gather it: out_dst replicate)"
PLAIN_TENSOR_MEETS_DTENSOR = ("a plain tensor of the model's own (a buffer, a fresh tensor) meets "
                              "a DTensor in validate mode: make the module that raised a "
                              "`local_region: true` boundary, or add an adapter "
                              "(docs/adapters.md)")

WIDTH_READ_OFF_INPUT = ("the attention reads its width off its input, so its heads cannot be "
                        "divided (head_counts does not reach a width read off the input): shape "
                        "the heads by a head size from the config (docs/bring-your-own-model.md"
                        "#the-width-read-off-the-input), or leave the attention replicated "
                        "(gather its projection)")
HEADS_FIXED_IN_EINOPS = ("an einops pattern fixes the head count (h=): fix the head size (d=) "
                         "instead, dividing any head count the forward reads with head_counts "
                         "(docs/bring-your-own-model.md#heads-fixed-in-einops), or leave the "
                         "attention replicated (gather its projection)")
MHA_READS_ITS_OWN_WEIGHTS = ("nn.MultiheadAttention computes in F.multi_head_attention_forward, "
                             "which reads in_proj_weight and out_proj.weight itself and never "
                             "calls out_proj: shard it with style: multihead_attention and "
                             "out_proj row-wise (docs/cookbook.md#nnmultiheadattention-"
                             "torchvisions-vit), or leave it replicated")
REFERENCE_COMPUTES_IN_16_BIT = ("the reference itself computes in 16 bits inside a float32 "
                                "model, and the ranks differ by 16-bit rounding: compare with "
                                "16-bit tolerances (--atol 1e-2 --rtol 1e-2), or run the model's "
                                "float32 path")


@attrs.frozen(kw_only=True)
class Suggestion:
    """A cause (one of the constants above) and the measurement that points to it."""

    cause: str
    evidence: str
    verification: str | None = None
    """What ``compile``'s verification step refuses of the plan, beside a pattern's evidence
    (the recipe line and the fix), when it refuses it."""


@attrs.frozen(kw_only=True)
class DiagnosisContext:
    """What the heuristics may consult besides the traces.

    Attributes:
        plan: the compiled plan.
        tree: the model's structure (integer attributes, parameter shapes).
        reference_params: the reference model's parameters before any step, by FQN.
        mode: ``"production"`` or ``"validate"``.
        rank_ids: the rank of each trace passed to :func:`suggest`.
        verification: what the verification step at compile refused of this plan (a
            ``RecipeError``'s text), or ``None``: when there is one, it is the likely cause,
            before any pattern (it was seen on shapes and placements, not guessed from values).
        hazards: the model's attentions whose heads cannot be divided, by FQN
            (:func:`hyperrecipe.forward_hazards.forward_hazards`, read off the live model).
        half_precision: the 16-bit computation the reference did inside a float32 model
            (:func:`hyperrecipe.check.precision.half_precision_seen`), or ``None``.
    """

    plan: Plan
    tree: ModelTree
    reference_params: Mapping[str, Tensor]
    mode: str
    rank_ids: tuple[int, ...]
    verification: str | None = None
    hazards: Mapping[str, ForwardHazard] = attrs.field(factory=dict)
    half_precision: HalfPrecision | None = None

    @property
    def sizes(self) -> dict[str, int]:
        return self.plan.mesh_shape


def within(fqn: str, root: str) -> bool:
    """Whether module ``fqn`` is ``root`` or inside it (every module is inside ``""``)."""
    return not root or fqn == root or fqn.startswith(f"{root}.")


def fmt_number(x: float) -> str:
    """A measured error as the evidence prints it (three significant digits)."""
    return f"{x:.3g}"
