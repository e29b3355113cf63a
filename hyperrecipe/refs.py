"""Resolving ``pkg.mod:attr.path`` references, and deciding which code may be imported.

This module is the one place where a name written in a recipe, a plan or a command line becomes
imported code: model factories, ``--inputs`` makers, inner wrappers, adapter targets. One walk,
one set of messages, and one trust check (docs/security.md), so that a typo and a refusal read
the same wherever code is named. Callers turn :class:`RefError` into their own error type (a
model-spec error, a recipe error, a plan mismatch) and add what they check next (callable,
decorated). Adapter targets walk classes with ``inspect.getattr_static`` and check each step,
so they take the module from :func:`import_trusted_module` and keep their own walk.

**Trust.** A recipe or a plan is data. A module it names is imported only when it is

- part of hyperrecipe (the built-in wrappers),
- already imported by the process (importing it again runs nothing),
- in a package that declares an entry point in :data:`ENTRY_POINT_GROUPS`, or
- opted in: ``--trust-code`` / ``--trust MODULE`` on the command line, ``trust_code=`` of
  :func:`hyperrecipe.compile_recipe` and :func:`hyperrecipe.apply`, or the environment variable
  :data:`TRUST_ENV` (``1`` for every module, else comma-separated module prefixes).

A name the user typed on the command line (``--model``, ``--inputs``) is their own choice and
needs no opt-in.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from hyperrecipe.errors import RefError, UntrustedCodeError

__all__ = [
    "ENTRY_POINT_GROUPS",
    "TRUST_ENV",
    "RefError",
    "UntrustedCodeError",
    "import_trusted_module",
    "is_trusted_module",
    "resolve_ref",
    "trusting",
]

TRUST_ENV = "HYPERRECIPE_TRUST_CODE"
"""Environment variable: ``1`` trusts every module; ``a,b.c`` trusts those modules and their
submodules. Inherited by the ranks ``hyperrecipe check`` launches."""

ENTRY_POINT_GROUPS = ("hyperrecipe.wrappers", "hyperrecipe.adapters")
"""Entry-point groups whose packages are trusted: an installed package that declares an entry
point in one of them (``[project.entry-points."hyperrecipe.wrappers"]``) is trusted as a
whole, as is every module of its top-level package."""

_OPT_IN_HINT = ("recipes and plans are data: code they name is imported only when it is built "
                "in, already imported, from a package declaring a 'hyperrecipe.wrappers' or "
                "'hyperrecipe.adapters' entry point, or trusted explicitly: pass --trust-code "
                "(or --trust {top}) on the command line, trust_code=True (or [{top!r}]) to "
                "compile_recipe()/apply(), or set " + TRUST_ENV + "=1 (or ={top}); see "
                "docs/security.md")

_TrustSetting = bool | frozenset[str]
_TRUST: ContextVar[_TrustSetting] = ContextVar("hyperrecipe_trust_code", default=False)


@contextlib.contextmanager
def trusting(trust_code: bool | Iterable[str]) -> Iterator[None]:
    """Within the block, also trust every module (``True``) or those module prefixes.

    ``False`` or an empty collection adds nothing (the environment and entry points still
    apply).
    """
    setting: _TrustSetting = (bool(trust_code) if isinstance(trust_code, bool)
                              # one prefix, not its letters: `trust_code="mypkg"` trusts mypkg
                              else frozenset((trust_code,)) if isinstance(trust_code, str)
                              else frozenset(trust_code))
    token = _TRUST.set(setting)
    try:
        yield
    finally:
        _TRUST.reset(token)


def _under(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes if p)


@functools.lru_cache(maxsize=1)
def _entry_point_packages() -> frozenset[str]:
    """Top-level packages of installed entry points in :data:`ENTRY_POINT_GROUPS` (metadata
    only: nothing is imported)."""
    from importlib.metadata import entry_points

    out: set[str] = set()
    for group in ENTRY_POINT_GROUPS:
        for ep in entry_points(group=group):
            out.add(ep.value.split(":", 1)[0].split(".", 1)[0].strip())
    return frozenset(out)


def is_trusted_module(module: str) -> bool:
    """Whether ``module`` may be imported on behalf of a recipe or plan (see the module doc)."""
    if _under(module, ("hyperrecipe",)) or module in sys.modules:
        return True
    setting = _TRUST.get()
    if setting is True or (isinstance(setting, frozenset) and _under(module, setting)):
        return True
    env = os.environ.get(TRUST_ENV, "").strip()
    if env.lower() in ("1", "true", "yes", "all", "*"):
        return True
    if env and _under(module, (p.strip() for p in env.split(","))):
        return True
    return _under(module, _entry_point_packages())


def import_trusted_module(module: str, what: str, ref: str) -> Any:
    """Import ``module`` for ``what`` ``ref`` if it is trusted.

    Raises:
        UntrustedCodeError: not trusted; the message says how to opt in.
        RefError: the import fails (its text is kept: it names the missing package).
    """
    if not is_trusted_module(module):
        top = module.split(".", 1)[0]
        msg = (f"{what} {ref!r} names module {module!r}, which is not trusted; "
               f"{_OPT_IN_HINT.format(top=top)}")
        raise UntrustedCodeError(msg)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RefError(f"cannot import {module!r} for {what} {ref!r}: {exc}") from None


def resolve_ref(ref: str, what: str, *, named_by_user: bool = False) -> Any:
    """The object ``ref`` (``pkg.mod:name`` or ``pkg.mod:Outer.name``) names.

    Args:
        ref: the reference.
        what: how messages name it (``"model spec"``, ``"--inputs"``, ``"inner wrapper"``).
        named_by_user: the user typed it (a command-line option, an API argument): imported
            without the trust check. A reference read from a recipe or plan is not.

    Raises:
        UntrustedCodeError: read from a recipe or plan and its module is not trusted.
        RefError: malformed, not importable (the import error's text is kept: it names the
            missing package), or an attribute along the path is missing.
    """
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise RefError(f"{what} {ref!r} is not 'pkg.module:attribute'")
    if named_by_user:
        try:
            target: Any = importlib.import_module(mod_name)
        except ImportError as exc:
            raise RefError(f"cannot import {mod_name!r} for {what} {ref!r}: {exc}") from None
    else:
        target = import_trusted_module(mod_name, what, ref)
    for part in attr.split("."):
        if not hasattr(target, part):
            raise RefError(f"{mod_name!r} has no attribute {attr!r} ({what} {ref!r})")
        target = getattr(target, part)
    return target
