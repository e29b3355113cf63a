"""Patterns in the numbers: a value off by a bias, scaled by a mesh size, summing to the
reference over a mesh dim, or transposed; or every difference within 16-bit rounding where the
reference itself computed in 16 bits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from hyperrecipe.check.compare import ModeComparison, compare_mode, diff_tensors
from hyperrecipe.check.diagnose.causes import (
    BIAS_COUNTED_TP_TIMES,
    COLWISE_ROWWISE_SWAPPED,
    REFERENCE_COMPUTES_IN_16_BIT,
    DiagnosisContext,
    Suggestion,
    fmt_number,
    within,
)
from hyperrecipe.check.precision import HALF_TOLERANCE
from hyperrecipe.check.record import Trace
from hyperrecipe.plan import Plan

__all__ = ["after_all_reduce", "after_transpose", "bias_offset", "rounding_in_16_bit", "scaled",
           "sums_to_reference"]




def bias_offset(a: Tensor, b: Tensor, fqn: str, ctx: DiagnosisContext) -> Suggestion | None:
    """The error is one vector repeated at every position, an integer multiple of a bias."""
    if a.shape != b.shape or a.ndim < 1 or a.numel() == 0:
        return None
    d = (a.double() - b.double()).reshape(-1, a.shape[-1])
    scale = float(b.double().abs().max()) or 1.0
    row = d[0]
    norm = float(row.norm())
    if norm <= 1e-6 * scale or float((d - row).abs().max()) > 1e-4 * norm + 1e-7 * scale:
        return None
    for p in ctx.plan.params:
        if p.name != "bias" or not within(p.module, fqn) or p.shape != (a.shape[-1],):
            continue
        beta = ctx.reference_params.get(p.fqn)
        if beta is None:
            continue
        beta = beta.double().reshape(-1)
        bb = float(beta @ beta)
        if bb == 0.0:
            continue
        k = float(row @ beta) / bb
        if round(k) < 1 or abs(k - round(k)) > 1e-2 or float((row - k * beta).norm()) > 1e-3 * norm:
            continue
        times = round(k) + 1
        dims = [n for n, s in ctx.sizes.items() if s == times]
        tp = f" ({dims[0]} has size {times})" if dims else ""
        deferred = next((bd for bd in ctx.plan.boundaries if bd.fqn == p.module), None)
        plan_note = ""
        if deferred is not None and "bias" not in deferred.defer_bias:
            plan_note = f"; the plan does not defer {p.fqn} (defer_bias is off)"
        evidence = (f"the error of {fqn} is the same at every position and equals {k:.3f} x "
                    f"{p.fqn}: the bias is added {times} times{tp}{plan_note}")
        return Suggestion(cause=BIAS_COUNTED_TP_TIMES, evidence=evidence)
    return None


def scaled(a: Tensor, b: Tensor, fqn: str, ctx: DiagnosisContext) -> Suggestion | None:
    """The whole value is ``n`` x the reference for a mesh dim of size ``n``."""
    if a.shape != b.shape or a.numel() == 0:
        return None
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    yy = float(y @ y)
    if yy == 0.0:
        return None
    s = float(x @ y) / yy
    if float((x - s * y).norm()) > 1e-4 * float(x.norm()):
        return None
    for name, n in ctx.sizes.items():
        if n > 1 and abs(s - n) < 1e-3 * n:
            return Suggestion(cause=BIAS_COUNTED_TP_TIMES, evidence=(
                f"{fqn}'s value is {s:.4f} x the reference and {name} has size {n}: a value "
                f"every rank already held whole was summed over {name} as if it were partial"))
    return None


def _coords(plan: Plan, rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in reversed(plan.mesh):
        out[d.name] = rank % d.size
        rank //= d.size
    return out


def _sum_over(values: Mapping[int, Tensor], plan: Plan, dim: str) -> list[Tensor]:
    """Per group of ranks that differ only in their ``dim`` coordinate: the sum of their values."""
    groups: dict[tuple[tuple[str, int], ...], list[Tensor]] = {}
    for r, v in values.items():
        key = tuple((k, c) for k, c in sorted(_coords(plan, r).items()) if k != dim)
        groups.setdefault(key, []).append(v.double())
    return [torch.stack(vs).sum(0) for vs in groups.values()]


def sums_to_reference(values: Mapping[int, Tensor], b: Tensor, ctx: DiagnosisContext,
                       atol: float, rtol: float) -> tuple[str, float] | None:
    """The mesh dim over which the ranks' values add up to ``b``, and the max error."""
    world = 1
    for d in ctx.plan.mesh:
        world *= d.size
    if len(values) != world or any(v.shape != b.shape for v in values.values()):
        return None
    for name, n in ctx.sizes.items():
        if n < 2:
            continue
        sums = _sum_over(values, ctx.plan, name)
        diffs = [diff_tensors(s, b, atol=atol * n, rtol=rtol) for s in sums]
        if all(d.ok for d in diffs):
            return name, max(d.max_abs or 0.0 for d in diffs)
    return None


def after_all_reduce(values: Mapping[int, Tensor], b: Tensor, fqn: str, ctx: DiagnosisContext,
                      atol: float, rtol: float) -> Suggestion | None:
    found = sums_to_reference(values, b, ctx, atol, rtol)
    if found is None:
        return None
    name, err = found
    return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
        f"summing the ranks' values of {fqn} over {name} reproduces the reference (max abs "
        f"error {fmt_number(err)}): each rank holds a partial sum that is never reduced, as a row-wise "
        f"layer placed where a column-wise one belongs leaves it"))


def after_transpose(a: Tensor, b: Tensor, fqn: str, atol: float, rtol: float
                     ) -> Suggestion | None:
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape != b.shape:
        return None
    d = diff_tensors(a.transpose(-1, -2), b, atol=atol, rtol=rtol)
    if not d.ok:
        return None
    return Suggestion(cause=COLWISE_ROWWISE_SWAPPED, evidence=(
        f"{fqn}'s value transposed matches the reference (max abs error {fmt_number(d.max_abs or 0)})"))


def rounding_in_16_bit(cmp: ModeComparison, reference: Trace, ranks: Sequence[Trace],
                       ctx: DiagnosisContext, atol: float, rtol: float) -> Suggestion | None:
    """The reference itself computed in 16 bits inside a float32 model
    (``ctx.half_precision``), and at check's tolerances for a 16-bit model every value, gradient
    and parameter the mode compared agrees: the ranks differ from the reference by 16-bit
    rounding (a shard's partial matmul rounds differently from the whole one), not by the
    plan. A divergence 16-bit rounding does not explain (a shape error, a bias counted twice)
    still fails the re-comparison and goes to the other patterns."""
    seen = ctx.half_precision
    half_atol, half_rtol = HALF_TOLERANCE
    if seen is None or (atol >= half_atol and rtol >= half_rtol):
        return None
    again = compare_mode(cmp.mode, reference, ranks, atol=half_atol, rtol=half_rtol,
                         rank_ids=ctx.rank_ids)
    if not again.agree:
        return None
    if cmp.first is not None:
        worst = (f"the first divergence, {cmp.first.fqn or '<root>'} ({cmp.first.what}), is off "
                 f"by {fmt_number(cmp.first.max_abs or 0.0)} at most")
    else:
        grad = cmp.worst_gradient
        worst = (f"the worst gradient, {grad.name}, is off by "
                 f"{fmt_number(grad.diff.max_abs or 0.0)} at most" if grad is not None else
                 "only the parameters after the SGD steps differ")
    tol_a, tol_r = _short(half_atol), _short(half_rtol)
    return Suggestion(cause=REFERENCE_COMPUTES_IN_16_BIT, evidence=(
        f"the reference (one process, no plan) computed {seen.describe()} while the model's "
        f"parameters are {seen.params_dtype}; re-compared at atol {tol_a}, rtol {tol_r} "
        f"(check's tolerances for a 16-bit model) every value agrees, and {worst}: pass "
        f"--atol {tol_a} --rtol {tol_r}, or check the model's float32 path"))


def _short(x: float) -> str:
    """``1e-2`` for 0.01, as the flag would be typed."""
    mantissa, _, exponent = f"{x:.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}"
