"""Generate ``docs/recipe-reference.md`` from the tables the validator itself uses.

Sources, so the reference cannot say anything the code does not do:

- top-level and rule fields: ``TOP_LEVEL_SPECS`` and ``RULE_FIELD_SPECS``
  (``hyperrecipe/recipe/validate.py``); style keys from the JSON Schema export;
- match patterns: the docstring of ``hyperrecipe/recipe/patterns.py``;
- placements: the grammar in the docstring of ``hyperrecipe/placement.py`` and its
  ``PLACEMENT_FORMS``;
- built-in styles: ``BUILTIN_STYLES`` (``hyperrecipe/recipe/styles.py``), each rendered as the
  explicit rule fields it expands to;
- inner wrappers: ``INNER_WRAPPERS``.

Usage::

    python tools/gen_docs.py            # write docs/recipe-reference.md
    python tools/gen_docs.py --check    # exit 1 if the file on disk differs from what it would write
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from hyperrecipe import placement as placement_module
from hyperrecipe.placement import PLACEMENT_FORMS, NamedPlacement
from hyperrecipe.recipe import patterns as patterns_module
from hyperrecipe.recipe.jsonschema import recipe_json_schema
from hyperrecipe.recipe.pipeline import PIPELINE_FIELD_SPECS
from hyperrecipe.recipe.schema import MAPPING_FIELDS, RULE_FIELD_NAMES, RuleFields, StyleDef
from hyperrecipe.recipe.styles import BUILTIN_STYLES
from hyperrecipe.recipe.validate import (
    ADAPTER_KEYS,
    INNER_WRAPPERS,
    RULE_FIELD_SPECS,
    TOP_LEVEL_SPECS,
    FieldSpec,
)

__all__ = ["REFERENCE", "main", "render_reference", "render_style_fields"]

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "recipe-reference.md"

KIND_SYNTAX: dict[str, str] = {
    "pipeline": "mapping (see [Pipeline section](#pipeline-section))",
    "pattern": "string: a module FQN pattern (see [Match patterns](#match-patterns))",
    "conditions": 'mapping: mesh dim → `">N"`, `">=N"`, `"<N"`, `"<=N"`, `"==N"`, `"!=N"`, or an '
                  "integer `N` (same as `==N`)",
    "style": "string: a built-in style or one of the recipe's `styles`",
    "param_placements": "mapping: direct parameter name → [named placement](#placements)",
    "bool": "`true` or `false`",
    "layout": "mapping: argument / output name, or position `0`, `1`, … → "
              "[named placement](#placements)",
    "grad_layout": "mapping: argument / output name, or position → `replicate`, or a mapping "
                   "of mesh dim → `partial` or `replicate`",
    "names": "list of identifiers, no repeats",
    "head_counts": "mapping: integer attribute of the module → mesh dim name",
    "reduce_grads": "mapping: direct parameter name → mesh dim name",
    "wrapper": "string: an [inner wrapper](#inner-wrappers) name or `pkg.mod:callable`, or a list of them (fallback chain)",
    "string": "string",
    "version": "the integer `1`",
    "mesh_dims": "list of identifiers, no repeats",
    "unclaimed": "`replicate` or `error`",
    "styles": "mapping: style name → style body (see [Styles](#recipe-styles))",
    "rules": "list of rules (see [Rule fields](#rule-fields))",
    "adapters": f"list of mappings with keys {', '.join(f'`{k}`' for k in ADAPTER_KEYS)}",
}
"""How each field kind is written; every kind in the field tables must have an entry."""


def _rst_to_md(text: str) -> str:
    """The little reStructuredText our docstrings use, as Markdown."""
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _paragraphs(doc: str) -> list[str]:
    return [" ".join(line.strip() for line in p.splitlines()) for p in doc.strip().split("\n\n")]


def _placement_grammar() -> str:
    doc = placement_module.__doc__ or ""
    head, sep, rest = doc.partition("Grammar (one mesh dim)::")
    if not sep:
        msg = "hyperrecipe/placement.py's docstring no longer has a 'Grammar (one mesh dim)::' block"
        raise SystemExit(msg)
    block, _, after = rest.strip("\n").partition("\n\n")
    lines = [line[4:] if line.startswith("    ") else line for line in block.splitlines()]
    out = ["One mesh dim:", "", "```text", *lines, "```", ""]
    out += [_rst_to_md(p) for p in _paragraphs(after)]
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _field_table(specs: Sequence[FieldSpec]) -> list[str]:
    rows = ["| field | written as | required | meaning |", "|---|---|---|---|"]
    for s in specs:
        if s.kind not in KIND_SYNTAX:
            msg = f"tools/gen_docs.py: KIND_SYNTAX has no entry for field kind {s.kind!r} ({s.name})"
            raise SystemExit(msg)
        rows.append(f"| `{s.name}` | {_cell(KIND_SYNTAX[s.kind])} | {'yes' if s.required else ''} "
                    f"| {_cell(s.doc)} |")
    return rows


def _flow(value: object) -> str:
    """A placement in YAML flow syntax: one with a comma (``shard(0, chunks=3)``) quoted, as a
    recipe must write it inside ``{...}``."""
    if not isinstance(value, NamedPlacement) or value.is_replicate:
        return str(value)
    parts = (f'"{q}"' if "," in str(q) else str(q) for _, q in value.dims)
    return "{" + ", ".join(f"{k}: {q}" for (k, _), q in zip(value.dims, parts, strict=True)) + "}"


def _value(name: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if name in MAPPING_FIELDS:
        assert isinstance(value, tuple)
        items = ", ".join(f"{k}: {_flow(v)}" for k, v in value)
        return "{" + items + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, NamedPlacement):
        return str(value)
    return str(value)


def render_style_fields(fields: RuleFields) -> str:
    """The explicit rule fields a style expands to, one ``field: value`` line each, in recipe
    syntax (a block that parses as YAML rule fields)."""
    lines = [f"{name}: {_value(name, getattr(fields, name))}" for name in RULE_FIELD_NAMES
             if getattr(fields, name) is not None]
    return "\n".join(lines)


def _style_section(style: StyleDef) -> list[str]:
    return [f"### `{style.name}`", "", _rst_to_md(style.doc), "", "Expands to:", "", "```yaml",
            render_style_fields(style.fields), "```", ""]


def render_reference() -> str:
    """The full text of ``docs/recipe-reference.md``."""
    schema = recipe_json_schema()
    style_keys = list(schema["$defs"]["style"]["properties"])
    patterns_doc = _paragraphs(patterns_module.__doc__ or "")[1:]
    out: list[str] = [
        "# Recipe format reference",
        "",
        "<!-- GENERATED by tools/gen_docs.py from the validator's field tables; do not edit. "
        "Regenerate with `python tools/gen_docs.py`; CI runs `python tools/gen_docs.py --check`. -->",
        "",
        "Recipe format version 1. This page is generated from the tables the validator, the JSON "
        "Schema (`hyperrecipe schema`) and the resolver use, so it lists exactly what is "
        "accepted. The guide to using these fields is [recipes.md](recipes.md); what a compiled "
        "plan holds is [plan.md](plan.md).",
        "",
        "## Top-level fields",
        "",
        *_field_table(TOP_LEVEL_SPECS),
        "",
        "## Pipeline section",
        "",
        "The keys of `pipeline`. The resolver decides which modules each stage owns and records "
        "it in the plan (`compile --explain` prints it); the schedules and their bubbles are in "
        "[pipeline.md](pipeline.md).",
        "",
        "| field | required | meaning |",
        "|---|---|---|",
        *[f"| `{name}` | {'yes' if required else ''} | {_cell(doc)} |"
          for name, _, required, doc in PIPELINE_FIELD_SPECS],
        "",
        "## Rule fields",
        "",
        "Each entry of `rules`. Every field but `match` is optional; a field a rule does not write "
        "says nothing (it does not reset what another rule or a style decided).",
        "",
        *_field_table(RULE_FIELD_SPECS),
        "",
        "## Recipe styles",
        "",
        "Each entry of `styles` is a style body: a name for a bundle of rule fields, used as "
        "`style: NAME` by rules and by other styles. Its keys: "
        + ", ".join(f"`{k}`" for k in style_keys) + ". A style body may name a base `style`; "
        "its own fields refine the base's as a rule's do. Built-in style names cannot be "
        "redefined.",
        "",
        "## Match patterns",
        "",
        *[_rst_to_md(p) for p in patterns_doc],
        "",
        "## Placements",
        "",
        _placement_grammar(),
        "",
        "All forms: " + ", ".join(f"`{f}`" for f in PLACEMENT_FORMS) + ".",
        "",
        "## Built-in styles",
        "",
        "Each built-in style is nothing but the explicit rule fields shown under it, rendered from "
        "`BUILTIN_STYLES`, the table the validator expands `style:` from; a rule's own fields "
        "refine them (mappings merge key by key). Built-ins speak of the mesh dim `tp`; write a "
        "recipe `styles:` entry for the same layout on another dim. Layout keys are positions: "
        "`0` is the first positional argument of the forward, or its only / first output.",
        "",
    ]
    for style in BUILTIN_STYLES.values():
        out += _style_section(style)
    out += [
        "## Inner wrappers",
        "",
        "Registry names accepted by `inner_wrapper` (besides `pkg.mod:callable`):",
        "",
        "| name | what it does |",
        "|---|---|",
        *[f"| `{name}` | {_cell(doc)} |" for name, doc in sorted(INNER_WRAPPERS.items())],
    ]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file differs from what would be generated")
    parser.add_argument("--output", type=Path, default=REFERENCE, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    text = render_reference()
    path: Path = ns.output
    if ns.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                    fromfile=f"{path} (on disk)", tofile=f"{path} (generated)")
        sys.stdout.writelines(diff)
        print(f"{path} is out of date; regenerate it with: python tools/gen_docs.py",
              file=sys.stderr)
        return 1
    path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
