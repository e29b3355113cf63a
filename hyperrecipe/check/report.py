"""Rendering a :class:`~hyperrecipe.check.run.CheckReport`: text for people, JSON for tools.

The JSON object (``--format json``) has these keys: ``agree``; what ran (``recipe``,
``source``, ``recipe_files``, ``model``, ``mesh``, ``world_size``, ``backend``, ``seed``, ``sample``,
``steps``, ``tolerance``, ``loss``, ``notes``); ``modes``, one object per mode with ``agree``,
``first_divergent`` (``{fqn, what, rank, max_abs, max_rel, detail}`` or null), ``suggestion``
(``{cause, evidence, verification}`` or null: ``verification`` is what compile's
verification step refuses of the plan, or null), ``failure`` (what a rank raised, or null), ``output``,
``worst_gradient`` (``{name, rank, max_abs, max_rel, agree}``), ``gradients`` (``compared``,
``diverged``), ``params_after_steps`` (null without ``--steps``), ``boundary_values_compared``,
``inner_wrappers`` (rank 0's inner-wrapper choices, ``[{fqn, wrapper, state, reason}]``, empty
when the recipe has none or a rank raised), ``error`` (why the mode could not run — a rank failed
outside the compared step, or the launch timed out — with every comparison key null or empty;
else null) and ``timings`` (seconds); and the overall ``timings``. Non-finite numbers are written
as null. When a mode could not run, a top-level ``error`` repeats each such mode's error
(``mode <name>: <error>``, one per line), as when the whole check fails before any mode runs.
The text form gives every mode its own line, whatever happened to the others.
"""

from __future__ import annotations

import math
from typing import Any

from hyperrecipe.check.compare import NamedDiff, TensorDiff
from hyperrecipe.check.run import CheckReport, ModeResult

__all__ = ["render_text", "report_json"]


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _diff_json(d: TensorDiff) -> dict[str, Any]:
    out: dict[str, Any] = {"agree": d.ok, "max_abs": _num(d.max_abs), "max_rel": _num(d.max_rel)}
    if d.problem:
        out["problem"] = d.problem
    return out


def _named_json(n: NamedDiff | None) -> dict[str, Any] | None:
    if n is None:
        return None
    return {"name": n.name, "rank": n.rank, **_diff_json(n.diff)}


def _error_json(m: ModeResult) -> dict[str, Any]:
    return {"agree": False, "first_divergent": None, "suggestion": None, "failure": None,
            "output": None, "worst_gradient": None, "gradients": {"compared": 0, "diverged": []},
            "params_after_steps": None, "boundary_values_compared": 0, "inner_wrappers": [],
            "error": m.error, "timings": {k: round(v, 4) for k, v in m.timings.items()}}


def _mode_json(m: ModeResult) -> dict[str, Any]:
    c = m.comparison
    if c is None:
        return _error_json(m)
    first = None if c.first is None else {
        "fqn": c.first.fqn, "what": c.first.what, "rank": c.first.rank,
        "max_abs": _num(c.first.max_abs), "max_rel": _num(c.first.max_rel),
        "detail": c.first.detail}
    failure = None if c.failure is None else {
        "rank": c.failure_rank, "phase": c.failure.phase, "error": c.failure.error,
        "boundary": c.failure.boundary, "module": c.failure.module}
    params = None
    if c.params_after:
        params = {"compared": len(c.params_after),
                  "diverged": [p.name for p in c.diverged_params],
                  "worst": _named_json(c.worst_param)}
    return {
        "agree": m.agree,
        "first_divergent": first,
        "suggestion": None if m.suggestion is None else {
            "cause": m.suggestion.cause, "evidence": m.suggestion.evidence,
            "verification": m.suggestion.verification},
        "failure": failure,
        "output": None if c.output is None else _diff_json(c.output.diff),
        "worst_gradient": _named_json(c.worst_gradient),
        "gradients": {"compared": len(c.gradients),
                      "diverged": [g.name for g in c.diverged_gradients]},
        "params_after_steps": params,
        "boundary_values_compared": c.events_compared,
        "inner_wrappers": [{"fqn": f, "wrapper": w, "state": st, "reason": why or None}
                           for f, w, st, why in m.wrapper_choices],
        "error": None,
        "timings": {k: round(v, 4) for k, v in m.timings.items()},
    }


def report_json(report: CheckReport) -> dict[str, Any]:
    """The report as a JSON-ready object (see the module docstring for the keys)."""
    return {
        "agree": report.agree,
        "recipe": report.recipe,
        "source": report.source,
        "recipe_files": list(report.recipe_files),
        "model": report.model,
        "mesh": dict(report.mesh),
        "world_size": report.world_size,
        "backend": report.backend,
        "seed": report.seed,
        "sample": report.sample,
        "steps": report.steps,
        "tolerance": {"atol": report.atol, "rtol": report.rtol},
        "loss": _num(report.loss),
        "notes": list(report.notes),
        "modes": {m.mode: _mode_json(m) for m in report.modes},
        "timings": {k: round(v, 4) for k, v in report.timings.items()},
        **({"error": "\n".join(f"mode {m.mode}: {m.error}" for m in report.errors)}
           if report.errors else {}),
    }


def _indent(text: str, pad: str) -> str:
    """Continuation lines of a multi-line message (an error's text) indented like the first."""
    return f"\n{pad}".join(line for line in text.splitlines() if line.strip())


def _wrapper_text(m: ModeResult) -> str | None:
    """One line summing up which inner wrapper each boundary got, grouped so that a chain's
    fallback across a whole model reads as two or three phrases, not one row per layer."""
    if not m.wrapper_choices:
        return None
    groups: dict[tuple[str, str, str], int] = {}
    for _fqn, wrapper, state, reason in m.wrapper_choices:
        key = (wrapper, state, reason)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (wrapper, state, reason), n in groups.items():
        why = f" ({reason})" if reason and state != "installed" else ""
        parts.append(f"{wrapper} {state} on {n} module{'s' if n != 1 else ''}{why}")
    return "inner wrappers: " + "; ".join(parts)


def _mode_text(m: ModeResult, width: int, pipelined: bool = False) -> list[str]:
    c = m.comparison
    pad = " " * (width + 2)
    head = f"{m.mode:<{width}}  "
    if c is None:
        # the first line of the launcher's message; the rank's traceback goes to stderr
        error = (m.error or "").splitlines()[0] if m.error else "no result"
        return [f"{head}ERROR  {error}; {m.timings.get('launch_s', 0.0):.1f} s"]
    worst = c.worst_gradient
    grads = (f"{len(c.gradients)} gradients (worst {worst.name}, max abs {_g(worst.diff.max_abs)})"
             if worst is not None else "no gradients compared")
    seconds = f"{m.timings.get('launch_s', 0.0):.1f} s"
    if m.agree:
        output = "loss" if pipelined else "output"
        out = (f", {output} max abs {_g(c.output.diff.max_abs)}" if c.output is not None else "")
        params = ""
        if c.params_after:
            wp = c.worst_param
            params = (f", {len(c.params_after)} parameters after the steps"
                      + (f" (worst max abs {_g(wp.diff.max_abs)})" if wp is not None else ""))
        values = "stage boundary values" if pipelined else "boundary values"
        agreed = [f"{head}agree  {c.events_compared} {values}{out}, {grads}{params}; "
                  f"{seconds}"]
        wrappers = _wrapper_text(m)
        return agreed + ([f"{pad}{wrappers}"] if wrappers else [])
    lines: list[str] = []
    if c.first is not None:
        f = c.first
        where = "first divergent boundary" if f.fqn != "<output>" else "first divergence"
        metrics = (f": max abs {_g(f.max_abs)}, max rel {_g(f.max_rel)}"
                   if f.max_abs is not None else "")
        lines.append(f"{head}DIVERGED  {where}: {f.fqn or '<root>'} ({f.what}, rank {f.rank})"
                     f"{metrics}; {seconds}")
        lines.append(f"{pad}{_indent(f.detail, pad)}")
    else:
        lines.append(f"{head}DIVERGED  the forward agrees ({c.events_compared} boundary values and "
                     f"the output); {seconds}")
    if m.suggestion is not None:
        lines.append(f"{pad}likely cause: {m.suggestion.cause}")
        lines.append(f"{pad}evidence: {_indent(m.suggestion.evidence, pad)}")
        if m.suggestion.verification is not None:
            lines.append(f"{pad}verification at compile refuses this plan: "
                         f"{_indent(m.suggestion.verification, pad)}")
    if c.failure is not None and c.first is not None and not c.first.what.startswith("raised"):
        lines.append(f"{pad}rank {c.failure_rank} then raised in {c.failure.phase}: "
                     f"{_indent(c.failure.error, pad)}")
    if c.gradients:
        bad = c.diverged_gradients
        if bad:
            w = max(bad, key=lambda g: g.diff.badness)
            what = (f"max abs {_g(w.diff.max_abs)}" if w.diff.max_abs is not None
                    else w.diff.problem)
            lines.append(f"{pad}gradients: {len(bad)} of {len(c.gradients)} differ, worst "
                         f"{w.name} ({what}, rank {w.rank})")
        else:
            lines.append(f"{pad}gradients: all {len(c.gradients)} agree")
    elif c.failure is not None:
        lines.append(f"{pad}gradients: not compared (rank {c.failure_rank} raised)")
    if c.params_after:
        bad_p = c.diverged_params
        lines.append(f"{pad}parameters after the steps: "
                     + (f"{len(bad_p)} of {len(c.params_after)} differ" if bad_p
                        else f"all {len(c.params_after)} agree"))
    wrappers = _wrapper_text(m)
    if wrappers:
        lines.append(f"{pad}{wrappers}")
    return lines


def render_text(report: CheckReport) -> str:
    """A few lines per mode: the verdict, where it diverged, the likely cause and its evidence."""
    mesh = ",".join(f"{k}={v}" for k, v in report.mesh.items())
    files = f" ({report.source})" if report.source != report.recipe else ""
    steps = f"{report.steps} SGD step(s)" if report.steps else "one step"
    lines = [
        f"check {report.recipe!r}{files} on {mesh}: {report.world_size} ranks, {report.backend}; "
        f"model {report.model}, seed {report.seed}, {report.sample}, {steps}; "
        f"atol {report.atol:g}, rtol {report.rtol:g}",
    ]
    lines += [f"note: {n}" for n in report.notes]
    width = max((len(m.mode) for m in report.modes), default=0)
    for m in report.modes:
        lines += _mode_text(m, width, report.pipelined)
    total = report.timings.get("total_s", 0.0)
    if report.agree:
        lines.append(f"all modes agree with the single-process reference ({total:.1f} s)")
    else:
        bad = [m.mode for m in report.modes if not m.agree and m.error is None]
        failed = [m.mode for m in report.errors]
        verdicts = ([f"diverged: {', '.join(bad)}"] if bad else []) + (
            [f"could not run: {', '.join(failed)}"] if failed else [])
        lines.append(f"{'; '.join(verdicts)} ({total:.1f} s)")
    return "\n".join(lines) + "\n"
