"""Zeros known by construction, answered on the meta device where validate mode asks for them.

Validate mode takes a plain tensor that meets DTensors as replicated when it is **zeros that
carry no gradient** (:mod:`~hyperrecipe.runtime.forward.plain_tensors`): the state a recurrence
starts from, ``torch.zeros(batch, intermediate_size, state)`` in transformers' torch Mamba scan
(Mamba, Jamba, and every model built on that mixer). It asks ``bool(t.any())``, and on the meta
device that is ``Tensor.item()``, which has no value to read: the step stopped there, before the
mixer's backward, so its partial gradients were never seen.

Whether such a tensor is zeros does not need its values: it was made zeros (``torch.zeros``,
``torch.zeros_like``, ``Tensor.new_zeros``, ``Tensor.zero_``) and nothing has written to it
since. PyTorch counts every in-place write to a tensor, through itself or any view or
``detach()`` of it, in the version counter they share (``Tensor._version``, the counter autograd
checks saved tensors against), so "made zeros at version ``v`` and still at version ``v``"
holds. ``.data`` makes an alias that does not share the counter: a tensor it is taken of is
forgotten. The one route this mode cannot see is ``set_`` (another tensor put onto the zeros'
storage and written through), which torch does not pass through ``__torch_function__``; model
code does not write a state it has just made that way. While the verification step runs, this
mode records the meta tensors such factories return with their version, and answers two
questions about them with the value they hold:

- ``t.any()`` (over all elements: no ``dim``) of a tensor still at its recorded version is
  computed as usual (a meta scalar) and recorded as known ``False``;
- ``bool()`` and ``.item()`` of a scalar recorded so return that value.

Any other value a step asks for on the meta device still fails as before (the step stops and
the record notes it). That is deliberate: the alternatives do not hold. Fake tensors with a
``ShapeEnv`` turn ``t.any()`` into an unbacked symbol, but ``bool()`` of it still has to be
decided and raises ``GuardOnDataDependentSymNode`` (for ``torch.zeros(2, 3).any()`` too: fake
tensors keep no values); deciding it without the value would pick a branch the real run may not
take, a false refusal or a missed finding either way.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["KnownZerosOnMeta"]

_MAKE_ZEROS = frozenset({torch.zeros, torch.zeros_like, Tensor.new_zeros})
"""Factories whose result is zeros."""

_ANSWERED = frozenset({Tensor.__bool__, Tensor.item})
"""Reads of a scalar's value that a known scalar answers."""

_ANY = frozenset({torch.any, Tensor.any})

_DATA: Any = inspect.getattr_static(Tensor, "data").__get__
"""``.data``: an alias of the tensor without its version counter (writes to it are not counted)."""


def _plain_meta(t: Any) -> bool:
    """A plain tensor (no subclass such as DTensor) on the meta device, with a version counter
    (not an inference tensor)."""
    return (type(t) in (Tensor, torch.nn.Parameter) and bool(t.is_meta)
            and not t.is_inference())


def _unwritten(table: WeakIdKeyDictionary, t: Any) -> bool:
    """``t`` is in ``table`` and still at the version recorded there."""
    return _plain_meta(t) and t in table and bool(table[t] == t._version)


class KnownZerosOnMeta(TorchFunctionMode):
    """Inside: ``bool(t.any())`` of a meta tensor made zeros and not written since is ``False``
    (see the module docstring); every other op runs as it would without the mode."""

    def __init__(self) -> None:
        super().__init__()
        self._zeros = WeakIdKeyDictionary()
        """Meta tensors made zeros, with the version they were zeros at."""
        self._false = WeakIdKeyDictionary()
        """Meta scalars known to be ``False`` (``any()`` of zeros), with their version."""

    def _forget(self, t: Any) -> None:
        for table in (self._zeros, self._false):
            if t in table:
                del table[t]

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ANSWERED and len(args) == 1 and not kwargs and _unwritten(self._false,
                                                                              args[0]):
            return False
        if func == _DATA:
            self._forget(args[0])
        out = func(*args, **kwargs)
        if func in _ANY and len(args) == 1 and not kwargs and _unwritten(self._zeros, args[0]):
            if _plain_meta(out) and out.dim() == 0:
                self._false[out] = out._version
        elif func in _MAKE_ZEROS and _plain_meta(out):
            self._zeros[out] = out._version
        elif func is Tensor.zero_ and args and _plain_meta(args[0]):
            self._zeros[args[0]] = args[0]._version
        return out
