"""``hyperrecipe lint``: the gate that keeps forward rewrites inside ``hyperrecipe/rewriter.py``.

What lives here: the rule registry (``codes``: every code and name, importable without libcst),
``[tool.hyperrecipe.lint]`` configuration (``config``), file discovery (``files``), the guarded
attribute names (``targets``, read by the rules and the screen alike), the cheap text/``ast``
screen that decides which files need libcst (``prefilter``), the libcst engine and suppression
comments (``engine``, ``suppressions``, ``rule``), one module per rule under ``rules/``,
recipe-file checks (``recipes``), what a run reports (``findings``), the rule reference in
docs/lint.md rendered from the rules (``docs``), output formats (``output``), bounded worker processes that give
every file a time and memory budget (``supervisor``), the runner (``runner``) and the command
line (``cli``). What does not: anything that imports torch — the lint runs in pre-commit and CI
before a model exists — and any fixing of code (rules only report).
"""

from __future__ import annotations

from hyperrecipe.lint.findings import Finding
from hyperrecipe.lint.runner import LintResult, lint_paths

__all__ = ["Finding", "LintResult", "lint_paths"]
