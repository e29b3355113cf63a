"""The ``hyperrecipe`` command: thin argument parsing over the parts that do the work.

Subcommands import what they need when they run, so ``hyperrecipe lint`` never imports torch.
Exit codes: 0 clean, 1 findings or divergence, 2 errors (printed without a traceback).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "lint":
        from hyperrecipe.lint.cli import main as lint_main

        return lint_main(args[1:])
    try:
        from hyperrecipe._cli_commands import run

        return run(args)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        # torch is an extra (pre-commit installs the lint without it): say how to get it.
        sys.stderr.write(
            f"hyperrecipe: error: `hyperrecipe {args[0] if args else ''}` needs torch, which is "
            "not installed; install your torch build, or `pip install 'hyperrecipe[torch]'` "
            "(only `hyperrecipe lint` works without it)\n"
        )
        return 2
