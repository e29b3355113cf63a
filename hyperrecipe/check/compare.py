"""Comparing rank traces with the reference trace, and finding where they first part.

Two tensors *agree* when they have the same shape, every element satisfies
``|actual - expected| <= atol + rtol * |expected|`` (``torch.isclose``; NaN agrees only with
NaN), and the largest difference is within ``rtol`` of the tensor's largest value (plus
``atol * 1e-3``). The second test is what judges a tensor whose values all lie below ``atol``:
a small model's gradients (a norm's ~1e-6 at a tiny logit scale, Cohere's) reduced twice
differ by less than ``atol`` everywhere, yet by 100% of their size. ``max_abs`` is the largest ``|actual - expected|``; ``max_rel`` the largest
``|actual - expected| / |expected|`` over the elements where ``expected`` is not zero.

The **first divergence** is found by walking the reference's boundary events in execution order
(see :mod:`hyperrecipe.check.record`) on every rank; the earliest event that disagrees on any
rank decides:

- an ``output`` event: its inputs (and every inner boundary up to there) still agreed, so this
  boundary itself computed something else — it is blamed;
- an ``input`` event inside an enclosing boundary: the value was already wrong when it was
  passed in, so the code of the *enclosing* boundary between its inner boundaries produced it
  (e.g. attention math between the q/k/v projections and ``o_proj``) — the enclosing one is
  blamed, with the metrics of its own output;
- an ``input`` event at top level: model code outside any boundary produced it; that boundary
  is named with the input that already differed.

A rank whose step raised is blamed where it raised, unless an earlier event had already
diverged. When every boundary and the final output agree, the mode may still disagree on
gradients (or on parameters after the SGD steps); ``first`` is then ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
import torch
from torch import Tensor

from hyperrecipe.check.record import Event, Failure, Trace

__all__ = ["Divergence", "ModeComparison", "NamedDiff", "TensorDiff", "compare_mode",
           "diff_tensors"]

_SCALE_FLOOR = 1e-3
"""The scaled test allows ``atol * _SCALE_FLOOR`` besides ``rtol`` of the tensor's largest value,
so that a reference of exact zeros still agrees with rounding noise."""


@attrs.frozen(kw_only=True)
class TensorDiff:
    """How one tensor compares with its reference. ``problem`` says why metrics are missing."""

    ok: bool
    max_abs: float | None
    max_rel: float | None
    problem: str = ""

    @property
    def badness(self) -> float:
        """For picking the worst: inf when there are no metrics or they are NaN."""
        if self.max_abs is None or math.isnan(self.max_abs):
            return math.inf
        return self.max_abs


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def diff_tensors(actual: Tensor | None, expected: Tensor, *, atol: float, rtol: float,
                 note: str = "") -> TensorDiff:
    """Compare ``actual`` with ``expected`` (see the module docstring for the criterion)."""
    if actual is None:
        return TensorDiff(ok=False, max_abs=None, max_rel=None, problem=note or "no value")
    if actual.shape != expected.shape:
        return TensorDiff(ok=False, max_abs=None, max_rel=None,
                          problem=f"shape {_shape(actual)}, reference {_shape(expected)}")
    a = actual.detach().cpu().double()
    b = expected.detach().cpu().double()
    if a.numel() == 0:
        return TensorDiff(ok=True, max_abs=0.0, max_rel=0.0)
    ok = bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all())
    d = (a - b).abs()
    both_nan = a.isnan() & b.isnan()
    d = torch.where(both_nan, torch.zeros_like(d), d)
    max_abs = float(d.max())
    finite = b[b.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    if ok and max_abs > rtol * scale + atol * _SCALE_FLOOR:
        ok = False  # every element within atol, but wrong relative to the tensor's own size
    nonzero = b != 0
    max_rel = float((d[nonzero] / b[nonzero].abs()).max()) if bool(nonzero.any()) else 0.0
    return TensorDiff(ok=ok, max_abs=max_abs, max_rel=max_rel)


@attrs.frozen(kw_only=True)
class NamedDiff:
    """The worst comparison of one named tensor (a gradient, a parameter) over the ranks."""

    name: str
    rank: int
    diff: TensorDiff


@attrs.frozen(kw_only=True)
class Divergence:
    """Where a mode first departs from the reference.

    Attributes:
        fqn: the blamed boundary (``""`` is the root module), or ``"<output>"`` for the model's
            final output when every boundary agreed.
        what: what was compared there (``"output 0"``, ``"input hidden_states"``, ``"raised in
            forward"``, ``"final output"``).
        rank: the rank it was seen on first (lowest rank at the earliest event).
        max_abs, max_rel: metrics of the blamed boundary's output where it was recorded,
            otherwise of the event that revealed the divergence; ``None`` without metrics.
        detail: one sentence on what was seen.
        event_index: index of the revealing event in the reference trace (``None`` when none).
    """

    fqn: str
    what: str
    rank: int
    max_abs: float | None
    max_rel: float | None
    detail: str
    event_index: int | None = None


@attrs.frozen(kw_only=True)
class ModeComparison:
    """Everything one mode's comparison found; :func:`compare_mode` builds it."""

    mode: str
    agree: bool
    first: Divergence | None
    events_compared: int
    event_diffs: tuple[tuple[TensorDiff | None, ...], ...]
    """``[event index][rank]``: the diff, or ``None`` where that rank did not record it."""
    output: NamedDiff | None
    gradients: tuple[NamedDiff, ...]
    params_after: tuple[NamedDiff, ...]
    failure: Failure | None
    failure_rank: int | None

    @property
    def diverged_gradients(self) -> tuple[NamedDiff, ...]:
        return tuple(g for g in self.gradients if not g.diff.ok)

    @property
    def worst_gradient(self) -> NamedDiff | None:
        return max(self.gradients, key=lambda g: g.diff.badness, default=None)

    @property
    def diverged_params(self) -> tuple[NamedDiff, ...]:
        return tuple(p for p in self.params_after if not p.diff.ok)

    @property
    def worst_param(self) -> NamedDiff | None:
        return max(self.params_after, key=lambda p: p.diff.badness, default=None)

    @property
    def forward_agrees(self) -> bool:
        """No boundary event, no final output disagreed and nothing raised in forward."""
        return (self.first is None and (self.failure is None or self.failure.phase != "forward")
                and (self.output is None or self.output.diff.ok))


def _worst_named(reference: Mapping[str, Tensor], ranks: Sequence[Mapping[str, Tensor] | None],
                 rank_ids: Sequence[int], atol: float, rtol: float, *,
                 held_in_part: bool = False) -> tuple[NamedDiff, ...]:
    out: list[NamedDiff] = []
    for name, expected in reference.items():
        worst: NamedDiff | None = None
        holders = [values is not None and name in values for values in ranks]
        for r, values, holds in zip(rank_ids, ranks, holders):
            if values is None or (held_in_part and not holds and any(holders)):
                continue
            missing = "no rank holds it" if held_in_part else "no gradient"
            d = diff_tensors(values.get(name), expected, atol=atol, rtol=rtol,
                             note=missing if name not in values else "")
            if worst is None or (worst.diff.ok and not d.ok) or (
                    worst.diff.ok == d.ok and d.badness > worst.diff.badness):
                worst = NamedDiff(name=name, rank=r, diff=d)
        if worst is not None:
            out.append(worst)
    for r, values in zip(rank_ids, ranks):
        for name in sorted(set(values or {}) - set(reference)):
            out.append(NamedDiff(name=name, rank=r, diff=TensorDiff(
                ok=False, max_abs=None, max_rel=None, problem="the reference has none")))
    return tuple(out)


def _what(kind: str, name: str) -> str:
    """``"output"`` for an unnamed output (``output``/``0``), else ``"output attn_output"``."""
    return kind if name in (kind, "0") else f"{kind} {name}"


def _event_divergence(index: int, event: Event, rank: int, diff: TensorDiff,
                      reference: Trace, by_rank: Sequence[dict[tuple[str, int, str, str], Event]],
                      rank_ids: Sequence[int], atol: float, rtol: float) -> Divergence:
    why = diff.problem or "values differ"
    if event.kind in ("send", "receive"):
        return _stage_divergence(index, event, rank, diff, why)
    if event.kind == "output":
        what = _what("output", event.name)
        return Divergence(fqn=event.fqn, what=what, rank=rank,
                          max_abs=diff.max_abs, max_rel=diff.max_rel, event_index=index,
                          detail=f"its inputs agreed, its {what} does not ({why})")
    if event.enclosing is not None:
        outer, _, call_text = event.enclosing.rpartition("#")
        call = int(call_text)
        outer_out = next((e for e in reference.events
                          if e.fqn == outer and e.call == call and e.kind == "output"), None)
        metrics = diff
        if outer_out is not None:
            pos = rank_ids.index(rank)
            mine = by_rank[pos].get(outer_out.key)
            if mine is not None and outer_out.value is not None:
                metrics = diff_tensors(mine.value, outer_out.value, atol=atol, rtol=rtol,
                                       note=mine.note)
        return Divergence(
            fqn=outer, what=_what("output", outer_out.name) if outer_out else "output",
            rank=rank, max_abs=metrics.max_abs, max_rel=metrics.max_rel, event_index=index,
            detail=(f"entered with agreeing inputs, but the {_what('input', event.name)} it "
                    f"passed to {event.fqn} differs ({why}): the code of {outer or '<root>'} "
                    f"around its inner boundaries computed it"))
    previous = next((e for e in reversed(reference.events[:index]) if e.kind == "output"), None)
    after = f"after {previous.fqn} returned" if previous else "before the first boundary"
    what = _what("input", event.name)
    mine = by_rank[rank_ids.index(rank)].get(event.key)
    hint = _refolded_hint(None if mine is None else mine.value, event.value,
                          previous.fqn if previous else None)
    return Divergence(fqn=event.fqn, what=what, rank=rank,
                      max_abs=diff.max_abs, max_rel=diff.max_rel, event_index=index,
                      detail=(f"its {what} already differs when it is entered "
                              f"({why}); model code outside any boundary computed it, {after}"
                              f"{hint}"))


def _stage_divergence(index: int, event: Event, rank: int, diff: TensorDiff,
                      why: str) -> Divergence:
    """A pipeline stage boundary (:mod:`hyperrecipe.check.pipeline`): what a stage sent, or
    what the next one received, for one microbatch."""
    sender = event.fqn.removeprefix("stage ").split(" ")[0]
    if event.kind == "send":
        what = f"{event.name} output, microbatch {event.call}"
        detail = (f"stage {sender} sends hidden states that differ from {event.name}'s output "
                  f"in one process ({why}); every earlier stage boundary agreed, so stage "
                  f"{sender} computed them: its layers give other values on a microbatch than "
                  f"on the whole batch (a layer that mixes the batch's rows), or on what it "
                  f"received")
    else:
        what = f"{event.name} input, microbatch {event.call}"
        detail = (f"the hidden states {event.name} starts the next stage from differ from its "
                  f"input in one process ({why}), though the sent ones agreed: the model's code "
                  f"between the layers changes the hidden states (a value added or scaled "
                  f"outside the layers), which a pipeline does not run; only the last layer's "
                  f"output crosses a stage boundary")
    return Divergence(fqn=event.fqn, what=what, rank=rank, max_abs=diff.max_abs,
                      max_rel=diff.max_rel, event_index=index, detail=detail)


def _refolded_hint(actual: Tensor | None, expected: Tensor | None, previous: str | None) -> str:
    """Same elements, another shape: the model's own code reshaped a value that was still
    sharded with the whole tensor's shape (GPT2Model's ``view(output_shape)`` of a
    sequence-sharded ln_f output), which folds rows together silently on every rank."""
    if (actual is None or expected is None or previous is None
            or actual.shape == expected.shape or actual.numel() != expected.numel()):
        return ""
    return (f"; the same number of elements in another shape: the model's code reshaped a value "
            f"that was still sharded with the whole tensor's shape; gather it before that code "
            f"(`out_dst: {{0: replicate}}` on {previous})")


def compare_mode(mode: str, reference: Trace, ranks: Sequence[Trace], *, atol: float,
                 rtol: float, rank_ids: Sequence[int] | None = None,
                 held_in_part: bool = False) -> ModeComparison:
    """Compare the traces of one mode's ranks with the reference.

    Args:
        mode: the mode's name (carried into the result).
        reference: the single-process trace.
        ranks: one trace per rank that reported (a failed launch gives only the failing rank's
            partial trace).
        atol, rtol: tolerances (see :func:`diff_tensors`).
        rank_ids: the rank of each trace (default ``0, 1, ...``).
        held_in_part: each rank holds some of the parameters (pipeline stages): a gradient or
            parameter is compared on the ranks that hold it, and missing when none does.
    """
    ids = list(rank_ids) if rank_ids is not None else list(range(len(ranks)))
    by_rank = [{e.key: e for e in t.events} for t in ranks]
    event_diffs: list[tuple[TensorDiff | None, ...]] = []
    first: Divergence | None = None
    for i, ref_event in enumerate(reference.events):
        if ref_event.value is None:
            event_diffs.append(tuple(None for _ in ranks))
            continue
        row: list[TensorDiff | None] = []
        for events in by_rank:
            mine = events.get(ref_event.key)
            row.append(None if mine is None else diff_tensors(
                mine.value, ref_event.value, atol=atol, rtol=rtol, note=mine.note))
        event_diffs.append(tuple(row))
        if first is None:
            bad = [(r, d) for r, d in zip(ids, row) if d is not None and not d.ok]
            if bad:
                r, d = bad[0]
                first = _event_divergence(i, ref_event, r, d, reference, by_rank, ids, atol, rtol)
    compared = sum(1 for row in event_diffs if any(d is not None for d in row))

    failed = [(r, t.failure) for r, t in zip(ids, ranks) if t.failure is not None]
    failure_rank, failure = failed[0] if failed else (None, None)
    if first is None and failure is not None and failure_rank is not None:
        where = failure.boundary if failure.boundary is not None else (
            failure.module if failure.module is not None else f"<{failure.phase}>")
        module = (f"; it raised in {failure.module}" if failure.module and failure.module != where
                  else "")
        first = Divergence(fqn=where, what=f"raised in {failure.phase}", rank=failure_rank,
                           max_abs=None, max_rel=None,
                           detail=f"{failure.error}{module}")

    output: NamedDiff | None = None
    if reference.output is not None:
        worst: NamedDiff | None = None
        for r, t in zip(ids, ranks):
            if t.output is None:
                continue
            d = diff_tensors(t.output, reference.output, atol=atol, rtol=rtol)
            if worst is None or (worst.diff.ok and not d.ok) or d.badness > worst.diff.badness:
                worst = NamedDiff(name="output", rank=r, diff=d)
        output = worst
        if first is None and output is not None and not output.diff.ok:
            why = output.diff.problem or "values differ"
            first = Divergence(fqn="<output>", what="final output", rank=output.rank,
                               max_abs=output.diff.max_abs, max_rel=output.diff.max_rel,
                               detail=(f"every boundary agreed but the model's output does not "
                                       f"({why}): model code after the last boundary"))

    complete = [t for t in ranks if t.failure is None]
    complete_ids = [r for r, t in zip(ids, ranks) if t.failure is None]
    gradients = _worst_named(reference.grads, [t.grads for t in complete], complete_ids,
                             atol, rtol, held_in_part=held_in_part) if complete else ()
    params: tuple[NamedDiff, ...] = ()
    if reference.params_after is not None and complete:
        params = _worst_named(reference.params_after, [t.params_after for t in complete],
                              complete_ids, atol, rtol, held_in_part=held_in_part)
    agree = (first is None and failure is None and all(g.diff.ok for g in gradients)
             and all(p.diff.ok for p in params) and len(complete) == len(ranks) and bool(ranks))
    return ModeComparison(mode=mode, agree=agree, first=first, events_compared=compared,
                          event_diffs=tuple(event_diffs), output=output, gradients=gradients,
                          params_after=params, failure=failure, failure_rank=failure_rank)
