"""The rule reference in ``docs/lint.md``, rendered from the rule classes themselves.

The docs of a rule live in its class docstring, next to its code; ``docs/lint.md`` holds a copy
between two markers, and a test fails when the copy is stale. Regenerate with::

    python -m hyperrecipe.lint.docs --write docs/lint.md
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Final

from hyperrecipe.lint.codes import CODES
from hyperrecipe.lint.rule import LintRule
from hyperrecipe.lint.rules import ALL_RULES

__all__ = ["BEGIN", "END", "render_reference", "rule_markdown", "update_document"]

BEGIN: Final = "<!-- BEGIN GENERATED RULE REFERENCE (python -m hyperrecipe.lint.docs) -->"
END: Final = "<!-- END GENERATED RULE REFERENCE -->"


def rule_markdown(rule: type[LintRule]) -> str:
    """One rule's section: heading, docstring, and the number of embedded cases."""
    body = inspect.cleandoc(rule.__doc__ or "")
    body = body.replace("#### ", "### ")
    gate = ""
    if rule.gated:
        gate = " It is part of the forward gate: off in the configured `rewriter` paths."
    opt_in = ""
    if rule.opt_in:
        opt_in = (
            f"**Opt-in**: reported only where selected by its exact code or name "
            f"(`--select {rule.code}`, or `select = [..., \"{rule.name}\"]` in "
            f"`[tool.hyperrecipe.lint]`); never by default, and never through a prefix such as "
            f"`{rule.code[:3]}`.\n\n"
        )
    return (
        f"## {rule.code} {rule.name}\n\n"
        f"{opt_in}"
        f"Message: *{rule.message}*\n\n"
        f"{body}\n\n"
        f"Tested by {len(rule.VALID)} valid and {len(rule.INVALID)} invalid embedded cases.{gate}\n"
    )


def render_reference() -> str:
    """The generated part of ``docs/lint.md``: the code table, then every rule."""
    rows = ["| code | name | what |", "|---|---|---|"]
    rows += [
        f"| {info.code} | {info.name} | {'(opt-in) ' if info.opt_in else ''}{info.summary} |"
        for info in CODES
    ]
    sections = [rule_markdown(rule) for rule in ALL_RULES]
    return "\n".join([BEGIN, "", "\n".join(rows), "", "\n".join(sections).rstrip("\n"), "", END])


def update_document(text: str) -> str:
    """``text`` with the part between the markers replaced by :func:`render_reference`."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + render_reference() + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyperrecipe.lint.docs")
    parser.add_argument("--write", metavar="MARKDOWN", help="update the generated part in place")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(update_document(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(render_reference() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
