"""Every patch of code hyperrecipe does not own is declared in one table and undone.

- ``PROCESS_PATCHES`` names exactly what the package patches: the held patches are exactly the
  keys the guards hand the rewriter (both branches of torch's clipping internals), each
  transaction or registration entry is made by its supplier and nowhere else in the package
  (a scan for torch's global-registry functions), and the lint (HR005) finds no other patch of
  an imported module in the package;
- each held patch goes in on the first hold, is not wrapped twice, and the last release puts
  torch's original back; another library's patch over ours (also one made with
  ``functools.wraps``, which copies our attributes) is left in place; a failing builder undoes
  what its call installed; undeclared keys are refused by name;
- the guards and ``keep_non_persistent_buffers`` restore each original on removal.
"""

from __future__ import annotations

import ast
import functools
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe.errors import RewriteError
from hyperrecipe.process_patches import (
    PROCESS_PATCHES,
    declared_patch,
    hold_process_patches,
    is_held,
    resolve_owner,
)

PACKAGE = Path(__file__).resolve().parents[1] / "hyperrecipe"
HELD = [p for p in PROCESS_PATCHES if p.route == "held"]
#: torch's functions that register into a process-global registry.
GLOBAL_REGISTRIES = frozenset({
    "register_sharding", "register_op_strategy", "register_optimizer_step_pre_hook",
    "register_optimizer_step_post_hook", "register_module_forward_hook",
    "register_module_forward_pre_hook", "register_module_full_backward_hook",
    "register_module_full_backward_pre_hook", "register_module_buffer_registration_hook",
    "register_module_parameter_registration_hook", "register_module_module_registration_hook",
    "add_safe_globals", "register_pytree_node", "register_kernel", "register_fake",
    "register_autograd", "register_torch_dispatch",
})


def _raw(key: str) -> Any:
    patch = declared_patch(key)
    return vars(resolve_owner(patch)).get(patch.attribute)


def _wrapping(original: Callable[..., Any]) -> Callable[..., Any]:
    def replacement(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return replacement


@pytest.fixture()
def torch_originals() -> Iterator[dict[str, Any]]:
    """Each held patch's current value, put back however a test ends."""
    saved = {p.key: (resolve_owner(p), p.attribute, vars(resolve_owner(p)).get(p.attribute))
             for p in HELD}
    yield {key: value for key, (_, _, value) in saved.items()}
    for owner, name, value in saved.values():
        if value is not None:
            setattr(owner, name, value)


def test_the_held_patches_are_exactly_the_keys_the_guards_hand_the_rewriter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.utils import clip_grad

    from hyperrecipe.runtime.grads import scaler_guard, torch_clip_guard

    supplied = {(k, torch_clip_guard.__name__) for k in torch_clip_guard._builders()}
    monkeypatch.delattr(clip_grad, "_get_total_norm")  # the fallback for a torch without it
    supplied |= {(k, torch_clip_guard.__name__) for k in torch_clip_guard._builders()}
    supplied.add((scaler_guard.PATCH, scaler_guard.__name__))
    assert supplied == {(p.key, p.supplier) for p in HELD}


def _calls_of(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name is not None:
                yield name


def test_every_global_registration_in_the_package_is_declared_by_its_supplier() -> None:
    registrations = {(p.attribute, p.supplier) for p in PROCESS_PATCHES
                     if p.route == "registration"}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found |= {(name, module) for name in _calls_of(path) if name in GLOBAL_REGISTRIES}
    assert found == registrations


def test_every_transaction_patch_is_made_by_its_supplier() -> None:
    for patch in PROCESS_PATCHES:
        if patch.route != "transaction":
            continue
        source = (PACKAGE.parent / (patch.supplier.replace(".", "/") + ".py")).read_text()
        assert "tx.set_" in source, patch.key
        mention = ("ALL_ATTENTION_FUNCTIONS" if patch.attribute.startswith("<")
                   else f'"{patch.attribute}"')
        # the runtime names no library's attribute: the library's answer does (models/)
        library = "".join(p.read_text() for p in (PACKAGE / "models").glob("*.py"))
        assert mention in source or mention in library, patch.key


def test_the_package_patches_no_imported_module_outside_the_rewriter() -> None:
    from hyperrecipe.lint.runner import lint_paths

    result = lint_paths([str(PACKAGE)], select=["HR005"], jobs=1)
    assert [(f.path, f.line) for f in result.findings] == []


def test_each_held_patch_goes_in_once_and_the_last_release_puts_torch_back(
        torch_originals: dict[str, Any]) -> None:
    keys = [p.key for p in HELD if torch_originals[p.key] is not None]
    assert "torch.amp.GradScaler:_unscale_grads_" in keys
    first = hold_process_patches({k: _wrapping for k in keys})
    ours = {k: _raw(k) for k in keys}
    second = hold_process_patches({k: _wrapping for k in keys})  # ours is there: not twice
    for key in keys:
        assert ours[key] is not torch_originals[key]
        assert ours[key].__wrapped__ is torch_originals[key]
        assert _raw(key) is ours[key] and is_held(key)
    first.release()
    first.release()  # idempotent
    assert all(_raw(k) is ours[k] for k in keys)
    second.release()
    assert {k: _raw(k) for k in keys} == {k: torch_originals[k] for k in keys}
    assert not any(is_held(k) for k in keys)


@pytest.mark.parametrize("how", ["plain", "functools.wraps"])
def test_another_librarys_patch_over_ours_is_left_in_place(
        torch_originals: dict[str, Any], how: str) -> None:
    key = "torch.amp.GradScaler:_unscale_grads_"
    hold = hold_process_patches({key: _wrapping})
    ours = _raw(key)

    def theirs(*args: Any, **kwargs: Any) -> Any:
        return ours(*args, **kwargs)

    other = functools.wraps(ours)(theirs) if how == "functools.wraps" else theirs
    torch.amp.GradScaler._unscale_grads_ = other  # type: ignore[method-assign]
    hold.release()
    assert _raw(key) is other


def test_a_failing_builder_undoes_what_its_call_installed(
        torch_originals: dict[str, Any]) -> None:
    def broken(original: Any) -> Any:
        raise RuntimeError("builder failed")

    first = "torch.nn.utils.clip_grad:_get_total_norm"
    with pytest.raises(RuntimeError, match="builder failed"):
        hold_process_patches({first: _wrapping, "torch.amp.GradScaler:_unscale_grads_": broken})
    assert _raw(first) is torch_originals[first] and not is_held(first)


def test_undeclared_and_non_held_patches_are_refused_by_name() -> None:
    with pytest.raises(RewriteError, match=r"'torch:compile' is not declared in "
                                           r"hyperrecipe.process_patches.PROCESS_PATCHES"):
        hold_process_patches({"torch:compile": _wrapping})
    with pytest.raises(RewriteError, match=r"made by transaction, not held; "
                                           r"hyperrecipe.runtime.state.materialize makes it"):
        hold_process_patches({"torch.nn.Module:_apply": _wrapping})


class _Live:
    """What the guards hold weakly; no installation's gradients (torch's answer is kept)."""

    own: tuple[Any, ...] = ()


def test_the_guards_put_torchs_functions_back_when_removed(
        torch_originals: dict[str, Any]) -> None:
    from hyperrecipe.runtime.grads.scaler_guard import guard_grad_scaler
    from hyperrecipe.runtime.grads.torch_clip_guard import _builders, guard_torch_clipping

    live = _Live()
    clip = guard_torch_clipping(live, lambda what: None)  # type: ignore[arg-type]
    scaler = guard_grad_scaler(live)  # type: ignore[arg-type]
    keys = [*_builders(), "torch.amp.GradScaler:_unscale_grads_"]
    assert all(_raw(k) is not torch_originals[k] for k in keys)
    grads = [torch.ones(3), torch.ones(4)]
    assert torch.nn.utils.get_total_norm(grads) == pytest.approx(7 ** 0.5)  # torch's answer
    clip.remove()
    scaler.remove()
    assert all(_raw(k) is torch_originals[k] for k in keys)


def test_the_guards_let_go_when_the_installation_is_collected(
        torch_originals: dict[str, Any]) -> None:
    from hyperrecipe.runtime.grads.torch_clip_guard import guard_torch_clipping

    live = _Live()
    guard_torch_clipping(live, lambda what: None)  # type: ignore[arg-type]
    key = "torch.nn.utils.clip_grad:_get_total_norm"
    assert _raw(key) is not torch_originals[key]
    ref = weakref.ref(live)
    del live
    assert ref() is None
    assert _raw(key) is torch_originals[key]


def test_keeping_non_persistent_buffers_sets_and_restores_an_instance_apply() -> None:
    from hyperrecipe.runtime.state.materialize import keep_non_persistent_buffers

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].register_buffer("inv_freq", torch.arange(3.0), persistent=False)
    keeper = keep_non_persistent_buffers(model)
    assert "_apply" in vars(model[0]) and "_apply" not in vars(model)
    model.to_empty(device="cpu")
    assert torch.equal(model[0].inv_freq, torch.arange(3.0))
    keeper.remove()
    keeper.remove()  # idempotent
    assert "_apply" not in vars(model[0]) and "_hr_non_persistent_values" not in vars(model[0])
