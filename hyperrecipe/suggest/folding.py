"""Which segments of a module FQN are repetition indices: the one fold every part of suggest
uses to turn concrete modules into patterns.

A recipe pattern's ``*`` is one path segment, so folding ``model.layers.3.mlp`` to
``model.layers.*.mlp`` makes one rule for every layer. Not every number is a layer index, and
not every layer index is a number:

- **Repeated blocks** are siblings of the same class whose names differ only by a trailing
  integer: a ``ModuleList``'s ``0``, ``1``, … and torchvision's ``encoder_layer_0``,
  ``encoder_layer_1``, … (an ``nn.Sequential`` built from an ``OrderedDict``). Their segment
  folds to ``*`` when they are every child of their parent, so that ``*`` matches exactly them.
  A named family folds only when its members hold submodules (blocks): ``fc1``/``fc2`` of an
  MLP are two projections, not two layers.
- **Numbered steps** of a ``Sequential`` of leaf modules of several classes (``Linear, GELU,
  Dropout, Linear, Dropout``: torchvision's ``MLPBlock``) keep their numbers, so ``mlp.0`` and
  ``mlp.3`` are distinct patterns, one column-wise and one row-wise. Layers of several kinds in
  one list (Jamba's attention and Mamba layers) hold submodules and still fold.

What does not live here: reading the structure (:mod:`~hyperrecipe.suggest.structure`) and
translating it into rules (:mod:`~hyperrecipe.suggest.translate`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hyperrecipe.model_tree import ModuleInfo

__all__ = ["Folding"]

_TRAILING = re.compile(r"^(.*?)(\d+)$")


class Folding:
    """``fqn -> pattern`` for one model's modules (see the module doc).

    Built from ``(fqn, class, its children's FQNs)`` of every module;
    a FQN it was not built with folds its numeric segments (the fold of a list of layers).
    """

    def __init__(self, modules: Iterable[tuple[str, str, Sequence[str]]]) -> None:
        rows = list(modules)
        cls = {fqn: c for fqn, c, _ in rows}
        containers = {fqn for fqn, _, children in rows if children}
        self._known = frozenset(cls)
        self._repeated: set[str] = set()
        for _, _, children in rows:
            self._repeated.update(_repeated_children(children, cls, containers))
        self._cache: dict[str, str] = {}

    @classmethod
    def of_tree(cls, modules: Iterable[ModuleInfo]) -> Folding:
        """The folding of a :class:`~hyperrecipe.model_tree.ModelTree`'s modules."""
        return cls((m.fqn, m.cls, m.children) for m in modules)

    @classmethod
    def of_module(cls, model: nn.Module) -> Folding:
        """The folding of a live (or meta) module tree."""
        rows: list[tuple[str, str, Sequence[str]]] = []
        for fqn, m in model.named_modules():
            kind = f"{type(m).__module__}.{type(m).__qualname__}"
            rows.append((fqn, kind, tuple(f"{fqn}.{c}" if fqn else c
                                          for c, _ in m.named_children())))
        return cls(rows)

    def __call__(self, fqn: str) -> str:
        found = self._cache.get(fqn)
        if found is not None:
            return found
        parts = fqn.split(".")
        out = []
        for i, seg in enumerate(parts):
            prefix = ".".join(parts[:i + 1])
            out.append("*" if prefix in self._repeated or (
                seg.isdigit() and prefix not in self._known) else seg)
        folded = ".".join(out)
        self._cache[fqn] = folded
        return folded


def _repeated_children(children: Sequence[str], cls: dict[str, str],
                       containers: set[str]) -> set[str]:
    """The children of one parent that are repetitions of one block (folded to ``*``)."""
    if not children:
        return set()
    names = [c.rsplit(".", 1)[-1] for c in children]
    keys = []
    for name in names:
        m = _TRAILING.match(name)
        if m is None:
            return set()
        keys.append(m.group(1))
    if len(set(keys)) != 1:
        return set()
    key = keys[0]
    classes = {cls.get(c) for c in children}
    if key == "":  # numbered: a list of layers, unless numbered steps of mixed leaf modules
        if len(classes) > 1 and any(c not in containers for c in children):
            return set()
        return set(children)
    if len(classes) == 1 and all(c in containers for c in children):
        return set(children)
    return set()
