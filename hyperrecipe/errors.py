"""The error hierarchy every part of hyperrecipe raises.

One root, :class:`HyperrecipeError`, so a trainer can catch everything we raise in one clause;
each subclass also derives from the builtin a caller would reach for first (``ValueError`` for
bad input, ``RuntimeError`` for a state that went wrong at run time). Errors carry their
structured data as attributes so tools can act on them without parsing the message.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = [
    "BatchMismatchError",
    "CheckError",
    "CollectiveShapeError",
    "ConfigError",
    "DeadlinePassed",
    "HyperrecipeError",
    "ExplainError",
    "ExportAbortedError",
    "ExportError",
    "FolderLockedError",
    "ImpossibleTransition",
    "InterpreterLimit",
    "LintUsageError",
    "LaunchError",
    "LossParallelError",
    "MixedParametersError",
    "ModeError",
    "ModelSpecError",
    "PatternError",
    "PipelineError",
    "PipelineUnsupportedError",
    "PatternSyntaxError",
    "PlacementError",
    "PlacementMismatchError",
    "PlacementSyntaxError",
    "PlanFormatError",
    "PlanMismatchError",
    "RankFailedError",
    "RecipeError",
    "RefError",
    "UntrustedCodeError",
    "UsageError",
    "ValidateShardingError",
    "ValidateUnsupportedError",
    "RewriteError",
    "SelectorError",
    "SourceSpan",
    "StageDone",
    "StageBoundaryError",
    "StepFailed",
    "SuggestError",
    "SwitchIncompleteError",
    "WeightLoadError",
    "WrapperDeclarationError",
    "WrapperError",
    "check_path_arg",
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


class UsageError(HyperrecipeError, TypeError):
    """A public function was called with an argument of the wrong type (a path that is not a
    ``str``/``PathLike``, a mesh shape that is not a mapping, a model that is not a module).
    Raised where the argument arrives, so the message names the argument, not a frame deep
    inside pathlib or the resolver."""


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


# ----------------------------------------------------------------------------- placements


class PlacementError(HyperrecipeError, ValueError):
    """A placement cannot be expressed where it was asked for (a chunked shard has no single
    torch placement; a plan's DTensor placement text is malformed)."""


class PlacementSyntaxError(PlacementError):
    """A placement string does not follow the grammar; the recipe loader adds the location."""


class PatternError(HyperrecipeError, ValueError):
    """A rule's ``match`` pattern is malformed; the recipe validator adds the location."""


class PatternSyntaxError(PatternError):
    """A ``match`` pattern is malformed or too large for the non-backtracking automaton; the
    message says which and where (the recipe validator adds the file and line)."""


class RefError(HyperrecipeError, ValueError):
    """A ``pkg.mod:attr`` reference is malformed, its module does not import, or an attribute
    is missing."""


class UntrustedCodeError(RefError):
    """A recipe or plan names a module that is not trusted; the message says how to opt in
    (``--trust-code``, ``trust_code=``, ``HYPERRECIPE_TRUST_CODE``; docs/security.md)."""


class ExplainError(HyperrecipeError, ValueError):
    """``--explain`` names nothing in the plan; the message lists the nearest FQNs."""


class ImpossibleTransition(HyperrecipeError, ValueError):
    """No collective produces ``dst`` from ``src``; the resolver adds the recipe location."""


# ----------------------------------------------------------------------------- runtime


class LossParallelError(HyperrecipeError, RuntimeError):
    """Logits a ``loss_parallel`` plan keeps sharded on the vocab were used in a way that would be
    wrong on a slice of the vocab (any torch op on them, ``F.cross_entropy`` included), or
    ``vocab_parallel_cross_entropy`` got logits it cannot compute over; the message names the
    supported path (docs/training.md#loss-on-vocab-shards)."""


class MixedParametersError(HyperrecipeError, RuntimeError):
    """In validate mode an optimizer would run torch's multi-tensor kernels (``foreach`` or
    ``fused``) over one list holding DTensor and plain parameters, which DTensor refuses; the
    message names both kinds and the fix (``foreach=False``).

    Args:
        message: the whole message.
        dtensors: FQNs of the list's DTensor parameters (validate mode's boundaries).
        plain: FQNs of its plain parameters (replicated, outside every boundary).
    """

    def __init__(self, message: str, *, dtensors: tuple[str, ...] = (),
                 plain: tuple[str, ...] = ()) -> None:
        self.dtensors = dtensors
        self.plain = plain
        super().__init__(message)


class UnsupportedTorchError(HyperrecipeError, RuntimeError):
    """The installed torch is older than the oldest release the runtime is tested on. torch is an
    extra, not a core dependency, so pip never checks the range for a torch the user brought;
    older DTensor releases fail in ways that name the wrong cause (torch 2.6: validate mode
    reports a sharded input as arriving replicated), so ``apply`` refuses them by name."""


class ValidateUnsupportedError(HyperrecipeError, NotImplementedError):
    """Validate mode met an op DTensor has no sharding rule for, inside a boundary's compute.

    DTensor's own error names the aten op and nothing else; this one names the boundary module
    whose compute called it and the way out (a function adapter or a local region runs that code
    on local tensors; production mode needs no rule). It derives from ``NotImplementedError``,
    as DTensor's does, so code that caught that keeps working.

    Args:
        message: the whole message.
        fqn: the boundary module whose compute called the op.
        op: the aten op, as DTensor names it (``aten.foo.default``).
    """

    def __init__(self, message: str, *, fqn: str, op: str) -> None:
        self.fqn = fqn
        self.op = op
        super().__init__(message)


class ValidateShardingError(HyperrecipeError, RuntimeError):
    """DTensor's sharding propagation refused an op's inputs inside a validate-mode boundary's
    compute (a matmul of mismatched shapes: most often a count or size the module computed that
    does not fit the shards it was given). The message names the boundary, the op and DTensor's
    reason. Not a :class:`ValidateUnsupportedError`: the op runs, these inputs do not fit it,
    and ``check`` diagnoses it as the step's failure.

    Args:
        message: the whole message.
        fqn: the boundary module whose compute called the op.
        op: the aten op, as DTensor names it.
    """

    def __init__(self, message: str, *, fqn: str, op: str) -> None:
        self.fqn = fqn
        self.op = op
        super().__init__(message)


class PipelineError(HyperrecipeError, RuntimeError):
    """A pipeline could not be built from its plan, or a step broke the stage contract (a
    stage that never reached its last layer, a plan whose stage ranks differ from the
    schedule's)."""


class PipelineUnsupportedError(PipelineError, NotImplementedError):
    """The plan asks for a pipeline combination the runtime does not run yet (pipeline
    together with parameters split over another mesh dim)."""


class StageBoundaryError(PipelineError):
    """A module was used on the wrong side of a pipeline stage split: another stage's module
    was called where its output would matter. The message names the module, the stage and
    the recipe field (``pipeline.first`` / ``pipeline.last``) that would fix it."""


class ModeError(HyperrecipeError, ValueError):
    """``apply`` was given a mode that is neither ``"production"`` nor ``"validate"``."""


class WeightLoadError(HyperrecipeError, ValueError):
    """A checkpoint does not fit the model (every offending tensor named) or cannot be read.

    The model is left as it was before the call.
    """


class ExportError(HyperrecipeError, RuntimeError):
    """An export failed on some rank (a full disk, a file-size limit, an unwritable folder);
    every rank raises it, and the folder's previous export is left as it was."""


class SwitchIncompleteError(HyperrecipeError, OSError):
    """The switch failed after the target changed: the new state is in (whole, after an
    exchange; in part, in the per-file switch, which the manifest or commit record written
    last refuses), and what is left to do is in a staging folder the next save finishes.
    Nothing may remove the staging folder in between: it may hold the user's entries."""


class BatchMismatchError(PlanMismatchError):
    """The ranks of a model-parallel group were handed different inputs at the first training
    forward (a sampler over the world instead of the data dim): they hold one model replica
    between them, so each rank's shards would compute on other data and the gradients would be
    silently wrong. Raised on every rank; the message names the mesh dim, the ranks, the inputs
    that differ and the sampler to use.

    Args:
        message: the whole message.
        dim: the mesh dim whose ranks disagree (the first, in mesh order).
        ranks: those ranks (global ranks of one group along ``dim``).
        inputs: the names of the forward's arguments that differ between them.
    """

    def __init__(self, message: str, *, dim: str = "", ranks: tuple[int, ...] = (),
                 inputs: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.dim = dim
        self.ranks = ranks
        self.inputs = inputs


class WrapperError(PlanMismatchError):
    """An inner-wrapper reference cannot be loaded, or is not an inner wrapper."""


class WrapperDeclarationError(HyperrecipeError, ValueError):
    """``@inner_wrapper`` was given a declaration it cannot use (an unknown hook, a layout that
    does not parse or names a mesh dim the wrapper does not declare)."""


class CollectiveShapeError(HyperrecipeError, ValueError):
    """A tensor's shape does not fit the collective: a dim is missing, out of range or uneven.

    Args:
        message: the full message, naming the op, the dim and the sizes.
        op: the op that could not run (a :class:`~hyperrecipe.collective.CollectiveOp`).
        shape: the shape of the local tensor it was given.
    """

    def __init__(self, message: str, *, op: object, shape: tuple[int, ...]) -> None:
        self.op = op
        self.shape = shape
        super().__init__(message)


# ----------------------------------------------------------------------------- check


class CheckError(HyperrecipeError, RuntimeError):
    """The check itself could not run (not a divergence): e.g. the model fails in one process."""


class StepFailed(HyperrecipeError, RuntimeError):
    """A recorded training step raised; ``trace`` holds what was recorded, with its failure.
    The original exception is ``__cause__``.

    Args:
        trace: the partial :class:`~hyperrecipe.check.record.Trace` (its ``failure`` is set).
    """

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        assert trace.failure is not None
        super().__init__(trace.failure.error)


class LaunchError(HyperrecipeError, ValueError):
    """``run_ranks`` was called with arguments or in a state it cannot launch from."""


class RankFailedError(HyperrecipeError, RuntimeError):
    """A rank raised, died, or did not finish before the timeout; all ranks have been stopped.

    Args:
        message: the full message (built by the launcher).
        rank: the rank that failed first, or ``None`` when the launch timed out.
        rank_traceback: the failing rank's formatted traceback (``""`` when it had none); for a
            rank that died without reporting, what faulthandler wrote as it died.
        unfinished: the ranks that had not finished when the launch was stopped.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        rank_traceback: str = "",
        unfinished: tuple[int, ...] = (),
    ) -> None:
        self.rank = rank
        self.rank_traceback = rank_traceback
        self.unfinished = unfinished
        super().__init__(message)


class StageDone(HyperrecipeError, RuntimeError):  # noqa: N818 - control flow, not an error
    """A pipeline stage's last layer ran: the stage's exit raises this to end the model's own
    forward there, carrying the hidden states to send (``output``). The stage module catches
    it; it never reaches a caller.

    An ``Exception``, so that torch runs the forward hooks registered ``always_call`` as it
    unwinds the model's forward (the rewriter's function swaps scoped to a module's forward
    put the function back there). A model whose own ``except Exception`` swallowed it would
    run on past the stage's last layer into placeholders of later layers, which raise.
    """

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage finished")
        self.output = output


class DeadlinePassed(BaseException):
    """``hyperrecipe check``'s own deadline for work in its parent process passed (the
    ``SIGALRM`` of :func:`~hyperrecipe.check.run.parent_deadline`).

    Deliberately outside :class:`HyperrecipeError` and ``Exception``: the signal handler raises
    it inside the user's code (a model factory, a forward), whose own ``except Exception`` must
    not swallow it, and raising is the only way a signal handler can stop the code it
    interrupted. It never leaves ``parent_deadline``, which turns it into a :class:`CheckError`.
    """


# ----------------------------------------------------------------------------- lint


class LintUsageError(HyperrecipeError, ValueError):
    """The lint's command line or configuration is wrong (exit 2); the message says how."""


class SelectorError(HyperrecipeError, ValueError):
    """A lint rule code, name or prefix (``--select``, ``ignore``, a suppression) that matches
    no rule."""


class ConfigError(HyperrecipeError, ValueError):
    """The lint's ``[tool.hyperrecipe.lint]`` table is malformed; the message names the file and
    the key."""


class InterpreterLimit(HyperrecipeError, ValueError):
    """The interpreter refuses a linted source for one of its limits (nesting, parser stack).

    Such a file is not Python any interpreter runs, and the same nesting can overflow libcst's
    native parser (a crash, not an error), so the lint reports it as a syntax error and never
    hands it to libcst.

    Args:
        message: the interpreter's words.
        line: 1-based.
        column: 1-based.
    """

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column


# ----------------------------------------------------------------------------- suggest


class SuggestError(HyperrecipeError, RuntimeError):
    """``hyperrecipe suggest`` has no recipe it can hand over: the model carries no plan it can
    translate, or every suggested rule had to be narrowed away before ``check`` agreed.

    Args:
        message: what was tried and why nothing is left.
        narrowed: ``(what, why)`` for each rule given up on the way.
    """

    def __init__(self, message: str, *, narrowed: tuple[tuple[str, str], ...] = ()) -> None:
        self.narrowed = narrowed
        super().__init__(message)


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The candidates nearest to ``name``, best first (may be empty)."""
    pool = sorted(set(candidates))
    return difflib.get_close_matches(name, pool, n=n, cutoff=0.5)


def check_path_arg(value: object, where: str) -> None:
    """Raise :class:`UsageError` unless ``value`` is a ``str`` or ``os.PathLike`` path."""
    if not isinstance(value, (str, os.PathLike)):
        msg = f"{where} must be a path (str or os.PathLike), not {type(value).__name__}"
        raise UsageError(msg)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ``"; did you mean 'x'?"`` suffix, or ``""`` when nothing is close."""
    near = closest(name, candidates, n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


class TrainerSetupError(HyperrecipeError, ValueError):
    """A trainer (the Hugging Face Trainer, Lightning) is set up in a way its integration cannot
    make right on an applied plan; the message names the setting and what to use instead."""


class ShardedGradNormError(HyperrecipeError, RuntimeError):
    """torch's ``clip_grad_norm_`` / ``get_total_norm`` was handed gradients of an applied
    model's shards together with tensors whose layout is unknown (another installation's, a
    plain tensor, a parameter added after apply), so no norm of them is the one a single
    process computes; the message names them and the call to use instead.

    Args:
        message: the whole message.
        foreign: a description of each tensor that does not belong (at most a few).
    """

    def __init__(self, message: str, *, foreign: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.foreign = foreign


class ExportAbortedError(ExportError):
    """A rank failed or stopped in the middle of an export's gathers, so the ranks can no
    longer agree: the rank that failed raises at once, the others within
    ``collective_timeout_s``; nothing in the folder was replaced, and the process group is
    out of step (restart every rank)."""


class FolderLockedError(ExportError):
    """Another writer holds the folder a ``save_checkpoint`` or ``save_pretrained`` was
    given (its ``hyperrecipe.lock``): every rank of the refused job raises it, with the same
    message, before any of them wrote there, so the other writer's state is untouched.

    Args:
        message: the whole message: the folder, the lock file, the holder (host, pid, what
            it runs and since when) and what to do.
        folder: the folder refused.
        lock: the lock file's path.
        holder: what the lock file says of its holder (``host``, ``pid``, ``what``,
            ``since``...; empty when it could not be read).
    """

    def __init__(self, message: str, *, folder: str = "", lock: str = "",
                 holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.folder = folder
        self.lock = lock
        self.holder = dict(holder or {})
