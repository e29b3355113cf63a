"""Running a lint over paths: discovery, configuration, screening, libcst, in parallel.

Per Python file the work is: read it, screen it (:mod:`hyperrecipe.lint.prefilter`), and run the
libcst rules only when the screen cannot rule a finding out. The screen costs about two thirds
of an ``ast.parse`` of the file, so with more than a few files it runs in a ``fork``-ed process
pool (biggest files first, in batches). Meanwhile the parent imports libcst; the files the
screen could not clear then go to a second pool forked from the parent, which inherits the
import instead of paying it once per worker. Recipe files are checked in the parent.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from typing import Final

import attrs

from hyperrecipe.lint.codes import by_code, resolve_selection, resolve_selectors
from hyperrecipe.lint.config import ConfigError, ConfigFinder, LintConfig
from hyperrecipe.lint.files import Target, discover
from hyperrecipe.lint.findings import Finding
from hyperrecipe.lint.recipes import check_recipe

__all__ = ["LintResult", "LintUsageError", "lint_paths"]

#: Below this many Python files, a process pool costs more than it saves.
POOL_MIN_FILES: Final = 8
_BATCHES_PER_WORKER: Final = 6


class LintUsageError(ValueError):
    """The command line or configuration is wrong (exit 2); the message says how."""


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


def _read(job: _Job) -> bytes | Finding:
    path, display = job[0], job[1]
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        info = by_code("HR000")
        return Finding(path=display, line=1, column=1, code=info.code, name=info.name,
                       message=f"cannot read: {exc.strerror or exc}", severity="error")


def _screen(job: _Job) -> list[Finding] | None:
    """The file's findings if the screen settles it (usually none); ``None``: libcst must look."""
    from hyperrecipe.lint.prefilter import needs_libcst

    source = _read(job)
    if isinstance(source, Finding):
        return [source]
    return None if needs_libcst(source, job[1]) else []


def _screen_batch(jobs: Sequence[_Job]) -> list[list[Finding] | None]:
    # ast trees hold no reference cycles, so the cyclic collector only costs time here (~15%
    # of the screen: every parse allocates enough objects to trigger collections).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return [_screen(job) for job in jobs]
    finally:
        if enabled:
            gc.enable()


def _lint_with_libcst(job: _Job) -> list[Finding]:
    from hyperrecipe.lint.engine import lint_source

    source = _read(job)
    if isinstance(source, Finding):
        return [source]
    return lint_source(source, display=job[1], codes=job[2], allow_gated=job[3])


def _libcst_batch(jobs: Sequence[_Job]) -> list[list[Finding]]:
    return [_lint_with_libcst(job) for job in jobs]


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _batches(
    jobs: list[tuple[int, _Job]], count: int
) -> list[list[tuple[int, _Job]]]:
    """Split size-sorted (biggest first) jobs into about ``count`` batches of similar bytes."""
    total = sum(size for size, _ in jobs) or 1
    target = total / max(count, 1)
    batches: list[list[tuple[int, _Job]]] = []
    current: list[tuple[int, _Job]] = []
    current_size = 0
    for size, job in jobs:
        current.append((size, job))
        current_size += size
        if current_size >= target:
            batches.append(current)
            current, current_size = [], 0
    if current:
        batches.append(current)
    return batches


def _pool(workers: int) -> Executor:
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork") if "fork" in methods else None
    return ProcessPoolExecutor(max_workers=workers, mp_context=context)


def lint_paths(
    paths: Sequence[str] = (".",),
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    jobs: int | None = None,
    screen: bool = True,
) -> LintResult:
    """Lint files and folders.

    Args:
        paths: files and folders; folders are walked (see :func:`hyperrecipe.lint.files.discover`).
        select: codes/names/prefixes to report, replacing the configuration's ``select``.
        ignore: codes/names/prefixes not to report, added to the configuration's ``ignore``.
        jobs: worker processes (default: the usable CPUs; 1 runs everything in this process).
        screen: skip libcst for files the text/``ast`` screen clears. ``False`` runs libcst on
            every file; findings are the same, only slower (the equivalence tests use it).

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
    try:
        if select is not None:
            resolve_selectors(select, where="--select")
        resolve_selectors(ignore, where="--ignore")
        finder = ConfigFinder()
        targets, missing = discover(paths, finder)
    except (ConfigError, ValueError) as exc:
        raise LintUsageError(str(exc)) from exc
    if missing:
        msg = "no such file or folder: " + ", ".join(missing)
        raise LintUsageError(msg)

    selections: dict[LintConfig, frozenset[str]] = {}

    def codes_for(config: LintConfig) -> frozenset[str]:
        if config not in selections:
            where = str(config.source) if config.source is not None else "configuration"
            try:
                selections[config] = resolve_selection(
                    select=select if select is not None else config.select,
                    ignore=(*config.ignore, *ignore),
                    where=where,
                )
            except ValueError as exc:
                raise LintUsageError(str(exc)) from exc
        return selections[config]

    python: list[tuple[int, _Job]] = []
    recipes: list[Target] = []
    for target in targets:
        codes = codes_for(target.config)
        if target.kind == "recipe":
            if "HR100" in codes:
                recipes.append(target)
            continue
        allowed = target.config.allows_forward_install(target.path)
        python.append((target.size, (str(target.path), target.display, codes, allowed)))
    python.sort(key=lambda item: -item[0])  # biggest first: the pool balances better

    workers = min(jobs if jobs is not None else _available_cpus(), len(python))
    parallel = workers > 1 and len(python) >= POOL_MIN_FILES
    findings: list[Finding] = []
    for recipe in recipes:
        findings.extend(check_recipe(recipe.path, recipe.display))

    # Phase 1: screen. Phase 2: libcst on what the screen could not clear. The phases run in
    # separate pools so that the parent can import libcst while the screen runs and the
    # phase-2 workers inherit it through fork, instead of every worker importing it (~0.25 s).
    needs: list[tuple[int, _Job]] = []
    if not screen:
        needs = python
    elif parallel:
        batches = _batches(python, workers * _BATCHES_PER_WORKER)
        with _pool(min(workers, len(batches))) as pool:
            pending = {
                pool.submit(_screen_batch, [job for _, job in batch]): batch for batch in batches
            }
            # While the workers screen, import libcst here, so phase-2 workers inherit it.
            # (Speculative: a tree the screen clears entirely pays ~0.2 s CPU for nothing.)
            import hyperrecipe.lint.engine  # noqa: F401
            for future in as_completed(pending):
                for (size, job), outcome in zip(pending[future], future.result()):
                    if outcome is None:
                        needs.append((size, job))
                    else:
                        findings.extend(outcome)
    else:
        for (size, job), outcome in zip(python, _screen_batch([job for _, job in python])):
            if outcome is None:
                needs.append((size, job))
            else:
                findings.extend(outcome)

    needs.sort(key=lambda item: -item[0])
    if parallel and len(needs) > 1:
        import hyperrecipe.lint.engine  # noqa: F401 - imported once here, inherited by fork

        batches = _batches(needs, workers * _BATCHES_PER_WORKER)
        with _pool(min(workers, len(batches))) as pool:
            for batch_findings in pool.map(_libcst_batch, [[j for _, j in b] for b in batches]):
                for file_findings in batch_findings:
                    findings.extend(file_findings)
    else:
        for _, job in needs:
            findings.extend(_lint_with_libcst(job))

    findings.sort(key=Finding.sort_key)
    return LintResult(
        findings=tuple(findings),
        files=len(python) + len(recipes),
        libcst_files=len(needs),
    )


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
