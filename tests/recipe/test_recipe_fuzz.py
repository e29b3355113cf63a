"""Malformed recipes of every shape give RecipeError, never another exception."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrecipe.errors import RecipeError
from hyperrecipe.model_tree import snapshot
from hyperrecipe.recipe import load_recipe
from hyperrecipe.recipe.validate import RULE_FIELD_SPECS, TOP_LEVEL_SPECS
from hyperrecipe.resolve import resolve_recipe
from tests.support.recipe_text import to_toml, to_yaml
from tests.support.toy_models import Toy

with torch.device("meta"):
    TREE = snapshot(Toy())

_words = st.sampled_from([
    "replicate", "partial", "partial(avg)", "partial(max)", "shard(0)", "shard(-1)", "shard(9)",
    "shard(0, chunks=2)", "shard(0, chunks=[8, 8])", "shard(", "colwise", "rowwise", "bogus",
    "layers.*", "layers.*.up", "**", "embed", "head", "re:(", "re:layers\\.0\\..*", "{a,b", "tp",
    "dp", "x", "0", ">1", "==2", "ulysses", "pkg.mod:fn", "num_heads", "weight", "bias", "",
])
_scalars = st.one_of(_words, st.integers(-3, 5), st.booleans(), st.none(), st.floats(0, 2))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(_words, st.sampled_from(["weight", "bias", "tp", "0"])), inner,
                    max_size=3)), max_leaves=8)
_rule_keys = st.sampled_from([s.name for s in RULE_FIELD_SPECS] + ["parms", "boundry"])
_rules = st.dictionaries(_rule_keys, _values, max_size=5)
_top = st.fixed_dictionaries(
    {"recipe": st.one_of(st.just("t"), _scalars), "version": st.sampled_from([1, 1, 1, 2, "1"]),
     "mesh": st.one_of(st.just(["tp"]), st.just(["dp", "tp"]), _values),
     "rules": st.one_of(st.lists(_rules, max_size=4), _values)},
    optional={k: _values for k in [s.name for s in TOP_LEVEL_SPECS] + ["rulez"]
              if k not in ("recipe", "version", "mesh", "rules", "extends")})


def _load_and_resolve(path: Path) -> None:
    try:
        recipe = load_recipe(path)
    except RecipeError:
        return
    try:
        resolve_recipe(recipe, TREE, {"tp": 2})
    except RecipeError:
        return


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_top)
@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_generated_recipes_load_and_resolve_or_raise_recipe_error(data: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        y = Path(d) / "r.yaml"
        y.write_text(to_yaml(data))
        _load_and_resolve(y)
        try:
            toml_text = to_toml(data)
        except TypeError:  # TOML cannot hold null; nothing to test in that format
            return
        t = Path(d) / "r.toml"
        t.write_text(toml_text)
        _load_and_resolve(t)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.sampled_from([".yaml", ".toml"]))
def test_arbitrary_text_gives_recipe_error(text: str, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"r{suffix}"
        p.write_text(text, encoding="utf-8")
        try:
            load_recipe(p)
        except RecipeError:
            pass


# ----------------------------------------------------------------------------- hostile text
# Recipe text spliced from the fragments that broke the loader before it was bounded (issue 16):
# aliases, tags, deep nesting, huge and non-ASCII numbers, catastrophic patterns, long extends.
# CI runs FUZZ_EXAMPLES (a few thousand); HYPERRECIPE_FUZZ_EXAMPLES=20000 for a deeper run.

FUZZ_EXAMPLES = int(os.environ.get("HYPERRECIPE_FUZZ_EXAMPLES", "2000"))

_hostile_values = st.sampled_from([
    "&a [x, x, x]", "*a", "&r [*r]", "!!timestamp abc", "!!float llama", "!!python/tuple [a]",
    "!!python/object/apply:os.system [echo]", "!!binary aGk=", "!!set {a: null}", "!x y",
    "9" * 5000, "9" * 40, "-" + "9" * 30, "0x" + "f" * 40, "1e999", ".nan", "'shard(٠)'",
    "'shard(" + "9" * 400 + ")'", "'shard(0, chunks=[" + "9" * 400 + ", 1])'", "'>٣'",
    "'re:(.*)*Z'", "'re:a{99999999999}'", "'re:(a{999}){999}'", "'re:(?=a)'", "'re:\\\\1'",
    "'" + "{a," * 60 + "b" + "}" * 60 + "'", "'**.**.**.**.**'", "'*a*a*a*a*a*b'",
    "[" * 80 + "]" * 80, "{a: " * 80 + "1" + "}" * 80, "'x'", "[]", "{}", "null", "1",
    "'" + "x" * 3000 + "'", "'" + "x/" * 600 + "'",
])
_keys = st.sampled_from(["recipe", "version", "mesh", "rules", "styles", "description",
                         "extends", "unclaimed", "adapters", "match", "when", "params", "<<"])
_toml_values = st.sampled_from([
    "9" * 5000, "9" * 40, "[" * 80 + "]" * 80, "{a = " * 80 + "1" + "}" * 80, "'re:(.*)*Z'",
    "'shard(٠)'", "\"" + "x" * 3000 + "\"", "nan", "inf", "1979-05-27T07:32:00Z", "[1, 'a']",
])


@st.composite
def _hostile_yaml(draw: st.DrawFn) -> str:
    lines = ["recipe: t", "version: 1", "mesh: [tp]"]
    for _ in range(draw(st.integers(1, 4))):
        lines.append(f"{draw(_keys)}: {draw(_hostile_values)}")
    if draw(st.booleans()):
        rule = ", ".join(f"{draw(_keys)}: {draw(_hostile_values)}" for _ in range(2))
        lines.append(f"rules: [{{match: {draw(_hostile_values)}, {rule}}}]")
    else:
        lines.append("rules: []")
    return "\n".join(draw(st.permutations(lines))) + "\n"


@st.composite
def _hostile_toml(draw: st.DrawFn) -> str:
    lines = ['recipe = "t"', "version = 1", 'mesh = ["tp"]']
    for _ in range(draw(st.integers(1, 3))):
        lines.append(f"{draw(_keys).strip('<')} = {draw(_toml_values)}")
    lines.append(f"rules = [{{match = {draw(_toml_values)}}}]")
    return "\n".join(lines) + "\n"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.one_of(_hostile_yaml().map(lambda t: (t, ".yaml")),
                 _hostile_toml().map(lambda t: (t, ".toml"))))
@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_hostile_recipe_text_raises_only_recipe_error(case: tuple[str, str]) -> None:
    text, suffix = case
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"r{suffix}"
        p.write_text(text, encoding="utf-8")
        _load_and_resolve(p)
