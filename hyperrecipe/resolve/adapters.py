"""Stage 6: the recipe's method adapters (``adapters:``), one per target.

Targets are not imported: resolving stays free of import side effects, and the adapted package
need not be installed where the plan is compiled. A target whose module the model already
imported is checked, so a misspelt class or method of the model's own code fails at compile
time with its recipe line; ``apply`` finds the rest.
"""

from __future__ import annotations

import sys
from typing import Any

from hyperrecipe.errors import RecipeError, SourceSpan, did_you_mean
from hyperrecipe.plan import AdapterPlan, Provenance
from hyperrecipe.model_tree import ModelTree
from hyperrecipe.recipe.patterns import compile_pattern, generalize_fqn
from hyperrecipe.recipe.schema import AdapterSpec, Recipe

__all__ = ["plan_adapters"]


def plan_adapters(recipe: Recipe, tree: ModelTree) -> tuple[AdapterPlan, ...]:
    """The recipe's adapters, one per target: a recipe that ``extends`` another may re-declare
    a base's adapter (its own entry wins, as its rules refine the base's); one file may not
    declare a target twice (the loader refuses it).

    Targets are not imported here: resolving stays free of import side effects, and the
    adapted package need not be installed where the plan is compiled. A target whose module
    the model already imported is checked, though, so a misspelt class or method of the model's
    own code fails at compile time with its recipe line; the rest are found by ``apply``.

    Raises:
        RecipeError: a target's module is imported and lacks the class or the method.
    """
    chosen: dict[str, AdapterPlan] = {}
    index_in_file: dict[str, int] = {}
    for a in recipe.adapters:
        i = index_in_file.get(a.file, 0)
        index_in_file[a.file] = i + 1
        reason = f"adapter {a.mode}" + (f" (output placement {a.out_src})" if a.out_src else "")
        earlier = chosen.get(a.target)
        if earlier is not None:
            reason += f"; overrides {earlier.provenance.file}:{earlier.provenance.line}"
        plan = AdapterPlan(target=a.target, mode=a.mode, out_src=a.out_src, provenance=Provenance(
            file=a.file, line=a.line, column=a.column, rule_index=-1, reason=reason),
            within=_adapter_within(a, tree, f"$.adapters[{i}].within"))
        _check_imported_target(plan, f"$.adapters[{i}].target")
        chosen.pop(a.target, None)
        chosen[a.target] = plan
    return tuple(chosen.values())


def _adapter_within(a: AdapterSpec, tree: ModelTree, path: str) -> tuple[str, ...]:
    """The FQNs a function adapter's ``within`` pattern matches (none for a method adapter).

    Raises:
        RecipeError: the pattern matches no module; the nearest FQNs are listed.
    """
    if a.within is None:
        return ()
    rx = compile_pattern(a.within)
    found = tuple(m.fqn for m in tree.modules if rx.fullmatch(m.fqn))
    if not found:
        near = did_you_mean(a.within, sorted({generalize_fqn(m.fqn) for m in tree.modules}))
        raise RecipeError(f"adapter {a.target!r}: within {a.within!r} matches no module of the "
                          f"model{near}", span=SourceSpan(path=a.file, line=a.line,
                                                          column=a.column), path=path)
    return found


def _check_imported_target(adapter: AdapterPlan, path: str) -> None:
    module = sys.modules.get(adapter.module_name)
    if module is None:
        return
    prov = adapter.provenance
    span = SourceSpan(path=prov.file, line=prov.line, column=prov.column)
    owner: Any = module
    walked = adapter.module_name
    for part in (*adapter.class_path, adapter.method_name):
        if not hasattr(owner, part):
            names = [n for n in dir(owner) if not n.startswith("_")]
            raise RecipeError(f"adapter target {adapter.target!r}: {walked} has no attribute "
                              f"{part!r}{did_you_mean(part, names)}", span=span, path=path)
        owner = getattr(owner, part)
        walked = f"{walked}{':' if walked == adapter.module_name else '.'}{part}"
        if part != adapter.method_name and not isinstance(owner, type):
            raise RecipeError(f"adapter target {adapter.target!r}: {walked} is not a class",
                              span=span, path=path)
    if not callable(owner):
        raise RecipeError(f"adapter target {adapter.target!r} is not a method", span=span,
                          path=path)
