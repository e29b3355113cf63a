"""The rewriter: signature validation, atomic install with rollback, restore, double installs."""

from __future__ import annotations

import gc
import inspect
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe.errors import RewriteError
from hyperrecipe.rewriter import (
    Rewrite,
    Rewritten,
    installed_forward_owner,
    validate_signature,
)

# --------------------------------------------------------------------------------------------
# validate_signature (pure)
# --------------------------------------------------------------------------------------------


def _original(x: Any, mask: Any = None) -> None: ...


def _message(original: Any, replacement: Any, **kwargs: Any) -> str:
    with pytest.raises(RewriteError) as info:
        validate_signature(original, replacement, fqn="layers.0.attn", **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    "replacement",
    [
        lambda x, mask=None: None,
        lambda x, mask=None, scale=1.0: None,
        lambda *args, **kwargs: None,
        lambda x, *args, **kwargs: None,
        lambda x, mask=None, **kwargs: None,
    ],
    ids=["same", "extra-optional", "var-args-and-kwargs", "x-then-var", "kwargs-only-extra"],
)
def test_replacement_accepting_every_original_argument_is_valid(replacement: Any) -> None:
    validate_signature(_original, replacement, fqn="layers.0.attn")


def test_missing_argument_is_named_with_both_signatures() -> None:
    assert _message(_original, lambda x: None) == (
        "layers.0.attn: the replacement forward (x) cannot stand in for "
        "forward(x, mask=None): does not accept argument 'mask'"
    )


def test_swapped_positions_name_both_arguments() -> None:
    def original(x: Any, mask: Any) -> None: ...

    assert _message(original, lambda mask, x: None) == (
        "layers.0.attn: the replacement forward (mask, x) cannot stand in for "
        "forward(x, mask): takes 'x' at position 1, the original forward at "
        "position 0; takes 'mask' at position 0, the original forward at position 1"
    )


def test_different_name_in_a_positional_slot_is_rejected() -> None:
    def original(x, mask): ...  # type: ignore[no-untyped-def]

    assert _message(original, lambda x, attention_mask: None) == (
        "layers.0.attn: the replacement forward (x, attention_mask) cannot stand in for "
        "forward(x, mask): has 'attention_mask' at position 1 where the original forward has "
        "'mask'; requires argument 'attention_mask', which the original forward does not have"
    )


def test_keyword_only_replacement_breaks_positional_callers() -> None:
    def original(x, mask): ...  # type: ignore[no-untyped-def]

    def replacement(x, *, mask): ...  # type: ignore[no-untyped-def]

    assert _message(original, replacement) == (
        "layers.0.attn: the replacement forward (x, *, mask) cannot stand in for "
        "forward(x, mask): accepts 'mask' only by keyword; the original forward takes it at "
        "position 1"
    )


def test_var_args_without_kwargs_does_not_cover_keyword_callers() -> None:
    def original(x, mask): ...  # type: ignore[no-untyped-def]

    assert _message(original, lambda x, *args: None) == (
        "layers.0.attn: the replacement forward (x, *args) cannot stand in for "
        "forward(x, mask): does not accept 'mask' by keyword (it has *args but no **kwargs)"
    )


def test_kwargs_without_var_args_does_not_cover_positional_callers() -> None:
    def original(x, mask): ...  # type: ignore[no-untyped-def]

    assert _message(original, lambda x, **kwargs: None) == (
        "layers.0.attn: the replacement forward (x, **kwargs) cannot stand in for "
        "forward(x, mask): does not accept 'mask' at position 1 (no parameter there and no *args)"
    )


def test_required_parameter_the_original_makes_optional_is_rejected() -> None:
    assert _message(_original, lambda x, mask: None) == (
        "layers.0.attn: the replacement forward (x, mask) cannot stand in for "
        "forward(x, mask=None): requires 'mask', which the original forward makes optional"
    )


def test_original_var_args_and_kwargs_must_be_accepted() -> None:
    def original(x, *rest, **options): ...  # type: ignore[no-untyped-def]

    assert _message(original, lambda x: None) == (
        "layers.0.attn: the replacement forward (x) cannot stand in for "
        "forward(x, *rest, **options): does not accept extra positional arguments (*rest); "
        "does not accept extra keyword arguments (**options)"
    )


def test_positional_only_original_arguments_need_the_slot_not_the_name() -> None:
    def original(x, /): ...  # type: ignore[no-untyped-def]

    validate_signature(original, lambda inp: None, fqn="m")


def test_required_mode_lets_a_compute_function_drop_optional_arguments() -> None:
    def original(x, mask=None, *rest, **options): ...  # type: ignore[no-untyped-def]

    validate_signature(original, lambda x: None, fqn="m", require="required")
    assert _message(original, lambda: None, require="required") == (
        "layers.0.attn: the replacement forward () cannot stand in for "
        "forward(x, mask=None, *rest, **options): does not accept argument 'x'"
    )


def test_signatures_can_be_validated_without_callables() -> None:
    original = inspect.Signature([inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    validate_signature(original, inspect.signature(lambda x: x), fqn="m")


def test_uncallable_replacement_is_reported() -> None:
    assert _message(_original, 3) == (
        "layers.0.attn: the replacement forward is not callable (got int)"
    )


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.num_heads = 4

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self.proj(x)
        return out


def _doubled(block: Block) -> Any:
    def forward(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = 2 * block.proj(x)
        return out

    return forward


def _assert_pristine(block: Block) -> None:
    assert "forward" not in vars(block)
    assert block.forward.__func__ is Block.forward  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# install_forward / restore
# --------------------------------------------------------------------------------------------


def test_installed_forward_is_called_and_restore_returns_the_class_forward() -> None:
    block, x = Block(), torch.ones(1, 4)
    expected = block(x)
    with Rewrite(label="apply") as tx:
        tx.install_forward(block, _doubled(block), fqn="block")
    torch.testing.assert_close(block(x), 2 * expected, rtol=0, atol=0)
    assert installed_forward_owner(block) == "apply"

    tx.result.restore()
    _assert_pristine(block)
    assert installed_forward_owner(block) is None
    torch.testing.assert_close(block(x), expected, rtol=0, atol=0)


def test_records_follow_each_entry_through_install_and_restore() -> None:
    block = Block()
    with Rewrite(label="apply") as tx:
        tx.install_forward(block, _doubled(block), fqn="block", companions={"_hr_spec": "spec"})
        tx.set_attribute(block, "num_heads", 2, fqn="block")
    rows = [(r.fqn, r.kind, r.what, r.state, r.error) for r in tx.result.records]
    assert rows == [
        ("block", "forward", "forward", "installed", None),
        ("block", "companion", "_hr_spec", "installed", None),
        ("block", "attribute", "num_heads", "installed", None),
    ]
    tx.result.restore()
    assert [r.state for r in tx.result.records] == ["restored"] * 3
    assert tx.result.restored


def test_companions_are_set_and_removed_or_put_back_with_the_forward() -> None:
    block = Block()
    block._hr_old = "before"  # type: ignore[assignment]
    helper = nn.Linear(2, 2)
    with Rewrite() as tx:
        tx.install_forward(
            block, _doubled(block), fqn="block", companions={"_hr_helper": helper, "_hr_old": 1}
        )
    assert block._hr_helper is helper
    assert "_hr_helper" not in dict(block.named_children())  # not registered as a submodule
    assert block._hr_old == 1
    tx.result.restore()
    assert not hasattr(block, "_hr_helper")
    assert block._hr_old == "before"


def test_an_instance_forward_present_before_install_is_put_back() -> None:
    block = Block()
    earlier = _doubled(block)
    # hyperrecipe: ignore[HR002] -- a foreign forward the rewriter must preserve
    object.__setattr__(block, "forward", earlier)
    with Rewrite() as tx:
        tx.install_forward(block, lambda x, mask=None: x, fqn="block")
    tx.result.restore()
    assert vars(block)["forward"] is earlier


def test_installing_twice_in_one_transaction_is_an_error_not_a_double_wrap() -> None:
    block = Block()
    with pytest.raises(RewriteError) as info, Rewrite(label="apply") as tx:
        tx.install_forward(block, _doubled(block), fqn="layers.0")
        tx.install_forward(block, _doubled(block), fqn="layers.0")
    assert str(info.value) == (
        "layers.0: a forward from rewrite 'apply' is already installed; restore it before "
        "installing another (hyperrecipe never wraps twice)"
    )
    _assert_pristine(block)


def test_installing_over_an_unrestored_earlier_rewrite_is_an_error() -> None:
    block = Block()
    with Rewrite(label="first") as first:
        first.install_forward(block, _doubled(block), fqn="layers.0")
    installed = vars(block)["forward"]
    with pytest.raises(RewriteError, match="from rewrite 'first' is already installed"):
        with Rewrite(label="second") as second:
            second.install_forward(block, _doubled(block), fqn="layers.0")
    assert vars(block)["forward"] is installed  # the first install is untouched

    first.result.restore()
    with Rewrite(label="third") as third:  # allowed again once restored
        third.install_forward(block, _doubled(block), fqn="layers.0")
    third.result.restore()
    _assert_pristine(block)


def test_restoring_twice_is_an_error() -> None:
    block = Block()
    with Rewrite(label="apply") as tx:
        tx.install_forward(block, _doubled(block), fqn="block")
    tx.result.restore()
    with pytest.raises(RewriteError) as info:
        tx.result.restore()
    assert str(info.value) == "rewrite 'apply' was already restored"


def test_signature_mismatch_names_the_module_and_installs_nothing() -> None:
    block = Block()
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        tx.install_forward(block, lambda x: x, fqn="layers.3.mlp")
    assert str(info.value) == (
        "layers.3.mlp: the replacement forward (x) cannot stand in for "
        "forward(x, mask=None): does not accept argument 'mask'"
    )
    _assert_pristine(block)
    assert [(r.state, r.error) for r in tx.records] == [("failed", str(info.value))]


def test_a_companion_named_forward_is_refused() -> None:
    block = Block()
    with pytest.raises(RewriteError, match="a companion cannot be named 'forward'"):
        with Rewrite() as tx:
            tx.install_forward(block, _doubled(block), fqn="b", companions={"forward": 1})
    _assert_pristine(block)


# --------------------------------------------------------------------------------------------
# Atomicity
# --------------------------------------------------------------------------------------------


def test_failure_midway_rolls_back_forwards_companions_attributes_and_parameters() -> None:
    first, second, third = Block(), Block(), Block()
    original_weight = second.proj.weight
    with pytest.raises(RewriteError, match="third: the replacement forward"):
        with Rewrite(label="apply") as tx:
            tx.install_forward(first, _doubled(first), fqn="first", companions={"_hr_spec": 1})
            tx.set_attribute(second, "num_heads", 2, fqn="second")
            tx.replace_parameter(
                second.proj, "weight", nn.Parameter(torch.zeros(2, 4)), fqn="second.proj"
            )
            tx.install_forward(third, lambda x: x, fqn="third")  # bad signature: fails here
            tx.set_attribute(third, "num_heads", 1, fqn="third")  # never reached
    _assert_pristine(first)
    assert not hasattr(first, "_hr_spec")
    assert installed_forward_owner(first) is None
    assert second.num_heads == 4
    assert second.proj.weight is original_weight
    _assert_pristine(third)
    assert [(r.fqn, r.what, r.state) for r in tx.records] == [
        ("first", "forward", "restored"),
        ("first", "_hr_spec", "restored"),
        ("second", "num_heads", "restored"),
        ("second.proj", "weight", "restored"),
        ("third", "forward", "failed"),
    ]
    with pytest.raises(RewriteError, match="it is rolled back, not committed"):
        tx.result  # noqa: B018


def test_any_exception_in_the_block_rolls_back_and_propagates_unchanged() -> None:
    block = Block()
    boom = RuntimeError("trainer failed while applying")
    with pytest.raises(RuntimeError) as info:
        with Rewrite() as tx:
            tx.install_forward(block, _doubled(block), fqn="block")
            raise boom
    assert info.value is boom
    _assert_pristine(block)


def test_a_failed_companion_undoes_its_forward_even_if_the_caller_carries_on() -> None:
    class WithReadOnly(Block):
        @property
        def frozen(self) -> int:
            return 0

    block = WithReadOnly()
    with Rewrite() as tx:
        with pytest.raises(AttributeError):
            tx.install_forward(block, _doubled(block), fqn="b", companions={"frozen": 1})
        _assert_pristine(block)  # the forward went with its companion
    assert [(r.what, r.state) for r in tx.result.records] == [
        ("forward", "restored"),
        ("frozen", "failed"),
    ]


def test_a_rollback_that_cannot_undo_an_entry_says_so_on_the_exception() -> None:
    block = Block()
    foreign = _doubled(block)
    with pytest.raises(RuntimeError) as info:
        with Rewrite(label="apply") as tx:
            tx.install_forward(block, _doubled(block), fqn="block")
            # hyperrecipe: ignore[HR003] -- simulates someone else's overwrite
            vars(block)["forward"] = foreign
            raise RuntimeError("later step failed")
    assert vars(block)["forward"] is foreign  # left alone, not clobbered
    assert info.value.__notes__ == [
        "hyperrecipe: rollback of rewrite 'apply' failed for block (forward): block: forward "
        "was changed after it was installed; leaving it as is rather than overwriting someone "
        "else's change"
    ]
    assert tx.records[0].state == "failed"


def test_restore_reports_entries_it_cannot_undo_and_restores_the_rest() -> None:
    first, second = Block(), Block()
    with Rewrite(label="apply") as tx:
        tx.install_forward(first, _doubled(first), fqn="first")
        tx.install_forward(second, _doubled(second), fqn="second")
    # hyperrecipe: ignore[HR003] -- simulates a foreign overwrite
    vars(first)["forward"] = lambda x, mask=None: x
    with pytest.raises(RewriteError) as info:
        tx.result.restore()
    assert str(info.value) == (
        "rewrite 'apply': could not restore first (forward): first: forward was changed after "
        "it was installed; leaving it as is rather than overwriting someone else's change"
    )
    _assert_pristine(second)
    assert [r.state for r in tx.result.records] == ["failed", "restored"]


def test_changes_outside_an_open_transaction_are_refused() -> None:
    block = Block()
    tx = Rewrite(label="apply")
    with pytest.raises(RewriteError) as info:
        tx.install_forward(block, _doubled(block), fqn="block")
    assert str(info.value) == (
        "block: rewrite 'apply' is new; changes go inside 'with Rewrite(...) as tx:'"
    )
    with tx:
        pass
    with pytest.raises(RewriteError, match="rewrite 'apply' is committed"):
        tx.set_attribute(block, "num_heads", 1, fqn="block")
    with pytest.raises(RewriteError, match="cannot be opened twice"):
        with tx:
            pass
    assert isinstance(tx.result, Rewritten)


# --------------------------------------------------------------------------------------------
# set_attribute / replace_parameter
# --------------------------------------------------------------------------------------------


def test_set_attribute_restores_the_previous_value_or_removes_a_new_one() -> None:
    block = Block()
    with Rewrite() as tx:
        tx.set_attribute(block, "num_heads", 1, fqn="b")
        tx.set_attribute(block, "head_dim", 8, fqn="b")
    assert (block.num_heads, getattr(block, "head_dim")) == (1, 8)
    tx.result.restore()
    assert block.num_heads == 4
    assert not hasattr(block, "head_dim")


def test_set_attribute_goes_through_a_property_setter_and_back() -> None:
    class Config:
        def __init__(self) -> None:
            self._heads = 8

        @property
        def heads(self) -> int:
            return self._heads

        @heads.setter
        def heads(self, value: int) -> None:
            self._heads = value

    config = Config()
    with Rewrite() as tx:
        tx.set_attribute(config, "heads", 2, fqn="config")
    assert config.heads == 2
    tx.result.restore()
    assert config.heads == 8


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("forward", print, "b: set_attribute cannot change 'forward' (use install_forward)"),
        ("__class__", Block, "b: set_attribute cannot change '__class__'"),
        ("proj", 1, "b: 'proj' is in _modules; set_attribute changes plain attributes only"),
        (
            "scale",
            nn.Parameter(torch.ones(1)),
            "b: set_attribute cannot assign a Parameter to 'scale'; use replace_parameter for "
            "parameters",
        ),
    ],
)
def test_set_attribute_refuses_what_has_a_dedicated_path(
    name: str, value: object, message: str
) -> None:
    block = Block()
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        tx.set_attribute(block, name, value, fqn="b")
    assert str(info.value) == message
    _assert_pristine(block)


def test_replace_parameter_without_on_restore_puts_back_the_very_same_parameter() -> None:
    block = Block()
    original = block.proj.weight
    shard = nn.Parameter(torch.zeros(2, 4))
    with Rewrite() as tx:
        tx.replace_parameter(block.proj, "weight", shard, fqn="proj")
    assert block.proj.weight is shard
    assert dict(block.proj.named_parameters())["weight"] is shard
    tx.result.restore()
    assert block.proj.weight is original


def test_replace_parameter_with_on_restore_drops_the_original_after_commit() -> None:
    block = Block()
    original_ref = weakref.ref(block.proj.weight)
    rebuilt = nn.Parameter(torch.full((4, 4), 3.0))
    with Rewrite() as tx:
        tx.replace_parameter(
            block.proj, "weight", nn.Parameter(torch.zeros(2, 4)), fqn="proj",
            on_restore=lambda: rebuilt,
        )
    gc.collect()
    assert original_ref() is None  # no full copy is kept alive by the memento
    tx.result.restore()
    assert block.proj.weight is rebuilt


def test_replace_parameter_rollback_uses_the_kept_original_even_with_on_restore() -> None:
    block = Block()
    original = block.proj.weight
    calls: list[int] = []

    def rebuild() -> nn.Parameter:
        calls.append(1)
        return nn.Parameter(torch.zeros(4, 4))

    with pytest.raises(RuntimeError), Rewrite() as tx:
        tx.replace_parameter(
            block.proj, "weight", nn.Parameter(torch.zeros(2, 4)), fqn="proj", on_restore=rebuild
        )
        raise RuntimeError("later step failed")
    assert block.proj.weight is original
    assert calls == []


def test_replace_parameter_names_the_known_parameters_when_the_name_is_wrong() -> None:
    block = Block()
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        tx.replace_parameter(block.proj, "weigth", nn.Parameter(torch.zeros(1)), fqn="proj")
    assert str(info.value) == (
        "proj: Linear has no parameter 'weigth'; did you mean 'weight'? "
        "(parameters: ['weight', 'bias'])"
    )


def test_replace_parameter_refuses_a_plain_tensor() -> None:
    block = Block()
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        plain: Any = torch.zeros(1)
        tx.replace_parameter(block.proj, "weight", plain, fqn="proj")
    assert str(info.value) == (
        "proj: the replacement for parameter 'weight' is a Tensor, not torch.nn.Parameter"
    )


# --------------------------------------------------------------------------------------------
# install_method (class-level adapters)
# --------------------------------------------------------------------------------------------


class Base:
    def greet(self, name: str) -> str:
        return f"hello {name}"

    @staticmethod
    def scale(x: int) -> int:
        return x


class Child(Base):
    def shout(self, name: str) -> str:
        return name.upper()


def test_method_defined_on_the_class_is_restored_to_the_same_function() -> None:
    original = vars(Child)["shout"]
    with Rewrite() as tx:
        tx.install_method(Child, "shout", lambda self, name: "patched", fqn="Child.shout")
    assert Child().shout("x") == "patched"
    tx.result.restore()
    assert vars(Child)["shout"] is original


def test_inherited_method_is_removed_again_on_restore() -> None:
    with Rewrite() as tx:
        tx.install_method(Child, "greet", lambda self, name: "patched", fqn="Child.greet")
    assert Child().greet("x") == "patched"
    assert Base().greet("x") == "hello x"
    tx.result.restore()
    assert "greet" not in vars(Child)
    assert Child().greet("x") == "hello x"


def test_staticmethod_is_replaced_by_a_staticmethod_and_restored_exactly() -> None:
    original = vars(Base)["scale"]
    with Rewrite() as tx:
        tx.install_method(Base, "scale", staticmethod(lambda x: 2 * x), fqn="Base.scale")
    assert Base.scale(3) == 6
    tx.result.restore()
    assert vars(Base)["scale"] is original


def test_method_kind_mismatch_is_refused() -> None:
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        tx.install_method(Base, "scale", lambda x: x, fqn="Base.scale")
    assert str(info.value) == (
        "Base.scale: Base.scale is a staticmethod; the replacement is a plain method"
    )
    assert Base.scale(3) == 3


def test_method_signature_is_validated_including_self() -> None:
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        tx.install_method(Child, "shout", lambda self: "x", fqn="Child.shout")
    assert str(info.value) == (
        "Child.shout: the replacement Child.shout (self) cannot stand in for "
        "Child.shout(self, name): does not accept argument 'name'"
    )


def test_installing_a_method_twice_without_restore_is_an_error() -> None:
    with Rewrite(label="adapters") as tx:
        tx.install_method(Child, "shout", lambda self, name: name, fqn="Child.shout")
    with pytest.raises(RewriteError) as info, Rewrite() as again:
        again.install_method(Child, "shout", lambda self, name: name, fqn="Child.shout")
    assert str(info.value) == (
        "Child.shout: Child.shout from rewrite 'adapters' is already installed; restore it "
        "before installing another"
    )
    tx.result.restore()


def test_missing_method_is_reported() -> None:
    with pytest.raises(RewriteError) as info, Rewrite() as tx:
        tx.install_method(Child, "whisper", lambda self: None, fqn="Child.whisper")
    assert str(info.value) == "Child.whisper: Child has no method 'whisper'"
