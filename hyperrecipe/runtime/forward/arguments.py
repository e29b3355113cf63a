"""Finding declared arguments and outputs in a call: by position, else by name.

A plan names each declared input with its position in ``forward``'s signature (``None`` for
keyword-only) and its name, because callers pass the same argument either way
(``attn(hidden_states=h)`` and ``attn(h)``). Boundaries, local regions and anything else that
touches declared inputs bind ``(position, name, fn)`` slots once at install time and call
:func:`map_declared` per call. Outputs are found the same way everywhere (a tensor is output 0,
a mapping such as ``ModelOutput`` is read by name, a tuple by position), so that what
``hyperrecipe check`` records is exactly what the boundary converted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["Slot", "declared_argument", "get_output", "map_declared", "set_output"]

Slot = tuple[int | None, str, Callable[[Any], Any]]
"""``(position, name, fn)``: where a declared argument sits and what to do with it."""


def map_declared(args: list[Any], kwargs: MutableMapping[str, Any], slots: Sequence[Slot]) -> None:
    """Replace each declared argument present in the call with ``fn(value)``, in place; an
    argument the call leaves out (a default) is left alone."""
    for position, name, fn in slots:
        if position is not None and position < len(args):
            args[position] = fn(args[position])
        elif name in kwargs:
            kwargs[name] = fn(kwargs[name])


def declared_argument(args: Sequence[Any], kwargs: Mapping[str, Any], position: int | None,
                      name: str) -> Any:
    """The value a call passes for one declared argument, or ``None`` when it passes none."""
    if position is not None and position < len(args):
        return args[position]
    return kwargs.get(name)


def get_output(out: Any, position: int, name: str) -> Any:
    """One declared output of a forward's result, or ``None`` when the result lacks it."""
    if isinstance(out, Tensor):
        return out if position == 0 else None
    if isinstance(out, Mapping):  # ModelOutput and dicts: by name
        return out.get(name)
    if isinstance(out, (tuple, list)) and position < len(out):
        return out[position]
    return None


def set_output(out: Any, position: int, name: str, value: Any) -> Any:
    """``out`` with one declared output replaced (a mapping in place; a tuple rebuilt)."""
    if isinstance(out, Tensor):
        return value
    if isinstance(out, Mapping):
        out[name] = value  # type: ignore[index]
        return out
    items = list(out)
    items[position] = value
    return type(out)(items) if isinstance(out, list) else tuple(items)
