"""The causes ``hyperrecipe check`` can name, and what every heuristic may consult."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from torch import Tensor

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
    "HEADS_NOT_WHOLE",
    "OUTPUT_LEFT_SHARDED",
    "PARAMS_UNUSED_ON_RANKS",
    "PLAIN_TENSOR_MEETS_DTENSOR",
    "WHOLE_PARAM_ON_SHARD",
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
    """

    plan: Plan
    tree: ModelTree
    reference_params: Mapping[str, Tensor]
    mode: str
    rank_ids: tuple[int, ...]
    verification: str | None = None

    @property
    def sizes(self) -> dict[str, int]:
        return self.plan.mesh_shape


def within(fqn: str, root: str) -> bool:
    """Whether module ``fqn`` is ``root`` or inside it (every module is inside ``""``)."""
    return not root or fqn == root or fqn.startswith(f"{root}.")


def fmt_number(x: float) -> str:
    """A measured error as the evidence prints it (three significant digits)."""
    return f"{x:.3g}"
