"""The Python lint rules, one module each; :data:`ALL_RULES` in code order.

``forward_assignment`` (HR001), ``forward_setattr`` (HR002), ``forward_dict`` (HR003),
``class_swap`` (HR004), ``process_patch`` (HR005: a patch of an imported module or class
outside the rewriter), and ``_patterns``: the assignment targets, setattr-like calls and
namespace dicts several rules match.

Importing this package imports libcst. The registry in :mod:`hyperrecipe.lint.codes` carries
the same codes and names without that cost.
"""

from __future__ import annotations

from typing import Final

from hyperrecipe.lint.rule import LintRule
from hyperrecipe.lint.rules.class_swap import ClassSwap
from hyperrecipe.lint.rules.forward_assignment import ForwardAssignment
from hyperrecipe.lint.rules.forward_dict import ForwardDict
from hyperrecipe.lint.rules.forward_setattr import ForwardSetattr
from hyperrecipe.lint.rules.process_patch import ProcessPatch

__all__ = ["ALL_RULES", "ClassSwap", "ForwardAssignment", "ForwardDict", "ForwardSetattr",
           "ProcessPatch"]

ALL_RULES: Final[tuple[type[LintRule], ...]] = (
    ForwardAssignment,
    ForwardSetattr,
    ForwardDict,
    ClassSwap,
    ProcessPatch,
)
