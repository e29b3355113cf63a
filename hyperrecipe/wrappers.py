"""Inner wrappers: named, declared replacements for a boundary module's inner computation.

A boundary converts its inputs and outputs between layouts; an *inner wrapper* replaces what runs
in between with code that knows the parallel layout: context-parallel attention that all-gathers
K/V along the sequence, Ulysses' all-to-all between heads and sequence, a user's own kernel.

An inner wrapper is a **factory** decorated with :func:`inner_wrapper`. The decorator declares,
as data the resolver can read without running anything:

- ``hook``: what is replaced. ``"attention"``: the attention function a transformers attention
  module looks up by ``config._attn_implementation`` (the wrapper is called with that original
  function and the module's query/key/value); ``"forward"``: the boundary module's own compute.
- ``mesh_dims``: the mesh dims whose process groups the wrapper receives (``("cp",)``); a recipe
  naming it on a mesh without them is refused at compile time.
- ``requires``: :class:`Requirement` checks run at install time (a backend, a device, an
  installed package, a property of the module). An unmet requirement makes the wrapper
  *ineligible*; a recipe may give a fallback chain (``inner_wrapper: [ulysses, cp_allgather_kv]``)
  of which the first eligible wrapper that installs is used.
- ``inner_out_src``: the layout of what the callable returns, by output position, over the
  wrapper's own mesh dims (``{0: {"cp": "shard(1)"}}``). It is the default of the recipe field of
  the same name; the resolver refuses to use it where the boundary is also sharded on a dim the
  declaration does not name (heads over ``tp``, say), since the wrapper cannot know that layout.

At install time the factory is called once per module with a :class:`WrapperContext` (the
module, its process groups, the mode) and returns the callable used on every call; all
decisions are made there, none per call. The callable always computes on **local tensors**: in
validate mode the runtime unwraps DTensor arguments before the call and wraps the results with
the recipe's ``inner_out_src``, so the same code runs in both modes.

Example::

    from hyperrecipe.wrappers import inner_wrapper, requires_package

    @inner_wrapper(hook="attention", mesh_dims=("cp",), requires=(requires_package("flash_attn"),))
    def ring_flash(ctx):
        group = ctx.group("cp")
        def attention(original, module, query, key, value, attention_mask, **kwargs):
            ...  # local tensors in, local (output, weights) out
        return attention

Recipes name it ``inner_wrapper: mypkg.attn:ring_flash``.

This module is the wrapper *registry*, below both the resolver and the runtime, and imports no
torch: the built-in wrappers are declared here as data (:data:`BUILTIN_WRAPPERS`), so compiling
a recipe that names one reads its declaration (:func:`declared_wrapper`) and imports nothing;
their factories live in the runtime and are imported only by ``apply`` (:func:`load_wrapper`).
A custom ``pkg.mod:factory`` reference is imported at compile time to read its declaration.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import attrs

from hyperrecipe.errors import PlanMismatchError, WrapperDeclarationError, WrapperError
from hyperrecipe.placement import NamedPlacement, PlacementSyntaxError, parse_named_placement
from hyperrecipe.refs import RefError, resolve_ref

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "BUILTIN_WRAPPERS",
    "Hook",
    "WrapperDeclaration",
    "WrapperDeclarationError",
    "WrapperError",
    "builtin_wrapper",
    "declared_wrapper",
    "Requirement",
    "WrapperContext",
    "WrapperSpec",
    "inner_wrapper",
    "load_wrapper",
    "requires_backend",
    "requires_device",
    "requires_package",
    "requirement",
]

Hook = Literal["attention", "forward"]

@attrs.frozen(kw_only=True)
class Requirement:
    """Something a wrapper needs at install time.

    ``check(ctx)`` returns ``None`` when the need is met, else the reason it is not (shown in
    ``TrainingState.status()`` and in the error when no wrapper of a chain is eligible).
    """

    what: str
    check: Callable[[WrapperContext], str | None] = attrs.field(eq=False)


def requirement(what: str) -> Callable[[Callable[[WrapperContext], str | None]], Requirement]:
    """Decorator form: ``@requirement("divisible kv heads") def check(ctx): ...``."""

    def make(check: Callable[[WrapperContext], str | None]) -> Requirement:
        return Requirement(what=what, check=check)

    return make


def requires_backend(*names: str) -> Requirement:
    """The process groups of the wrapper's mesh dims use one of ``names`` (``"nccl"``), alone
    or as one of several per-device backends (``"cpu:gloo,cuda:nccl"``)."""

    def check(ctx: WrapperContext) -> str | None:
        found = ctx.backend()
        # a group may name one backend per device: "cpu:gloo,cuda:nccl"
        parts = {part.rsplit(":", 1)[-1].strip() for part in found.split(",")}
        return None if parts & set(names) else f"backend is {found}, needs {' or '.join(names)}"

    return Requirement(what=f"backend {'|'.join(names)}", check=check)


def requires_device(device_type: str) -> Requirement:
    """The mesh lives on ``device_type`` (``"cuda"``)."""

    def check(ctx: WrapperContext) -> str | None:
        found = ctx.mesh.device_type
        return None if found == device_type else f"mesh is on {found}, needs {device_type}"

    return Requirement(what=f"device {device_type}", check=check)


def requires_package(name: str) -> Requirement:
    """Package ``name`` is importable (a fused kernel's package, such as ``flash_attn``).

    A dotted ``name`` is looked up the way ``import`` would: its parent packages are imported
    (``find_spec`` must, to read their ``__path__``), so a missing or broken parent is reported
    as the requirement failing, not as an exception out of the capability chain.
    """

    def check(ctx: WrapperContext) -> str | None:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError) as exc:  # a missing parent package, or a bad name
            return f"{name} is not installed ({type(exc).__name__}: {exc})"
        return None if found else f"{name} is not installed"

    return Requirement(what=f"package {name}", check=check)


@attrs.frozen(kw_only=True)
class WrapperDeclaration:
    """What the resolver knows about an inner wrapper: data only, nothing to run.

    ``factory`` is the ``pkg.mod:attr`` of the factory, imported only by ``apply``.
    """

    name: str
    hook: Hook
    mesh_dims: tuple[str, ...]
    inner_out_src: tuple[tuple[int, NamedPlacement], ...] = ()
    factory: str
    summary: str = ""
    #: parameters (relative to the boundary module) the wrapper computes with, and the
    #: placement each must have: a wrapper that reads a fused weight chunk by chunk computes
    #: silently wrong on any other shard, so the resolver refuses the recipe at its line.
    params: tuple[tuple[str, NamedPlacement], ...] = ()
    #: submodules (relative names) the wrapper calls as modules and that must be boundaries
    #: nested in the wrapped one (a row-wise output projection that reduces its partial
    #: output): the resolver refuses the recipe when one is not.
    boundaries: tuple[str, ...] = ()


BUILTIN_WRAPPERS: Mapping[str, WrapperDeclaration] = {
    d.name: d for d in (
        WrapperDeclaration(
            name="cp_allgather_kv", hook="attention", mesh_dims=("cp",),
            inner_out_src=((0, parse_named_placement({"cp": "shard(1)"})),),
            factory="hyperrecipe.runtime.features.context_parallel:cp_allgather_kv",
            summary="context parallel attention: K/V all-gathered along the sequence, "
                    "offset-aware causal mask"),
        WrapperDeclaration(
            name="mha_heads", hook="forward", mesh_dims=("tp",),
            inner_out_src=((0, parse_named_placement("replicate")),
                           (1, parse_named_placement({"tp": "partial"}))),
            factory="hyperrecipe.runtime.features.multihead_attention:mha_heads",
            summary="torch.nn.MultiheadAttention on each rank's heads: in_proj "
                    "shard(0, chunks=3), out_proj a nested rowwise boundary",
            params=(("in_proj_weight", parse_named_placement({"tp": "shard(0, chunks=3)"})),
                    ("in_proj_bias", parse_named_placement({"tp": "shard(0, chunks=3)"})),
                    ("out_proj.weight", parse_named_placement({"tp": "shard(1)"})),
                    ("out_proj.bias", parse_named_placement("replicate"))),
            boundaries=("out_proj",)),
        WrapperDeclaration(
            name="ulysses", hook="attention", mesh_dims=("cp",),
            inner_out_src=((0, parse_named_placement({"cp": "shard(1)"})),),
            factory="hyperrecipe.runtime.features.context_parallel:ulysses",
            summary="context parallel attention: all-to-all between heads and sequence "
                    "(Ulysses)"),
    )
}
"""The built-in inner wrappers by registry name: their declarations. The context-parallel
ones (the attention output ``[batch, seq, heads, head_dim]`` comes back sharded on the sequence
over ``cp``) have their factories in :mod:`hyperrecipe.runtime.features.context_parallel`;
``mha_heads`` (``torch.nn.MultiheadAttention`` sharded by heads over ``tp``, its averaged
attention weights a partial sum) in :mod:`hyperrecipe.runtime.features.multihead_attention`."""


@attrs.frozen(kw_only=True)
class WrapperSpec:
    """What :func:`inner_wrapper` declares about a factory, with the factory itself."""

    name: str
    hook: Hook
    mesh_dims: tuple[str, ...]
    requires: tuple[Requirement, ...]
    inner_out_src: tuple[tuple[int, NamedPlacement], ...] = ()
    factory: Callable[[WrapperContext], Callable[..., Any]] = attrs.field(eq=False)
    params: tuple[tuple[str, NamedPlacement], ...] = ()
    boundaries: tuple[str, ...] = ()

    def declaration(self, ref: str) -> WrapperDeclaration:
        """The data part of this spec, for the factory found at ``ref``."""
        return WrapperDeclaration(name=self.name, hook=self.hook, mesh_dims=self.mesh_dims,
                                  inner_out_src=self.inner_out_src, factory=ref,
                                  params=self.params, boundaries=self.boundaries)


_SPEC_ATTRIBUTE = "__hyperrecipe_wrapper__"
F = TypeVar("F", bound=Callable[..., Any])


def inner_wrapper(*, name: str | None = None, hook: Hook = "attention",
                  mesh_dims: Sequence[str] = (), requires: Sequence[Requirement] = (),
                  inner_out_src: Mapping[int, str | Mapping[str, str]] | None = None,
                  params: Mapping[str, str | Mapping[str, str]] | None = None,
                  boundaries: Sequence[str] = ()) -> Callable[[F], F]:
    """Declare a factory as an inner wrapper (see the module docstring).

    Args:
        name: shown in plans and status (default: the factory's ``__name__``).
        hook: ``"attention"`` or ``"forward"``.
        mesh_dims: the mesh dims whose groups :meth:`WrapperContext.group` hands out.
        requires: install-time checks; the wrapper is skipped in a chain when one fails.
        inner_out_src: output position → placement in recipe syntax (``"replicate"`` or
            ``{"cp": "shard(1)"}``) over ``mesh_dims``; the default of the recipe's field.
        params: parameter (relative to the boundary module, ``"out_proj.weight"``) →
            the placement the wrapper computes with, in recipe syntax; the resolver refuses a
            recipe that places one otherwise (a wrapper reading a fused weight chunk by chunk
            is silently wrong on any other shard of the same shape).
        boundaries: submodules (relative names) the wrapper calls as modules and that must be
            boundaries nested in the wrapped one (an output projection that reduces).

    Returns:
        The factory itself, marked with its :class:`WrapperSpec`.

    Raises:
        WrapperDeclarationError: an unknown hook, or an ``inner_out_src`` that does not parse,
            is not keyed by positions, or names a mesh dim outside ``mesh_dims`` (a
            ``ValueError``).
    """
    if hook not in ("attention", "forward"):
        raise WrapperDeclarationError(f"hook must be 'attention' or 'forward', not {hook!r}")
    declared = _declared_layout(inner_out_src or {}, tuple(mesh_dims))
    placed: list[tuple[str, NamedPlacement]] = []
    for param, text in (params or {}).items():
        try:
            placed.append((param, parse_named_placement(text)))
        except PlacementSyntaxError as exc:
            raise WrapperDeclarationError(f"params[{param!r}]: {exc}") from None

    def mark(factory: F) -> F:
        spec = WrapperSpec(name=name or factory.__name__, hook=hook, mesh_dims=tuple(mesh_dims),
                           requires=tuple(requires), inner_out_src=declared, factory=factory,
                           params=tuple(placed), boundaries=tuple(boundaries))
        setattr(factory, _SPEC_ATTRIBUTE, spec)
        return factory

    return mark


def builtin_wrapper(name: str, *, requires: Sequence[Requirement] = ()) -> Callable[[F], F]:
    """Mark the factory of the built-in wrapper ``name`` with its registry declaration (the
    factory adds only its install-time ``requires``), so the two cannot drift apart."""
    d = BUILTIN_WRAPPERS[name]

    def mark(factory: F) -> F:
        spec = WrapperSpec(name=d.name, hook=d.hook, mesh_dims=d.mesh_dims,
                           requires=tuple(requires), inner_out_src=d.inner_out_src,
                           factory=factory, params=d.params, boundaries=d.boundaries)
        setattr(factory, _SPEC_ATTRIBUTE, spec)
        return factory

    return mark


def _declared_layout(raw: Mapping[int, str | Mapping[str, str]], mesh_dims: tuple[str, ...]
                     ) -> tuple[tuple[int, NamedPlacement], ...]:
    out: list[tuple[int, NamedPlacement]] = []
    for key, value in raw.items():
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            msg = f"inner_out_src is keyed by output position (0, 1, ...), not {key!r}"
            raise WrapperDeclarationError(msg)
        try:
            placement = parse_named_placement(value)
        except PlacementSyntaxError as exc:
            raise WrapperDeclarationError(f"inner_out_src[{key}]: {exc}") from None
        foreign = [d for d in placement.mesh_dims if d not in mesh_dims]
        if foreign:
            msg = (f"inner_out_src[{key}] names mesh dim(s) {', '.join(foreign)}, which the "
                   f"wrapper does not declare in mesh_dims {list(mesh_dims)}")
            raise WrapperDeclarationError(msg)
        out.append((key, placement))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def declared_wrapper(ref: str) -> WrapperDeclaration:
    """What the resolver reads about a wrapper: a built-in's registry entry (nothing is
    imported), or the declaration of a ``pkg.mod:factory`` (its module is imported; nothing
    runs but the decorator).

    Raises:
        WrapperError: the reference cannot be loaded or is not an inner wrapper.
    """
    builtin = BUILTIN_WRAPPERS.get(ref)
    if builtin is not None:
        return builtin
    return load_wrapper(ref).declaration(ref)


def load_wrapper(ref: str) -> WrapperSpec:
    """The spec, with its factory, of a built-in name or a ``pkg.mod:callable`` reference
    (``apply`` calls this; a built-in's factory module is imported here).

    Raises:
        WrapperError: the module is not trusted (:mod:`hyperrecipe.refs`; it is then not
            imported), the module or attribute does not exist, it is not decorated with
            :func:`inner_wrapper`, or a built-in's factory disagrees with its declaration.
    """
    builtin = BUILTIN_WRAPPERS.get(ref)
    try:
        obj = resolve_ref(builtin.factory if builtin else ref, "inner wrapper")
    except RefError as exc:
        raise WrapperError(str(exc)) from None
    spec = getattr(obj, _SPEC_ATTRIBUTE, None)
    if not isinstance(spec, WrapperSpec):
        msg = (f"inner wrapper {ref!r} is not declared with @hyperrecipe.wrappers.inner_wrapper "
               f"(it must be a factory taking a WrapperContext)")
        raise WrapperError(msg)
    if builtin is not None and spec.declaration(builtin.factory) != attrs.evolve(builtin,
                                                                                summary=""):
        msg = f"built-in inner wrapper {ref!r}: its factory's declaration differs from the registry"
        raise WrapperError(msg)
    return spec


class WrapperContext:
    """What a wrapper factory receives at install time (one per module and candidate).

    The runtime builds it, handing in how to reach a mesh dim's process group (``groups``) and
    how to change an attribute through the rewriter (``set_attribute``).

    Attributes:
        fqn: the boundary module's FQN.
        module: the module.
        mode: ``"production"`` or ``"validate"``.
        mesh: the whole ``DeviceMesh``.
        mesh_dims: the wrapper's declared mesh dims.
    """

    def __init__(self, *, fqn: str, module: nn.Module, mode: str, mesh: DeviceMesh,
                 mesh_dims: Sequence[str], set_attribute: Callable[[object, str, object], None],
                 groups: Callable[[str], Any]) -> None:
        self.fqn = fqn
        self.module = module
        self.mode = mode
        self.mesh = mesh
        self.mesh_dims = tuple(mesh_dims)
        self._set_attribute = set_attribute
        self._groups = groups

    def group(self, mesh_dim: str) -> Any:
        """``(group, size, rank)`` of one declared mesh dim (a ``MeshDimGroup``)."""
        if mesh_dim not in self.mesh_dims:
            msg = (f"{self.fqn}: the wrapper asked for mesh dim {mesh_dim!r} but declares "
                   f"{list(self.mesh_dims)}")
            raise PlanMismatchError(msg)
        return self._groups(mesh_dim)

    def backend(self) -> str:
        """The process-group backend of the wrapper's first mesh dim (or the default group)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return "none"
        group = self.group(self.mesh_dims[0]).group if self.mesh_dims else None
        return str(dist.get_backend(group))

    def set_attribute(self, obj: object, name: str, value: object) -> None:
        """Change an attribute for as long as the plan is applied (through the rewriter: undone
        if this wrapper fails to install, restored with everything else)."""
        self._set_attribute(obj, name, value)
