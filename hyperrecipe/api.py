"""The trainer-facing functions re-exported by ``hyperrecipe``: load, compile, load plans."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hyperrecipe.errors import UsageError
from hyperrecipe.model_tree import ModelTree, snapshot
from hyperrecipe.plan import Plan
from hyperrecipe.recipe import Recipe
from hyperrecipe.recipe import load_recipe as _load_recipe
from hyperrecipe.refs import trusting
from hyperrecipe.resolve import resolve_recipe

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = ["compile_recipe", "load_plan", "load_recipe"]


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load and validate a recipe file, or a shipped recipe by name (``"llama"``).

    Raises:
        RecipeError: the file is missing or malformed (file:line:col in the message).
    """
    return _load_recipe(path)


def compile_recipe(recipe_or_path: Recipe | str | os.PathLike[str], model: nn.Module | ModelTree,
                   mesh_shape: Mapping[str, int], *,
                   trust_code: bool | Sequence[str] = False) -> Plan:
    """Compile a recipe for a model and a mesh shape into a frozen plan.

    Args:
        recipe_or_path: a loaded :class:`Recipe`, a recipe file, or a shipped recipe's name.
        model: the model (build it on the meta device: only its structure is read), or its
            :class:`ModelTree` snapshot.
        mesh_shape: mesh dim name → size, e.g. ``{"tp": 2}``.
        trust_code: also import the inner wrappers the recipe names (to read their
            declarations) from any module (``True``) or from these module prefixes; without it
            a recipe runs nothing but built-in, already imported and entry-point-declared code
            (docs/security.md).

    Returns:
        The plan; ``plan.save(path)`` writes it.

    Raises:
        RecipeError: the recipe does not fit the model or mesh, or names code that is not
            trusted (the message says how to opt in).
        UsageError: an argument of the wrong type (a ``TypeError`` too).

    Example::

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        plan = hyperrecipe.compile_recipe("recipes/llama.yaml", model, {"tp": 2})
    """
    from torch import nn

    recipe = (recipe_or_path if isinstance(recipe_or_path, Recipe)
              else _load_recipe(recipe_or_path))
    given: tuple[object, object] = (model, mesh_shape)  # typed, but callers may be untyped
    if not isinstance(given[0], (nn.Module, ModelTree)):
        msg = (f"compile_recipe: model must be an nn.Module (built on the meta device) or its "
               f"ModelTree, not {type(model).__name__}")
        raise UsageError(msg)
    if not isinstance(given[1], Mapping):
        msg = (f"compile_recipe: mesh_shape must be a mapping of mesh dim name to size, e.g. "
               f"{{'tp': 2}}, not {type(mesh_shape).__name__}")
        raise UsageError(msg)
    prefixes = isinstance(trust_code, Sequence) and all(isinstance(m, str) for m in trust_code)
    if not (isinstance(trust_code, bool) or prefixes):
        msg = (f"compile_recipe: trust_code must be True, False or module prefixes (a str or a "
               f"list of str), "
               f"not {str(trust_code)[:60]!r}")
        raise UsageError(msg)
    tree = model if isinstance(model, ModelTree) else snapshot(model)
    with trusting(trust_code):
        return resolve_recipe(recipe, tree, mesh_shape)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by ``hyperrecipe compile -o`` or :meth:`Plan.save`.

    Raises:
        PlanFormatError: not a plan, another format version, or a fingerprint mismatch.
    """
    return Plan.load(path)
