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
    from hyperrecipe._cli_commands import run

    return run(args)
