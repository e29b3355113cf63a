"""``hyperrecipe lint [PATHS] [--format text|json|github] [--select CODES] [--ignore CODES]``.

Exit status: 0 clean; 1 findings; 2 usage errors, or files that could not be linted (syntax
errors) when there is no finding. Nothing here imports torch or, unless a file needs it, libcst.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hyperrecipe.lint.output import FORMATS, render
from hyperrecipe.lint.runner import LintUsageError, explain, lint_paths

__all__ = ["main"]


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
                        help="files or folders to lint (default: the current folder)")
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format")
    parser.add_argument("--select", type=_codes, action="append", metavar="CODES",
                        help="comma-separated codes, names or prefixes to report "
                             "(replaces the configured select)")
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
        if args.explain:
            sys.stdout.write(explain(args.explain))
            return 0
        if args.jobs is not None and args.jobs < 1:
            raise LintUsageError("--jobs must be at least 1")
        select = None if args.select is None else [c for group in args.select for c in group]
        ignore = [c for group in args.ignore for c in group]
        result = lint_paths(args.paths or ["."], select=select, ignore=ignore, jobs=args.jobs,
                            screen=args.screen)
    except LintUsageError as exc:
        sys.stderr.write(f"hyperrecipe lint: error: {exc}\n")
        return 2
    sys.stdout.write(render(result.findings, args.format))
    if args.format == "text" and result.findings:
        count = sum(f.severity == "finding" for f in result.findings)
        errors = len(result.findings) - count
        parts = [f"{count} finding{'s' * (count != 1)}"]
        if errors:
            parts.append(f"{errors} file{'s' * (errors != 1)} not linted")
        files = f"{result.files} file{'s' * (result.files != 1)}"
        sys.stderr.write(f"hyperrecipe lint: {', '.join(parts)} in {files} checked\n")
    return result.exit_code
