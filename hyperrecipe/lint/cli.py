"""``hyperrecipe lint [PATHS | -] [--format text|json|github|sarif] [--select CODES] ...``.

Exit status: 0 clean; 1 findings; 2 usage errors, or files that could not be linted (syntax
errors, files over their budget) when there is no finding; ``--exit-zero`` makes findings exit 0.
The options follow ruff where ruff has one (``-`` with ``--stdin-filename``, ``--exit-zero``,
``--statistics``, ``--force-exclude``, ``--version``). Nothing here imports torch or, unless a
file needs it, libcst.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hyperrecipe.lint.output import FORMATS, render, statistics
from hyperrecipe.lint.runner import STDIN_PATH, Budget, LintUsageError, explain, lint_paths

__all__ = ["main"]


MAX_STDIN_BYTES = 256 * 2**20
"""Most source ``-`` reads from standard input (an editor sends one file)."""
MAX_FILE_SECONDS = 1e6
"""Longest ``--file-timeout`` (about 11 days: longer is unbounded in all but name)."""


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    if number > MAX_FILE_SECONDS:  # also inf: a wait that long overflows the OS's timeouts
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_FILE_SECONDS:g} seconds, got {value}")
    return number


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyperrecipe")
    except PackageNotFoundError:  # pragma: no cover - running from a checkout, not installed
        return "unknown"


def _codes(value: str) -> list[str]:
    return [token.strip() for token in value.split(",") if token.strip()]


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises instead of exiting, so ``main`` returns 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise LintUsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hyperrecipe lint",
        description=(
            "Forbid forward rewrites outside the configured rewriter, and check recipe files. "
            "Configuration: [tool.hyperrecipe.lint] in the nearest pyproject.toml."
        ),
    )
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="files or folders to lint (default: the current folder); `-` reads "
                             "one Python file from standard input")
    parser.add_argument("--stdin-filename", metavar="PATH",
                        help="the path standard input (`-`) is shown and configured as")
    parser.add_argument("--force-exclude", action="store_true",
                        help="apply `exclude` to the paths named on the command line too (the "
                             "pre-commit hooks pass it)")
    parser.add_argument("--exit-zero", action="store_true",
                        help="exit 0 even when there are findings (errors still exit 2)")
    parser.add_argument("--statistics", action="store_true",
                        help="print how many findings each code has, instead of the findings")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--file-timeout", type=_positive_float, default=Budget().seconds,
                        metavar="SECONDS",
                        help="wall-clock seconds one file may take (default: %(default)s); "
                             "a file over it is reported as HR998")
    parser.add_argument("--file-memory", type=_positive_int, default=Budget().memory_mib,
                        metavar="MIB",
                        help="MiB of memory one file may take (default: %(default)s); "
                             "a file over it is reported as HR998")
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format")
    parser.add_argument("--select", type=_codes, action="append", metavar="CODES",
                        help="comma-separated codes, names or prefixes to report "
                             "(replaces the configured select; an opt-in rule such as "
                             "HR005 only by its code or name)")
    parser.add_argument("--ignore", type=_codes, action="append", default=[], metavar="CODES",
                        help="comma-separated codes, names or prefixes not to report")
    parser.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                        help="worker processes (default: usable CPUs)")
    parser.add_argument("--no-screen", dest="screen", action="store_false",
                        help="run libcst on every file instead of screening first (slow; "
                             "same findings)")
    parser.add_argument("--explain", metavar="CODE", help="print the documentation of a code")
    return parser


def main(argv: Sequence[str]) -> int:
    """Run the lint command; returns the exit status."""
    try:
        args = _parser().parse_args(list(argv))
        if args.version:
            sys.stdout.write(f"hyperrecipe lint {_version()}\n")
            return 0
        if args.explain:
            sys.stdout.write(explain(args.explain))
            return 0
        if args.jobs is not None and args.jobs < 1:
            raise LintUsageError("--jobs must be at least 1")
        paths = args.paths or ["."]
        stdin: bytes | None = None
        if STDIN_PATH in paths:
            if paths.count(STDIN_PATH) > 1:
                raise LintUsageError("`-` (standard input) may be named once")
            stdin = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)  # `lint - < /dev/zero` ends
            if len(stdin) > MAX_STDIN_BYTES:
                raise LintUsageError(f"standard input is larger than {MAX_STDIN_BYTES >> 20} MiB; "
                                     f"name the file instead (files are read by workers with a "
                                     f"memory budget, --file-memory)")
        elif args.stdin_filename is not None:
            raise LintUsageError("--stdin-filename needs `-` among the paths")
        if args.statistics and args.format not in ("text", "json"):
            # (it printed the text table, ignoring the format asked for)
            raise LintUsageError(f"--statistics prints a table (--format text) or JSON (--format "
                                 f"json), not {args.format}; drop --statistics for "
                                 f"{args.format} findings")
        select = None if args.select is None else [c for group in args.select for c in group]
        ignore = [c for group in args.ignore for c in group]
        result = lint_paths(paths, select=select, ignore=ignore, jobs=args.jobs,
                            screen=args.screen, force_exclude=args.force_exclude, stdin=stdin,
                            stdin_filename=args.stdin_filename,
                            budget=Budget(seconds=args.file_timeout, memory_mib=args.file_memory))
    except LintUsageError as exc:
        sys.stderr.write(f"hyperrecipe lint: error: {exc}\n")
        return 2
    if args.statistics:
        sys.stdout.write(statistics(result.findings, args.format))
    else:
        # (importlib.metadata costs ~0.1 s: only SARIF names the version.)
        version = _version() if args.format == "sarif" else ""
        sys.stdout.write(render(result.findings, args.format, version=version))
    if args.format == "text" and result.findings:
        count = sum(f.severity == "finding" for f in result.findings)
        unread = sum(f.code == "HR997" for f in result.findings)
        errors = len(result.findings) - count - unread
        parts = [f"{count} finding{'s' * (count != 1)}"]
        if errors:
            parts.append(f"{errors} file{'s' * (errors != 1)} not linted")
        if unread:
            parts.append(f"{unread} path{'s' * (unread != 1)} not read")
        files = f"{result.files} file{'s' * (result.files != 1)}"
        sys.stderr.write(f"hyperrecipe lint: {', '.join(parts)} in {files} checked\n")
    if args.exit_zero and result.exit_code == 1:
        return 2 if any(f.severity == "error" for f in result.findings) else 0
    return result.exit_code
