"""Resolving ``pkg.mod:attr.path`` references: model factories, ``--inputs`` makers, inner
wrappers.

One walk, one set of messages, so that a typo reads the same wherever a recipe or command line
names code. Callers turn :class:`RefError` into their own error type (a model-spec error, a
plan mismatch) and add what they check next (callable, decorated). Adapter targets walk
classes with ``inspect.getattr_static`` and check each step, so they keep their own walk.
"""

from __future__ import annotations

import importlib
from typing import Any

from hyperrecipe.errors import RefError

__all__ = ["RefError", "resolve_ref"]


def resolve_ref(ref: str, what: str) -> Any:
    """The object ``ref`` (``pkg.mod:name`` or ``pkg.mod:Outer.name``) names.

    Args:
        ref: the reference.
        what: how messages name it (``"model spec"``, ``"--inputs"``, ``"inner wrapper"``).

    Raises:
        RefError: malformed, not importable (the import error's text is kept: it names the
            missing package), or an attribute along the path is missing.
    """
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise RefError(f"{what} {ref!r} is not 'pkg.module:attribute'")
    try:
        target: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise RefError(f"cannot import {mod_name!r} for {what} {ref!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise RefError(f"{mod_name!r} has no attribute {attr!r} ({what} {ref!r})")
        target = getattr(target, part)
    return target
