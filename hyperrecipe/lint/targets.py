"""The attribute names the gate guards: one source of truth for the rules and the screen.

A leaf module (no libcst, no ``ast``), so the screen (``prefilter``) and the rule base
(``rule``) both read it and neither depends on the other.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ENTRY_NAMES", "METADATA_NAMES", "PATCHED_METHOD_NAMES", "SCREENED_NAMES",
           "TARGET_NAMES"]

#: The attributes that decide what ``m(x)`` runs: ``forward``, the ``nn.Module.__call__``
#: implementations it dispatches through (``_call_impl``, and the ``_compiled_call_impl`` that
#: ``Module.compile`` installs), and ``__call__`` itself.
ENTRY_NAMES: Final = frozenset({"forward", "_call_impl", "_compiled_call_impl", "__call__"})
#: Attribute names whose assignment the gate forbids.
TARGET_NAMES: Final = ENTRY_NAMES | {"__class__"}
#: ``nn.Module`` methods that are patched per instance to change what every device move, cast
#: and ``to_empty`` does (HR005 reports their assignment on any receiver).
PATCHED_METHOD_NAMES: Final = frozenset({"_apply"})
#: Attributes that only describe an object (where it is documented, what it is called): setting
#: them on an imported function or class is not a patch (HR005 lets them be).
METADATA_NAMES: Final = frozenset({"__doc__", "__module__", "__name__", "__qualname__"})
#: Every attribute name the screen looks for.
SCREENED_NAMES: Final = TARGET_NAMES | PATCHED_METHOD_NAMES
