"""Checkpoints in the layout transformers converts at load time, loaded by slices.

transformers 5 holds Mixtral's experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``) while its
checkpoints, including what ``save_pretrained`` writes, keep one tensor per expert and
projection (``block_sparse_moe.experts.3.w1.weight``). ``load_weights`` must read such a
checkpoint the way ``from_pretrained`` places it, still reading only each rank's slices.

The reference is ``from_pretrained`` of the same folder in one process (transformers' own
conversion); logits and every gradient within atol 2e-6, rtol 1e-5 (fp32), as in
``tests/runtime/test_family_recipes.py``. Validate mode runs the default attention and ``batched_mm`` experts on both
sides (DTensor runs ``grouped_mm`` in bfloat16 only; see docs/runtime.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.runtime.state.weights import WeightLoadError
from tests.support.family_harness import build, step
from tests.support.runtime_harness import ROOT, assert_close, grads_of


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``save_pretrained`` of tiny Mixtral, split into several files, in transformers' layout."""
    from safetensors import safe_open

    folder = tmp_path_factory.mktemp("hf-mixtral")
    build("mixtral").save_pretrained(folder, max_shard_size="60KB")
    keys: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    assert len(list(folder.glob("*.safetensors"))) > 2
    # What makes this test mean something: the file does not hold the model's fused names.
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    return folder


def _mesh(dim: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=(dim,))


def _experts(mode: str) -> dict[str, str]:
    # validate mode refuses transformers' default grouped_mm experts in fp32 (DTensor runs
    # aten._grouped_mm in bfloat16 only), so both sides build batched_mm there; attention stays
    # the model's default (sdpa)
    return {"experts_implementation": "batched_mm"} if mode == "validate" else {}


def _load_worker(rank: int, world: int, folder: str, recipe: str, dim: str,
                 mode: str) -> dict[str, Any]:
    meta = build("mixtral", "meta", **_experts(mode))
    plan = compile_recipe(str(ROOT / "recipes" / recipe), meta, {dim: world})
    inst = apply(meta, plan, _mesh(dim, world), mode=mode)  # type: ignore[arg-type]
    inst.state.load_weights(folder)
    rows = {r.what: (r.state, r.note) for r in inst.state.status() if r.what.startswith("weights")}
    logits = step(meta)
    return {"logits": logits, "grads": inst.full_grads(), "rows": rows}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("recipe", "dim", "mode"), [
    ("mixtral.yaml", "tp", "production"),   # fused gate|up chunked over tp: slices span w1 and w3
    ("mixtral.yaml", "tp", "validate"),
    ("mixtral-ep.yaml", "ep", "production"),  # whole experts per rank
])
def test_per_expert_checkpoint_loads_into_fused_experts_like_from_pretrained(
        mixtral_checkpoint: Path, recipe: str, dim: str, mode: str) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(mixtral_checkpoint, **_experts(mode))
    ref_logits = step(ref)
    ref_grads = grads_of(ref)
    for res in run_ranks(_load_worker, 2, str(mixtral_checkpoint), recipe, dim, mode):
        state, detail = res["rows"]["weights safetensors"]
        assert state == "loaded"
        assert detail is not None and "assembled from transformers' checkpoint layout" in detail
        assert_close(res["logits"], ref_logits, "logits")
        assert set(res["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"grad {name}")


def _refusal_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        Transpose,
        WeightConverter,
        WeightRenaming,
    )

    # A mapping with an operation that cannot be read by slices (registered in this rank's
    # process only): the down projections are stored transposed.
    register_checkpoint_conversion_mapping("mixtral", [
        WeightRenaming(".block_sparse_moe.", ".mlp."),
        WeightConverter(source_patterns=[".experts.*.w1.weight", ".experts.*.w3.weight"],
                        target_patterns=".experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns=[".experts.*.w2.weight"],
                        target_patterns=".experts.down_proj",
                        operations=[MergeModulelist(dim=0), Transpose(1, 2)]),
    ], overwrite=True)
    meta = build("mixtral", "meta")
    plan = compile_recipe(str(ROOT / "recipes/mixtral.yaml"), meta, {"tp": world})
    inst = apply(meta, plan, _mesh("tp", world))
    try:
        inst.state.load_weights(folder)
    except WeightLoadError as exc:
        return {"msg": str(exc), "rows": [(r.what, r.state) for r in inst.state.status()
                                          if r.what == "weights"]}
    return {"msg": None}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_conversion_that_cannot_be_read_by_slices_is_refused_by_name(
        mixtral_checkpoint: Path) -> None:
    res = run_ranks(_refusal_worker, 1, str(mixtral_checkpoint))[0]
    assert res["msg"] is not None, "a transposing conversion must not load"
    assert ("'model.layers.0.mlp.experts.down_proj' from ['model.layers.0.block_sparse_moe."
            "experts.0.w2.weight'" in res["msg"])
    assert "transformers converts it with Transpose, which a sharded load cannot read by " \
           "slices" in res["msg"]
    assert res["rows"] == [("weights", "unset")], "nothing was written"


def test_composite_reads_only_the_requested_block() -> None:
    from hyperrecipe.models.hf_conversion import Composite

    full = {f"e{i}.{p}": torch.randn(3, 5) for i in range(4) for p in ("a", "b")}
    stacks = [Composite.stack(0, [Composite.leaf(f"e{i}.{p}", (3, 5)) for i in range(4)])
              for p in ("a", "b")]
    fused = Composite.cat(1, stacks)
    expected = torch.cat([torch.stack([full[f"e{i}.{p}"] for i in range(4)]) for p in ("a", "b")],
                         dim=1)
    assert fused.shape == tuple(expected.shape) == (4, 6, 5)
    touched: list[tuple[str, tuple[slice, ...]]] = []

    def open_key(key: str) -> Any:
        def read(block: tuple[slice, ...]) -> torch.Tensor:
            touched.append((key, block))
            return full[key][block]
        return read

    block = (slice(1, 3), slice(2, 5), slice(0, 5))  # rows 2 of part a and 0..1 of part b
    torch.testing.assert_close(fused.read(block, open_key), expected[block], rtol=0, atol=0)
    assert {k for k, _ in touched} == {"e1.a", "e2.a", "e1.b", "e2.b"}
    assert (("e1.a", (slice(2, 3), slice(0, 5))) in touched
            and ("e1.b", (slice(0, 2), slice(0, 5))) in touched)
