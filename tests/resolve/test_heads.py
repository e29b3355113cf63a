"""Heads at compile time: a sharded parameter of an attention must give every rank whole heads.

Real tiny transformers configs (Llama, GPT-2, Phi-3, GPT-NeoX) on the meta device, the shipped
recipes or small ones written here; each refusal is asserted in full with its file and line. On
the code before the check these all compiled and failed later with raw shape errors. The last
test runs ``hyperrecipe check`` on a model whose head size the tree cannot see, so the split
compiles, and asserts that check names heads as the likely cause.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.recipe_text import resolve_only as compile_recipe
from hyperrecipe.check.diagnose import HEADS_NOT_WHOLE
from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.resolve.head_counts import head_size_of
from tests.support.recipe_text import locate

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_MODELS = ROOT / "tests/recipes/cookbook/models"


def tiny(family: str, **overrides: Any) -> dict[str, Any]:
    folder = ROOT / "recipes/models" if (ROOT / f"recipes/models/tiny-{family}.json").exists() \
        else COOKBOOK_MODELS
    cfg: dict[str, Any] = json.loads((folder / f"tiny-{family}.json").read_text())
    return {**cfg, **overrides}


def refusal(recipe: Path, family: str, tp: int, **overrides: Any) -> str:
    meta = build_model(f"hf:{family}", tiny(family, **overrides))
    with pytest.raises(RecipeError) as err:
        compile_recipe(str(recipe), meta, {"tp": tp})
    return str(err.value)


def test_kv_projection_split_mid_head_is_refused_at_the_rule_with_the_heads_and_the_mesh(
        ) -> None:
    # tiny Llama: 4 q heads, 2 kv heads of 16; tp=4 gives each rank 8 of k_proj's 32 rows
    recipe = ROOT / "recipes/llama.yaml"
    line, col = locate(recipe.read_text(), "model.layers.*.self_attn.{q_proj,k_proj,v_proj}")
    assert refusal(recipe, "llama", 4) == (
        f"{recipe}:{line}:{col}: module 'model.layers.0.self_attn.k_proj': dim 0 of parameter "
        "'weight' holds 2 head(s) of head_dim 16 (model.layers.0.self_attn.head_dim); mesh dim "
        "tp=4 would split it mid-head (8 of 16 per rank, shard(0)) @ $.rules[2].params.weight; "
        "every rank must hold whole heads: use a smaller tp that divides 2 heads (tp=2), or "
        "replicate 'model.layers.0.self_attn.k_proj' instead of sharding it (with the "
        "projections of 'model.layers.0.self_attn' whose heads pair with its heads); where "
        "query heads stay sharded, declare reduce_grads over tp on what you replicate (its "
        "gradient is then partial)")


def test_query_heads_are_checked_too() -> None:
    recipe = ROOT / "recipes/llama.yaml"
    message = refusal(recipe, "llama", 8, num_key_value_heads=4)
    assert ("module 'model.layers.0.self_attn.q_proj': dim 0 of parameter 'weight' holds 4 "
            "head(s) of head_dim 16") in message
    assert "use a smaller tp that divides 4 heads (tp=2, tp=4)" in message


def test_whole_heads_compile() -> None:
    meta = build_model("hf:llama", tiny("llama"))
    plan = compile_recipe(str(ROOT / "recipes/llama.yaml"), meta, {"tp": 2})
    k = next(p for p in plan.params if p.fqn == "model.layers.0.self_attn.k_proj.weight")
    assert k.local_shape == (16, 64)


def test_each_part_of_a_fused_projection_is_checked() -> None:
    # GPT-2's c_attn is q, k and v on dim 1 (Conv1D): each part of 64 is 4 heads of 16
    recipe = ROOT / "recipes/gpt2.yaml"
    line, col = locate(recipe.read_text(), '{tp: "shard(1, chunks=3)"}')
    assert refusal(recipe, "gpt2", 8) == (
        f"{recipe}:{line}:{col}: module 'transformer.h.0.attn.c_attn': part 1 of 3 of dim 1 "
        "of parameter 'weight' holds 4 head(s) of head_dim 16 (transformer.h.0.attn.head_dim); "
        "mesh dim tp=8 would split it mid-head (8 of 16 per rank, shard(1, chunks=3)) @ "
        "$.rules[2].params.weight; every rank must hold whole heads: use a smaller tp that "
        "divides 4 heads (tp=2, tp=4), or replicate 'transformer.h.0.attn.c_attn' instead of "
        "sharding it (with the projections of 'transformer.h.0.attn' whose heads pair with its "
        "heads); where query heads stay sharded, declare reduce_grads over tp on what you "
        "replicate (its gradient is then partial)")


PHI3_QKV = """\
recipe: phi3-qkv
version: 1
mesh: [tp]
rules:
  - match: model.layers.*.self_attn.qkv_proj
    params: {weight: {tp: "shard(0, chunks=[64, 32, 32])"}}
"""


def test_unequal_fused_parts_are_checked_per_part(tmp_path: Path) -> None:
    # Phi-3's qkv_proj: 4 q heads then 2 k and 2 v heads of 16; at tp=4 q is whole, k is not
    recipe = tmp_path / "phi3-qkv.yaml"
    recipe.write_text(PHI3_QKV)
    message = refusal(recipe, "phi3", 4, num_key_value_heads=2)  # the shipped config is MHA
    line, col = locate(PHI3_QKV, '{tp: "shard(0, chunks=[64, 32, 32])"}')
    assert message.startswith(
        f"{recipe}:{line}:{col}: module 'model.layers.0.self_attn.qkv_proj': part 2 of 3 of dim "
        "0 of parameter 'weight' holds 2 head(s) of head_dim 16 "
        "(model.layers.0.self_attn.head_dim); mesh dim tp=4 would split it mid-head")
    meta = build_model("hf:phi3", tiny("phi3", num_key_value_heads=2))
    assert compile_recipe(str(recipe), meta, {"tp": 2}).params


NEOX_QKV = """\
recipe: neox-qkv
version: 1
mesh: [tp]
rules:
  - match: gpt_neox.layers.*.attention.query_key_value
    style: colwise
"""


def test_a_head_size_by_another_name_is_read_from_the_tree(tmp_path: Path) -> None:
    # GPT-NeoX states `head_size`; its query_key_value interleaves q, k, v per head
    recipe = tmp_path / "neox.yaml"
    recipe.write_text(NEOX_QKV)
    message = refusal(recipe, "gpt_neox", 16)
    assert ("module 'gpt_neox.layers.0.attention.query_key_value': dim 0 of parameter 'weight' "
            "holds 12 head(s) of head_dim 16 (gpt_neox.layers.0.attention.head_size); mesh dim "
            "tp=16 would split it mid-head (12 of 16 per rank, shard(0))") in message


def test_head_size_from_a_width_and_a_head_count() -> None:
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_dim, self.num_heads = 64, 4
            self.proj = nn.Linear(64, 64)

    with torch.device("meta"):
        tree = snapshot(Attention())
    assert head_size_of(tree.module("")) == (16, "<root>.embed_dim // <root>.num_heads")
    assert head_size_of(tree.module("proj")) is None


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_check_names_heads_when_a_split_the_tree_cannot_see_fails_at_runtime() -> None:
    """One head of 16 at tp=2: the attention's head size is ``hidden_size_per_attention_head``
    (ChatGLM's name), which resolve does not read, so the plan compiles; production then fails
    at the ``view`` and check names heads as the likely cause. Validate mode computes with
    global shapes (DTensor cannot keep one head sharded and replicates it) and agrees."""
    report = run_check(CheckOptions(
        recipe=str(ROOT / "tests/recipes/toy-attn-no-head-counts.yaml"),
        model="tests.support.check_models:make_unlisted_head_size_toy", model_config={"heads": 1},
        mesh={"tp": 2}))
    assert report.exit_code == 1
    prod, validate = report.modes
    assert prod.comparison is not None and prod.comparison.first is not None
    assert (prod.comparison.first.fqn, prod.comparison.first.what) == ("layers.0.attn",
                                                                       "raised in forward")
    assert prod.suggestion is not None and prod.suggestion.cause == HEADS_NOT_WHOLE
    assert prod.suggestion.evidence == (
        "layers.0.attn raised a shape error in forward where it states heads "
        "(num_attention_heads = 1, not divisible by tp=2) and layers.0.attn.q.weight is "
        "sharded {tp: shard(0)} (local [8, 16] of [16, 16]): every rank must hold whole "
        "heads of every projection (heads and kv heads divisible by tp=2) and each head "
        "count the forward reads must be divided (head_counts)")
    assert validate.mode == "validate" and validate.agree


EMBED_UNDER_HEADS = """\
recipe: embed-under-heads
version: 1
mesh: [tp]
rules:
  - match: blk.embed
    style: vocab_parallel
"""


def test_an_embedding_table_is_never_read_as_heads(tmp_path: Path) -> None:
    """A vocab of 48 is 3 x 16, but a table's dims are vocab and width: 24 rows per rank is
    fine even under a module that states ``head_dim = 16``."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = 16
            self.embed = nn.Embedding(48, 16)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blk = Block()

    recipe = tmp_path / "embed.yaml"
    recipe.write_text(EMBED_UNDER_HEADS)
    with torch.device("meta"):
        model = Model()
    plan = compile_recipe(str(recipe), model, {"tp": 2})
    assert plan.params[0].local_shape == (24, 16)


def test_a_single_kv_head_cannot_be_sharded_and_the_hint_says_replicate() -> None:
    message = refusal(ROOT / "recipes/llama.yaml", "llama", 2, num_key_value_heads=1)
    assert message.endswith(
        "every rank must hold whole heads: replicate 'model.layers.0.self_attn.k_proj' instead "
        "of sharding it (with the projections of 'model.layers.0.self_attn' whose heads pair "
        "with its heads); where query heads stay sharded, declare reduce_grads over tp on what "
        "you replicate (its gradient is then partial)")
    assert "holds 1 head(s) of head_dim 16" in message
