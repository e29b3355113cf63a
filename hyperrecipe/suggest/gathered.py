"""A region that fails under sequence parallelism is computed whole on the gathered sequence
instead of giving sequence parallelism up.

Sequence parallelism changes a region only at its edges: it all-gathers the sequence on entry
and reduce-scatters on exit, so the region's own code sees what it sees without it. When
``check`` blames such a region (or a projection in it), the likeliest fault is the region's
sharding itself: code between the projections that is not head-local (DiffLlama pairs head
``i`` with head ``i + heads/2`` through ``chunk`` on the head dim and normalises over both),
which no placement of the plan's projections can make right. The region is then left
replicated *and gathered*: it all-gathers the sequence on entry, every rank computes it whole
with whole parameters, and its output is sliced back to this rank's tokens (the gathered
replicated block of :mod:`hyperrecipe.suggest.sequence`). Its rules join that group, so a
check that still fails on it gives up sequence parallelism as a whole, and the region's own
rules come back then (:func:`hyperrecipe.suggest.verify.verify_rules` holds them). Pure: reads
and writes rules only.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hyperrecipe.suggest.rules import SuggestedRule
from hyperrecipe.suggest.sequence import GATHERED_GROUP, SEQUENCE_GROUP, nested_region

__all__ = ["GATHERED_INSTEAD", "gather_instead"]

GATHERED_INSTEAD = " (computed whole on the gathered sequence; sequence parallelism kept)"
"""How a region given up this way is named in the narrowings."""


def _region_of(rules: Sequence[SuggestedRule], culprit: SuggestedRule) -> SuggestedRule | None:
    """The region whose sequence-parallel layouts ``culprit`` is part of: the region rule of
    the group that the plan's own rule with the culprit's match belongs to."""
    if culprit.group != SEQUENCE_GROUP:
        return None
    base = next((r for r in rules if not r.deeper and r.match == culprit.match), None)
    if base is None:
        return None
    return next((r for r in rules if r.group == base.group and not r.deeper
                 and r.sources and r.sources[0].startswith("region: ")), None)


def gather_instead(rules: Sequence[SuggestedRule], culprit: SuggestedRule
                   ) -> tuple[list[SuggestedRule], list[SuggestedRule], str] | None:
    """Replace the region that ``culprit`` (a sequence-parallel layout of a region or of one
    of its projections) belongs to with a gathered replicated block.

    Returns:
        ``(rules, given_up, what)``: the new rules, the region's own rules taken out (to put
        back if sequence parallelism goes after all), and the narrowing's name; ``None`` when
        the culprit is not such a layout.
    """
    region = _region_of(rules, culprit)
    if region is None:
        return None
    refinement = next((r for r in rules if r.group == SEQUENCE_GROUP
                       and r.match == region.match and "in_src" in dict(r.fields)), None)
    if refinement is None:
        return None
    in_src = dict(dict(refinement.fields)["in_src"])
    arg, seq = next(iter(in_src.items()))
    group = region.group
    own = [r for r in rules if r.group == group]
    matches = {r.match for r in own}
    kept = [r for r in rules if r.group != group and nested_region(r.group) != group
            and not (r.group == SEQUENCE_GROUP and r.match in matches)]
    fields = {"boundary": True, "in_src": {arg: seq}, "in_dst": {arg: "replicate"},
              "out_src": {0: "replicate"}, "out_dst": {0: seq}}
    source = (f"deeper than the plan: sequence parallelism: {region.match} failed sharded, so "
              f"it is computed replicated: it all-gathers the sequence on entry and slices on "
              f"exit, computed whole on every rank (its gradients whole, not reduced; the "
              f"gather's backward a slice)")
    gathered = attrs.evolve(refinement, fields=tuple(fields.items()), sources=(source,),
                            group=GATHERED_GROUP)
    out = sorted([*kept, gathered], key=lambda r: r.order)
    return out, own, group + GATHERED_INSTEAD
