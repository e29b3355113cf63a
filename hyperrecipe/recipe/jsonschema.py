"""The recipe format as a JSON Schema, built from the same field table the validator uses, so
editors can validate and complete recipe files (docs/editor.md).

The schema is draft-07 because that is what yaml-language-server (VS Code's YAML extension,
Neovim's yamlls) validates instances with; it uses nothing later drafts added. ``$defs`` are
reached by JSON pointer, which draft-07 validators resolve like ``definitions``.

The schema checks shape and syntax (keys, types, placement grammar, built-in style names where
the file can only use built-ins); ``hyperrecipe lint`` and resolving against a model check the
rest. Two things JSON Schema cannot say, because a value would have to be compared with another
part of the same document: that a named placement's mesh dims are among the recipe's ``mesh``,
and that a style name is one the file (or what it ``extends``) defines. ``hyperrecipe lint``
reports both with their line.
"""

from __future__ import annotations

from typing import Any

from hyperrecipe.recipe.pipeline import pipeline_json_schema
from hyperrecipe.recipe.styles import BUILTIN_STYLES
from hyperrecipe.recipe.validate import INNER_WRAPPERS, RULE_FIELD_SPECS, TOP_LEVEL_SPECS

__all__ = ["SCHEMA_ID", "recipe_json_schema"]

SCHEMA_ID = "urn:hyperrecipe:recipe-schema:v1"
"""The schema's ``$id``: a URN, because no address serves the schema; editors are given the file
(``recipes/recipe.schema.json`` or the output of ``hyperrecipe schema``) by path."""

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
        "style": {"type": "string", "pattern": _IDENT, "examples": sorted(BUILTIN_STYLES)},
        "param_placements": {"type": "object", "propertyNames": {"pattern": _IDENT},
                             "additionalProperties": named},
        "bool": {"type": "boolean"},
        "layout": {"type": "object", "propertyNames": {"pattern": r"^([A-Za-z_]\w*|\d+)$"},
                   "additionalProperties": named},
        "grad_layout": {"type": "object", "propertyNames": {"pattern": r"^([A-Za-z_]\w*|\d+)$"},
                        "additionalProperties": {"oneOf": [
                            {"const": "replicate"},
                            {"type": "object", "propertyNames": {"pattern": _IDENT},
                             "additionalProperties": {"enum": ["replicate", "partial",
                                                               "partial(sum)"]}}]}},
        "names": {"type": "array", "items": {"type": "string", "pattern": _IDENT},
                  "uniqueItems": True},
        "head_counts": {"type": "object",
                        "propertyNames": {"pattern": r"^(config\.)?[A-Za-z_]\w*$"},
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
        "pipeline": pipeline_json_schema(),
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
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": SCHEMA_ID,
        "title": "hyperrecipe recipe (version 1)",
        "$comment": ("Generated by `hyperrecipe schema`; recipes/recipe.schema.json is a copy. "
                     "The $id is a name, not an address: point an editor at the file "
                     "(docs/editor.md)."),
        "type": "object",
        "additionalProperties": False,
        "required": [s.name for s in TOP_LEVEL_SPECS if s.required],
        "properties": {s.name: {**_kind(s.kind), "description": s.doc} for s in TOP_LEVEL_SPECS},
        # With no `styles:` of its own and nothing it `extends`, a file can only name built-in
        # styles: there the schema lists them, so a typo (`colwse`) is an error in the editor.
        "if": {"not": {"anyOf": [{"required": ["styles"]}, {"required": ["extends"]}]}},
        "then": {"properties": {"rules": {"items": {"properties": {
            "style": {"enum": sorted(BUILTIN_STYLES),
                      "description": "A built-in style (this file defines no styles and extends "
                                     "no recipe)."}}}}}},
        "$defs": {
            "placement": {"type": "string", "pattern": f"^\\s*{_ONE}\\s*$",
                          "description": "replicate | partial | partial(sum|avg) | shard(D) | "
                                         "shard(D, chunks=K) | shard(D, chunks=[S1, ...])",
                          # read by VS Code's and yaml-language-server's validator, ignored by
                          # others: the pattern itself is no message for a user
                          "patternErrorMessage": "not a placement: expected replicate, partial, "
                                                 "partial(sum|avg), shard(D), shard(D, chunks=K) "
                                                 "or shard(D, chunks=[S1, ...])"},
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
