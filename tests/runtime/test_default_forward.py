"""A user's own forward and ``generate()`` under every shipped recipe, both modes, on gloo ranks.

``model(input_ids=ids)`` with the config's defaults (``use_cache=True``: each attention grows a
KV cache inside its boundary; in validate mode the cache starts as a plain empty tensor and then
holds DTensors) and ``model.generate(ids, max_new_tokens=8, do_sample=False)``, compared with
one process: the logits within atol 2e-6 / rtol 1e-5 (fp32; measured worst ~2e-7), the cache
length exactly, and the generated token ids exactly.

GPT-2's fused ``c_attn`` (``shard(1, chunks=3)``) runs in validate mode as DTensor's
``_StridedShard``, its ``split`` into q, k and v done on chunk boundaries
(:mod:`hyperrecipe.runtime.comm.strided`); at tp=4 as well. The sequence-sharded recipes (``llama-sp``,
``llama-cp``, ``llama-tp-cp`` on 4 ranks, GPT-2's in ``tests/recipes``) run the default forward; they cannot decode one token
at a time (one token does not split over two ranks), which both modes refuse by name.
"""

from __future__ import annotations

import pytest
import torch

from hyperrecipe.check.launcher import RankFailedError, run_ranks
from tests.support.generate_harness import generate_worker, overrides_for, reference
from tests.support.runtime_harness import ROOT, assert_close

TP2 = {"tp": 2}
CASES: list[tuple[str, str, dict[str, int], str]] = [
    (family, f"{family}.yaml", TP2, mode)
    for family in ("llama", "qwen2", "qwen3", "mistral", "mixtral", "phi3")
    for mode in ("production", "validate")
] + [
    ("mixtral", "mixtral-ep.yaml", {"ep": 2}, "production"),
    ("mixtral", "mixtral-ep.yaml", {"ep": 2}, "validate"),
    ("gpt2", "gpt2.yaml", TP2, "production"),
    ("gpt2", "gpt2.yaml", TP2, "validate"),
    ("gpt2", "gpt2.yaml", {"tp": 4}, "validate"),
]


def _world(mesh: dict[str, int]) -> int:
    world = 1
    for size in mesh.values():
        world *= size
    return world


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("family", "recipe", "mesh", "mode"), CASES,
                         ids=[f"{r.removesuffix('.yaml')}-{m}" + ("" if _world(w) == 2 else f"-{_world(w)}")
                              for _, r, w, m in CASES])
def test_default_forward_and_greedy_generate_equal_one_process(
        family: str, recipe: str, mesh: dict[str, int], mode: str) -> None:
    path = str(ROOT / "recipes" / recipe)
    overrides = overrides_for(family, mode, path)
    ref = reference(family, overrides)
    results = run_ranks(generate_worker, _world(mesh), family, path, mesh, mode, overrides,
                        timeout_s=300)
    for rank, res in enumerate(results):
        assert_close(res["logits"], ref["logits"], f"rank {rank} logits")
        assert res["cached"].item() == ref["cached"].item() == 6, "the prompt is cached"
        assert torch.equal(res["tokens"], ref["tokens"]), \
            f"rank {rank} generated {res['tokens'].tolist()}, one process {ref['tokens'].tolist()}"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_gqa_phi3_with_unequal_fused_parts_generates_like_one_process(mode: str) -> None:
    """``qkv_proj`` as ``shard(0, chunks=[64, 32, 32])``: validate mode computes it part by part
    (the plan's ``chunk_parts``), production on the rank's local parts."""
    path = str(ROOT / "tests/recipes/phi3-gqa.yaml")
    overrides = {**overrides_for("phi3", mode, path), "num_key_value_heads": 2}
    ref = reference("phi3", overrides)
    for rank, res in enumerate(run_ranks(generate_worker, 2, "phi3", path, TP2, mode, overrides,
                                         timeout_s=300)):
        assert_close(res["logits"], ref["logits"], f"rank {rank} logits")
        assert torch.equal(res["tokens"], ref["tokens"]), f"rank {rank} generated tokens"


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize(("family", "recipe", "mesh"), [
    ("llama", "recipes/llama-sp.yaml", TP2), ("llama", "recipes/llama-cp.yaml", {"cp": 2}),
    ("llama", "recipes/llama-tp-cp.yaml", {"tp": 2, "cp": 2}),
    ("llama", "recipes/llama-sp-loss.yaml", TP2),
    # GPT-2 views ln_f's output with the whole sequence's shape: gathered at ln_f, not lm_head
    ("gpt2", "tests/recipes/gpt2-sp.yaml", TP2), ("gpt2", "tests/recipes/gpt2-cp.yaml", {"cp": 2}),
])
def test_sequence_sharded_recipes_run_the_default_forward(family: str, recipe: str,
                                                          mesh: dict[str, int], mode: str) -> None:
    path = str(ROOT / recipe)
    overrides = overrides_for(family, mode, path)
    ref = reference(family, overrides)
    for rank, res in enumerate(run_ranks(generate_worker, _world(mesh), family, path, mesh,
                                         mode, overrides, False, timeout_s=300)):
        assert_close(res["logits"], ref["logits"], f"rank {rank} logits")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("mode", "message"), [
    ("production", "CollectiveShapeError: local_slice[tp](scatter_dim=1) (forward): scatter_dim=1 "
                   "of a tensor of shape (2, 1, 64) has size 1, which does not divide evenly "
                   "into 2 shards"),
    # validate mode refuses the prefill already: generate() keeps the last token's row of the
    # sequence shard model.norm handed back, each rank's own last token
    ("validate", "PlanMismatchError: lm_head: input 'input' (declared {tp: shard(1)}) arrived "
                 "with local shape [2, 1, 64], a view of the local shard that model.norm handed "
                 "back as output 0"),
])
def test_sequence_parallel_decoding_is_refused_by_name_in_both_modes(mode: str,
                                                                    message: str) -> None:
    path = str(ROOT / "recipes/llama-sp.yaml")
    overrides = overrides_for("llama", mode, path)
    with pytest.raises(RankFailedError) as info:
        run_ranks(generate_worker, 2, "llama", path, TP2, mode, overrides, timeout_s=300)
    assert message in str(info.value)


def _scope_worker(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hyperrecipe.runtime.forward.validate_scope import validate_compute

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    keys = DTensor.from_local(torch.ones(2, 3), mesh, (Shard(1),))

    def grow() -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.cat([torch.tensor([]), keys], dim=-2)  # a cache's first update
        return first, torch.cat(tensors=[first, keys], dim=0)

    first, second = validate_compute(grow)()
    try:
        # not zeros: a plain tensor of zeros that needs no gradient is taken as replicated
        # (runtime/forward/plain_tensors.py); any other plain tensor could be a rank's piece
        validate_compute(lambda: torch.cat([torch.ones(2, 6), keys]))()
        mixed = "accepted"
    except RuntimeError as exc:
        mixed = str(exc)
    return {"first": (type(first).__name__, tuple(first.shape), str(first.placements)),
            "second": tuple(second.shape), "mixed": mixed}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_only_legacy_empty_tensors_concatenate_with_dtensors_in_a_validate_compute() -> None:
    (res,) = run_ranks(_scope_worker, 1, timeout_s=60)
    assert res["first"] == ("DTensor", (2, 3), "(Shard(dim=1),)")
    assert res["second"] == (4, 3)
    assert str(res["mixed"]).startswith("aten.cat.default got mixed torch.Tensor and DTensor")
