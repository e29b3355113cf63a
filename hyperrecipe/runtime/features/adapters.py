"""Adapters: third-party methods and functions that validate mode cannot run on DTensors as
they are.

A recipe's ``adapters:`` names methods (``pkg.mod:Class.method``) that sit inside a boundary and
trip over DTensor in validate mode, where a forward cannot be rewritten because the method is a
helper, or the class builds modules we never see; or module-level functions
(``pkg.mod:function``, with ``within:`` the modules that call them), such as a model's own call
of ``F.scaled_dot_product_attention``, for which DTensor has no CPU strategy. Two needs, one
adapter body each:

- ``marshal``: the method mixes its DTensor arguments with plain tensors of its own (a buffer
  such as a rotary embedding's ``inv_freq``), or runs code DTensor has no rule for. Its DTensor
  arguments are unwrapped to their local tensors once (differentiably), the original method
  runs eagerly on them, and its tensor outputs are wrapped again as DTensors on the same mesh,
  with the adapter's ``out_src`` placements or, by default, those of the first DTensor argument.
- ``wrap``: the method is fine on DTensors but is handed plain tensors next to them (a buffer
  slice, a fresh ``arange``), which DTensor refuses to mix. Its plain tensor arguments are wrapped
  as *replicated* DTensors on the mesh of its DTensor arguments; its outputs are left as they are.

Both look at the arguments only (``self``/``cls`` excluded) and are a pass-through when none is a
DTensor, so the same adapter is installed in both modes: production mode, and calls outside any
boundary, run the original untouched. Method adapters are installed through
:meth:`hyperrecipe.rewriter.Rewrite.install_method` in ``apply``'s transaction, before the
boundaries (a boundary binds its module's class forward when it is installed, and that forward
may be the adapted method); function adapters through
:meth:`~hyperrecipe.rewriter.Rewrite.replace_function_during`, once per module of ``within``
(the function is the replacement only while one of them runs). What does not live here: parsing (``recipe.validate``), the plan
entry (``plan.AdapterPlan``), assigning class attributes (only the rewriter does).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

from torch import Tensor

from hyperrecipe.errors import PlanMismatchError, RewriteError
from hyperrecipe.placement import to_torch_placements
from hyperrecipe.plan import AdapterPlan
from hyperrecipe.refs import RefError, UntrustedCodeError, import_trusted_module
from hyperrecipe.rewriter import Rewrite
from hyperrecipe.runtime.forward.marshal import map_tensors, to_local_tree, wrap_local_tree

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["install_adapters", "locate_function", "locate_target", "make_function_adapter",
           "make_method_adapter"]

_MISSING = object()


def _where(adapter: AdapterPlan) -> str:
    prov = adapter.provenance
    return f"adapter {adapter.target!r} ({prov.file}:{prov.line}:{prov.column})"


def _import_module(adapter: AdapterPlan, where: str) -> ModuleType:
    """The adapter's module, through the trust gate (:mod:`hyperrecipe.refs`)."""
    try:
        module: ModuleType = import_trusted_module(adapter.module_name, "adapter target",
                                                   adapter.target)
    except UntrustedCodeError as exc:
        raise PlanMismatchError(f"{where}: {exc}") from None
    except RefError as exc:
        cause = exc.__cause__ or exc.__context__
        msg = f"{where}: cannot import {adapter.module_name!r}: {cause or exc}"
        raise PlanMismatchError(msg) from exc
    return module


def locate_target(adapter: AdapterPlan) -> tuple[type, str]:
    """Import the adapter's module and find its class and method.

    Returns:
        ``(cls, method_name)``; the method may be inherited.

    Raises:
        PlanMismatchError: the module cannot be imported, a name on the way does not exist, a
            name that should be a class is not one, or the class has no such method; the message
            names the adapter and its recipe file, line and column.
    """
    where = _where(adapter)
    owner: Any = _import_module(adapter, where)
    walked = adapter.module_name
    for part in adapter.class_path:
        if not hasattr(owner, part):
            msg = f"{where}: {walked} has no attribute {part!r}"
            raise PlanMismatchError(msg)
        owner = getattr(owner, part)
        walked = f"{walked}{':' if walked == adapter.module_name else '.'}{part}"
        if not isinstance(owner, type):
            msg = f"{where}: {walked} is a {type(owner).__name__}, not a class"
            raise PlanMismatchError(msg)
    name = adapter.method_name
    raw = inspect.getattr_static(owner, name, _MISSING)
    if raw is _MISSING or not callable(getattr(owner, name, None)):
        msg = f"{where}: {owner.__qualname__} has no method {name!r}"
        raise PlanMismatchError(msg)
    return owner, name


def locate_function(adapter: AdapterPlan) -> tuple[ModuleType, str]:
    """Import a function adapter's module and find the function.

    Raises:
        PlanMismatchError: the module cannot be imported, or has no callable of that name;
            the message names the adapter and its recipe file, line and column.
    """
    where = _where(adapter)
    module = _import_module(adapter, where)
    name = adapter.method_name
    if not callable(getattr(module, name, None)):
        msg = f"{where}: {adapter.module_name} has no function {name!r}"
        raise PlanMismatchError(msg)
    return module, name


def _dtensors_in(value: Any) -> list[Any]:
    from torch.distributed.tensor import DTensor

    found: list[Any] = []

    def visit(t: Tensor) -> Tensor:
        if isinstance(t, DTensor):
            found.append(t)
        return t

    map_tensors(value, visit)
    return found


def _one_mesh(dtensors: Sequence[Any], where: str) -> DeviceMesh:
    mesh: DeviceMesh = dtensors[0].device_mesh
    if any(d.device_mesh != mesh for d in dtensors[1:]):
        msg = f"{where}: the DTensor arguments lie on different meshes; an adapter needs one"
        raise PlanMismatchError(msg)
    return mesh


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _marshal(fn: Callable[..., Any], skip: int, out_placements: tuple[Any, ...] | None,
             where: str) -> Callable[..., Any]:
    def adapter(*args: Any, **kwargs: Any) -> Any:
        head, rest = args[:skip], args[skip:]
        found = _dtensors_in((rest, kwargs))
        if not found:
            return fn(*args, **kwargs)
        partial = [d for d in found if any(p.is_partial() for p in d.placements)]
        if partial:
            msg = (f"{where}: marshal runs the method on local tensors, but an argument is "
                   f"partial ({tuple(partial[0].placements)}); its local values are summands, "
                   f"not values: reduce it before the call (declare its in_dst replicate or "
                   f"shard)")
            raise PlanMismatchError(msg)
        mesh = _one_mesh(found, where)
        placements = out_placements if out_placements is not None else tuple(found[0].placements)
        local_rest, local_kwargs = to_local_tree(rest), to_local_tree(kwargs)
        try:
            out = fn(*head, *local_rest, **local_kwargs)
        except Exception as exc:
            _add_note(exc, f"hyperrecipe: {where} ran this method on local tensors (marshal); "
                           f"a DTensor it meets elsewhere (a parameter of self) cannot mix "
                           f"with them")
            raise
        return wrap_local_tree(out, mesh, placements, where=where)

    return adapter


def _wrap(fn: Callable[..., Any], skip: int, where: str) -> Callable[..., Any]:
    def adapter(*args: Any, **kwargs: Any) -> Any:
        head, rest = args[:skip], args[skip:]
        found = _dtensors_in((rest, kwargs))
        if not found:
            return fn(*args, **kwargs)
        from torch.distributed.tensor import DTensor, Replicate

        mesh = _one_mesh(found, where)
        replicated = tuple(Replicate() for _ in range(mesh.ndim))

        def lift(t: Tensor) -> Tensor:
            if isinstance(t, DTensor):
                return t
            return DTensor.from_local(t, mesh, replicated, run_check=False)

        return fn(*head, *map_tensors(rest, lift), **map_tensors(kwargs, lift))

    return adapter


def make_method_adapter(original: object, adapter: AdapterPlan,
                        mesh_dims: Sequence[str]) -> object:
    """The class attribute that replaces ``original`` (as ``inspect.getattr_static`` returns it).

    All decisions are made here, once: which body (``marshal`` or ``wrap``), how many leading
    arguments are the receiver (``self``/``cls``; none for a ``staticmethod``), the torch
    placements of ``out_src``. The result is of the original's kind (function,
    ``staticmethod``, ``classmethod``) and carries its signature (``functools.wraps``), since it
    accepts and forwards every argument.

    Args:
        original: the raw class-dict entry being adapted.
        adapter: the plan entry.
        mesh_dims: the plan's mesh dim names, in mesh order (to read ``out_src``).

    Returns:
        A function, ``staticmethod`` or ``classmethod`` for
        :meth:`~hyperrecipe.rewriter.Rewrite.install_method`.
    """
    fn: object
    rebuild: Callable[[Callable[..., Any]], object] | None
    if isinstance(original, staticmethod):
        fn, skip, rebuild = original.__func__, 0, staticmethod
    elif isinstance(original, classmethod):
        fn, skip, rebuild = original.__func__, 1, classmethod
    else:
        fn, skip, rebuild = original, 1, None
    if not callable(fn):
        msg = f"{_where(adapter)}: the class attribute is a {type(fn).__name__}, not a method"
        raise PlanMismatchError(msg)
    where = _where(adapter)
    if adapter.mode == "marshal":
        out = (to_torch_placements(adapter.out_src, mesh_dims) if adapter.out_src is not None
               else None)
        body = _marshal(fn, skip, out, where)
    else:
        body = _wrap(fn, skip, where)
    functools.update_wrapper(body, fn)
    return body if rebuild is None else rebuild(body)


def make_function_adapter(function: Callable[..., Any], adapter: AdapterPlan,
                          mesh_dims: Sequence[str]) -> Callable[..., Any]:
    """The replacement of a module-level function: the ``marshal`` or ``wrap`` body over every
    argument (there is no receiver), carrying the function's name and docstring."""
    where = _where(adapter)
    if adapter.mode == "marshal":
        out = (to_torch_placements(adapter.out_src, mesh_dims) if adapter.out_src is not None
               else None)
        body = _marshal(function, 0, out, where)
    else:
        body = _wrap(function, 0, where)
    functools.update_wrapper(body, function)
    return body


def _install_function(tx: Rewrite, adapter: AdapterPlan, mesh_dims: Sequence[str],
                      modules: Mapping[str, nn.Module],
                      seen: dict[tuple[Any, str], AdapterPlan]) -> None:
    namespace, name = locate_function(adapter)
    other = seen.get((namespace, name))
    if other is not None:
        msg = (f"{_where(adapter)} and {_where(other)} adapt the same function "
               f"{namespace.__name__}.{name}; keep one")
        raise PlanMismatchError(msg)
    seen[(namespace, name)] = adapter
    replacement = make_function_adapter(getattr(namespace, name), adapter, mesh_dims)
    for fqn in adapter.within:
        if fqn not in modules:
            msg = f"{_where(adapter)}: the model has no module {fqn!r} (within)"
            raise PlanMismatchError(msg)
        try:
            tx.replace_function_during(modules[fqn], namespace, name, replacement, fqn=fqn)
        except RewriteError as exc:
            prov = adapter.provenance
            msg = f"{exc} (adapter declared at {prov.file}:{prov.line}:{prov.column})"
            raise RewriteError(msg) from exc


def install_adapters(tx: Rewrite, adapters: Sequence[AdapterPlan], mesh_dims: Sequence[str],
                     modules: Mapping[str, nn.Module] = MappingProxyType({})) -> None:
    """Install every adapter of a plan in ``tx``: one status row per method adapter (fqn = the
    target) and one per module of a function adapter's ``within`` (fqn = the module, found in
    ``modules``, the model's FQN → module).

    Raises:
        PlanMismatchError: a target cannot be found, or two adapters reach one method or
            function (re-exported under two module paths).
        RewriteError: the rewriter refused an install (another live installation already adapts
            the method or function, or the signatures differ), with the adapter's recipe
            location added.
    """
    seen: dict[tuple[Any, str], AdapterPlan] = {}
    for adapter in adapters:
        if adapter.is_function:
            _install_function(tx, adapter, mesh_dims, modules, seen)
            continue
        cls, name = locate_target(adapter)
        other = seen.get((cls, name))
        if other is not None:
            msg = (f"{_where(adapter)} and {_where(other)} adapt the same method "
                   f"{cls.__qualname__}.{name}; keep one")
            raise PlanMismatchError(msg)
        seen[(cls, name)] = adapter
        replacement = make_method_adapter(inspect.getattr_static(cls, name), adapter, mesh_dims)
        try:
            tx.install_method(cls, name, replacement, fqn=adapter.target)
        except RewriteError as exc:
            prov = adapter.provenance
            msg = f"{exc} (adapter declared at {prov.file}:{prov.line}:{prov.column})"
            raise RewriteError(msg) from exc
