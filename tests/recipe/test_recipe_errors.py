"""Every refusal of the loader and resolver: exact message, file, line and column, YAML and TOML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import snapshot
from hyperrecipe.recipe import load_recipe
from hyperrecipe.resolve import resolve_recipe
from tests.support.recipe_text import locate, write_both
from tests.support.toy_models import Toy

STYLES = "colwise, colwise_gather_output, multihead_attention, replicate, rowwise, sequence_parallel, vocab_parallel"
RULE_KEYS = ("match, when, style, params, boundary, in_src, in_dst, out_src, out_dst, in_grad, "
             "out_grad, out_names, "
             "defer_bias, head_counts, reduce_grads, inner_wrapper, inner_out_src, local_region, no_grad, "
             "loss_parallel, note")


def base(*rules: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"recipe": "t", "version": 1, "mesh": ["tp"], **top, "rules": list(rules)}


# (id, recipe data, yaml needle, toml needle, message after "file:line:col: ")
LOAD_CASES = [
    ("unknown-style", base({"match": "layers.*.up", "style": "colwse"}), "colwse", '"colwse"',
     f"unknown style 'colwse'; did you mean 'colwise'? @ $.rules[0].style; expected one of: {STYLES}"),
    ("unknown-rule-key", base({"match": "layers.*.up", "parms": {"weight": "replicate"}}),
     "parms", "parms",
     f"unknown key 'parms' in rule 0; did you mean 'params'? @ $.rules[0].parms; expected one of: "
     f"{RULE_KEYS}"),
    ("unknown-placement", base({"match": "layers.*.up", "params": {"weight": {"tp": "shard(x)"}}}),
     "shard(x)", '"shard(x)"',
     "unknown placement 'shard(x)'; expected one of replicate, partial, partial(sum), partial(avg), "
     "shard(D), shard(D, chunks=K), shard(D, chunks=[S1, S2, ...]) @ $.rules[0].params.weight.tp"),
    ("undeclared-mesh-dim", base({"match": "layers.*.up", "params": {"weight": {"tq": "shard(0)"}}}),
     "tq", "tq",
     "placement names mesh dim 'tq', which the recipe does not declare; did you mean 'tp'? "
     "@ $.rules[0].params.weight.tq; declared mesh dims: [tp]"),
    ("missing-match", base({"style": "colwise"}), "{style", "[[rules]]",
     "required field missing: 'match' in rule 0 @ $.rules[0]"),
    ("bad-pattern", base({"match": "layers..up", "style": "colwise"}), "layers..up", '"layers..up"',
     "invalid pattern 'layers..up': empty segment (two dots in a row, or a leading/trailing dot) "
     "@ $.rules[0].match"),
    ("unknown-top-key", {**base({"match": "embed"}), "rulez": []}, "rulez", "rulez",
     "unknown key 'rulez' in the recipe; did you mean 'rules'? @ $.rulez; expected one of: recipe, "
     "version, mesh, description, extends, unclaimed, styles, rules, adapters, pipeline"),
    ("bad-version", {**base({"match": "embed"}), "version": 2}, "2", "2",
     "unsupported recipe version 2; expected 1 @ $.version"),
    ("bad-when", base({"match": "embed", "when": {"tp": "big"}}), "big", '"big"',
     "condition 'big' is not one of >N, >=N, <N, <=N, ==N, !=N or N @ $.rules[0].when.tp"),
    ("layout-on-non-boundary", base({"match": "embed", "style": "colwise", "boundary": False,
                                     "in_src": {"0": "replicate"}}), "in_src", "in_src",
     "in_src has no effect with boundary: false @ $.rules[0].in_src"),
    ("unknown-wrapper", base({"match": "embed", "inner_wrapper": "ulyses"}), "ulyses", '"ulyses"',
     "unknown inner wrapper 'ulyses'; did you mean 'ulysses'? @ $.rules[0].inner_wrapper; expected "
     "one of cp_allgather_kv, mha_heads, ulysses or `pkg.mod:callable`"),
    ("grad-layout-shard", base({"match": "layers.*.mlp", "boundary": True,
                                "in_src": {"x": "replicate"}, "in_grad": {"x": {"tp": "shard(1)"}}}),
     "shard(1)", '"shard(1)"',
     "a gradient layout is replicate (whole) or partial on each mesh dim, found shard(1) on tp "
     "@ $.rules[0].in_grad.x.tp; a sharded value's gradient is sharded the same way without a "
     "declaration; write {DIM: partial} or replicate"),
    ("grad-layout-avg", base({"match": "layers.*.mlp", "boundary": True,
                              "out_src": {"0": "replicate"},
                              "out_grad": {"0": {"tp": "partial(avg)"}}}),
     "partial(avg)", '"partial(avg)"',
     "a gradient layout is replicate (whole) or partial on each mesh dim, found partial(avg) on tp "
     "@ $.rules[0].out_grad.0.tp; a sharded value's gradient is sharded the same way without a "
     "declaration; write {DIM: partial} or replicate"),
    ("grad-on-non-boundary", base({"match": "embed", "style": "colwise", "boundary": False,
                                   "out_grad": {"0": {"tp": "partial"}}}), "out_grad", "out_grad",
     "out_grad has no effect with boundary: false @ $.rules[0].out_grad"),
]


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
@pytest.mark.parametrize(("case", "data", "y_needle", "t_needle", "message"), LOAD_CASES,
                         ids=[c[0] for c in LOAD_CASES])
def test_loader_refusal_names_file_line_column_and_path(
        tmp_path: Path, fmt: str, case: str, data: dict[str, Any], y_needle: str, t_needle: str,
        message: str) -> None:
    y, t = write_both(tmp_path, case, data)
    path = y if fmt == "yaml" else t
    line, col = locate(path.read_text(), y_needle if fmt == "yaml" else t_needle)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == f"{path}:{line}:{col}: {message}"
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (line, col)


def test_invalid_yaml_reports_the_parser_position(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("recipe: t\nversion: 1\nmesh: [tp\nrules: []\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    assert str(err.value).startswith(f"{p}:4:6: invalid YAML: expected ',' or ']', but got ':'")


def test_invalid_toml_reports_the_parser_position(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('recipe = "t"\nversion = 1\nmesh = ["tp"\n')
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    assert str(err.value).startswith(f"{p}:4:1: invalid TOML:")


def test_extends_of_a_missing_recipe_lists_the_shipped_ones(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("recipe: t\nversion: 1\nmesh: [tp]\nextends: lama\nrules: []\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}:4:10: extends 'lama': no such file next to this recipe and no "
                          f"shipped recipe of that name; did you mean 'llama'? @ $.extends; "
                          f"shipped recipes: ")
    assert "llama" in msg.rsplit("shipped recipes: ", 1)[1]


def test_extends_cycle_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("recipe: a\nversion: 1\nmesh: [tp]\nextends: b.yaml\nrules: []\n")
    (tmp_path / "b.yaml").write_text("recipe: b\nversion: 1\nmesh: [tp]\nextends: a.yaml\nrules: []\n")
    with pytest.raises(RecipeError, match="extends forms a cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_style_cycle_is_refused(tmp_path: Path) -> None:
    data = base({"match": "embed", "style": "a"},
                styles={"a": {"style": "b"}, "b": {"style": "a"}})
    y, t = write_both(tmp_path, "cyc", data)
    for path in (y, t):
        with pytest.raises(RecipeError, match=r"styles form a cycle: a -> b -> a"):
            load_recipe(path)


# ----------------------------------------------------------------------------- resolver

def toy_tree(**kw: Any):  # type: ignore[no-untyped-def]
    import torch

    with torch.device("meta"):
        return snapshot(Toy(**kw))


RESOLVE_CASES = [
    ("no-match", base({"match": "layer.*.up", "style": "colwise"}), {"tp": 2}, "layer.*.up",
     '"layer.*.up"',
     "rule 0 (match 'layer.*.up') matches no module of the model @ $.rules[0].match; nearest module "
     "FQNs: layers.*.mlp, layers.*.mlp.up, layers.*"),
    ("double-claim", base({"match": "layers.*.mlp.up", "style": "colwise"},
                          {"match": "layers.0.mlp.up", "params": {"weight": "replicate"}}), {"tp": 2},
     "replicate", '"replicate"',
     "parameter 'layers.0.mlp.up.weight' is placed {tp: shard(0)} by rule 0 ({file}:{r0}) and "
     "replicate by rule 1 (match 'layers.0.mlp.up') @ $.rules[1].params.weight; a parameter belongs to "
     "exactly one rule"),
    ("not-divisible", base({"match": "layers.*.mlp.up", "style": "colwise"}), {"tp": 3}, "layers.*.mlp.up",
     '"layers.*.mlp.up"',
     "parameter 'layers.0.mlp.up.weight': dim 0 (size 16) is not divisible by mesh dim tp=3 (shard(0)) "
     "@ $.rules[0].params.weight; shape [16, 8]; each rank must hold an equal slice"),
    ("head-count", base({"match": "layers.*.mlp", "head_counts": {"num_heads": "tp"}}), {"tp": 3},
     "num_heads", "num_heads",
     "head count layers.0.mlp.num_heads = 4 is not divisible by mesh dim tp of size 3 "
     "@ $.rules[0].head_counts.num_heads; every rank must hold whole heads"),
    ("unknown-head-attr", base({"match": "layers.*.mlp", "head_counts": {"n_heads": "tp"}}), {"tp": 2},
     "n_heads", "n_heads",
     "module 'layers.0.mlp' has no integer attribute 'n_heads'; did you mean 'num_heads'? "
     "@ $.rules[0].head_counts.n_heads; its integer attributes: [num_heads]"),
    ("mesh-lacks-dim", {**base({"match": "layers.*.mlp.up", "params": {"weight": {"cp": "shard(0)"}}}),
                        "mesh": ["tp", "cp"]}, {"tp": 2}, "{cp: shard(0)}", '{ cp = ',
     "parameter 'layers.0.mlp.up.weight' is placed on mesh dim 'cp', which the mesh lacks "
     "@ $.rules[0].params.weight; mesh: tp=2; add cp=1 or guard the rule with `when`"),
    ("recipe-lacks-dim", base({"match": "layers.*.mlp.up", "style": "colwise"}), {"tp": 2, "dp": 2},
     "[tp]", '["tp"]',
     "mesh dim 'dp' is not declared by recipe 't' @ $.mesh; declared: [tp]; mesh: tp=2,dp=2"),
    ("impossible", base({"match": "layers.*.mlp.up", "style": "colwise", "out_dst": {"0": {"tp": "partial"}}}),
     {"tp": 2}, "out_dst", "out_dst",
     "'layers.0.mlp.up' output 'output' on tp: shard(-1) -> partial is impossible: no collective turns a "
     "tensor into a pending reduction (partial is only ever produced by the forward itself) "
     "@ $.rules[0].out_dst"),
    ("unknown-param", base({"match": "layers.*.norm", "params": {"wieght": "replicate"}}), {"tp": 2},
     "wieght", "wieght",
     "module 'layers.0.norm' (LayerNorm) has no parameter 'wieght'; did you mean 'weight'? "
     "@ $.rules[0].params.wieght; its direct parameters: [weight, bias]"),
    ("unknown-arg", base({"match": "layers.*", "boundary": True, "in_src": {"hidden": "replicate"}}),
     {"tp": 2}, "hidden", "hidden",
     "in_src names argument 'hidden', which 'layers.0'.forward does not take @ $.rules[0].in_src.hidden;"
     " forward(x)"),
    ("no-grad-undeclared", base({"match": "layers.*.mlp", "boundary": True,
                                 "in_src": {"x": "replicate"}, "no_grad": ["xx"]}),
     {"tp": 2}, "xx", '"xx"',
     "no_grad names input 'xx' of 'layers.0.mlp', which has no declared layout; did you mean 'x'? "
     "@ $.rules[0].no_grad[0]; declared inputs: x; no_grad only affects inputs named in in_src / "
     "in_dst"),
    ("embedding-not-vocab-parallel", base({"match": "embed", "boundary": True,
                                           "in_src": {"input": "replicate"},
                                           "out_src": {"0": "replicate"},
                                           "params": {"weight": {"tp": "shard(1)"}}}),
     {"tp": 2}, "{tp: shard(1)}", "{ tp = ",
     "embed: a vocab-parallel embedding shards the vocab dim (0) on one mesh dim; found "
     "{tp: shard(1)} @ $.rules[0].params.weight; shard the table's dim 0 over one mesh dim (as "
     "`style: vocab_parallel` does), or replicate it"),
    ("in-grad-undeclared", base({"match": "layers.*.mlp", "boundary": True,
                                 "in_src": {"x": "replicate"},
                                 "out_src": {"0": "replicate"},
                                 "out_grad": {"1": "replicate"}}),
     {"tp": 2}, "out_grad", "out_grad",
     "out_grad names output 'output1' of 'layers.0.mlp', which has no declared layout; did you "
     "mean 'output'? @ $.rules[0].out_grad.1; declared outputs: output; declare its layout (out_src) as well"),
    ("in-grad-on-shard", base({"match": "layers.*.mlp", "boundary": True,
                               "in_src": {"x": {"tp": "shard(1)"}},
                               "in_grad": {"x": {"tp": "partial"}}}),
     {"tp": 2}, "x: {tp: partial}", 'x = { tp = "partial"',
     "in_grad[x] of 'layers.0.mlp' declares the gradient on tp, where the input is shard(1) "
     "(in_dst): a sharded value's gradient is sharded the same way, with nothing to declare "
     "@ $.rules[0].in_grad.x; declare the gradient only on mesh dims where 'x' is replicated "
     "(in_dst)"),
    ("in-grad-and-no-grad", base({"match": "layers.*.mlp", "boundary": True,
                                  "in_src": {"0": "replicate"}, "no_grad": ["x"],
                                  "in_grad": {"x": "replicate"}}),
     {"tp": 2}, "x: replicate", 'x = "replicate"',
     "in_grad declares how the gradient of input 'x' of 'layers.0.mlp' comes back, but no_grad "
     "says it carries none @ $.rules[0].in_grad.x; drop 'x' from one of in_grad and no_grad"),
    ("unclaimed-error", {**base({"match": "layers.*.mlp.up", "style": "colwise"}), "unclaimed": "error"},
     {"tp": 2}, "error", '"error"',
     "10 parameter(s) claimed by no rule: embed.weight, layers.0.norm.weight, layers.0.norm.bias, "
     "layers.0.mlp.down.weight, layers.0.mlp.down.bias and 5 more @ $.unclaimed; add rules for them, or set "
     "`unclaimed: replicate`"),
]


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
@pytest.mark.parametrize(("case", "data", "mesh", "y_needle", "t_needle", "message"), RESOLVE_CASES,
                         ids=[c[0] for c in RESOLVE_CASES])
def test_resolver_refusal_names_file_line_rule_and_expectation(
        tmp_path: Path, fmt: str, case: str, data: dict[str, Any], mesh: dict[str, int],
        y_needle: str, t_needle: str, message: str) -> None:
    y, t = write_both(tmp_path, case, data)
    path = y if fmt == "yaml" else t
    text = path.read_text()
    line, col = locate(text, y_needle if fmt == "yaml" else t_needle)
    recipe = load_recipe(path)
    with pytest.raises(RecipeError) as err:
        resolve_recipe(recipe, toy_tree(), mesh)
    r0 = recipe.rules[0].span()
    expected = message.replace("{file}", str(path)).replace("{r0}", f"{r0.line}:{r0.column}")
    assert str(err.value) == f"{path}:{line}:{col}: {expected}"


def test_tied_parameters_with_different_placements_are_refused(tmp_path: Path) -> None:
    data = base({"match": "embed", "style": "vocab_parallel"},
                {"match": "head", "params": {"weight": {"tp": "shard(1)"}}})
    y, _ = write_both(tmp_path, "tied", data)
    with pytest.raises(RecipeError) as err:
        resolve_recipe(load_recipe(y), toy_tree(tie=True), {"tp": 2})
    assert "tied parameter 'embed.weight' is placed {tp: shard(0)} by rule 0" in str(err.value)
    assert "tied parameters share one tensor and need one placement" in str(err.value)


def test_boundary_false_over_a_base_boundary_blames_the_extending_rule(tmp_path: Path) -> None:
    """A recipe extending one whose rule makes ``layers.*.mlp.up`` a colwise boundary cannot turn
    it into a plain sharded projection with ``boundary: false``: the base's layouts stay. The
    refusal points at the ``boundary: false`` the user wrote, not at the base's rule."""
    (tmp_path / "base.yaml").write_text(
        "recipe: base\nversion: 1\nmesh: [tp]\nrules:\n"
        "  - {match: layers.*.mlp.up, style: colwise}\n")
    child = tmp_path / "child.yaml"
    child.write_text("recipe: child\nversion: 1\nmesh: [tp]\nextends: base.yaml\nrules:\n"
                     "  - {match: layers.*.mlp.up, style: colwise, boundary: false}\n")
    with pytest.raises(RecipeError) as err:
        resolve_recipe(load_recipe(child), toy_tree(), {"tp": 2})
    assert str(err.value).startswith(
        f"{child}:6:56: rule 0 (match 'layers.*.mlp.up') sets boundary: false on "
        f"'layers.0.mlp.up', but rule 0 (match 'layers.*.mlp.up') ({tmp_path / 'base.yaml'}:5:5) "
        f"declares its in_src @ $.rules[0].boundary; boundary: false drops only the layouts of "
        f"its own rule's style"), str(err.value)
