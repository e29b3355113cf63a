"""Recipes: the file format users write, loaded and validated without a model.

What lives here: the schema (attrs classes in ``schema``), YAML/TOML reading with source
positions, bounded against hostile files (``source``), validation of one document
(``validate``), built-in styles (``styles``), ``match`` patterns (``patterns``) and the
non-backtracking automaton they compile to (``automaton``), ``extends`` and shipped recipes
(``loader``), the ``pipeline`` section (``pipeline``) and the JSON Schema export
(``jsonschema``). What does not: anything about a model
or torch — this package must stay importable by the lint, which never imports torch —, where the
shipped files are (:mod:`hyperrecipe.shipped`), the built-in inner wrappers (their names and
declarations are read from the registry in :mod:`hyperrecipe.wrappers`), and importing code a
recipe names (``hyperrecipe.refs`` decides whether that is trusted).
"""

from hyperrecipe.recipe.loader import check_recipe_file, load_recipe, shipped_recipes
from hyperrecipe.recipe.schema import Recipe, Rule, RuleFields, StyleDef
from hyperrecipe.recipe.styles import BUILTIN_STYLES

__all__ = [
    "BUILTIN_STYLES",
    "Recipe",
    "Rule",
    "RuleFields",
    "StyleDef",
    "check_recipe_file",
    "load_recipe",
    "shipped_recipes",
]
