"""Suggested rules written as a recipe file, with a comment above each rule saying where it came
from. Values are written in YAML's flow style, as the shipped recipes are; strings that YAML
would not read back as themselves are double-quoted (JSON's quoting is valid YAML)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from hyperrecipe.suggest.rules import SuggestedRule

__all__ = ["merge_rules", "render_recipe", "write_recipe"]

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.*{},]*|shard\(-?\d+\)|-?\d+")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and "{" not in text and text not in ("true", "false", "null"):
        return text
    return json.dumps(text)


def _flow(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_scalar(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _scalar(value)


def _match(pattern: str) -> str:
    return json.dumps(pattern) if "{" in pattern or pattern.startswith("*") else pattern


def _refine(fields: dict[str, Any], more: Sequence[tuple[str, Any]]) -> None:
    for key, value in more:
        old = fields.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            fields[key] = {**old, **value}
        else:
            fields[key] = value


def merge_rules(rules: Sequence[SuggestedRule]
                ) -> list[tuple[SuggestedRule, tuple[SuggestedRule, ...]]]:
    """The rules as written: a rule whose ``match`` an earlier rule already has refines that
    rule (mappings key by key) instead of being a rule of its own — a recipe refuses two rules
    deciding one field. Each written rule comes with the suggested rules it was made of."""
    out: list[tuple[SuggestedRule, tuple[SuggestedRule, ...]]] = []
    index: dict[str, int] = {}
    for rule in rules:
        at = index.get(rule.match)
        if at is None:
            index[rule.match] = len(out)
            out.append((rule, (rule,)))
            continue
        written, parts = out[at]
        fields = dict(written.fields)
        _refine(fields, rule.fields)
        out[at] = (attrs.evolve(written, fields=tuple(fields.items()),
                                sources=written.sources + rule.sources), (*parts, rule))
    return out


def render_recipe(name: str, mesh: Sequence[str], rules: Sequence[SuggestedRule], *,
                  header: Sequence[str], description: str,
                  pipeline: Mapping[str, Any] | None = None,
                  pipeline_sources: Sequence[str] = ()) -> str:
    """The recipe file's text.

    Args:
        name: the recipe's name.
        mesh: the mesh dim names.
        rules: the rules, in order.
        header: comment lines for the top of the file (without ``#``).
        description: the recipe's ``description``.
        pipeline: the ``pipeline`` section's keys, in order (none: no section).
        pipeline_sources: comment lines above the section (where its ``layers`` came from).
    """
    lines = ["# yaml-language-server: $schema=recipe.schema.json"]
    lines += [f"# {h}".rstrip() for h in header]
    lines += [f"recipe: {name}", "version: 1", f"mesh: [{', '.join(mesh)}]",
              f"description: {json.dumps(description)}", ""]
    if pipeline is not None:
        lines += [f"# {source}" for source in pipeline_sources]
        lines.append("pipeline:")
        lines += [f"  {key}: {_flow(value)}" for key, value in pipeline.items()]
        lines.append("")
    if not rules:
        lines.append("rules: []")
        return "\n".join(lines) + "\n"
    lines.append("rules:")
    for rule, _parts in merge_rules(rules):
        for source in rule.sources:
            lines.append(f"  # {source}")
        lines.append(f"  - match: {_match(rule.match)}")
        for key, value in rule.fields:
            lines.append(f"    {key}: {_flow(value)}")
        lines.append("")
    return "\n".join(lines)


def write_recipe(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file in the same folder,
    flushed and fsynced, renamed into place (a crash leaves the previous file intact)."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".suggest-", suffix=".yaml", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
