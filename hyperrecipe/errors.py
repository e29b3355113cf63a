"""The error hierarchy every part of hyperrecipe raises.

One root, :class:`HyperrecipeError`, so a trainer can catch everything we raise in one clause;
each subclass also derives from the builtin a caller would reach for first (``ValueError`` for
bad input, ``RuntimeError`` for a state that went wrong at run time). Errors carry their
structured data as attributes so tools can act on them without parsing the message.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import attrs

__all__ = [
    "HyperrecipeError",
    "ModelSpecError",
    "PlacementMismatchError",
    "PlanFormatError",
    "PlanMismatchError",
    "RecipeError",
    "RewriteError",
    "SourceSpan",
    "closest",
    "did_you_mean",
]


@attrs.frozen(kw_only=True)
class SourceSpan:
    """Where a recipe value came from: a file and a 1-based line and column."""

    path: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"


class HyperrecipeError(Exception):
    """Root of every error hyperrecipe raises on purpose."""


class RecipeError(HyperrecipeError, ValueError):
    """A recipe is malformed, or cannot be resolved against the model and mesh it was given.

    The message starts with ``file:line:col`` and ends with the cattrs-style path of the offending
    value (``@ $.rules[2].style``); the same facts are attributes.

    Args:
        problem: what is wrong, in one sentence, without location.
        span: where in the recipe file; ``None`` for errors with no single location.
        path: the JSON path of the value (``$.rules[2].params.weight``).
        rule_index: index of the rule in the recipe's own ``rules`` list, when one is to blame.
        hint: extra guidance (expected values, nearest names).
    """

    def __init__(
        self,
        problem: str,
        *,
        span: SourceSpan | None = None,
        path: str = "$",
        rule_index: int | None = None,
        hint: str = "",
    ) -> None:
        self.problem = problem
        self.span = span
        self.path = path
        self.rule_index = rule_index
        self.hint = hint
        where = f"{span}: " if span is not None else ""
        tail = f"; {hint}" if hint else ""
        super().__init__(f"{where}{problem} @ {path}{tail}")


class ModelSpecError(HyperrecipeError, ValueError):
    """A ``--model`` spec or model config cannot be turned into a model."""


class PlanFormatError(HyperrecipeError, ValueError):
    """A plan file is not a plan this version of hyperrecipe can read."""


class PlanMismatchError(HyperrecipeError, RuntimeError):
    """A plan was applied to a model, mesh or rank set it was not compiled for."""


class PlacementMismatchError(HyperrecipeError, RuntimeError):
    """In validate mode, a module produced an output whose placement differs from the declared one.

    Args:
        fqn: the boundary module.
        output: the output (or input) name.
        declared: the placement the plan declares, formatted.
        actual: the placement DTensor propagated, formatted.
        stage: ``"output"`` (checked against ``out_src``) or ``"input"`` (against ``in_src``).
    """

    def __init__(self, fqn: str, output: str, declared: str, actual: str, *,
                 stage: str = "output") -> None:
        self.fqn = fqn
        self.output = output
        self.declared = declared
        self.actual = actual
        self.stage = stage
        if stage == "input":
            text = (f"{fqn}: input {output!r} was declared {declared} (in_src) but arrived "
                    f"{actual}")
        else:
            text = (f"{fqn}: output {output!r} was declared {declared} (out_src) but the forward "
                    f"produced {actual}")
        super().__init__(text)


class RewriteError(HyperrecipeError, RuntimeError):
    """A forward could not be installed or restored; nothing was left half-done."""


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The candidates nearest to ``name``, best first (may be empty)."""
    pool = sorted(set(candidates))
    return difflib.get_close_matches(name, pool, n=n, cutoff=0.5)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ``"; did you mean 'x'?"`` suffix, or ``""`` when nothing is close."""
    near = closest(name, candidates, n=1)
    return f"; did you mean {near[0]!r}?" if near else ""
