"""hyperrecipe: declarative model-parallel recipes compiled to frozen plans.

This namespace is the trainer API and nothing else: load and compile recipes, load plans, apply
them, and the errors all of that raises. Everything else lives in subpackages and modules, in the
order data flows (``docs/architecture.md``): ``errors`` and ``placement``; ``recipe`` and
``shipped``; ``wrappers`` (the torch-free wrapper registry); ``model_tree`` and
``forward_hazards`` (attentions whose heads cannot be divided, read off a live model for
``suggest`` and ``check`` alike); ``pipeline`` (the torch-free description of pipeline
schedules: placement, order, bubble); ``resolve``;
``plan``; ``collective`` (the collectives a plan stores); ``refs`` (``pkg.mod:attr``
references and which code may be imported) and ``_files`` (reading files someone else named, in
bounded time and memory); ``models`` (what the runtime asks of a model library, below it);
``rewriter`` and ``signature``, with ``process_patches`` (the rewriter's process-wide half:
every patch of torch the package makes, declared in one table and held by reference count); ``runtime``; ``verify`` (one step on fake tensors at compile);
``api`` (the functions this namespace re-exports); ``check`` and ``plan_report``; ``simulate``
(a dry run at real scale) and ``simulate_pipeline`` (its report of a pipelined plan); ``suggest``; ``trainers`` (one module per trainer, above the
runtime); ``lint``; ``cli`` and ``_cli_commands`` (the command line). Names resolve lazily (PEP 562) so that ``hyperrecipe lint``, the recipe loader and
compiling never import the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hyperrecipe.errors import (
    HyperrecipeError,
    LossParallelError,
    MixedParametersError,
    ModelSpecError,
    PlacementMismatchError,
    PlanFormatError,
    PlanMismatchError,
    RecipeError,
    RewriteError,
    UnsupportedTorchError,
)

if TYPE_CHECKING:  # pragma: no cover
    from hyperrecipe.api import compile_recipe, load_plan, load_recipe
    from hyperrecipe.plan import Plan
    from hyperrecipe.api import apply
    from hyperrecipe.runtime import Installation
    from hyperrecipe.runtime import vocab_parallel_cross_entropy

__all__ = [
    "HyperrecipeError",
    "Installation",
    "LossParallelError",
    "MixedParametersError",
    "ModelSpecError",
    "PlacementMismatchError",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "RecipeError",
    "RewriteError",
    "UnsupportedTorchError",
    "apply",
    "compile_recipe",
    "load_plan",
    "load_recipe",
    "vocab_parallel_cross_entropy",
]

__version__ = "0.1.0"

_LAZY = {
    "compile_recipe": "hyperrecipe.api",
    "load_plan": "hyperrecipe.api",
    "load_recipe": "hyperrecipe.api",
    "Plan": "hyperrecipe.plan",
    "apply": "hyperrecipe.api",
    "Installation": "hyperrecipe.runtime",
    "vocab_parallel_cross_entropy": "hyperrecipe.runtime",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'hyperrecipe' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
