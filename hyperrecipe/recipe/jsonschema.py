"""The recipe format as a JSON Schema (draft 2020-12), built from the same field table the
validator uses, so editors can validate and complete recipe files.

The schema checks shape and syntax (keys, types, placement grammar); resolving against a model
checks the rest.
"""

from __future__ import annotations

from typing import Any

from hyperrecipe.recipe.styles import BUILTIN_STYLES
from hyperrecipe.recipe.validate import INNER_WRAPPERS, RULE_FIELD_SPECS, TOP_LEVEL_SPECS

__all__ = ["recipe_json_schema"]

_ONE = r"(replicate|partial(\((sum|avg)\))?|shard\(\s*-?\d+\s*(,\s*chunks\s*=\s*(\d+|\[[\d\s,]*\])\s*)?\))"
_IDENT = r"^[A-Za-z_]\w*$"


def _kind(kind: str) -> dict[str, Any]:
    named = {"$ref": "#/$defs/named_placement"}
    wrapper_ref = {"type": "string", "anyOf": [{"enum": sorted(INNER_WRAPPERS)},
                                               {"pattern": r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"}]}
    table: dict[str, dict[str, Any]] = {
        "pattern": {"type": "string", "minLength": 1},
        "conditions": {"type": "object", "additionalProperties": {
            "oneOf": [{"type": "integer"}, {"type": "string", "pattern": r"^\s*(>=|<=|==|!=|>|<)?\s*\d+\s*$"}]}},
        "style": {"type": "string", "examples": sorted(BUILTIN_STYLES)},
        "param_placements": {"type": "object", "propertyNames": {"pattern": _IDENT},
                             "additionalProperties": named},
        "bool": {"type": "boolean"},
        "layout": {"type": "object", "propertyNames": {"pattern": r"^([A-Za-z_]\w*|\d+)$"},
                   "additionalProperties": named},
        "names": {"type": "array", "items": {"type": "string", "pattern": _IDENT},
                  "uniqueItems": True},
        "head_counts": {"type": "object", "propertyNames": {"pattern": _IDENT},
                        "additionalProperties": {"type": "string"}},
        "reduce_grads": {"type": "object", "propertyNames": {"pattern": _IDENT},
                         "additionalProperties": {"type": "string"}},
        "wrapper": {"anyOf": [wrapper_ref, {"type": "array", "items": wrapper_ref, "minItems": 1,
                                             "uniqueItems": True}]},
        "string": {"type": "string"},
        "version": {"const": 1},
        "mesh_dims": {"type": "array", "items": {"type": "string", "pattern": _IDENT},
                      "uniqueItems": True},
        "unclaimed": {"enum": ["replicate", "error"]},
        "styles": {"type": "object", "additionalProperties": {"$ref": "#/$defs/style"}},
        "rules": {"type": "array", "items": {"$ref": "#/$defs/rule"}},
        "adapters": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["target"],
            "properties": {"target": {"type": "string", "pattern": r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"},
                           "mode": {"enum": ["wrap", "marshal"]},
                           "out_src": named,
                           "within": {"type": "string"}}}},
    }
    return dict(table[kind])


def recipe_json_schema() -> dict[str, Any]:
    """The JSON Schema of recipe format version 1."""
    rule_props = {s.name: {**_kind(s.kind), "description": s.doc} for s in RULE_FIELD_SPECS}
    style_props = {k: v for k, v in rule_props.items() if k not in ("match", "when")}
    style_props["doc"] = {"type": "string", "description": "What the style is for."}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://hyperrecipe.dev/schema/recipe-v1.json",
        "title": "hyperrecipe recipe (version 1)",
        "type": "object",
        "additionalProperties": False,
        "required": [s.name for s in TOP_LEVEL_SPECS if s.required],
        "properties": {s.name: {**_kind(s.kind), "description": s.doc} for s in TOP_LEVEL_SPECS},
        "$defs": {
            "placement": {"type": "string", "pattern": f"^\\s*{_ONE}\\s*$",
                          "description": "replicate | partial | partial(sum|avg) | shard(D) | "
                                         "shard(D, chunks=K) | shard(D, chunks=[S1, ...])"},
            "named_placement": {
                "description": "`replicate`, or a mapping of mesh dim to placement; a mesh dim "
                               "not named is replicate.",
                "oneOf": [{"const": "replicate"},
                          {"type": "object", "propertyNames": {"pattern": _IDENT},
                           "additionalProperties": {"$ref": "#/$defs/placement"}}]},
            "rule": {"type": "object", "additionalProperties": False, "required": ["match"],
                     "properties": rule_props},
            "style": {"type": "object", "additionalProperties": False, "properties": style_props},
        },
    }
