"""Printing findings: ``text`` for people, ``json`` for tools, ``github`` for CI annotations,
``sarif`` for code-scanning services; and the ``--statistics`` table."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any, Final, Literal
from urllib.parse import quote

from hyperrecipe.lint.codes import CODES
from hyperrecipe.lint.findings import Finding

__all__ = ["FORMATS", "OutputFormat", "render", "statistics"]

OutputFormat = Literal["text", "json", "github", "sarif"]
FORMATS: Final[tuple[OutputFormat, ...]] = ("text", "json", "github", "sarif")
_SARIF_SCHEMA: Final = "https://json.schemastore.org/sarif-2.1.0.json"


def _printable(value: str) -> str:
    """``value`` with control and format characters (a newline, ESC, a bidi override) and
    undecodable bytes escaped as ``\\xNN`` / ``\\uNNNN``: a file name is chosen by whoever
    named the file, and printed raw it could forge finding lines or send terminal escapes."""
    if value.isprintable():
        return value
    out = []
    for ch in value:
        if ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


def _github_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _github_property(value: str) -> str:
    return _github_data(value).replace(":", "%3A").replace(",", "%2C")


def _uri(path: str) -> str:
    """A SARIF artifact URI: relative paths stay relative (to the checkout), others ``file://``."""
    pure = PurePath(path)
    if pure.is_absolute():
        return "file://" + _quote(pure.as_posix())
    return _quote(pure.as_posix())


def _quote(path: str) -> str:
    """Percent-encode the file name's bytes: a name that is not UTF-8 (``bad\xff.py``, held
    as a surrogate escape) is encoded as the bytes on disk instead of failing to encode."""
    return quote(os.fsencode(path))


def _sarif(findings: Sequence[Finding], version: str) -> dict[str, Any]:
    """A SARIF 2.1.0 log with one run: every code as a rule, every finding as a result."""
    rules = [
        {
            "id": info.code,
            "name": info.name,
            "shortDescription": {"text": info.summary},
            "help": {"text": f"hyperrecipe lint --explain {info.code} (docs/lint.md)"},
            "defaultConfiguration": {"level": "error"},
        }
        for info in CODES
    ]
    index = {info.code: position for position, info in enumerate(CODES)}
    results = [
        {
            "ruleId": f.code,
            "ruleIndex": index[f.code],
            "level": "error",
            "message": {"text": f.message},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": _uri(f.path)},
                        "region": {
                            "startLine": f.line,
                            "startColumn": f.column,
                            "endLine": f.end_line,
                            "endColumn": f.end_column,
                        },
                    }
                }
            ],
        }
        for f in findings
    ]
    return {
        "$schema": _SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "hyperrecipe-lint",
                        "version": version,
                        "rules": rules,
                    }
                },
                "columnKind": "unicodeCodePoints",
                "results": results,
            }
        ],
    }


def render(findings: Sequence[Finding], fmt: OutputFormat, *, version: str = "") -> str:
    """The findings in one format, one per line (``json``, ``sarif``: one document), ending in a
    newline.

    * ``text``: ``path:line:col: HR001 forward-assignment message`` (control characters in
      the path and message escaped, so every finding is one line)
    * ``json``: a list of objects with ``path``, ``line``, ``column``, ``end_line``,
      ``end_column``, ``code``, ``name`` and ``message`` (``[]`` when clean)
    * ``github``: ``::error file=…,line=…,col=…,endLine=…,endColumn=…,title=HR001
      forward-assignment::message`` workflow commands, which GitHub Actions turns into
      annotations on the diff
    * ``sarif``: a SARIF 2.1.0 log (``version`` is the tool version it names), for GitHub code
      scanning and other code-scanning services

    End positions are where the reported code ends; the end column is one past its last
    character, as ruff reports it.
    """
    if fmt == "json":
        rows = [
            {"path": f.path, "line": f.line, "column": f.column, "end_line": f.end_line,
             "end_column": f.end_column, "code": f.code, "name": f.name, "message": f.message}
            for f in findings
        ]
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "sarif":
        return json.dumps(_sarif(findings, version), indent=2) + "\n"
    if fmt == "github":
        lines = [
            f"::error file={_github_property(_printable(f.path))},line={f.line},col={f.column},"
            f"endLine={f.end_line},endColumn={f.end_column},"
            f"title={_github_property(f'{f.code} {f.name}')}::"
            f"{_github_data(_printable(f.message))}"
            for f in findings
        ]
    else:
        lines = [f"{_printable(f.path)}:{f.line}:{f.column}: {f.code} {f.name} "
                 f"{_printable(f.message)}" for f in findings]
    return "".join(line + "\n" for line in lines)


def statistics(findings: Sequence[Finding], fmt: OutputFormat = "text") -> str:
    """``--statistics``: one line per code, most frequent first: ``count code name``; with
    ``--format json`` a list of ``{"count", "code", "name"}`` objects in the same order (as
    ruff prints its statistics as JSON)."""
    counts = Counter((f.code, f.name) for f in findings)
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0][0]))
    if fmt == "json":
        rows = [{"count": count, "code": code, "name": name} for (code, name), count in ordered]
        return json.dumps(rows, indent=2) + "\n"
    width = max((len(str(count)) for _, count in ordered), default=1)
    return "".join(f"{count:>{width}}\t{code}\t{name}\n" for (code, name), count in ordered)
