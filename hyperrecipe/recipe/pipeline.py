"""The recipe's ``pipeline`` section: pipeline stages and their schedule, as written.

This module checks the section's shape (keys, types, ranges) and keeps where each key was
written; what the names mean for a model (which ``nn.ModuleList`` is split, which schedules
exist, whether the split fits the layer count) is decided by
:mod:`hyperrecipe.resolve.pipeline`, which can point back here for every refusal.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from hyperrecipe.errors import SourceSpan
from hyperrecipe.recipe.source import PathKey, Positions

__all__ = ["PIPELINE_FIELD_SPECS", "PipelineSpec", "MAX_MICROBATCHES", "MAX_STAGES_PER_RANK"]

MAX_MICROBATCHES = 65536
MAX_STAGES_PER_RANK = 64

SplitSpec = Literal["balanced", "even"] | tuple[int, ...]


@attrs.frozen(kw_only=True)
class PipelineSpec:
    """A validated ``pipeline`` section (see :data:`PIPELINE_FIELD_SPECS` for each field)."""

    mesh_dim: str
    layers: str
    schedule: str
    microbatches: int
    stages_per_rank: int | None
    split: SplitSpec
    first: tuple[str, ...] | None
    last: tuple[str, ...] | None
    file: str
    positions: Positions = attrs.field(eq=False, repr=False)
    path: PathKey = attrs.field(eq=False, repr=False)

    def span(self, *sub: str | int, key: bool = False) -> SourceSpan:
        """Where ``pipeline.<sub...>`` is written (the section itself when ``sub`` is empty)."""
        return self.positions.span((*self.path, *sub), key=key)

    def json_path(self, *sub: str | int) -> str:
        return "$.pipeline" + "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in sub)


# name, JSON Schema of the value, required, doc: one table for the validator, the schema and
# docs/recipe-reference.md.
PIPELINE_FIELD_SPECS: tuple[tuple[str, dict[str, Any], bool, str], ...] = (
    ("layers", {"type": "string"}, True,
     "FQN of the `nn.ModuleList` of repeated blocks the stages split (`model.layers`, "
     "`transformer.h`). Stages own contiguous runs of it."),
    ("schedule", {"type": "string"}, True,
     "A `torch.distributed.pipelining` schedule: `GPipe`, `1F1B`, `Interleaved1F1B`, "
     "`LoopedBFS`, `InterleavedZeroBubble`, `ZBVZeroBubble`, `DualPipeV` "
     "(docs/pipeline.md)."),
    ("microbatches", {"type": "integer", "minimum": 1, "maximum": MAX_MICROBATCHES}, True,
     "How many microbatches each step's batch is cut into (along dim 0); the batch size must "
     "divide by it. More microbatches, smaller bubble."),
    ("mesh_dim", {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"}, False,
     "The mesh dim the stages are laid over (default `pp`); must be declared in `mesh`. At "
     "size 1 the section is inactive."),
    ("stages_per_rank", {"type": "integer", "minimum": 1, "maximum": MAX_STAGES_PER_RANK}, False,
     "Stages each rank holds (virtual stages): 1 for `GPipe`/`1F1B`, 2 or more for the "
     "interleaved and looped schedules (default 2), exactly 2 for the V-shaped `ZBVZeroBubble` "
     "and `DualPipeV`."),
    ("split", {"anyOf": [{"enum": ["balanced", "even"]},
                         {"type": "array", "items": {"type": "integer", "minimum": 1},
                          "minItems": 1, "uniqueItems": True}]}, False,
     "Where stages start: `balanced` (default: contiguous runs with the largest stage's "
     "parameter bytes, embeddings and head included, as small as it can be), `even` (the same "
     "number of layers each; the layer count must divide), or the index in `layers` where each "
     "stage after the first starts (`[10, 20, 30]` for 4 stages; uneven allowed)."),
    ("first", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}, False,
     "FQNs of parameter-holding modules outside `layers` that run before them (owned by the "
     "first stage). Default: those registered before `layers`."),
    ("last", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}, False,
     "FQNs of parameter-holding modules outside `layers` that run after them (owned by the last "
     "stage, with the loss). Default: those registered after `layers`."),
)

PIPELINE_KEYS: tuple[str, ...] = tuple(name for name, *_ in PIPELINE_FIELD_SPECS)


def pipeline_json_schema() -> dict[str, Any]:
    """The JSON Schema of the ``pipeline`` section."""
    return {
        "type": "object", "additionalProperties": False,
        "required": [name for name, _, required, _ in PIPELINE_FIELD_SPECS if required],
        "properties": {name: {**schema, "description": doc}
                       for name, schema, _, doc in PIPELINE_FIELD_SPECS},
    }
