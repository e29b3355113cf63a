"""What a lint run reports: findings (a rule fired) and errors (a file could not be linted)."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["Finding", "Severity"]

Severity = Literal["finding", "error"]


@attrs.frozen(kw_only=True, order=False)
class Finding:
    """One reported problem at one place.

    Args:
        path: the file as shown to the user (relative to the working directory when inside it).
        line: 1-based line.
        column: 1-based column (in characters).
        code: the stable code, ``HR001``.
        name: the rule's name, ``forward-assignment``.
        message: what is wrong and what to do instead.
        severity: ``"finding"`` for a rule violation (exit 1), ``"error"`` for a file that could
            not be linted at all (exit 2 when there are no findings).
        end_line: 1-based line where the reported code ends (``line`` when it has no extent).
        end_column: 1-based column just past its end, as ruff reports it (``column`` when it
            has no extent).
    """

    path: str
    line: int
    column: int
    code: str
    name: str
    message: str
    severity: Severity = "finding"
    end_line: int = attrs.field(
        default=attrs.Factory(lambda self: self.line, takes_self=True)
    )
    end_column: int = attrs.field(
        default=attrs.Factory(lambda self: self.column, takes_self=True)
    )

    def sort_key(self) -> tuple[str, int, int, str, str]:
        """Order of output: by file, position, code."""
        return (self.path, self.line, self.column, self.code, self.message)
