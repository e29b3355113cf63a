"""The README's commands are the ones that run: CI runs the README's full test command, and the
quick tier's marker is registered."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _test_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("Run the tests", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README: a bash block after 'Run the tests'"
    return [line.split("&&")[-1].strip() for line in block.group(1).splitlines()]


def test_ci_runs_the_readme_full_test_command() -> None:
    quick, full = _test_commands()
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert full == "python -m pytest -q"
    assert ci[-1] == full, ".ci/run ends with the README's full test command"
    assert quick == f'{full} -m "not slow"'


def test_the_quick_tier_marker_is_registered() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    assert [m.split(":")[0] for m in markers] == ["slow"]
