"""``KnownZerosOnMeta``: ``bool(t.any())`` of a meta tensor is answered only where the tensor was
made zeros and nothing has written to it since; every other value stays unknown (the meta
device's own error), so verification stops there as before instead of guessing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from hyperrecipe.verify.known_zeros import KnownZerosOnMeta

NO_VALUE = "cannot be called on meta tensors"


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(2, 3, device="meta"),
    lambda: torch.zeros_like(torch.empty(2, 3, device="meta")),
    lambda: torch.empty(2, 3, device="meta").new_zeros(4),
    lambda: torch.empty(2, 3, device="meta").zero_(),
], ids=["zeros", "zeros_like", "new_zeros", "zero_"])
def test_any_of_a_tensor_made_zeros_is_false(make: Callable[[], Tensor]) -> None:
    with KnownZerosOnMeta():
        t = make()
        assert not bool(t.any())
        assert not bool(torch.any(t))
        assert t.any().item() is False


@pytest.mark.parametrize("write", [
    lambda t: t.add_(1),
    lambda t: t[0].fill_(1),  # through a view: the version counter is the storage's
    lambda t: t.copy_(torch.ones(2, 3, device="meta")),
    lambda t: t.detach().fill_(1),  # detach() shares the version counter
    lambda t: t.data.fill_(1),  # .data does not: the tensor is forgotten
], ids=["in_place", "through_a_view", "copy_", "detach", "data"])
def test_a_tensor_written_after_it_was_made_zeros_has_no_known_value(
        write: Callable[[Tensor], object]) -> None:
    with KnownZerosOnMeta():
        t = torch.zeros(2, 3, device="meta")
        write(t)
        with pytest.raises(RuntimeError, match=NO_VALUE):
            bool(t.any())


def test_values_not_known_by_construction_stay_unknown() -> None:
    with KnownZerosOnMeta():
        zeros = torch.zeros(2, 3, device="meta")
        for t in (torch.empty(2, 3, device="meta"), torch.ones(2, 3, device="meta"),
                  zeros + 0):  # a result computed from zeros is not tracked
            with pytest.raises(RuntimeError, match=NO_VALUE):
                bool(t.any())
        with pytest.raises(RuntimeError, match=NO_VALUE):
            bool(zeros.any(dim=0)[0])  # only the reduction over all elements is answered
        flag = zeros.any()
        flag.logical_not_()  # the answer itself written: no longer known
        with pytest.raises(RuntimeError, match=NO_VALUE):
            bool(flag)


def test_outside_the_mode_nothing_is_answered() -> None:
    with KnownZerosOnMeta():
        t = torch.zeros(2, device="meta")
    with pytest.raises(RuntimeError, match=NO_VALUE):
        bool(t.any())
