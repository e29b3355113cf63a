"""Printing findings: ``text`` for people, ``json`` for tools, ``github`` for CI annotations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final, Literal

from hyperrecipe.lint.findings import Finding

__all__ = ["FORMATS", "OutputFormat", "render"]

OutputFormat = Literal["text", "json", "github"]
FORMATS: Final[tuple[OutputFormat, ...]] = ("text", "json", "github")


def _github_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _github_property(value: str) -> str:
    return _github_data(value).replace(":", "%3A").replace(",", "%2C")


def render(findings: Sequence[Finding], fmt: OutputFormat) -> str:
    """The findings in one format, one per line (``json``: one list), ending in a newline.

    * ``text``: ``path:line:col: HR001 forward-assignment message``
    * ``json``: a list of objects with ``path``, ``line``, ``column``, ``code``, ``name`` and
      ``message`` (``[]`` when clean)
    * ``github``: ``::error file=…,line=…,col=…,title=HR001 forward-assignment::message``
      workflow commands, which GitHub Actions turns into annotations on the diff
    """
    if fmt == "json":
        rows = [
            {"path": f.path, "line": f.line, "column": f.column, "code": f.code, "name": f.name,
             "message": f.message}
            for f in findings
        ]
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "github":
        lines = [
            f"::error file={_github_property(f.path)},line={f.line},col={f.column},"
            f"title={_github_property(f'{f.code} {f.name}')}::{_github_data(f.message)}"
            for f in findings
        ]
    else:
        lines = [f"{f.path}:{f.line}:{f.column}: {f.code} {f.name} {f.message}" for f in findings]
    return "".join(line + "\n" for line in lines)
