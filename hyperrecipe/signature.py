"""Whether a replacement callable can stand in for the one it replaces, at every call site.

Pure: it reads signatures and raises, so the rewriter checks a replacement before it touches a
model, and recipes and tests can check one without a model. Callers of a module call
``module(x, mask)`` or ``module(x, mask=m)``; once the forward is swapped they must keep
working, so the replacement must accept each argument of the original *by name and in the same
positional slot*. ``*args``/``**kwargs`` in the replacement cover what they can receive (extra
positionals, unknown keywords). A replacement may add parameters only if they have defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Final, Literal

import attrs

from hyperrecipe.errors import RewriteError

__all__ = ["validate_signature"]

_POSITIONAL_KINDS: Final = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
)
_KEYWORD_KINDS: Final = (
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)
_VAR_KINDS: Final = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def validate_signature(
    original: Callable[..., Any] | inspect.Signature,
    replacement: Callable[..., Any] | inspect.Signature,
    *,
    fqn: str,
    what: str = "forward",
    require: Literal["all", "required"] = "all",
) -> None:
    """Check that ``replacement`` can stand in for ``original`` at every existing call site.

    Args:
        original: the forward (or method) being replaced, or its signature. Pass bound methods
            (``module.forward``) so ``self`` is not part of the comparison.
        replacement: the callable that will be installed, or its signature.
        fqn: the module FQN (or qualified method name), used in the message.
        what: what is being replaced, for the message (``"forward"``, ``"method"``).
        require: ``"all"`` (a forward wrapper: every argument of the original must be
            accepted) or ``"required"`` (a compute function: only the original's required
            arguments must be accepted; optional ones and ``*args``/``**kwargs`` may be left out).

    Raises:
        RewriteError: naming ``fqn``, every offending argument, and both signatures.

    Example::

        >>> def forward(x, mask=None): ...
        >>> def wrapper(x, mask=None, **kwargs): ...
        >>> validate_signature(forward, wrapper, fqn="layers.0.attn")  # fine
        >>> validate_signature(forward, lambda x: x, fqn="layers.0.attn")
        Traceback (most recent call last):
        ...
        hyperrecipe.errors.RewriteError: layers.0.attn: the replacement forward (x) cannot
        stand in for forward(x, mask=None): does not accept argument 'mask'
    """
    orig_sig = _signature_of(original, fqn=fqn, role=f"original {what}")
    repl_sig = _signature_of(replacement, fqn=fqn, role=f"replacement {what}")
    problems = signature_problems(orig_sig, repl_sig, what=what, require=require)
    if problems:
        msg = (
            f"{fqn}: the replacement {what} {_plain(repl_sig)} cannot stand in for "
            f"{what}{_plain(orig_sig)}: " + "; ".join(problems)
        )
        raise RewriteError(msg)


@attrs.frozen(kw_only=True)
class _Accepts:
    """What a replacement's signature accepts, indexed for the checks below."""

    params: tuple[inspect.Parameter, ...]
    by_name: dict[str, inspect.Parameter]
    positional: tuple[inspect.Parameter, ...]
    position_of: dict[str, int]
    has_args: bool
    has_kwargs: bool

    @classmethod
    def of(cls, signature: inspect.Signature) -> _Accepts:
        params = tuple(signature.parameters.values())
        positional = tuple(p for p in params if p.kind in _POSITIONAL_KINDS)
        return cls(
            params=params,
            by_name={p.name: p for p in params if p.kind not in _VAR_KINDS},
            positional=positional,
            position_of={p.name: i for i, p in enumerate(positional)},
            has_args=any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params),
            has_kwargs=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params),
        )


def signature_problems(
    original: inspect.Signature,
    replacement: inspect.Signature,
    *,
    what: str,
    require: Literal["all", "required"],
) -> list[str]:
    """Every reason ``replacement`` cannot stand in for ``original`` (at most one per argument
    of the original, then the replacement's required arguments the original lacks)."""
    repl = _Accepts.of(replacement)
    problems: list[str] = []
    position = 0
    for param in original.parameters.values():
        index = position
        if param.kind in _POSITIONAL_KINDS:
            position += 1
        if require == "required" and (
            param.default is not inspect.Parameter.empty or param.kind in _VAR_KINDS
        ):
            continue
        problem = (
            _variadic_problem(param, repl)
            if param.kind in _VAR_KINDS
            else _positional_problem(param, index, repl, what)
            or _keyword_problem(param, repl, what)
            or _default_problem(param, repl, what)
        )
        if problem is not None:
            problems.append(problem)
    problems.extend(_extra_required(original, repl, what))
    return problems


def _variadic_problem(param: inspect.Parameter, repl: _Accepts) -> str | None:
    if param.kind is inspect.Parameter.VAR_POSITIONAL and not repl.has_args:
        return f"does not accept extra positional arguments (*{param.name})"
    if param.kind is inspect.Parameter.VAR_KEYWORD and not repl.has_kwargs:
        return f"does not accept extra keyword arguments (**{param.name})"
    return None


def _positional_problem(param: inspect.Parameter, index: int, repl: _Accepts,
                        what: str) -> str | None:
    """Callers may pass a positional argument at ``index``: that slot of the replacement must
    receive it."""
    if param.kind not in _POSITIONAL_KINDS:
        return None
    same = repl.by_name.get(param.name)
    where = repl.position_of.get(param.name)
    by_name = param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    if index < len(repl.positional):
        at_index = repl.positional[index]
        if by_name and at_index.name != param.name:
            if where is not None:
                return (f"takes {param.name!r} at position {where}, the original {what} at "
                        f"position {index}")
            return (f"has {at_index.name!r} at position {index} where the original {what} has "
                    f"{param.name!r}")
        return None
    if where is not None and by_name:
        return f"takes {param.name!r} at position {where}, the original {what} at position {index}"
    if same is not None and same.kind is inspect.Parameter.KEYWORD_ONLY:
        return (f"accepts {param.name!r} only by keyword; the original {what} takes it at "
                f"position {index}")
    if not repl.has_args:
        if same is None and not repl.has_kwargs:
            return f"does not accept argument {param.name!r}"
        return (f"does not accept {param.name!r} at position {index} (no parameter there and "
                f"no *args)")
    return None


def _keyword_problem(param: inspect.Parameter, repl: _Accepts, what: str) -> str | None:
    """Callers may pass a keyword-capable argument by name: the replacement must take it."""
    if param.kind not in _KEYWORD_KINDS:
        return None
    same = repl.by_name.get(param.name)
    if (same is not None and same.kind in _KEYWORD_KINDS) or (same is None and repl.has_kwargs):
        return None
    if same is not None:  # positional-only in the replacement
        return (f"accepts {param.name!r} only by position; the original {what} also takes it "
                f"by keyword")
    if param.kind is inspect.Parameter.KEYWORD_ONLY:
        return f"does not accept argument {param.name!r}"
    return f"does not accept {param.name!r} by keyword (it has *args but no **kwargs)"


def _default_problem(param: inspect.Parameter, repl: _Accepts, what: str) -> str | None:
    """Callers may leave out an argument the original makes optional."""
    same = repl.by_name.get(param.name)
    if (same is not None and same.default is inspect.Parameter.empty
            and param.default is not inspect.Parameter.empty):
        return f"requires {param.name!r}, which the original {what} makes optional"
    return None


def _extra_required(original: inspect.Signature, repl: _Accepts, what: str) -> list[str]:
    """The replacement's required arguments that no call of the original passes."""
    orig_params = list(original.parameters.values())
    orig_names = {p.name for p in orig_params}
    orig_positional = [p for p in orig_params if p.kind in _POSITIONAL_KINDS]
    problems: list[str] = []
    for param in repl.params:
        if param.kind in _VAR_KINDS:
            continue
        slot = repl.position_of.get(param.name)
        if (
            slot is not None
            and slot < len(orig_positional)
            and orig_positional[slot].kind is inspect.Parameter.POSITIONAL_ONLY
        ):
            continue  # receives the original's positional-only argument; its name is private
        if param.name not in orig_names and param.default is inspect.Parameter.empty:
            problems.append(
                f"requires argument {param.name!r}, which the original {what} does not have"
            )
    return problems


def _signature_of(obj: object, *, fqn: str, role: str) -> inspect.Signature:
    if isinstance(obj, inspect.Signature):
        return obj
    if not callable(obj):
        msg = f"{fqn}: the {role} is not callable (got {type(obj).__name__})"
        raise RewriteError(msg)
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        msg = f"{fqn}: cannot read the signature of the {role}: {exc}"
        raise RewriteError(msg) from exc


def _plain(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` without annotations: names, kinds and defaults are what calls depend on."""
    return signature.replace(
        parameters=[
            p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
        ],
        return_annotation=inspect.Signature.empty,
    )
