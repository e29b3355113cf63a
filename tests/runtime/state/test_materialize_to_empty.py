"""``model.to_empty(device=...)`` after a meta apply, on real gloo ranks.

torch's ``to_empty`` replaces every buffer with uninitialised memory; nothing reloads a
non-persistent one (rotary ``inv_freq`` is in no checkpoint), so before the installation kept
them, a run in torchtitan's order (meta, apply, ``to_empty``, load) trained on garbage rotary
frequencies (NaN loss on one rank, finite garbage on the other) while ``status()`` showed
nothing unset. Compared with one process on the same checkpoint: fp32, atol 2e-6 / rtol 1e-5 on
the loss and every gradient; the buffers exactly.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import ROOT, assert_close, grads_of, llama, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

LLAMA = str(ROOT / "recipes/llama.yaml")


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 128, (2, 8), generator=g)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf-llama-to-empty")
    llama().save_pretrained(folder)
    return folder


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    rotary = model.model.rotary_emb  # type: ignore[union-attr]
    return {"inv_freq": rotary.inv_freq.clone(),
            "original_inv_freq": rotary.original_inv_freq.clone()}


def _to_empty_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    meta = llama("meta")
    plan = compile_recipe(LLAMA, meta, {"tp": world})
    inst = apply(meta, plan, mesh_1d(world), mode="production")
    meta.to_empty(device="cpu")  # torchtitan's Trainer's order, tools/train.py-style
    after_to_empty = _buffers(meta)
    inst.state.load_weights(folder)
    unset = [r.fqn for r in inst.state.status() if r.state == "unset"]
    loss = meta(input_ids=_batch(), labels=_batch()).loss
    loss.backward()
    copied = copy.deepcopy(meta)  # the kept values travel with a copy, bound to the copy
    copied.to_empty(device="cpu")
    return {"buffers": after_to_empty, "unset": unset, "copied": _buffers(copied)}


def _grads_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    meta = llama("meta")
    plan = compile_recipe(LLAMA, meta, {"tp": world})
    inst = apply(meta, plan, mesh_1d(world), mode="production")
    meta.to_empty(device="cpu")
    inst.state.load_weights(folder)
    loss = meta(input_ids=_batch(), labels=_batch()).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": inst.full_grads()}


def test_to_empty_after_meta_apply_keeps_rotary_buffers(hf_checkpoint: Path) -> None:
    ref = llama()
    expected = _buffers(ref)
    for res in run_ranks(_to_empty_worker, 2, str(hf_checkpoint)):
        for name, value in expected.items():
            torch.testing.assert_close(res["buffers"][name], value, atol=0, rtol=0,
                                       msg=lambda m, n=name: f"{n} after to_empty: {m}")
            torch.testing.assert_close(res["copied"][name], value, atol=0, rtol=0,
                                       msg=lambda m, n=name: f"{n} of a deepcopy: {m}")
        assert res["unset"] == [], "load_weights set every parameter and buffer"


def test_to_empty_after_meta_apply_trains_as_one_process(hf_checkpoint: Path) -> None:
    ref = llama()
    ref_loss = ref(input_ids=_batch(), labels=_batch()).loss
    ref_loss.backward()
    ref_grads = grads_of(ref)
    for res in run_ranks(_grads_worker, 2, str(hf_checkpoint)):
        assert torch.isfinite(res["loss"]), "the loss after to_empty is finite"
        assert_close(res["loss"], ref_loss.detach(), "loss after to_empty + load_weights")
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"grad {name}")
