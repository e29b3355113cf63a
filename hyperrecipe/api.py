"""The trainer-facing functions re-exported by ``hyperrecipe``: load, compile (and verify), load
plans, and apply a plan once it is verified."""

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
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.runtime import Installation
    from hyperrecipe.runtime import Mode, ModeName

__all__ = ["apply", "compile_recipe", "load_plan", "load_recipe"]

_VERIFIED_HERE: set[str] = set()
"""Checksums of the plans :func:`apply` verified in this process: once per plan."""


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load and validate a recipe file, or a shipped recipe by name (``"llama"``).

    Raises:
        RecipeError: the file is missing or malformed (file:line:col in the message).
    """
    return _load_recipe(path)


def compile_recipe(recipe_or_path: Recipe | str | os.PathLike[str], model: nn.Module | ModelTree,
                   mesh_shape: Mapping[str, int], *,
                   trust_code: bool | Sequence[str] = False, verify: bool = True,
                   inputs: str | None = None) -> Plan:
    """Compile a recipe for a model and a mesh shape into a frozen plan, verified.

    Verification (:mod:`hyperrecipe.verify`) runs one training step of the plan, in production
    and validate mode, on fake tensors under torch's fake process group (a second or two for
    a small model): a plan that would train wrong in a way shapes and placements show (a
    partial gradient no one reduces, a sharded parameter outside every boundary, a layout
    that does not arrive, a shape production mode cannot run) is refused here, at its recipe
    line, and the plan records that it was verified (``plan.verification``).

    Args:
        recipe_or_path: a loaded :class:`Recipe`, a recipe file, or a shipped recipe's name.
        model: the model (build it on the meta device: only its structure is read), or its
            :class:`ModelTree` snapshot.
        mesh_shape: mesh dim name → size, e.g. ``{"tp": 2}``.
        trust_code: also import the inner wrappers the recipe names (to read their
            declarations) from any module (``True``) or from these module prefixes; without it
            a recipe runs nothing but built-in, already imported and entry-point-declared code
            (docs/security.md).
        verify: run the verification step (default). ``False`` returns the resolved plan
            unverified, at your own risk: :func:`apply` then verifies it first. A
            :class:`ModelTree` cannot run a step, so its plan is returned unverified too.
        inputs: ``pkg.module:make_inputs`` for a model that takes neither token ids nor pixel
            values (``make_inputs(model, batch=, seq=, generator=)`` returning ``(args,
            kwargs)``, as ``check --inputs``).

    Returns:
        The plan; ``plan.save(path)`` writes it.

    Raises:
        RecipeError: the recipe does not fit the model or mesh, names code that is not
            trusted (the message says how to opt in), or the verification step refuses it.
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
        plan = resolve_recipe(recipe, tree, mesh_shape)
        if not verify or isinstance(model, ModelTree):
            return plan
        from hyperrecipe.verify import verify_plan

        return verify_plan(model, plan, inputs=inputs)


def apply(model: nn.Module, plan: Plan, mesh: DeviceMesh, *,
          mode: Mode | ModeName = "production", trust_code: bool | Sequence[str] = False,
          verify: bool = True) -> Installation:
    """Apply a compiled plan to ``model`` on this rank, verifying it first when it carries no
    verification record that holds here (:func:`compile_recipe`'s ``verify=False``, another
    torch or transformers, a plan from an older hyperrecipe): once per plan in a process.

    Args and Returns as :func:`hyperrecipe.runtime.apply`, and:
        verify: ``False`` skips that verification, at your own risk.

    Raises:
        RecipeError: the verification step refuses the plan (on every rank alike: the step
            is the same everywhere), before the model is touched.
        Everything :func:`hyperrecipe.runtime.apply` raises.
    """
    from hyperrecipe.runtime import apply as install_plan

    if verify and _fits(model, plan, mesh) and plan.checksum not in _VERIFIED_HERE:
        import torch.distributed as dist

        from hyperrecipe.verify import needs_verification, verify_plan

        if needs_verification(plan):
            with trusting(trust_code):
                verify_plan(model, plan, mesh=mesh if dist.is_initialized() else None)
        _VERIFIED_HERE.add(plan.checksum)
    return install_plan(model, plan, mesh, mode=mode, trust_code=trust_code)


def _fits(model: object, plan: object, mesh: object) -> bool:
    """Whether verification can run for these arguments: a model of the plan's structure and
    a mesh of its shape. Anything else is refused by the runtime's ``apply``, with its own
    message (a wrong model is no finding about the recipe)."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    if not (isinstance(model, nn.Module) and isinstance(plan, Plan)
            and isinstance(mesh, DeviceMesh)) or plan.pipeline is not None:
        return False  # a pipelined plan: apply refuses it, naming build_pipeline
    names = tuple(mesh.mesh_dim_names or ())
    shape = {n: mesh.size(i) for i, n in enumerate(names)}
    return shape == plan.mesh_shape and snapshot(model).digest() == plan.model_digest


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by ``hyperrecipe compile -o`` or :meth:`Plan.save`.

    Raises:
        PlanFormatError: not a plan, another format version, or a fingerprint mismatch.
    """
    return Plan.load(path)
