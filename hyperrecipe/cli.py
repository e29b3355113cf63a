"""The ``hyperrecipe`` command: thin argument parsing over the parts that do the work.

Subcommands import what they need when they run, so ``hyperrecipe lint`` never imports torch.
Exit codes: 0 clean, 1 findings or divergence, 2 errors (printed without a traceback).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

STARTED = time.perf_counter()
"""When the command started (this module is the first of hyperrecipe's that the entry point
imports): ``check`` counts its progress times and its total from here."""

__all__ = ["STARTED", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (``sys.argv[1:]`` when ``None``) and return its exit code.

    With ``argv=None`` this is the process's entry point (the ``hyperrecipe`` script and
    ``python -m hyperrecipe``): once ``compile``, ``explain``, ``schema`` or ``check`` has
    printed its result the process ends at once (``os._exit`` once stdout and stderr are
    flushed) instead of waiting for the interpreter to tear torch and transformers down, which
    took longer than ``check``'s own ranks. Called with a list (tests, other Python code) it
    always returns.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "lint":
        from hyperrecipe.lint.cli import main as lint_main

        return lint_main(args[1:])
    try:
        from hyperrecipe._cli_commands import run

        entry = argv is None  # the process's own command: its clock started with the process
        return run(args, started=STARTED if entry else None, end_process=entry)
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
