"""docs/architecture.md's feature table names only what exists: every path, every doc anchor,
every plan field; and its rooms table names the runtime's rooms as they are on disk.

A newcomer follows the table from a recipe feature to the code, so a stale row sends them to a
file that moved. The table is parsed from the doc itself: a cell is a comma-separated list of
backticked names (paths relative to the repository root, ``file.md#anchor`` for a doc section,
``Class.field`` for a plan field).
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

import hyperrecipe.plan

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
FEATURES = "## Where each recipe feature lives"
COLUMNS = ("feature", "resolve", "plan field", "runtime", "tests", "docs")
# The features issue 24 asked the table to cover (its first column starts with each of these).
REQUIRED = ("boundary", "params", "chunked shard", "`vocab_parallel`", "inner wrappers", "adapters",
            "`local_region`", "experts", "context parallel", "loss on vocab shards",
            "`reduce_grads`", "gradient buckets", "`head_counts`", "router loss",
            "torch's `clip_grad_norm_`", "DCP checkpoints", "trainers", "model libraries")


def _table(heading: str) -> list[list[str]]:
    """The rows (cells, header and rule excluded) of the first table after ``heading``."""
    text = DOC.read_text()
    assert heading in text, f"docs/architecture.md lost its section {heading!r}"
    rows = []
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows[2:]]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


FEATURE_ROWS = _table(FEATURES)


def test_the_feature_table_covers_every_feature_the_issue_names() -> None:
    assert all(len(row) == len(COLUMNS) for row in FEATURE_ROWS), FEATURE_ROWS
    firsts = [row[0] for row in FEATURE_ROWS]
    missing = [name for name in REQUIRED if not any(f.startswith(name) for f in firsts)]
    assert not missing, f"docs/architecture.md's feature table has no row for {missing}"


@pytest.mark.parametrize("row", FEATURE_ROWS, ids=[row[0] for row in FEATURE_ROWS])
def test_every_path_anchor_and_plan_field_of_a_feature_row_exists(row: list[str]) -> None:
    feature, resolve, plan_fields, runtime, tests, docs = row
    folders = {"resolve": (resolve, "hyperrecipe/"),
               "runtime": (runtime, ("hyperrecipe/runtime/", "hyperrecipe/trainers/",
                                     "hyperrecipe/models/")),
               "tests": (tests, "tests/"), "docs": (docs, "docs/")}
    for column, (cell, folder) in folders.items():
        names = _names(cell)
        assert names, f"{feature}: the {column} column is empty"
        for name in names:
            path, _, anchor = name.partition("#")
            assert path.startswith(folder), f"{feature}: {name} is not under {folder}"
            assert (REPO / path).is_file(), f"{feature}: {path} does not exist"
            if anchor:
                assert anchor in _anchors(REPO / path), f"{feature}: {path} has no #{anchor}"
    fields = _names(plan_fields)
    assert fields, f"{feature}: the plan field column is empty"
    for name in fields:
        cls_name, _, field = name.partition(".")
        cls = getattr(hyperrecipe.plan, cls_name, None)
        assert cls is not None and attrs.has(cls), f"{feature}: no plan class {cls_name}"
        assert field in attrs.fields_dict(cls), f"{feature}: {cls_name} has no field {field!r}"


def test_the_rooms_table_names_the_runtime_rooms_on_disk() -> None:
    rows = _table("## 8. Runtime")
    named = {name.rstrip("/") for row in rows for name in _names(row[0]) if name.endswith("/")}
    runtime = REPO / "hyperrecipe" / "runtime"
    on_disk = {p.parent.name for p in runtime.glob("*/__init__.py")}
    assert named == on_disk
    top = {name for row in rows for name in _names(row[0]) if name.endswith(".py")}
    assert top and all((runtime / name).is_file() for name in top), top
