"""Running a lint over paths: discovery, configuration, screening, libcst, in parallel.

Per Python file the work is: read it, screen it (:mod:`hyperrecipe.lint.prefilter`), and run the
libcst rules only when the screen cannot rule a finding out. Every file is handled in a forked
worker with a time and memory budget (:mod:`hyperrecipe.lint.supervisor`), so a file that
crashes or exhausts the parser is reported (``HR998``) and the others' findings are kept. With
more than a few files the screen runs on every CPU (biggest files first); meanwhile the parent
imports libcst, and the files the screen could not clear go to workers forked from the parent
afterwards, which inherit the import instead of paying it once each. Recipe files are checked
in the first-phase workers as well (bounded: a YAML full of aliases must not hang the run).
A few small Python files alone (the pre-commit case) are screened in this process instead, under
the memory budget (:data:`INLINE_MAX_BYTES` says why that is safe); a fork costs more than that.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import attrs

from hyperrecipe.errors import LintUsageError
from hyperrecipe.lint.codes import by_code, resolve_selection, resolve_selectors
from hyperrecipe.lint.config import ConfigError, ConfigFinder, LintConfig
from hyperrecipe.lint.files import Target, discover, display_path
from hyperrecipe.lint.findings import Finding
from hyperrecipe.lint.recipes import RECIPE_SUFFIXES, check_recipe
from hyperrecipe.lint.supervisor import Budget, TaskFailure, run_bounded, run_here

__all__ = ["STDIN_PATH", "Budget", "LintResult", "LintUsageError", "lint_paths"]

#: Below this many Python files, more than one worker costs more than it saves.
POOL_MIN_FILES: Final = 8
#: Fewer than :data:`POOL_MIN_FILES` Python files, each at most this big, are screened in this
#: process (no worker is forked unless one needs libcst): the pre-commit case. The screen is
#: bytes operations and the interpreter's own parser, linear in the size of a file and raising
#: errors (not crashing) past its nesting limits, so a file this small cannot run away; the
#: memory budget still applies (:func:`~hyperrecipe.lint.supervisor.run_here`).
INLINE_MAX_BYTES: Final = 256 * 1024
#: The path that stands for standard input, as in ruff.
STDIN_PATH: Final = "-"
#: The opt-in rule that widens the screen (``import`` sends a file to the ``ast`` walk) only
#: where it is selected.
_PROCESS_PATCH: Final = "HR005"


@attrs.frozen(kw_only=True)
class LintResult:
    """What a run found.

    Args:
        findings: findings and errors, sorted by path, line, column, code.
        files: how many files were linted.
        libcst_files: how many of the Python files went through the libcst pass.
    """

    findings: tuple[Finding, ...]
    files: int
    libcst_files: int

    @property
    def exit_code(self) -> int:
        """1 when there are findings; else 2 when some file could not be linted; else 0."""
        if any(f.severity == "finding" for f in self.findings):
            return 1
        if self.findings:
            return 2
        return 0


# A job crosses the process boundary, so it is plain data: path, display, codes, allowed.
_Job = tuple[str, str, frozenset[str], bool]
# A recipe job: path, display.
_RecipeJob = tuple[str, str]


def _error(display: str, code: str, message: str, line: int = 1, column: int = 1) -> Finding:
    info = by_code(code)
    return Finding(path=display, line=line, column=column, code=info.code, name=info.name,
                   message=message, severity="error")


def _read(job: _Job) -> bytes | Finding:
    path, display = job[0], job[1]
    if path == STDIN_PATH:
        return _stdin_source()
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        return _error(display, "HR000", f"cannot read: {exc.strerror or exc}")


#: ``lint_paths`` reads standard input once, before any worker starts; workers inherit it.
_STDIN: list[bytes] = []


def _stdin_source() -> bytes:
    return _STDIN[0] if _STDIN else b""


def _screens_patches(job: _Job) -> bool:
    """Whether the screen must look for process patches: HR005 (opt-in) is selected for the
    file, and the file is not a rewriter path (HR005 is gated, so it does not run there)."""
    return _PROCESS_PATCH in job[2] and not job[3]


def _screen(job: _Job) -> list[Finding] | None:
    """The file's findings if the screen settles it (usually none); ``None``: libcst must look."""
    from hyperrecipe.lint.prefilter import InterpreterLimit, needs_libcst

    source = _read(job)
    if isinstance(source, Finding):
        return [source]
    # ast trees hold no reference cycles, so the cyclic collector only costs time here (~15%
    # of the screen: every parse allocates enough objects to trigger collections).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return None if needs_libcst(source, job[1], patches=_screens_patches(job)) else []
    except InterpreterLimit as limit:
        return [_error(job[1], "HR000", f"cannot parse: {limit.message}", limit.line,
                       limit.column)]
    finally:
        if enabled:
            gc.enable()


def _first_phase(
    task: tuple[str, _Job | _RecipeJob],
) -> list[Finding] | tuple[list[Finding]] | None:
    """A recipe check, a screen (``None``: libcst must look), or — for ``"python+libcst"``, a
    run on one worker — the screen and then the libcst pass in the same worker, whose findings
    come back wrapped in a 1-tuple (so the caller knows libcst ran)."""
    kind, job = task
    if kind == "recipe":
        return check_recipe(Path(job[0]), job[1])
    assert len(job) == 4
    screened = _screen(job)
    if screened is None and kind == "python+libcst":
        return (_lint_screened(job),)
    return screened


def _screen_inline(python: Sequence[tuple[int, _Job]]) -> bool:
    """Whether the Python files are few and small enough to screen in this process."""
    return 0 < len(python) < POOL_MIN_FILES and all(
        size <= INLINE_MAX_BYTES for size, _ in python
    )


def _lint_with_libcst(job: _Job, screened: bool) -> list[Finding]:
    from hyperrecipe.lint.engine import lint_source

    source = _read(job)
    if isinstance(source, Finding):
        return [source]
    return lint_source(source, display=job[1], codes=job[2], allow_gated=job[3],
                       screened=screened)


def _lint_screened(job: _Job) -> list[Finding]:
    return _lint_with_libcst(job, screened=True)


def _lint_unscreened(job: _Job) -> list[Finding]:
    return _lint_with_libcst(job, screened=False)


def _not_checked(display: str, reason: str) -> Finding:
    return _error(display, "HR998", f"not checked: {reason}; the other files' findings stand")


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def lint_paths(
    paths: Sequence[str] = (".",),
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    jobs: int | None = None,
    screen: bool = True,
    force_exclude: bool = False,
    stdin: bytes | None = None,
    stdin_filename: str | None = None,
    budget: Budget | None = None,
) -> LintResult:
    """Lint files and folders.

    Args:
        paths: files and folders; folders are walked (see :func:`hyperrecipe.lint.files.discover`).
            ``-`` stands for ``stdin``.
        select: codes/names/prefixes to report, replacing the configuration's ``select``.
        ignore: codes/names/prefixes not to report, added to the configuration's ``ignore``.
        jobs: worker processes (default: the usable CPUs).
        screen: skip libcst for files the text/``ast`` screen clears. ``False`` runs libcst on
            every file; findings are the same, only slower (the equivalence tests use it).
        force_exclude: apply ``exclude`` to the named paths themselves (ruff's
            ``--force-exclude``; the pre-commit hooks pass it).
        stdin: the source that ``-`` stands for (read by the caller).
        stdin_filename: the path ``-`` is shown as and configured as (``-`` when ``None``).
        budget: time and memory per file (default :class:`Budget`); a file over it is an
            ``HR998`` error and every other file's findings are kept.

    Returns:
        The sorted findings and counts.

    Raises:
        LintUsageError: a path does not exist, a selector is unknown, or a configuration table
            is malformed.

    Example::

        >>> result = lint_paths(["hyperrecipe"], select=["HR001"])
        >>> result.exit_code
        0
    """
    select = None if select is None else tuple(select)
    ignore = tuple(ignore)
    budget = Budget() if budget is None else budget
    named = [p for p in paths if p != STDIN_PATH]
    try:
        if select is not None:
            resolve_selectors(select, where="--select")
        resolve_selectors(ignore, where="--ignore")
        finder = ConfigFinder()
        targets, missing, unreadable = discover(named, finder, force_exclude=force_exclude)
        if len(named) != len(paths):
            targets.extend(_stdin_target(stdin, stdin_filename, finder, force_exclude))
    except (ConfigError, ValueError) as exc:
        raise LintUsageError(str(exc)) from exc
    if missing:
        msg = "no such file or folder: " + ", ".join(missing)
        raise LintUsageError(msg)

    selections: dict[tuple[LintConfig, tuple[str, ...]], frozenset[str]] = {}

    def codes_for(target: Target) -> frozenset[str]:
        config = target.config
        extra = config.ignores_for(target.path)
        key = (config, extra)
        if key not in selections:
            where = str(config.source) if config.source is not None else "configuration"
            try:
                selections[key] = resolve_selection(
                    select=select if select is not None else config.select,
                    ignore=(*config.ignore, *extra, *ignore),
                    where=where,
                )
            except ValueError as exc:
                raise LintUsageError(str(exc)) from exc
        return selections[key]

    python: list[tuple[int, _Job]] = []
    recipes: list[tuple[int, _RecipeJob]] = []
    for target in targets:
        codes = codes_for(target)
        if target.kind == "recipe":
            if "HR100" in codes:
                recipes.append((target.size, (str(target.path), target.display)))
            continue
        allowed = target.config.allows_forward_install(target.path)
        job_path = STDIN_PATH if target.from_stdin else str(target.path)
        python.append((target.size, (job_path, target.display, codes, allowed)))
    python.sort(key=lambda item: -item[0])  # biggest first: the pool balances better

    _STDIN[:] = [stdin or b""]
    cpus = jobs if jobs is not None else _available_cpus()
    cwd = Path.cwd()
    findings: list[Finding] = [
        _error(display_path(path, cwd), "HR997", message) for path, message in unreadable]

    # Phase 1: screen (and recipe checks). Phase 2: libcst on what the screen could not clear.
    # Both run in bounded, forked workers (:mod:`hyperrecipe.lint.supervisor`). The phases use
    # separate workers so that the parent can import libcst while the screen runs and the
    # phase-2 workers inherit it through fork, instead of every worker importing it (~0.25 s).
    first: list[tuple[int, tuple[str, _Job | _RecipeJob]]] = [
        *((size, ("recipe", job)) for size, job in recipes),
        *((size, ("python", job)) for size, job in python),
    ]
    needs: list[tuple[int, _Job]] = []
    if not screen:
        needs = list(python)
        first = [item for item in first if item[1][0] == "recipe"]
    first.sort(key=lambda item: -item[0])
    if screen and not recipes and _screen_inline(python):
        # A few small files (pre-commit): screen them here, sparing the fork, the pipe and the
        # import of multiprocessing; only a file the screen cannot clear goes to a worker.
        for size, python_job in python:
            screened = run_here(_screen, python_job, budget=budget)
            if isinstance(screened, TaskFailure):
                findings.append(_not_checked(python_job[1], screened.reason))
            elif screened is None:
                needs.append((size, python_job))
            else:
                findings.extend(screened)
        first = []
    tasks = [task for _, task in first]
    parallel = cpus > 1 and len(python) >= POOL_MIN_FILES
    if not parallel and screen and tasks:
        # One worker: a file the screen cannot clear goes on to libcst in the same worker (it
        # imports libcst itself), sparing the parent the import and a second fork.
        tasks = [("python+libcst", job) if kind == "python" else (kind, job)
                 for kind, job in tasks]
    outcomes = run_bounded(_first_phase, tasks, workers=cpus if parallel else 1, budget=budget)
    imported = False
    in_first_phase = 0
    for index, outcome in outcomes:
        kind, job = tasks[index]
        if isinstance(outcome, TaskFailure):
            findings.append(_not_checked(job[1], outcome.reason))
        elif isinstance(outcome, tuple):
            findings.extend(outcome[0])
            in_first_phase += 1
        elif outcome is None:
            assert kind != "recipe" and len(job) == 4
            needs.append((first[index][0], job))
        else:
            findings.extend(outcome)
        if parallel and not imported:
            # While the workers screen, import libcst here, so phase-2 workers inherit it.
            # (Speculative: a tree the screen clears entirely pays ~0.2 s CPU for nothing.)
            import hyperrecipe.lint.engine  # noqa: F401

            imported = True

    needs.sort(key=lambda item: -item[0])
    if needs:
        second = [job for _, job in needs]
        workers = cpus if cpus > 1 and len(needs) > 1 else 1
        if workers > 1:
            # Imported once here and inherited by fork; a lone worker imports it itself (the
            # pre-commit case: forking a parent that holds libcst costs more than it saves).
            import hyperrecipe.lint.engine  # noqa: F401
        lint = _lint_screened if screen else _lint_unscreened
        for index, result in run_bounded(lint, second, workers=workers, budget=budget):
            if isinstance(result, TaskFailure):
                findings.append(_not_checked(second[index][1], result.reason))
            else:
                findings.extend(result)

    findings.sort(key=Finding.sort_key)
    return LintResult(
        findings=tuple(findings),
        files=len(python) + len(recipes),
        libcst_files=len(needs) + in_first_phase,
    )


def _stdin_target(
    source: bytes | None, filename: str | None, finder: ConfigFinder, force_exclude: bool
) -> list[Target]:
    """The target ``-`` stands for: shown and configured as ``filename`` when given."""
    shown = filename if filename is not None else STDIN_PATH
    path = Path(os.path.abspath(shown))
    config = finder.for_folder(path.parent)
    if filename is not None and config.is_excluded(path, named=path, force=force_exclude):
        return []
    if path.suffix in RECIPE_SUFFIXES:
        msg = (f"--stdin-filename {shown}: recipe files cannot be read from standard input "
               "(their `extends:` are relative to the file); name the file instead")
        raise LintUsageError(msg)
    display = shown if filename is None else display_path(path, Path.cwd())
    return [Target(path=path, display=display, kind="python", config=config,
                   size=len(source or b""), from_stdin=True)]


def explain(code_or_name: str) -> str:
    """The documentation of one code, for ``hyperrecipe lint --explain``.

    Raises:
        LintUsageError: for an unknown code or name.
    """
    try:
        (code,) = resolve_selectors([code_or_name], where="--explain")
    except ValueError as exc:
        msg = str(exc) if "unknown" in str(exc) else f"--explain: {code_or_name!r} is ambiguous"
        raise LintUsageError(msg) from exc
    info = by_code(code)
    if info.kind == "rule":
        from hyperrecipe.lint.docs import rule_markdown
        from hyperrecipe.lint.rules import ALL_RULES

        (rule,) = [r for r in ALL_RULES if r.code == code]
        return rule_markdown(rule)
    return f"{info.code} {info.name}: {info.summary}\n"
