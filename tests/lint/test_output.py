"""A file name is chosen by whoever named the file: printed, it must not forge finding lines or
send terminal escapes (issue 28). Real files with such names, linted and rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperrecipe.lint.output import render
from hyperrecipe.lint.runner import lint_paths

HIT = "m.forward = f\n"
HOSTILE = "a\nfake.py:1:1: HR001 forged\x1b[2J\u202ex.py"


@pytest.mark.parametrize("fmt", ["text", "github", "json", "sarif"])
def test_a_file_name_with_a_newline_or_escape_prints_as_one_finding(
        fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / HOSTILE).write_text(HIT)
    result = lint_paths(["."])
    assert [f.code for f in result.findings] == ["HR001"]
    out = render(result.findings, fmt)  # type: ignore[arg-type]
    assert "\x1b" not in out and "\u202e" not in out
    if fmt == "text":
        assert out.count("\n") == 1, out
        assert out.startswith("a\\x0afake.py:1:1: HR001 forged\\x1b[2J\\u202ex.py:1:1: HR001 ")
    elif fmt == "github":
        assert out.count("\n") == 1, out
        assert out.startswith("::error file=a\\x0afake.py%3A1%3A1%3A HR001 forged\\x1b[2J"
                              "\\u202ex.py,line=1,")
    else:
        json.loads(out)
