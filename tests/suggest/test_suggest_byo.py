"""`suggest` on models from outside transformers (issue 39): plain-torch models written the way
people write them (tests/support/byo_models.py), given as ``pkg.module:factory``.

Before, suggest refused every such model: it read the hidden size only from a transformers
model's ``get_input_embeddings()``, found none, and said the structure had no projection pair.
The fast tests read the structure on the meta device; the slow ones run suggest's own check (two
gloo ranks, both modes) and then check the written file again as a user would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import SuggestError
from hyperrecipe.model_tree import build_model
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.structure import hidden_size, read_structure

TP2 = {"tp": 2}
BYO = "tests.support.byo_models"
PIXELS = f"{BYO}:make_pixels"


def _read(factory: str, **config: object) -> tuple[dict[str, str], dict[str, str]]:
    """``(pattern -> style, what was left out -> why)`` of the model's structure."""
    entries, left_out = read_structure(build_model(f"{BYO}:{factory}", dict(config)))
    return {e.pattern: e.style for e in entries}, {n.what: n.why for n in left_out}


@pytest.mark.parametrize(("factory", "config"), [
    ("make_gpt", {}), ("make_litgpt", {}), ("make_mha_encoder", {}), ("make_torchvision_vit", {}),
    ("make_vit", {"conv_patches": True}), ("make_vit", {"conv_patches": False})])
def test_the_hidden_size_is_the_width_most_block_projections_read(
        factory: str, config: dict[str, object]) -> None:
    # no get_input_embeddings(); the ViTs have no nn.Embedding at all and the Linear patch
    # embedding (in 48) is outside the blocks, so it does not vote
    assert hidden_size(build_model(f"{BYO}:{factory}", config)) == 32


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _MlpStack(nn.Module):
    """Blocks of one MLP each: the widths 8 and 16 are read equally often."""

    def __init__(self, dim: int = 8, named: bool = True) -> None:
        super().__init__()
        if named:
            self.dim = dim
        self.blocks = nn.ModuleList(_Mlp(dim, 2 * dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_tie_between_widths_is_broken_by_the_width_the_model_names() -> None:
    with torch.device("meta"):
        assert hidden_size(_MlpStack(named=True)) == 8  # its `dim` attribute
        assert hidden_size(_MlpStack(named=False)) is None  # nothing says which
    # an nn.Embedding names it too (the toy models' `embed`)
    assert hidden_size(build_model("tests.support.toy_models:make_toy")) == 8


def test_an_attention_that_reads_its_width_off_the_input_is_left_replicated_and_says_why() -> None:
    styles, left_out = _read("make_gpt")
    assert styles == {"transformer.h.*.mlp.c_fc": "colwise",
                      "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather_output"}
    why = left_out["transformer.h.*.attn (CausalSelfAttention)"]
    assert why.startswith("its forward reads the width off its input (B, T, C = x.size()) and "
                          "shapes its heads by it: its heads cannot be divided between ranks")


def test_an_attention_that_takes_its_heads_from_its_config_is_sharded() -> None:
    styles, left_out = _read("make_litgpt")
    assert styles == {**{f"h.*.attn.{p}": "colwise" for p in "qkv"}, "h.*.attn.proj": "rowwise",
                      "h.*.mlp.fc_1": "colwise", "h.*.mlp.fc_2": "colwise",
                      "h.*.mlp.proj": "rowwise", "lm_head": "colwise_gather_output"}
    assert left_out == {}


def test_the_output_head_is_the_linear_outside_the_blocks_to_the_vocabulary() -> None:
    # nanoGPT's lm_head reads the hidden size and writes the 64 entries of wte (wpe, 16
    # positions, is an embedding of the hidden size too); a ViT's head writes its classes
    assert _read("make_gpt", tie=True)[0]["lm_head"] == "colwise_gather_output"
    assert "head" not in _read("make_vit")[0]


def test_nn_multihead_attention_is_sharded_by_heads_with_the_mlp_beside_it() -> None:
    styles, left_out = _read("make_mha_encoder")
    assert styles == {"layers.*.self_attention": "multihead_attention",
                      "layers.*.mlp.linear_1": "colwise", "layers.*.mlp.linear_2": "rowwise"}
    assert left_out == {}


def test_torchvision_vit_blocks_named_encoder_layer_n_are_read_as_repeated_blocks() -> None:
    # encoder.layers.encoder_layer_0, _1: siblings of one class whose names differ by a
    # trailing integer; mlp.0 and mlp.3 (MLPBlock, an nn.Sequential of Linear, GELU, Dropout,
    # Linear, Dropout) keep their numbers
    styles, left_out = _read("make_torchvision_vit")
    assert styles == {"encoder.layers.*.self_attention": "multihead_attention",
                      "encoder.layers.*.mlp.0": "colwise", "encoder.layers.*.mlp.3": "rowwise"}
    assert left_out == {}


def test_the_fold_reads_repeated_blocks_not_numbered_names() -> None:
    from hyperrecipe.suggest.folding import Folding

    with torch.device("meta"):
        fold = Folding.of_module(build_model(f"{BYO}:make_torchvision_vit", {}))
        assert fold("encoder.layers.encoder_layer_1.mlp.3") == "encoder.layers.*.mlp.3"
        assert fold("heads.head") == "heads.head"
        # fc1 / fc2 are two projections of one block, not two layers
        mlp = nn.Module()
        mlp.fc1, mlp.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        assert Folding.of_module(mlp)("fc2") == "fc2"
        # a list of layers of two kinds (Jamba's attention and Mamba layers) still folds
        mixed = nn.ModuleList([_Mlp(4, 8), _MlpStack(4)])
        assert Folding.of_module(mixed)("1.blocks.0.up") == "*.blocks.*.up"


class _MHAOptions(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.MultiheadAttention(16, 4, batch_first=True, **options)  # type: ignore[arg-type]
                                    for _ in range(2))
        self.mlps = nn.ModuleList(_Mlp(16, 32) for _ in range(2))


@pytest.mark.parametrize(("options", "why"), [
    ({"kdim": 8, "vdim": 8}, "its kdim (8) or vdim (8) differs from embed_dim (16), so q, k and v "
                             "are separate q_proj_weight, k_proj_weight and v_proj_weight"),
    ({"add_bias_kv": True}, "add_bias_kv=True appends one learned key/value over every head"),
    ({"add_zero_attn": True}, "add_zero_attn=True appends a zero key/value over every head")])
def test_an_nn_multihead_attention_mha_heads_cannot_shard_is_left_replicated_and_says_why(
        options: dict[str, object], why: str) -> None:
    with torch.device("meta"):
        entries, left_out = read_structure(_MHAOptions(**options))
    assert {e.pattern for e in entries} == {"mlps.*.up", "mlps.*.down"}
    assert [(n.what, n.why) for n in left_out] == [(
        "layers.* (nn.MultiheadAttention)",
        f"{why}, which the multihead_attention style (mha_heads) does not shard: left "
        f"replicated (docs/bring-your-own-model.md)")]


class _Rearrange(nn.Module):
    """Stands in for ``einops.layers.torch.Rearrange`` (einops is not a dependency): what the
    structure reads is the module it comes from and the axis lengths it fixes."""

    __module__ = "einops.layers.torch"

    def __init__(self, pattern: str, **axes_lengths: int) -> None:
        super().__init__()
        self.pattern = pattern
        self.axes_lengths = axes_lengths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.axes_lengths["h"], -1).transpose(1, 2)


class _EinopsAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.split_heads = _Rearrange("b n (h d) -> b h n d", h=heads)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(y.transpose(1, 2).flatten(2))


class _EinopsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_EinopsAttention() for _ in range(2))
        self.mlps = nn.ModuleList(_Mlp(16, 32) for _ in range(2))


def test_heads_fixed_in_an_einops_layer_leave_the_attention_replicated() -> None:
    with torch.device("meta"):
        entries, left_out = read_structure(_EinopsModel())
    assert {e.pattern for e in entries} == {"mlps.*.up", "mlps.*.down"}
    assert [n.what for n in left_out] == ["layers.* (_EinopsAttention)"]
    assert "fixes the head count in an einops pattern" in left_out[0].why


def rearrange(t: torch.Tensor, pattern: str, **axes: int) -> torch.Tensor:
    """Stands in for ``einops.rearrange`` on ``b n (h d) -> b h n d`` (what the structure reads
    is the call in the forward's source)."""
    b, n, _ = t.shape
    heads = axes.get("h")
    return t.view(b, n, heads if heads else -1, axes.get("d", -1)).transpose(1, 2)


class _EinopsInForward(_EinopsAttention):
    def __init__(self) -> None:
        super().__init__()
        del self.split_heads  # the pattern is in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(f(x), "b n (h d) -> b h n d", h=self.heads)
                   for f in (self.to_q, self.to_k, self.to_v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(y.transpose(1, 2).flatten(2))


class _EinopsHeadSize(_EinopsAttention):
    def __init__(self) -> None:
        super().__init__()
        del self.split_heads  # the pattern is in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(f(x), "b n (h d) -> b h n d", d=4)
                   for f in (self.to_q, self.to_k, self.to_v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(y.transpose(1, 2).flatten(2))


class _EinopsLiteral(_EinopsAttention):
    def __init__(self) -> None:
        super().__init__()
        del self.split_heads  # the pattern is in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(f(x), "b n (h d) -> b h n d", h=4)
                   for f in (self.to_q, self.to_k, self.to_v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(y.transpose(1, 2).flatten(2))


def test_heads_fixed_in_an_einops_call_by_a_literal_leave_the_attention_replicated() -> None:
    # h=4 in the call: no recipe can divide it. h=self.heads (vit-pytorch) is divided by the
    # region (head_counts), and a head size (d=) holds on a shard: both are read
    with torch.device("meta"):
        model = _EinopsModel()
        model.layers = nn.ModuleList([_EinopsLiteral(), _EinopsLiteral()])
        _, left_out = read_structure(model)
        assert [n.why.split(":")[0] for n in left_out] == [
            "its forward fixes the head count in an einops pattern (rearrange(f(x), "
            "\"b n (h d) -> b h n d\", h=4))"]
        for cls in (_EinopsInForward, _EinopsHeadSize):
            model.layers = nn.ModuleList([cls(), cls()])
            entries, left_out = read_structure(model)
            assert left_out == (), cls
            assert "layers.*.to_out" in {e.pattern for e in entries}, cls


class _OnlyMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.MultiheadAttention(16, 4, batch_first=True, kdim=8, vdim=8)
                                    for _ in range(2))


def make_only_mha() -> _OnlyMHA:
    return _OnlyMHA()


def test_a_refusal_says_what_was_read_and_what_was_left_out_and_why() -> None:
    with pytest.raises(SuggestError) as err:
        suggest_recipe("tests.suggest.test_suggest_byo:make_only_mha", TP2,
                       options=SuggestOptions(verify=False))
    assert str(err.value).startswith(
        "tests.suggest.test_suggest_byo:make_only_mha (_OnlyMHA) declares no tensor-parallel "
        "plan (transformers' base_model_tp_plan / _tp_plan), and its structure shows no block "
        "of column-wise projections from the hidden size and a row-wise one back to it (the "
        "blocks read a hidden size of 16); layers.* (nn.MultiheadAttention) was left out: its "
        "kdim (8) or vdim (8) differs from embed_dim (16)")


def test_a_factory_model_gets_an_unverified_recipe_named_by_its_factory() -> None:
    s = suggest_recipe(f"{BYO}:make_gpt", TP2, options=SuggestOptions(verify=False))
    assert "recipe: make_gpt-suggested" in s.text
    assert {r.match for r in s.rules} >= {"transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"}
    assert [n.what for n in s.narrowed][0] == "transformer.h.*.attn (CausalSelfAttention)"
    assert "narrowed: transformer.h.*.attn (CausalSelfAttention): its forward reads" in s.text


def _suggest_and_recheck(factory: str, config: dict[str, object], inputs: str | None,
                         tmp_path: Path) -> tuple[set[str], list[str]]:
    """Suggest at tp=2 (verified), check the written file again in both modes; the sharded
    patterns and what was narrowed."""
    model = f"{BYO}:{factory}"
    s = suggest_recipe(model, TP2, model_config=config,
                       options=SuggestOptions(timeout_s=120, inputs=inputs))
    assert s.verified, s.summary()
    assert s.sharded_fraction["tp"] > 0.2, s.summary()
    path = tmp_path / f"{factory}.yaml"
    path.write_text(s.text)
    report = run_check(CheckOptions(recipe=str(path), model=model, model_config=config,
                                    mesh=TP2, inputs=inputs, timeout_s=120))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]
    sharded = {m for r in s.rules
               if dict(r.fields).get("style") in ("colwise", "rowwise", "vocab_parallel",
                                                  "colwise_gather_output", "multihead_attention")
               or "shard" in str(dict(r.fields).get("params")) for m in _expand(r.match)}
    return sharded, [n.what for n in s.narrowed]


def _expand(match: str) -> list[str]:
    """``h.*.attn.{q,k,v}`` as ``h.*.attn.q``, ``h.*.attn.k``, ``h.*.attn.v``."""
    head, brace, rest = match.partition("{")
    if not brace:
        return [match]
    inner, _, tail = rest.partition("}")
    return [m for alt in inner.split(",") for m in _expand(head + alt + tail)]


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_a_nanogpt_gets_a_verified_recipe_of_its_mlps_embedding_and_head(tie: bool,
                                                                        tmp_path: Path) -> None:
    # nanoGPT ties lm_head to wte: the two are one group, sharded on the vocab together
    sharded, narrowed = _suggest_and_recheck("make_gpt", {"tie": tie}, None, tmp_path)
    assert {"transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj", "transformer.wte",
            "lm_head"} <= sharded
    assert not any(".attn" in m for m in sharded)
    assert "transformer.h.*.attn (CausalSelfAttention)" in narrowed


@pytest.mark.slow
def test_a_nanogpt_that_fixes_its_head_size_gets_its_attention_sharded_too(tmp_path: Path) -> None:
    # the forward the docs ask for: self.head_dim, reshape(B, T, -1); n_embd (the split size)
    # is divided with the heads
    sharded, narrowed = _suggest_and_recheck("make_gpt_head_size", {}, None, tmp_path)
    assert {"transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
            "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"} <= sharded
    assert not any(".attn" in n for n in narrowed)


@pytest.mark.slow
def test_a_litgpt_like_model_gets_its_attention_and_swiglu_sharded(tmp_path: Path) -> None:
    sharded, _ = _suggest_and_recheck("make_litgpt", {"n_layer": 2}, None, tmp_path)
    assert {"h.*.attn.q", "h.*.attn.k", "h.*.attn.v", "h.*.attn.proj", "h.*.mlp.fc_1",
            "h.*.mlp.fc_2", "h.*.mlp.proj"} <= sharded


@pytest.mark.slow
@pytest.mark.parametrize("conv_patches", [True, False])
def test_a_vit_on_patch_embeddings_gets_its_attention_and_mlps_sharded(
        conv_patches: bool, tmp_path: Path) -> None:
    # timm's fused qkv reshaped to (B, N, 3, heads, head_dim): in chunks of 3, which validate
    # mode computes through a gathered weight (tests/runtime/test_fused_qkv_input_grads.py)
    sharded, narrowed = _suggest_and_recheck("make_vit", {"conv_patches": conv_patches},
                                             PIXELS, tmp_path)
    assert {"blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc1",
            "blocks.*.mlp.fc2"} <= sharded
    assert not any(".attn" in n for n in narrowed)


@pytest.mark.slow
def test_an_encoder_on_nn_multihead_attention_gets_its_attention_and_mlps_sharded(
        tmp_path: Path) -> None:
    # the multihead_attention style: in_proj in 3 chunks, mha_heads on each rank's heads, and
    # out_proj row-wise; checked in both modes by suggest and again from the written file
    sharded, narrowed = _suggest_and_recheck("make_mha_encoder", {}, None, tmp_path)
    assert {"layers.*.self_attention", "layers.*.self_attention.out_proj",
            "layers.*.mlp.linear_1", "layers.*.mlp.linear_2"} <= sharded
    assert not any("self_attention" in n for n in narrowed)


@pytest.mark.slow
def test_the_suggest_command_takes_a_factory_and_inputs_as_check_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hyperrecipe.cli import main

    out = tmp_path / "vit.yaml"
    code = main(["suggest", "--model", f"{BYO}:make_vit", "--model-config",
                 '{"conv_patches": false}', "--inputs", PIXELS, "--mesh", "tp=2", "-q",
                 "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert out.read_text().startswith("# yaml-language-server")
    assert "recipe: make_vit-suggested" in out.read_text()
    assert f"--inputs {PIXELS} --mesh tp=2`" in out.read_text()
    assert main(["check", str(out), "--model", f"{BYO}:make_vit", "--model-config",
                 '{"conv_patches": false}', "--inputs", PIXELS, "--mesh", "tp=2", "-q"]) == 0


def test_an_mlp_written_as_nn_sequential_keeps_its_step_numbers_in_the_patterns() -> None:
    # numbered steps of mixed modules (Linear, GELU, Linear) are no list of layers: mlp.0 and
    # mlp.2 are two patterns, one column-wise and one row-wise
    styles, left_out = _read("make_sequential_mlp")
    assert styles == {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
    assert left_out == {}


def test_numbered_linears_of_one_class_still_fold_and_are_not_read_as_a_block() -> None:
    # a Sequential of Linears only: its numbers read as a list, so the two are one pattern
    with torch.device("meta"):
        model = _MlpStack()
        for block in model.blocks:
            block.seq = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
        entries, _ = read_structure(model)
    assert not any(".seq." in e.pattern for e in entries)


@pytest.mark.slow
def test_a_torchvision_vit_gets_its_attention_and_mlps_sharded(tmp_path: Path) -> None:
    sharded, narrowed = _suggest_and_recheck("make_torchvision_vit", {}, PIXELS, tmp_path)
    assert {"encoder.layers.*.self_attention", "encoder.layers.*.self_attention.out_proj",
            "encoder.layers.*.mlp.0", "encoder.layers.*.mlp.3"} <= sharded
    assert not any("encoder_layer" in n for n in narrowed)


@pytest.mark.slow
def test_an_nn_sequential_mlp_gets_a_verified_recipe(tmp_path: Path) -> None:
    sharded, narrowed = _suggest_and_recheck("make_sequential_mlp", {}, None, tmp_path)
    assert {"blocks.*.mlp.0", "blocks.*.mlp.2"} <= sharded


@pytest.mark.slow
def test_the_hand_written_rules_for_an_nn_sequential_mlp_agree_in_both_modes(
        tmp_path: Path) -> None:
    # the snippet of docs/bring-your-own-model.md#an-mlp-written-as-nnsequential
    path = tmp_path / "seq.yaml"
    path.write_text("recipe: seq\nversion: 1\nmesh: [tp]\nrules:\n"
                    "  - match: blocks.*.mlp.0\n    style: colwise\n"
                    "  - match: blocks.*.mlp.2\n    style: rowwise\n")
    report = run_check(CheckOptions(recipe=str(path), model=f"{BYO}:make_sequential_mlp",
                                    mesh=TP2, timeout_s=120))
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]
