"""The one place that rewrites a live model: forwards, adapter methods and functions, attributes,
parameters.

Every other module *describes* a rewrite (a replacement callable, a new parameter, a new head
count) and hands it here; only this module assigns ``forward``. ``hyperrecipe lint`` enforces that
(rules HR001-HR004 allow exactly the ``rewriter`` paths of ``[tool.hyperrecipe.lint]``).

Funnelling the assignments through one module buys three guarantees that a trainer relies on:

* **Validated.** A replacement forward must accept every argument of the forward it replaces, by
  name and in positional order (:func:`~hyperrecipe.signature.validate_signature`, in its own
  module and re-exported here), so a wrapped model still accepts the calls its callers make. The
  check runs before anything is touched.
* **Atomic.** Changes are grouped in a :class:`Rewrite` transaction. If anything inside the
  ``with`` block raises, everything done so far is undone in reverse order and the exception
  propagates: a model is never left half-rewritten.
* **Reversible.** A committed transaction yields a :class:`Rewritten` whose
  :meth:`~Rewritten.restore` puts back the original forwards, methods, attributes and parameters.
  Its :attr:`~Rewritten.records` are the rows of the runtime's status table.

Installing a forward twice on one module (or one method twice on one class) without restoring in
between is a :class:`~hyperrecipe.errors.RewriteError`, never a silent double wrap.

Patches that outlive one model's transaction (torch's own functions, replaced while any
installation lives) are the rewriter's process-wide half, :mod:`hyperrecipe.process_patches`,
which also keeps the one table of every patch the package makes to code it does not own
(HR005 refuses such a patch anywhere else).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from types import MappingProxyType, ModuleType, TracebackType
from typing import Any, Final, Literal

import attrs
import torch

from hyperrecipe.errors import RewriteError, did_you_mean
from hyperrecipe.signature import validate_signature

__all__ = [
    "EntryKind",
    "EntryState",
    "Rewrite",
    "RewriteRecord",
    "Rewritten",
    "installed_forward_owner",
    "validate_signature",
]

EntryState = Literal["pending", "installed", "restored", "failed"]
"""Life cycle of one entry: ``pending`` (requested, being validated), ``installed`` (in effect),
``restored`` (undone, by a rollback or by :meth:`Rewritten.restore`), ``failed`` (validation or
the change itself raised, or it could not be undone; ``error`` says why)."""

EntryKind = Literal["forward", "companion", "method", "attribute", "parameter", "item",
                    "function"]
"""What an entry changed."""

_NO_COMPANIONS: Final[Mapping[str, object]] = MappingProxyType({})
_MISSING: Final = object()
#: Names that only a dedicated operation may change; ``set_attribute`` refuses them.
_RESERVED_ATTRIBUTES: Final = frozenset({"forward", "__class__", "__dict__"})


@attrs.frozen(kw_only=True)
class RewriteRecord:
    """One row of a rewrite's status table.

    Args:
        fqn: the module (or class) the entry changed, as the plan names it.
        kind: what kind of change it is.
        what: the changed attribute, e.g. ``"forward"``, ``"weight"``, ``"LlamaAttention.forward"``.
        state: where the entry is in its life cycle.
        error: why it failed, when ``state == "failed"``.
    """

    fqn: str
    kind: EntryKind
    what: str
    state: EntryState
    error: str | None = None


# --------------------------------------------------------------------------------------------
# Registries: what is currently installed (for the double-install check)
# --------------------------------------------------------------------------------------------

_FORWARD_OWNERS: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
_METHOD_OWNERS: weakref.WeakKeyDictionary[type, dict[str, str]] = weakref.WeakKeyDictionary()


@attrs.define(eq=False)
class _ScopedFunction:
    """One module-level function, swapped for its replacement while any module scoped to it
    runs (a depth count: nested and recursive calls swap once and put back once)."""

    namespace: ModuleType
    name: str
    original: object
    replacement: object
    label: str
    modules: int = 0
    depth: int = 0

    def enter(self) -> None:
        if self.depth == 0:
            setattr(self.namespace, self.name, self.replacement)
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            setattr(self.namespace, self.name, self.original)


#: (module name, function name) → the live swap; one replacement per function at a time
_SCOPED_FUNCTIONS: dict[tuple[str, str], _ScopedFunction] = {}


def _validate_function_replacement(original: Callable[..., Any],
                                   replacement: Callable[..., Any], *, fqn: str,
                                   what: str) -> None:
    """:func:`validate_signature`, except for a builtin without a readable signature (most of
    ``torch.nn.functional``'s kernels): only a replacement taking ``(*args, **kwargs)`` and
    passing them on can stand in for one."""
    try:
        inspect.signature(original)
    except (TypeError, ValueError):
        params = inspect.signature(replacement, follow_wrapped=False).parameters.values()
        if {p.kind for p in params} != {inspect.Parameter.VAR_POSITIONAL,
                                        inspect.Parameter.VAR_KEYWORD}:
            msg = (f"{fqn}: {what} has no readable signature, so its replacement must take "
                   f"(*args, **kwargs)")
            raise RewriteError(msg) from None
        return
    validate_signature(original, replacement, fqn=fqn, what=what)


def installed_forward_owner(module: object) -> str | None:
    """The label of the rewrite whose forward is installed on ``module``, or ``None``.

    The runtime uses it to explain why a second ``apply`` is refused.
    """
    try:
        return _FORWARD_OWNERS.get(module)
    except TypeError:  # not weak-referenceable: we could never have installed on it
        return None


# --------------------------------------------------------------------------------------------
# Mementos: one per entry, each knows how to undo itself
# --------------------------------------------------------------------------------------------


class _Memento:
    """How to undo one entry; ``undo`` raises :class:`RewriteError` when it cannot."""

    def commit(self) -> None:
        """Called once the transaction commits; may drop what only rollback needed."""

    def undo(self) -> None:
        raise NotImplementedError


def _changed_since_install(fqn: str, what: str) -> RewriteError:
    """Undo refuses to overwrite a change someone else made after ours."""
    msg = (f"{fqn}: {what} was changed after it was installed; leaving it as is rather than "
           f"overwriting someone else's change")
    return RewriteError(msg)


def _put_back_instance_attribute(obj: object, name: str, previous: object) -> None:
    if previous is _MISSING:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, previous)


@attrs.define(eq=False)
class _ForwardMemento(_Memento):
    module: object
    fqn: str
    replacement: object
    previous: object  # the instance-dict forward before us, or _MISSING

    def undo(self) -> None:
        current = vars(self.module).get("forward", _MISSING)
        if current is not self.replacement:
            raise _changed_since_install(self.fqn, "forward")
        _put_back_instance_attribute(self.module, "forward", self.previous)
        _FORWARD_OWNERS.pop(self.module, None)


@attrs.define(eq=False)
class _CompanionMemento(_Memento):
    module: object
    name: str
    previous: object

    def undo(self) -> None:
        _put_back_instance_attribute(self.module, self.name, self.previous)


@attrs.define(eq=False)
class _MethodMemento(_Memento):
    cls: type
    name: str
    fqn: str
    replacement: object
    previous: object  # the raw class-dict entry before us, or _MISSING (inherited)

    def undo(self) -> None:
        current = vars(self.cls).get(self.name, _MISSING)
        if current is not self.replacement:
            raise _changed_since_install(self.fqn, f"{self.cls.__qualname__}.{self.name}")
        if self.previous is _MISSING:
            delattr(self.cls, self.name)
        else:
            setattr(self.cls, self.name, self.previous)
        owners = _METHOD_OWNERS.get(self.cls)
        if owners is not None:
            owners.pop(self.name, None)


@attrs.define(eq=False)
class _AttributeMemento(_Memento):
    obj: object
    name: str
    previous: object
    via_descriptor: bool

    def undo(self) -> None:
        if self.via_descriptor or self.previous is not _MISSING:
            setattr(self.obj, self.name, self.previous)
        else:
            delattr(self.obj, self.name)


@attrs.define(eq=False)
class _ItemMemento(_Memento):
    mapping: MutableMapping[Any, Any]
    key: object
    fqn: str
    value: object
    previous: object

    def undo(self) -> None:
        if self.mapping.get(self.key, _MISSING) is not self.value:
            raise _changed_since_install(self.fqn, f"entry {self.key!r}")
        if self.previous is _MISSING:
            del self.mapping[self.key]
        else:
            self.mapping[self.key] = self.previous


@attrs.define(eq=False)
class _ScopedFunctionMemento(_Memento):
    scope: _ScopedFunction
    handles: tuple[Any, ...]
    fqn: str

    def undo(self) -> None:
        scope = self.scope
        if scope.depth:
            msg = (f"{self.fqn}: cannot restore {scope.namespace.__name__}:{scope.name} while "
                   f"the module's forward is running")
            raise RewriteError(msg)
        for handle in self.handles:
            handle.remove()
        scope.modules -= 1
        if scope.modules == 0:
            _SCOPED_FUNCTIONS.pop((scope.namespace.__name__, scope.name), None)


@attrs.define(eq=False)
class _ParameterMemento(_Memento):
    module: torch.nn.Module
    name: str
    fqn: str
    installed: torch.nn.Parameter
    original: torch.nn.Parameter | None
    on_restore: Callable[[], torch.nn.Parameter] | None

    def commit(self) -> None:
        if self.on_restore is not None:
            # A sharded model must not keep a full copy of every parameter alive.
            self.original = None

    def undo(self) -> None:
        if self.module._parameters.get(self.name) is not self.installed:
            msg = (
                f"{self.fqn}: parameter {self.name!r} was replaced after it was installed; "
                "leaving it as is rather than overwriting someone else's change"
            )
            raise RewriteError(msg)
        if self.original is not None:
            restored = self.original
        else:
            assert self.on_restore is not None  # commit() only drops the original then
            rebuilt: object = self.on_restore()
            if not isinstance(rebuilt, torch.nn.Parameter):
                msg = (
                    f"{self.fqn}: on_restore for parameter {self.name!r} returned "
                    f"{type(rebuilt).__name__}, not torch.nn.Parameter"
                )
                raise RewriteError(msg)
            restored = rebuilt
        self.module.register_parameter(self.name, restored)


# --------------------------------------------------------------------------------------------
# Transaction
# --------------------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("memento", "record")

    def __init__(self, record: RewriteRecord) -> None:
        self.record = record
        self.memento: _Memento | None = None

    def set_state(self, state: EntryState, error: str | None = None) -> None:
        self.record = attrs.evolve(self.record, state=state, error=error)


def _undo_in_reverse(entries: list[_Entry]) -> list[str]:
    """Undo every installed entry, last first; return the failures (and keep going)."""
    failures: list[str] = []
    for entry in reversed(entries):
        if entry.record.state != "installed" or entry.memento is None:
            continue
        try:
            entry.memento.undo()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none may stop the rest
            entry.set_state("failed", str(exc))
            failures.append(f"{entry.record.fqn} ({entry.record.what}): {exc}")
        else:
            entry.set_state("restored")
    return failures


class Rewritten:
    """A committed rewrite: its status records and the way back.

    Obtained from :attr:`Rewrite.result` after the ``with`` block exits cleanly.
    """

    def __init__(self, label: str, entries: list[_Entry]) -> None:
        self._label = label
        self._entries = entries
        self._restored = False

    @property
    def label(self) -> str:
        """The label the transaction was opened with."""
        return self._label

    @property
    def restored(self) -> bool:
        """Whether :meth:`restore` has run."""
        return self._restored

    @property
    def records(self) -> tuple[RewriteRecord, ...]:
        """One record per entry, in installation order (the status table's rows)."""
        return tuple(entry.record for entry in self._entries)

    def restore(self) -> None:
        """Undo every entry in reverse order, returning the model to its original state.

        Afterwards a module's ``forward`` is the class's bound method again (``"forward" not in
        vars(module)`` unless an instance forward was there before), class methods are exactly
        what they were (deleted again if they were inherited), attributes are back, and each
        replaced parameter is the original or what its ``on_restore`` rebuilt.

        Every entry is attempted even if one fails, so one stuck entry does not strand the rest.

        Raises:
            RewriteError: when called a second time, or when some entries could not be undone
                (those records are ``"failed"`` with the reason; the others are restored).
        """
        if self._restored:
            msg = f"rewrite {self._label!r} was already restored"
            raise RewriteError(msg)
        self._restored = True
        failures = _undo_in_reverse(self._entries)
        if failures:
            msg = f"rewrite {self._label!r}: could not restore " + "; ".join(failures)
            raise RewriteError(msg)

    def __repr__(self) -> str:
        return (
            f"Rewritten(label={self._label!r}, entries={len(self._entries)}, "
            f"restored={self._restored})"
        )


class Rewrite:
    """A transaction of model rewrites that either all take effect or none do.

    Open it with ``with``; call the ``install_*``/``set_*``/``replace_*`` methods inside. Each one
    validates first and only then changes the model. If the block raises, every change made so
    far is undone in reverse order and the exception propagates (rollback failures are attached
    to it as notes). If it completes, :attr:`result` holds the :class:`Rewritten` to restore later.

    Args:
        label: names the transaction in messages and in the double-install check.

    Example::

        >>> with Rewrite(label="apply tp") as tx:
        ...     tx.install_forward(attn, wrapped, fqn="layers.0.attn",
        ...                        companions={"_hr_boundary": boundary})
        ...     tx.set_attribute(attn, "num_heads", 4, fqn="layers.0.attn")
        >>> rewritten = tx.result
        >>> rewritten.restore()
    """

    def __init__(self, *, label: str = "rewrite") -> None:
        self._label = label
        self._entries: list[_Entry] = []
        self._phase: Literal["new", "open", "committed", "rolled back"] = "new"
        self._result: Rewritten | None = None

    # -- context management -----------------------------------------------------------------

    def __enter__(self) -> Rewrite:
        if self._phase != "new":
            msg = f"rewrite {self._label!r} cannot be opened twice"
            raise RewriteError(msg)
        self._phase = "open"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc is None:
            for entry in self._entries:
                if entry.memento is not None:
                    entry.memento.commit()
            self._phase = "committed"
            self._result = Rewritten(self._label, self._entries)
            return False
        self._phase = "rolled back"
        for failure in _undo_in_reverse(self._entries):
            _add_note(exc, f"hyperrecipe: rollback of rewrite {self._label!r} failed for {failure}")
        return False

    @property
    def label(self) -> str:
        """The label given at construction."""
        return self._label

    @property
    def records(self) -> tuple[RewriteRecord, ...]:
        """The entries so far, with their current states (also readable after a rollback)."""
        return tuple(entry.record for entry in self._entries)

    @property
    def result(self) -> Rewritten:
        """The committed rewrite.

        Raises:
            RewriteError: if the transaction has not committed (still open, or rolled back).
        """
        if self._result is None:
            msg = f"rewrite {self._label!r} has no result: it is {self._phase}, not committed"
            raise RewriteError(msg)
        return self._result

    # -- entry bookkeeping ------------------------------------------------------------------

    def _check_open(self, fqn: str) -> None:
        if self._phase != "open":
            msg = (
                f"{fqn}: rewrite {self._label!r} is {self._phase}; changes go inside "
                f"'with Rewrite(...) as tx:'"
            )
            raise RewriteError(msg)

    def _record(
        self, fqn: str, kind: EntryKind, what: str, change: Callable[[], _Memento]
    ) -> None:
        """Run one change as its own entry: pending, then installed (or failed)."""
        entry = _Entry(RewriteRecord(fqn=fqn, kind=kind, what=what, state="pending"))
        self._entries.append(entry)
        try:
            memento = change()
        except BaseException as exc:
            entry.set_state("failed", str(exc))
            raise
        entry.memento = memento
        entry.set_state("installed")

    def _atomically(self, fqn: str, operation: Callable[[], None]) -> None:
        """Run an operation of several entries inside its own savepoint (:meth:`attempt`), so
        each public call is all-or-nothing even when the caller catches its exception and
        carries on inside the ``with`` block."""
        with self.attempt(fqn):
            operation()

    # -- operations -------------------------------------------------------------------------

    def install_forward(
        self,
        module: object,
        replacement: Callable[..., Any],
        *,
        fqn: str,
        companions: Mapping[str, object] = _NO_COMPANIONS,
    ) -> None:
        """Make ``module(...)`` call ``replacement`` instead of its class's forward.

        The replacement is stored as an instance attribute, so the class (and every other
        instance) is untouched and restore is a deletion. ``companions`` are extra instance
        attributes that belong to this forward (the boundary spec a wrapper reads, a handle to
        the original): they are set and undone with it, so a wrapper never runs without them.

        Args:
            module: the module to rewrite (normally an ``nn.Module``).
            replacement: called with the module's call arguments (no ``self``; close over the
                module if you need it). Validated with :func:`validate_signature`.
            fqn: the module's FQN, for messages and records.
            companions: attribute name to value; set with ``object.__setattr__`` so a companion
                module or tensor is not registered as a submodule or buffer.

        Raises:
            RewriteError: when a forward from an earlier, unrestored rewrite (or from this one)
                is already installed on ``module``, when the signatures do not match, or when a
                companion is named ``forward``.

        Example::

            >>> with Rewrite(label="apply") as tx:
            ...     tx.install_forward(mlp, wrapper, fqn="layers.0.mlp",
            ...                        companions={"_hr_spec": spec})
        """

        def install() -> _Memento:
            owner = installed_forward_owner(module)
            if owner is not None:
                msg = (
                    f"{fqn}: a forward from rewrite {owner!r} is already installed; restore it "
                    "before installing another (hyperrecipe never wraps twice)"
                )
                raise RewriteError(msg)
            if "forward" in companions:
                msg = f"{fqn}: a companion cannot be named 'forward'"
                raise RewriteError(msg)
            original = getattr(module, "forward", None)
            if not callable(original):
                msg = f"{fqn}: {type(module).__name__} has no callable forward to replace"
                raise RewriteError(msg)
            validate_signature(original, replacement, fqn=fqn)
            try:
                weakref.ref(module)
            except TypeError as exc:
                msg = (
                    f"{fqn}: {type(module).__name__} objects cannot be tracked "
                    "(no weakref support), so a second install could not be detected"
                )
                raise RewriteError(msg) from exc
            previous = vars(module).get("forward", _MISSING)
            object.__setattr__(module, "forward", replacement)
            _FORWARD_OWNERS[module] = self._label
            return _ForwardMemento(
                module=module, fqn=fqn, replacement=replacement, previous=previous
            )

        def operation() -> None:
            self._record(fqn, "forward", "forward", install)
            for name, value in companions.items():
                self._record(fqn, "companion", name, _companion_setter(module, name, value))

        self._atomically(fqn, operation)

    def install_method(
        self,
        cls: type,
        name: str,
        replacement: object,
        *,
        fqn: str,
    ) -> None:
        """Replace method ``name`` on class ``cls`` (third-party adapters).

        Some third-party code can only be adapted at class level (it builds modules we never see,
        or calls a helper method rather than ``forward``). The exact class-dict entry is
        remembered, so restore puts back the same function, ``staticmethod`` or ``classmethod``
        object, or deletes ours again when the method was inherited.

        Args:
            cls: the class to patch.
            name: the method name.
            replacement: a function, or a ``staticmethod``/``classmethod`` when the original is
                one. Its signature (``self`` included) is validated against the original's.
            fqn: qualified name for messages and records (``"transformers...LlamaAttention"``).

        Raises:
            RewriteError: when ``cls`` has no such method, the kinds (plain/static/class method)
                differ, the signatures do not match, or this method is already installed.
        """
        what = f"{cls.__qualname__}.{name}"

        def install() -> _Memento:
            owner = _METHOD_OWNERS.get(cls, {}).get(name)
            if owner is not None:
                msg = (
                    f"{fqn}: {what} from rewrite {owner!r} is already installed; restore it "
                    "before installing another"
                )
                raise RewriteError(msg)
            raw = inspect.getattr_static(cls, name, _MISSING)
            if raw is _MISSING:
                msg = f"{fqn}: {cls.__qualname__} has no method {name!r}"
                raise RewriteError(msg)
            original_fn, original_kind = _unwrap_method(raw)
            replacement_fn, replacement_kind = _unwrap_method(replacement)
            if original_kind != replacement_kind:
                msg = f"{fqn}: {what} is a {original_kind}; the replacement is a {replacement_kind}"
                raise RewriteError(msg)
            if not callable(original_fn) or not callable(replacement_fn):
                msg = f"{fqn}: {what} and its replacement must both be callable"
                raise RewriteError(msg)
            validate_signature(original_fn, replacement_fn, fqn=fqn, what=what)
            previous = vars(cls).get(name, _MISSING)
            setattr(cls, name, replacement)
            _METHOD_OWNERS.setdefault(cls, {})[name] = self._label
            return _MethodMemento(
                cls=cls, name=name, fqn=fqn, replacement=replacement, previous=previous
            )

        self._atomically(fqn, lambda: self._record(fqn, "method", what, install))

    def set_attribute(self, obj: object, name: str, value: object, *, fqn: str) -> None:
        """Set a plain attribute (a head count, a flag) as part of the transaction.

        Args:
            obj: the object to change.
            name: the attribute. Not ``forward`` (use :meth:`install_forward`), ``__class__`` or
                ``__dict__``; not a parameter, buffer or submodule of an ``nn.Module``.
            value: the new value; not a ``Parameter`` or ``Module`` (they have dedicated paths).
            fqn: the owner's FQN, for messages and records.

        Raises:
            RewriteError: for the names and values above.

        Example::

            >>> with Rewrite(label="apply") as tx:
            ...     tx.set_attribute(attn, "num_heads", attn.num_heads // tp, fqn="layers.0.attn")
        """

        def install() -> _Memento:
            if name in _RESERVED_ATTRIBUTES:
                hint = " (use install_forward)" if name == "forward" else ""
                msg = f"{fqn}: set_attribute cannot change {name!r}{hint}"
                raise RewriteError(msg)
            if isinstance(value, (torch.nn.Parameter, torch.nn.Module)):
                msg = (
                    f"{fqn}: set_attribute cannot assign a {type(value).__name__} to {name!r}; "
                    "use replace_parameter for parameters"
                )
                raise RewriteError(msg)
            if isinstance(obj, torch.nn.Module):
                for registry in ("_parameters", "_buffers", "_modules"):
                    if name in getattr(obj, registry):
                        msg = (
                            f"{fqn}: {name!r} is in {registry}; set_attribute changes plain "
                            "attributes only"
                        )
                        raise RewriteError(msg)
            descriptor = inspect.getattr_static(type(obj), name, _MISSING)
            via_descriptor = hasattr(descriptor, "__set__")
            if via_descriptor:
                previous = getattr(obj, name)
            else:
                previous = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
            setattr(obj, name, value)
            return _AttributeMemento(
                obj=obj, name=name, previous=previous, via_descriptor=via_descriptor
            )

        self._atomically(fqn, lambda: self._record(fqn, "attribute", name, install))

    def set_item(self, mapping: MutableMapping[Any, Any], key: object, value: object, *,
                 fqn: str) -> None:
        """Set ``mapping[key]`` as part of the transaction (a third-party registry entry, such
        as the attention function transformers looks up by name).

        Restore puts back the previous value, or deletes the key when there was none.

        Args:
            mapping: any mutable mapping.
            key: the entry.
            value: its new value.
            fqn: names the registry in messages and records.
        """

        def install() -> _Memento:
            previous = mapping[key] if key in mapping else _MISSING
            mapping[key] = value
            return _ItemMemento(mapping=mapping, key=key, fqn=fqn, value=value, previous=previous)

        self._atomically(fqn, lambda: self._record(fqn, "item", repr(key), install))

    def replace_function_during(self, module: torch.nn.Module, namespace: ModuleType,
                                name: str, replacement: Callable[..., Any], *,
                                fqn: str) -> None:
        """Make ``namespace.name`` (a module-level function) ``replacement`` while ``module``
        runs: a forward pre-hook swaps it in, a forward hook that runs even when the forward
        raises swaps the original back (function adapters). Nested and recursive calls of
        scoped modules swap once. The swap is process-wide for its duration: other threads
        calling the function meanwhile get the replacement too.

        Several modules may be scoped to one function with the same replacement; another live
        rewrite cannot replace the same function (restore it first).

        Args:
            module: the module whose forward sees the replacement.
            namespace: the Python module holding the function (``torch.nn.functional``, or
                the model's own module when it imported the function by name).
            name: the function's name in ``namespace``.
            replacement: what the forward's code calls instead; its signature is validated
                against the original's.
            fqn: the module's FQN, for messages and records.

        Raises:
            RewriteError: ``namespace`` has no callable ``name``, the signatures differ, or
                the function is already replaced by another rewrite or with another
                replacement.
        """
        what = f"{namespace.__name__}:{name}"

        def install() -> _Memento:
            scope = _SCOPED_FUNCTIONS.get((namespace.__name__, name))
            if scope is not None and (scope.label != self._label
                                      or scope.replacement is not replacement):
                msg = (f"{fqn}: {what} is already replaced (rewrite {scope.label!r}); one "
                       f"replacement per function: restore it first")
                raise RewriteError(msg)
            if scope is None:
                original = getattr(namespace, name, _MISSING)
                if not callable(original):
                    msg = f"{fqn}: {namespace.__name__} has no function {name!r}"
                    raise RewriteError(msg)
                _validate_function_replacement(original, replacement, fqn=fqn, what=what)
                scope = _ScopedFunction(namespace=namespace, name=name, original=original,
                                        replacement=replacement, label=self._label)
            active = scope

            def enter(_module: torch.nn.Module, _args: Any) -> None:
                active.enter()

            def leave(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
                active.leave()

            handles = (module.register_forward_pre_hook(enter),
                       module.register_forward_hook(leave, always_call=True))
            _SCOPED_FUNCTIONS[(namespace.__name__, name)] = scope
            scope.modules += 1
            return _ScopedFunctionMemento(scope=scope, handles=handles, fqn=fqn)

        self._atomically(fqn, lambda: self._record(fqn, "function", what, install))

    @contextlib.contextmanager
    def attempt(self, fqn: str) -> Iterator[None]:
        """A savepoint: if the block raises, undo what it changed and re-raise; what was done
        before the block stays in effect.

        This is how a chain of candidate implementations is tried: a candidate that fails half
        way through installing leaves nothing behind before the next one is tried. The undone
        entries stay in :attr:`records` as ``restored`` (or ``failed``).

        Example::

            >>> with Rewrite(label="apply") as tx:
            ...     try:
            ...         with tx.attempt("layers.0.attn"):
            ...             install_fast_kernel(tx)
            ...     except RuntimeError:
            ...         install_portable_kernel(tx)
        """
        self._check_open(fqn)
        first = len(self._entries)
        try:
            yield
        except BaseException as exc:
            for failure in _undo_in_reverse(self._entries[first:]):
                _add_note(exc, f"hyperrecipe: undoing {failure} failed")
            raise

    def replace_parameter(
        self,
        module: torch.nn.Module,
        name: str,
        new_param: torch.nn.Parameter,
        *,
        fqn: str,
        on_restore: Callable[[], torch.nn.Parameter] | None = None,
        keep_original: bool = True,
    ) -> None:
        """Swap a registered parameter (e.g. for its local shard) as part of the transaction.

        While the transaction is open the original is kept so a rollback can put it back. After
        commit, if ``on_restore`` is given, the original is dropped and ``on_restore()`` is called
        at restore time to rebuild the parameter to put back (e.g. all-gather the shards), so a
        sharded model does not keep a full copy of every weight alive. With
        ``keep_original=False`` the original is dropped at once and a rollback rebuilds it with
        ``on_restore()`` too, so that sharding a model never holds it twice (the caller makes
        that rebuild safe to run wherever a rollback may run it).

        Args:
            module: the module owning the parameter.
            name: the parameter's local name (``"weight"``).
            new_param: the parameter to register in its place.
            fqn: the module's FQN, for messages and records.
            on_restore: builds the parameter that restore puts back; without it the original is
                kept alive until restore.

        Raises:
            RewriteError: when ``module`` has no parameter ``name`` or ``new_param`` is not a
                ``torch.nn.Parameter``.

        Example::

            >>> with Rewrite(label="apply") as tx:
            ...     tx.replace_parameter(linear, "weight", local_shard, fqn="layers.0.mlp.up",
            ...                          on_restore=lambda: gather_full("layers.0.mlp.up.weight"))
        """

        def install() -> _Memento:
            if name not in module._parameters:
                known = list(module._parameters)
                msg = (
                    f"{fqn}: {type(module).__name__} has no parameter {name!r}"
                    f"{did_you_mean(name, known)} (parameters: {known})"
                )
                raise RewriteError(msg)
            if not keep_original and on_restore is None:
                msg = f"{fqn}: dropping the original parameter {name!r} needs on_restore"
                raise RewriteError(msg)
            candidate: object = new_param  # callers are not always type-checked
            if not isinstance(candidate, torch.nn.Parameter):
                msg = (
                    f"{fqn}: the replacement for parameter {name!r} is a "
                    f"{type(candidate).__name__}, not torch.nn.Parameter"
                )
                raise RewriteError(msg)
            original = module._parameters[name]
            if original is None:
                msg = f"{fqn}: parameter {name!r} is None; there is nothing to replace"
                raise RewriteError(msg)
            module.register_parameter(name, new_param)
            return _ParameterMemento(
                module=module,
                name=name,
                fqn=fqn,
                installed=new_param,
                original=original if keep_original else None,
                on_restore=on_restore,
            )

        self._atomically(fqn, lambda: self._record(fqn, "parameter", name, install))


def _companion_setter(module: object, name: str, value: object) -> Callable[[], _Memento]:
    def install() -> _Memento:
        previous = vars(module).get(name, _MISSING)
        object.__setattr__(module, name, value)
        return _CompanionMemento(module=module, name=name, previous=previous)

    return install


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _unwrap_method(raw: object) -> tuple[object, str]:
    if isinstance(raw, staticmethod):
        return raw.__func__, "staticmethod"
    if isinstance(raw, classmethod):
        return raw.__func__, "classmethod"
    return raw, "plain method"
