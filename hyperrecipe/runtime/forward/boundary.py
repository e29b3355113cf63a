"""The boundary wrapper: one body for both modes, built from plan data at install time.

``make_boundary_forward`` binds everything a call needs — which positional slot or keyword
holds each declared input, the converters the mode's redistributor built, where each declared
output sits in the result, the deferred bias — so a call only indexes and converts. The mode
shows nowhere in the body: it is in the converters it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ArgLayout, BoundaryPlan
from hyperrecipe.runtime.comm.shared_table import SharedTable
from hyperrecipe.runtime.forward.arguments import get_output, set_output
from hyperrecipe.runtime.forward.layouts import Converter, Redistributor, unchanged
from hyperrecipe.runtime.forward.marshal import map_tensors

__all__ = ["make_boundary_forward"]

Forward = Callable[..., Any]


def _gradient_free(convert: Converter, fqn: str) -> Converter:
    """An input the plan declared ``no_grad`` got no backward collective: refuse one that
    requires grad rather than let its gradient skip the communication it needs."""

    def guarded(value: Any, name: str) -> Any:
        if isinstance(value, Tensor) and value.requires_grad and torch.is_grad_enabled():
            msg = (f"{fqn}: input {name!r} is declared no_grad, but it requires grad; the plan "
                   f"has no backward collective for it, so its gradient would be wrong. Drop "
                   f"{name!r} from the boundary's no_grad (or detach it before the call)")
            raise PlanMismatchError(msg)
        return convert(value, name)

    return guarded


InputSlot = tuple[int | None, str, Converter]
"""``(position, name, converter)`` of a declared input a call converts."""

# The slots of the boundaries that convert only their inputs, and the (converter, name) of those
# that convert only their first output, by index (:func:`make_boundary_forward`).
_INPUT_SLOT_TABLE: SharedTable[tuple[InputSlot, ...], tuple[InputSlot, ...]] = SharedTable()
_INPUT_SLOTS = _INPUT_SLOT_TABLE.entries
_FIRST_OUTPUT_TABLE: SharedTable[tuple[Converter, str], tuple[Converter, str]] = SharedTable()
_FIRST_OUTPUTS = _FIRST_OUTPUT_TABLE.entries


def _input_slots(layouts: Sequence[ArgLayout], redist: Redistributor, boundary: BoundaryPlan
                 ) -> tuple[InputSlot, ...]:
    """The declared inputs a call must convert; one whose layout the plan leaves as it is
    (:func:`~hyperrecipe.runtime.forward.layouts.unchanged`) has no slot at all."""
    slots: list[InputSlot] = []
    for a in layouts:
        convert = redist.input_converter(boundary, a)
        if a.name in boundary.no_grad:
            convert = _gradient_free(convert, boundary.fqn)
        elif convert is unchanged:
            continue
        slots.append((a.position, a.name, convert))
    return tuple(slots)


def _convert_input(value: Any, name: str, convert: Converter) -> Any:
    """A declared input that is not one tensor: a tuple or list of tensors (a rotary
    ``(cos, sin)`` pair) has every tensor in it converted alike; anything else is given to the
    converter as it is (a no_grad guard, a validate-mode check)."""
    if isinstance(value, (tuple, list, dict)):
        return map_tensors(value, lambda t: convert(t, name))
    return convert(value, name)


def _convert_declared(inputs: Sequence[InputSlot], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> list[Any]:
    """The call's positional arguments with each declared input converted (``kwargs`` in
    place): ``map_declared`` for the hot path, a tensor converted without the walk."""
    args_l = list(args)
    for position, name, convert in inputs:
        if position is not None and position < len(args_l):
            v = args_l[position]
            args_l[position] = (convert(v, name) if isinstance(v, Tensor)
                                else _convert_input(v, name, convert))
        elif name in kwargs:
            v = kwargs[name]
            kwargs[name] = (convert(v, name) if isinstance(v, Tensor)
                            else _convert_input(v, name, convert))
    return args_l


def make_boundary_forward(
    boundary: BoundaryPlan,
    compute: Forward,
    redist: Redistributor,
    *,
    deferred_bias: nn.Parameter | None = None,
) -> Forward:
    """The forward installed on a boundary module.

    Everything a call needs is decided here, once: the declared inputs and outputs whose
    layout changes (the others are not looked at per call), the converters, and, when only
    output 0 is converted and nothing else is, a call path that converts a tensor result
    directly.

    Args:
        boundary: the plan's boundary entry.
        compute: what runs between the conversions (the class forward, or a local kernel).
        redist: the mode's converter factory (production or validate).
        deferred_bias: added to the first declared output right after its reduction (the
            redistributor's output converter does it, before any hand-back to local tensors).

    Returns:
        A callable accepting the module's forward arguments (positional or by keyword).
    """
    inputs = _input_slots(boundary.inputs, redist, boundary)
    converted = ((a.position if a.position is not None else 0, a.name,
                  redist.output_converter(boundary, a, deferred_bias if i == 0 else None))
                 for i, a in enumerate(boundary.outputs))
    outputs = tuple(o for o in converted if o[2] is not unchanged)
    undeclared = redist.undeclared_converter(boundary)
    finish = redist.finish_outputs(boundary)
    compute = redist.wrap_compute(boundary, compute)
    declared_positions = {a.position for a in boundary.inputs if a.position is not None}
    declared_names = {a.name for a in boundary.inputs}
    declared_outputs = {a.position if a.position is not None else 0 for a in boundary.outputs}
    names = boundary.out_names
    first_only = (undeclared is None and finish is None and len(outputs) == 1
                  and outputs[0][0] == 0)
    first_name = outputs[0][1] if outputs else ""
    first_convert = outputs[0][2] if outputs else unchanged

    # Two shapes most boundaries have (a block takes its input, a row-parallel linear hands its
    # output back), as bodies that read one cell of their own besides ``compute``: their slots
    # come from a module-level table by index, shared by every boundary with the same ones
    # (eight layers' MLPs: one entry), because under torch.compile dynamo guards what a body
    # reads on every call, once per boundary through a closure, once per graph through a
    # global (comm/shared_table.py; docs/benchmarks.md, the compiled gap).
    if undeclared is None and finish is None:
        if first_only and not inputs:
            out_key = (first_convert, first_name)
            out_index = _FIRST_OUTPUT_TABLE.acquire(out_key, lambda: out_key)

            def output_only(*args: Any, **kwargs: Any) -> Any:
                out = compute(*args, **kwargs)
                convert, name = _FIRST_OUTPUTS[out_index]
                if isinstance(out, Tensor):
                    return convert(out, name)
                if type(out) is tuple and out and out[0] is not None:
                    return (convert(out[0], name), *out[1:])
                value = get_output(out, 0, name)
                if value is not None:
                    out = set_output(out, 0, name, convert(value, name))
                return out

            _FIRST_OUTPUT_TABLE.release_with(output_only, out_key, out_index)
            return output_only
        if inputs and not outputs:
            in_index = _INPUT_SLOT_TABLE.acquire(inputs, lambda: inputs)

            def inputs_only(*args: Any, **kwargs: Any) -> Any:
                return compute(*_convert_declared(_INPUT_SLOTS[in_index], args, kwargs),
                               **kwargs)

            _INPUT_SLOT_TABLE.release_with(inputs_only, inputs, in_index)
            return inputs_only

    def forward(*args: Any, **kwargs: Any) -> Any:
        call: Sequence[Any] = args
        if inputs:
            call = _convert_declared(inputs, args, kwargs)
        if undeclared is not None:
            call = args_l = list(call)
            for i, v in enumerate(args_l):
                if i not in declared_positions:
                    args_l[i] = undeclared(v, f"#{i}")
            for k, v in kwargs.items():
                if k not in declared_names:
                    kwargs[k] = undeclared(v, k)
        out = compute(*call, **kwargs)
        if first_only:
            if isinstance(out, Tensor):
                return first_convert(out, first_name)
            # get_output / set_output on a tuple, inlined: (attn_output, attn_weights)
            if type(out) is tuple and out and out[0] is not None:
                return (first_convert(out[0], first_name), *out[1:])
        for position, name, convert in outputs:
            value = get_output(out, position, name)
            if value is not None:
                out = set_output(out, position, name, convert(value, name))
        if finish is not None:
            if isinstance(out, Tensor):
                if 0 not in declared_outputs:
                    out = finish(out, "output")
            elif isinstance(out, tuple):
                out = tuple(v if i in declared_outputs else finish(v, names[i] if i < len(names)
                                                               else f"output {i}")
                            for i, v in enumerate(out))
        return out

    return forward
