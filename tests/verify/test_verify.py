"""Verification at compile: wrong recipes are refused at their recipe line, right ones compile.

Every case compiles a recipe against a real model built on the meta device (transformers
families from the shipped tiny configs, plain-torch models from tests/support/verify_models.py)
and asserts the refusal's text, file and line, or that the plan records its verification.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import hyperrecipe
from hyperrecipe import compile_recipe
from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import build_model
from tests.support.runtime_harness import ROOT

GPT = "tests.support.verify_models:make_gpt"
GPT_WIDTH = "tests.support.verify_models:make_gpt_width_off_input"


def _recipe(tmp_path: Path, body: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def _line_of(path: Path, text: str) -> int:
    """The line of ``path`` that reads ``text`` (stripped), or contains it when none does."""
    lines = path.read_text().splitlines()
    exact = [i for i, line in enumerate(lines, 1) if line.strip() == text]
    return exact[0] if exact else next(i for i, line in enumerate(lines, 1) if text in line)


GPT_RIGHT = """
    recipe: gpt
    version: 1
    mesh: [tp]
    rules:
      - match: wte
        style: vocab_parallel
      - match: h.*.attn
        boundary: true
        in_src: {x: replicate}
        out_src: {0: replicate}
        head_counts: {n_head: tp}
      - match: h.*.attn.c_attn
        params: {weight: {tp: "shard(0, chunks=3)"}}
        boundary: false
      - match: h.*.attn.c_proj
        style: rowwise
      - match: h.*.mlp
        boundary: true
        in_src: {x: replicate}
        out_src: {0: replicate}
      - match: h.*.mlp.fc
        style: colwise
        boundary: false
      - match: h.*.mlp.proj
        style: rowwise
      - match: lm_head
        style: colwise_gather_output
"""


def test_a_correct_plain_torch_recipe_compiles_and_records_its_verification(
        tmp_path: Path) -> None:
    plan = compile_recipe(_recipe(tmp_path, GPT_RIGHT), build_model(GPT), {"tp": 2})
    record = plan.verification
    assert record is not None
    assert record.modes == ("production", "validate") and record.ranks == (0,)
    assert record.model_digest == plan.model_digest
    assert record.torch == hyperrecipe.__dict__.get("torch", __import__("torch")).__version__
    # the record survives a save and a load, and is covered by the checksum
    path = tmp_path / "plan.json"
    plan.save(path)
    assert hyperrecipe.load_plan(path) == plan


def test_no_verify_returns_the_resolvers_plan_unchanged(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, GPT_RIGHT)
    plan = compile_recipe(recipe, build_model(GPT), {"tp": 2}, verify=False)
    assert plan.verification is None
    assert '"verification"' not in plan.to_json()


def test_qwen3_under_the_llama_recipe_is_refused_at_the_line_that_leaves_its_norms_replicated(
) -> None:
    model = build_model("hf:qwen3", str(ROOT / "recipes/models/tiny-qwen3.json"))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(ROOT / "recipes/llama.yaml", model, {"tp": 2})
    err = caught.value
    assert err.span is not None and err.span.path.endswith("recipes/llama.yaml")
    recipe = ROOT / "recipes/llama.yaml"
    assert err.span.line == _line_of(recipe, "- match: model.layers.*.self_attn")
    text = str(err)
    assert "validate mode" in text and "_norm.weight: its gradient comes back partial over tp" in text
    assert "reduce_grads: {weight: tp}" in text


def test_a_tied_embedding_sharded_through_its_tie_onto_no_boundary_is_refused(
        tmp_path: Path) -> None:
    # the "forgot the embedding" mistake: lm_head is vocab-sharded, wte (the same tensor) is
    # not a boundary, so its lookup would read rank 0's rows as the whole table
    body = GPT_RIGHT.replace("      - match: wte\n        style: vocab_parallel\n", "")
    recipe = _recipe(tmp_path, body)
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model(GPT), {"tp": 2})
    err = caught.value
    assert "wte.weight is sharded over tp, sharded through its tie to lm_head.weight" in str(err)
    assert "outside every boundary" in str(err) and "style: vocab_parallel" in str(err)
    assert err.span is not None and err.span.line == _line_of(recipe, "match: lm_head")


def test_a_fused_qkv_split_plain_colwise_is_refused(tmp_path: Path) -> None:
    body = GPT_RIGHT.replace('params: {weight: {tp: "shard(0, chunks=3)"}}', "style: colwise")
    recipe = _recipe(tmp_path, body)
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model(GPT), {"tp": 2})
    assert "verification" in str(caught.value) and "h.0.attn" in str(caught.value)
    assert caught.value.span is not None and caught.value.span.path == str(recipe)


def test_an_attention_reading_its_width_off_the_input_is_refused_in_production(
        tmp_path: Path) -> None:
    body = (GPT_RIGHT.replace('params: {weight: {tp: "shard(0, chunks=3)"}}', "style: colwise")
            .replace("h.*.attn.c_attn", "h.*.attn.{q,k,v}").replace("h.*.attn.c_proj",
                                                                    "h.*.attn.o"))
    recipe = _recipe(tmp_path, body)
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model(GPT_WIDTH), {"tp": 2})
    text = str(caught.value)
    assert "production mode cannot run one training step" in text
    assert "while h.0.attn ran its forward" in text
    assert "width or head count read off the input" in text


@pytest.mark.parametrize("name", [
    # the quick tier keeps three representatives: plain tp, sequence parallel, experts
    pytest.param(p.stem, marks=() if p.stem in ("llama", "llama-sp", "mixtral")
                 else (pytest.mark.slow,))
    for p in sorted((ROOT / "recipes").glob("*.yaml")) if not p.stem.startswith("torchtitan")])
def test_every_shipped_recipe_verifies(name: str) -> None:
    recipe = hyperrecipe.load_recipe(ROOT / "recipes" / f"{name}.yaml")
    family = name.split("-")[0]
    model = build_model(f"hf:{family}", str(ROOT / "recipes/models" / f"tiny-{family}.json"))
    plan = compile_recipe(recipe, model, {d: 2 for d in recipe.mesh})
    assert plan.verification is not None
    assert plan.verification.modes == ("production", "validate")


def test_the_cli_refuses_a_wrong_recipe_with_exit_2_and_the_docs_show_its_first_words(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperrecipe.cli import main

    monkeypatch.chdir(ROOT)
    code = main(["compile", "recipes/llama.yaml", "--model", "hf:qwen3", "--model-config",
                 "recipes/models/tiny-qwen3.json", "--mesh", "tp=2"])
    err = capsys.readouterr().err
    assert code == 2
    line = _line_of(ROOT / "recipes/llama.yaml", "- match: model.layers.*.self_attn")
    head = (f"hyperrecipe: error: recipes/llama.yaml:{line}:5: verification (validate mode, one "
            f"training step on fake tensors) refused the plan: model.layers.1.self_attn.k_norm"
            f".weight: its gradient comes back partial over tp")
    assert err.startswith(head), err
    assert head in (ROOT / "docs/verification.md").read_text()


def test_the_cli_summary_says_what_was_verified_and_no_verify_says_it_was_skipped(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperrecipe.cli import main

    monkeypatch.chdir(ROOT)
    args = ["compile", "recipes/llama.yaml", "--model", "hf:llama", "--model-config",
            "recipes/models/tiny-llama.json", "--mesh", "tp=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("verified: one training step in production and validate mode on fake tensors (rank "
            "0; token ids [2, 4] < 128, the model's own loss) in ") in out
    assert main([*args, "--no-verify"]) == 0
    assert "verification: skipped (--no-verify): apply() verifies the plan first" in (
        capsys.readouterr().out)


def test_a_boundary_on_multihead_attentions_out_proj_is_refused_at_its_rule(
        tmp_path: Path) -> None:
    # F.multi_head_attention_forward reads out_proj.weight and never calls out_proj: the
    # row-wise boundary compiles, and production would compute with the shard as the weight
    recipe = _recipe(tmp_path, """
        recipe: mha
        version: 1
        mesh: [tp]
        rules:
          - match: blocks.*.attn.out_proj
            style: rowwise
    """)
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model("tests.support.verify_models:make_mha_encoder"),
                       {"tp": 2})
    text = str(caught.value)
    assert "production mode cannot run one training step" in text
    assert "while blocks.0.attn ran its forward" in text
    assert ("blocks.0.attn is a torch.nn.MultiheadAttention: its forward uses out_proj.weight "
            "without calling out_proj, so a rule on out_proj alone cannot shard it; give the "
            "attention `style: multihead_attention`") in text
    assert caught.value.span is not None
    assert caught.value.span.line == _line_of(recipe, "- match: blocks.*.attn.out_proj")


GPT_EINOPS = "tests.support.verify_models:make_gpt_einops"
GPT_REARRANGE = "tests.support.verify_models:make_gpt_rearrange_layers"
EINOPS_RIGHT = (GPT_RIGHT.replace("c_attn", "to_qkv").replace("c_proj", "to_out")
                .replace("head_counts: {n_head: tp}", "head_counts: {heads: tp}"))


def _refused_silent_split(recipe: Path, model: str, module: str, site: str) -> None:
    """The recipe compiles nothing: production would split each rank's shard into all the
    heads (``[2, 4, 8]`` into four heads of width 2) where the whole's shard is two heads of
    width 4, with no error in either mode."""
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model(model), {"tp": 2})
    text = str(caught.value)
    assert f"production mode splits a shard otherwise than the whole in {module}" in text
    models = ROOT / "tests/support/verify_models.py"
    assert f"verify_models.py:{_line_of(models, site)})" in text
    assert "reshapes this rank's [2, 4, 8] into [2, 4, 4, 2]" in text
    assert "shard of the whole as [2, 4, 2, 4]" in text
    assert "head_counts: {ATTR: tp}" in text
    assert caught.value.span is not None and caught.value.span.path == str(recipe)
    assert caught.value.span.line == _line_of(recipe, "- match: h.*.attn")


def test_heads_split_by_a_count_fixed_in_the_module_are_refused_where_the_widths_fit(
        tmp_path: Path) -> None:
    # nanoGPT's attention with `reshape(b, t, self.n_head, -1)` and no head_counts: the shard's
    # width 8 splits into the model's 4 heads without error in production
    body = GPT_RIGHT.replace("        head_counts: {n_head: tp}\n", "")
    _refused_silent_split(_recipe(tmp_path, body), GPT, "h.0.attn", "z.reshape(b, t, self.n_head")


def test_einops_heads_without_head_counts_are_refused_and_with_them_compile(
        tmp_path: Path) -> None:
    # vit-pytorch / x-transformers: rearrange(t, 'b n (h d) -> b h n d', h=self.heads)
    wrong = _recipe(tmp_path, EINOPS_RIGHT.replace("        head_counts: {heads: tp}\n", ""))
    _refused_silent_split(wrong, GPT_EINOPS, "h.0.attn", 'rearrange(t, "b n (h d)')
    plan = compile_recipe(_recipe(tmp_path, EINOPS_RIGHT, "right.yaml"), build_model(GPT_EINOPS),
                          {"tp": 2})
    assert plan.verification is not None
    assert plan.verification.modes == ("production", "validate")


@pytest.mark.slow  # ~1.5 s: the quick tier keeps einops' rearrange and the norm refused
def test_heads_fixed_in_an_einops_rearrange_layer_are_refused_at_the_attentions_rule(
        tmp_path: Path) -> None:
    body = (GPT_RIGHT.replace("        head_counts: {n_head: tp}\n", "")
            .replace('h.*.attn.c_attn\n        params: {weight: {tp: "shard(0, chunks=3)"}}',
                     "h.*.attn.{to_q,to_k,to_v}\n        style: colwise")
            .replace("c_proj", "to_out"))
    _refused_silent_split(_recipe(tmp_path, body), GPT_REARRANGE, "h.0.attn.split_heads",
                          "self.split_heads(p(x))")
    # gathering the attention's input and computing it whole is right, and compiles
    gathered = (GPT_RIGHT.replace("        head_counts: {n_head: tp}\n", "")
                .replace('      - match: h.*.attn.c_attn\n        params: {weight: {tp: "shard(0, '
                         'chunks=3)"}}\n        boundary: false\n', "")
                .replace("      - match: h.*.attn.c_proj\n        style: rowwise\n", ""))
    assert "to_" not in gathered and "c_attn" not in gathered
    plan = compile_recipe(_recipe(tmp_path, gathered, "gathered.yaml"),
                          build_model(GPT_REARRANGE), {"tp": 2})
    assert plan.verification is not None


GPT_WIDTH_NORM = "tests.support.verify_models:make_gpt_width_norm"
WIDTH_NORM_BASE = (GPT_RIGHT.replace('h.*.attn.c_attn\n        params: {weight: {tp: "shard(0, '
                                     'chunks=3)"}}', "h.*.attn.{q,k,v}\n        style: colwise")
                   .replace("c_proj", "o"))


def test_a_norm_over_a_sharded_width_sharded_with_the_heads_is_refused_where_it_sums(
        tmp_path: Path) -> None:
    # litgpt-style RMSNorm over the whole q width, its weight "fixed" by sharding it with the
    # heads: every shape fits, and production would normalize each rank's heads by their own
    # mean of squares
    recipe = _recipe(tmp_path, WIDTH_NORM_BASE + textwrap.indent(textwrap.dedent("""
        - match: h.*.attn.{q_norm,k_norm}
          params: {weight: {tp: shard(0)}}
    """).lstrip(), "      "))
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model(GPT_WIDTH_NORM), {"tp": 2})
    text = str(caught.value)
    models = ROOT / "tests/support/verify_models.py"
    line = _line_of(models, "return x * torch.rsqrt(norm_x + self.eps) * self.weight")
    assert (f"verification: h.0.attn.q_norm (tests/support/verify_models.py:{line}) reduces "
            f"over a dim the plan shards over tp") in text
    assert "production mode has no collective inside the module" in text
    assert caught.value.span is not None
    assert caught.value.span.line == _line_of(recipe, "- match: h.*.attn.{q_norm,k_norm}")


@pytest.mark.slow  # ~1.5 s: the quick tier keeps einops' rearrange and the norm refused
def test_a_norm_over_a_sharded_width_gathered_by_a_nested_boundary_compiles(
        tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, WIDTH_NORM_BASE + textwrap.indent(textwrap.dedent("""
        - match: h.*.attn.{q_norm,k_norm}
          boundary: true
          in_src: {x: {tp: shard(-1)}}
          in_dst: {x: replicate}
          out_src: {0: replicate}
          out_dst: {0: {tp: shard(-1)}}
          params: {weight: replicate}
    """).lstrip(), "      "))
    plan = compile_recipe(recipe, build_model(GPT_WIDTH_NORM), {"tp": 2})
    assert plan.verification is not None
    assert plan.verification.modes == ("production", "validate")


PRENORM = "tests.support.verify_models:make_prenorm_transformer"
PRENORM_RECIPE = ROOT / "tests/recipes/prenorm-blocks.yaml"


def _without_norm_reductions(tmp_path: Path) -> Path:
    text = PRENORM_RECIPE.read_text().replace("    reduce_grads: {weight: tp, bias: tp}\n", "")
    return _recipe(tmp_path, text, "no-norm-reductions.yaml")


def test_blocks_with_the_norm_inside_compile_with_the_norms_gradients_reduced() -> None:
    # the norm before the projections, inside each block's boundary (vit-pytorch,
    # x-transformers): DTensor sums its partial gradient inside the norm's backward, which is
    # no residual bypassing the sharded projections
    plan = compile_recipe(PRENORM_RECIPE, build_model(PRENORM), {"tp": 2})
    assert plan.verification is not None
    assert plan.verification.modes == ("production", "validate")


def test_blocks_with_the_norm_inside_are_refused_naming_the_norm_without_its_reduction(
        tmp_path: Path) -> None:
    recipe = _without_norm_reductions(tmp_path)
    with pytest.raises(RecipeError) as caught:
        compile_recipe(recipe, build_model(PRENORM), {"tp": 2})
    text = str(caught.value)
    assert "layers.1.1.net.0.weight: its gradient is partial over tp in production mode" in text
    assert "DTensor sums it inside NativeLayerNormBackward0's backward" in text
    assert "`reduce_grads: {weight: tp}` on layers.1.1.net.0's rule" in text
    assert caught.value.span is not None
    assert caught.value.span.line == _line_of(recipe, "- match: layers.*.1")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_blocks_with_the_norm_inside_agree_with_one_process_and_diverge_without_reductions(
        tmp_path: Path) -> None:
    """What verification accepts and refuses is what one process says: the recipe agrees in
    both modes (every gradient, check's fp32 tolerances), and without the norms' reductions
    production's norm gradients are each rank's share."""
    from hyperrecipe.check.run import CheckOptions, run_check

    def check(recipe: Path) -> dict[str, bool]:
        report = run_check(CheckOptions(recipe=str(recipe), model=PRENORM, model_config=None,
                                        mesh={"tp": 2}, modes=("production", "validate")))
        return {m.mode: m.agree for m in report.modes}

    assert check(PRENORM_RECIPE) == {"production": True, "validate": True}
    assert check(_without_norm_reductions(tmp_path))["production"] is False
