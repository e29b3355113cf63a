"""Write the same recipe as YAML and as TOML, and find where a token landed in each."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hyperrecipe import compile_recipe
from hyperrecipe.plan import Plan


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=200)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"TOML cannot hold {v!r}")


def _toml_key(k: Any) -> str:
    if k is None:
        raise TypeError("TOML keys cannot be null")
    k = str(k)
    return k if k and k.replace("_", "a").replace("-", "a").isalnum() else json.dumps(k)


def to_toml(data: dict[str, Any]) -> str:
    """TOML with styles as [styles.X] tables and rules as [[rules]] where the shapes allow it.

    Raises:
        TypeError: a value TOML cannot hold (null).
    """
    lines = []
    styles = data.get("styles")
    style_tables = isinstance(styles, dict) and all(isinstance(v, dict) for v in styles.values())
    arrays = {k: v for k, v in data.items() if k in ("rules", "adapters") and isinstance(v, list)
              and all(isinstance(i, dict) for i in v)}
    for k, v in data.items():
        if k in arrays or (k == "styles" and style_tables):
            continue
        lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    if style_tables:
        assert isinstance(styles, dict)
        for name, body in styles.items():
            lines += ["", f"[styles.{_toml_key(name)}]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in body.items()]
    for key, items in arrays.items():
        for item in items:
            lines += ["", f"[[{key}]]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in item.items()]
    return "\n".join(lines) + "\n"


def locate(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, column) of the nth occurrence of needle."""
    start = -1
    for _ in range(nth + 1):
        start = text.index(needle, start + 1)
    line = text.count("\n", 0, start) + 1
    col = start - (text.rfind("\n", 0, start) + 1) + 1
    return line, col


def write_both(tmp: Path, name: str, data: dict[str, Any]) -> tuple[Path, Path]:
    y = tmp / f"{name}.yaml"
    t = tmp / f"{name}.toml"
    y.write_text(to_yaml(data))
    t.write_text(to_toml(data))
    return y, t


def resolve_only(recipe: Any, model: Any, mesh: Mapping[str, int], **kwargs: Any) -> Plan:
    """``compile_recipe`` without the verification step: the resolver's plan, byte for byte.

    The resolver's tests compile recipes of a rule or two (a fused projection with no boundary
    around it, a tie) to read one decision off the plan; such recipes are not whole plans, and
    ``compile`` verifies whole plans (tests/verify/)."""
    return compile_recipe(recipe, model, mesh, verify=False, **kwargs)
