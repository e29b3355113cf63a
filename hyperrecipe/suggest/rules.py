"""The data a suggestion is made of: suggested rules, and what was given up or corrected."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["DIVIDED_COUNTS", "MHA_STYLE", "STRUCTURE_SOURCE", "Correction", "Narrowed",
           "SuggestedRule"]

DIVIDED_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
                  "n_heads", "n_kv_heads", "n_head", "n_query_groups", "heads",
                  "n_local_heads", "n_local_kv_heads")
"""The integer attributes of a block read off the structure that its region divides by the tp
size (``head_counts``): the structure reader counts on them (an einops ``h=self.heads`` is no
hazard) and the translation writes them. ``n_local_heads`` / ``n_local_kv_heads``: Meta's
reference Llama, whose counts are per rank already (``n_heads // model_parallel_size``)."""


@attrs.frozen(kw_only=True)
class SuggestedRule:
    """One rule of the suggested recipe, with where it came from.

    Attributes:
        match: the rule's ``match`` pattern.
        fields: the rule's other fields, as they are written in the recipe (YAML-ready values:
            strings, ints, bools, lists and mappings of them), in writing order.
        sources: one line each, for the comment above the rule: the plan entries or the part of
            the model's structure that it comes from.
        group: the unit that narrowing gives up together (a region and its projections, an
            embedding and the ``lm_head`` tied to it).
        deeper: the rule goes beyond the source plan (an option the user can turn off); a
            failing deeper rule is given up alone before its group is.
        order: position of the rule's first module in the model, for writing order.
    """

    match: str
    fields: tuple[tuple[str, Any], ...]
    sources: tuple[str, ...]
    group: str
    deeper: bool = False
    order: int = 0


@attrs.frozen(kw_only=True)
class Narrowed:
    """Something the suggestion gave up: ``what`` (a pattern, a plan entry) stays replicated."""

    what: str
    why: str


@attrs.frozen(kw_only=True)
class Correction:
    """A place where the source plan was wrong or incomplete, and what the suggestion does."""

    what: str
    detail: str


STRUCTURE_SOURCE = "the model's structure"
"""Where an entry read off the model's structure says it came from (the rule's comment;
:mod:`hyperrecipe.suggest.structure`)."""

MHA_STYLE = "multihead_attention"
"""The style of an entry read off an ``nn.MultiheadAttention``: the built-in recipe style of that
name (its heads run by the ``mha_heads`` inner wrapper), with its ``out_proj`` row-wise."""
