"""``torch.nn.MultiheadAttention`` sharded by heads: the ``multihead_attention`` style and its
built-in inner wrapper ``mha_heads`` (issue 39).

The fast tests compile on the meta device: the style's expansion, and each refusal at the
recipe line (a plain ``shard(0)`` of the fused ``in_proj_weight``, an ``out_proj`` that is no
row-wise boundary, separate q/k/v weights) or by name at compile time's verification
(``add_bias_kv``, ``add_zero_attn``). The slow test runs ``hyperrecipe check`` on gloo ranks in
both modes against one process (tp=2 and tp=4) — the output, every boundary value and every gradient within
check's default atol 1e-5 / rtol 1e-4 (fp32) — on ``tests.support.mha_models:make_mha_probe``,
whose attentions are called every way users call them (default ``need_weights``, averaged and
per-head weights, ``batch_first`` False, key padding and per-head masks, cross attention, no
biases).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hyperrecipe import compile_recipe
from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import HyperrecipeError, RecipeError

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "mha-probe-tp.yaml"
PROBE = "tests.support.mha_models:make_mha_probe"

_RULES = """\
recipe: one-mha
version: 1
mesh: [tp]
rules:
  - {{match: attn, {attn}}}
{out_proj}"""
_STYLE = "style: multihead_attention"
_ROWWISE = "  - {match: attn.out_proj, style: rowwise}\n"


class _OneMHA(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True, **options)  # type: ignore[arg-type]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        out: torch.Tensor = self.attn(x, x, x)[0]
        return out


def _compile(tmp_path: Path, attn: str = _STYLE, out_proj: str = _ROWWISE,
             **options: object) -> object:
    path = tmp_path / "one-mha.yaml"
    path.write_text(_RULES.format(attn=attn, out_proj=out_proj))
    with torch.device("meta"):
        model = _OneMHA(**options)
    return compile_recipe(str(path), model, {"tp": 2})


def test_the_style_shards_in_proj_in_three_chunks_and_runs_mha_heads(tmp_path: Path) -> None:
    plan: object = _compile(tmp_path)
    params = {p.fqn: str(p.placement) for p in plan.params}  # type: ignore[attr-defined]
    assert params["attn.in_proj_weight"] == "{tp: shard(0, chunks=3)}"
    assert params["attn.in_proj_bias"] == "{tp: shard(0, chunks=3)}"
    assert params["attn.out_proj.weight"] == "{tp: shard(1)}"
    (attn,) = [b for b in plan.boundaries if b.fqn == "attn"]  # type: ignore[attr-defined]
    assert attn.inner_wrapper == ("mha_heads",)
    assert {a.name: (str(a.src), str(a.dst)) for a in attn.outputs} == {
        "attn_output": ("replicate", "replicate"),
        "attn_weights": ("{tp: partial}", "replicate")}


def test_a_plain_shard_of_the_fused_in_proj_is_refused_at_its_line(tmp_path: Path) -> None:
    # rank 0 would hold q and half of k: every shape fits, every value is wrong
    attn = (_STYLE + ', params: {in_proj_weight: {tp: "shard(0)"}, '
            'in_proj_bias: {tp: "shard(0)"}}')
    with pytest.raises(RecipeError) as err:
        _compile(tmp_path, attn=attn)
    assert str(err.value).startswith(
        f"{tmp_path / 'one-mha.yaml'}:5:")
    assert ("inner wrapper 'mha_heads' of 'attn' computes with in_proj_weight placed "
            "{tp: shard(0, chunks=3)}, but the recipe places attn.in_proj_weight "
            "{tp: shard(0)}") in str(err.value)


def test_an_out_proj_without_its_rowwise_rule_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"computes with out_proj.weight placed \{tp: shard\(1\)\}, "
                                          r"but the recipe places attn.out_proj.weight replicate"):
        _compile(tmp_path, out_proj="")
    # sharded, but no boundary: its partial output would be taken as the whole
    params_only = "  - {match: attn.out_proj, params: {weight: {tp: shard(1)}}}\n"
    with pytest.raises(RecipeError, match=r"calls attn.out_proj as a module and needs it to be a "
                                          r"boundary nested in 'attn'"):
        _compile(tmp_path, out_proj=params_only)


def test_separate_q_k_v_weights_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"its kdim or vdim differs from embed_dim, so q, k and "
                                          r"v are separate q_proj_weight"):
        _compile(tmp_path, kdim=8, vdim=8)


@pytest.mark.parametrize(("option", "message"), [
    ("add_bias_kv", "add_bias_kv=True appends one learned key/value over every head"),
    ("add_zero_attn", "add_zero_attn=True is not supported by mha_heads")])
def test_what_mha_heads_cannot_shard_is_refused_when_compiling(tmp_path: Path, option: str,
                                                              message: str) -> None:
    # compiling verifies the plan by installing it on fake tensors, which runs the factory
    with pytest.raises(HyperrecipeError, match=message):
        _compile(tmp_path, **{option: True})


def test_a_bias_free_attention_compiles(tmp_path: Path) -> None:
    plan: object = _compile(tmp_path, bias=False)
    assert "attn.in_proj_bias" not in {p.fqn for p in plan.params}  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])  # at tp=4 the per-head mask's head 1 is on rank 1
def test_multihead_attention_by_heads_agrees_with_one_process_in_both_modes(tp: int) -> None:
    report = run_check(CheckOptions(recipe=str(RECIPE), model=PROBE, mesh={"tp": tp},
                                    timeout_s=120))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]


def test_a_custom_wrapper_declares_the_placements_and_boundaries_it_computes_with() -> None:
    from hyperrecipe.errors import WrapperDeclarationError
    from hyperrecipe.wrappers import inner_wrapper, load_wrapper

    @inner_wrapper(hook="forward", mesh_dims=("tp",), params={"w": {"tp": "shard(0, chunks=3)"}},
                   boundaries=("out",), inner_out_src={0: "replicate"})
    def fused(ctx: object) -> object:
        return lambda original, *a, **k: original(*a, **k)

    spec = getattr(fused, "__hyperrecipe_wrapper__")
    assert [(p, str(q)) for p, q in spec.declaration("m:fused").params] == [
        ("w", "{tp: shard(0, chunks=3)}")]
    assert spec.declaration("m:fused").boundaries == ("out",)
    with pytest.raises(WrapperDeclarationError, match=r"params\['w'\]: unknown placement"):
        inner_wrapper(params={"w": {"tp": "shard(x)"}})
    # the built-in's factory declares what the registry says
    assert load_wrapper("mha_heads").boundaries == ("out_proj",)
