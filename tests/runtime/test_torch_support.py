"""The runtime refuses a torch older than it is tested on, by name, before touching the model.

torch is an extra, so pip never compares a torch the user brought with our range. Measured with
torch 2.6.0: validate mode failed at the first boundary with "input 'input' was declared
{tp: shard(-1)} (in_src) but arrived replicate" — a wrong cause, and other paths need not raise
at all. The installed torch here is new enough, so the call site is exercised by setting
``torch.__version__`` to an old release string for one call (the only way to run ``apply``
under an old torch in this environment), and the model is checked to be untouched.
"""

from __future__ import annotations

import re

import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hyperrecipe import UnsupportedTorchError, compile_recipe
from hyperrecipe.runtime import apply
from hyperrecipe.runtime.preflight.torch_support import MIN_TORCH, require_supported_torch, torch_release
from tests.support.runtime_harness import ROOT


@pytest.mark.parametrize(("version", "release"), [
    ("2.13.0+cpu", (2, 13)), ("2.16.0a0+git1a2b3c", (2, 16)), ("2.15.0.dev20261201", (2, 15)),
    ("10.0.1", (10, 0)), ("custom", None),
])
def test_a_torch_version_string_is_read_as_its_release(version: str,
                                                       release: tuple[int, int] | None) -> None:
    assert torch_release(version) == release


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.12.1", "1.13.1"])
def test_an_older_torch_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedTorchError) as err:
        require_supported_torch(version)
    need = ".".join(map(str, MIN_TORCH))
    assert f"needs torch >= {need}; this environment has torch {version}" in str(err.value)


@pytest.mark.parametrize("version", ["2.13.0", "2.15.0+cu132", "2.16.0a0+gitabc", "3.1.0",
                                     "my-build"])
def test_a_supported_or_unreadable_torch_is_let_through(version: str) -> None:
    require_supported_torch(version)


def test_the_installed_torch_is_supported() -> None:
    require_supported_torch()


def test_the_extras_declare_the_same_lower_bound() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    need = ".".join(map(str, MIN_TORCH))
    for name in ("torch", "hf"):
        bounds = [re.sub(r"\s", "", r) for r in extras[name] if r.startswith("torch")]
        assert bounds == [f"torch>={need},<3"], f"[{name}] declares {bounds}"


def test_apply_refuses_an_old_torch_before_touching_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.toy_models import Toy

    model = Toy()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.device("meta"):
        plan = compile_recipe(str(ROOT / "tests/recipes/toy.yaml"), Toy(), {"tp": 2})
    forwards = {n: m.forward for n, m in model.named_modules()}
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    with pytest.raises(UnsupportedTorchError, match=r"this environment has torch 2\.6\.0"):
        apply(model, plan, None)  # type: ignore[arg-type] - refused before the mesh is read
    assert {n: m.forward for n, m in model.named_modules()} == forwards
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
