"""Hostile recipe and plan files end in a located RecipeError / PlanFormatError, in bounded time.

Each input here hangs, exhausts memory or raises a builtin exception (RecursionError,
OverflowError, ValueError, AttributeError, OSError) without the corresponding bound; each is
kept small enough to be quick with it. No wall-clock asserts: an unbounded path would hang the
test, which is what it guards against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe import PlanFormatError, RecipeError, load_recipe
from hyperrecipe.plan import Plan
from hyperrecipe.recipe.automaton import MAX_NFA_STATES
from hyperrecipe.recipe.loader import MAX_EXTENDS_DEPTH
from hyperrecipe.recipe.patterns import compile_pattern
from hyperrecipe.recipe.source import MAX_ALIAS_VALUES, MAX_NESTING

HEAD = "recipe: t\nversion: 1\nmesh: [tp]\n"
TOML_HEAD = 'recipe = "t"\nversion = 1\nmesh = ["tp"]\n'


def _error(tmp_path: Path, name: str, text: str) -> RecipeError:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    return err.value


def _where(err: RecipeError) -> tuple[str, int, int]:
    assert err.span is not None
    return Path(err.span.path).name, err.span.line, err.span.column


def _laughs(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_billion_laughs_stops_at_the_alias_budget(tmp_path: Path) -> None:
    err = _error(tmp_path, "laughs.yaml", HEAD + "rules: []\n" + _laughs(9))  # 10^9 values
    assert err.problem == f"aliases expand to more than {MAX_ALIAS_VALUES} values"
    name, line, _ = _where(err)
    assert name == "laughs.yaml" and 5 <= line <= 13


def test_aliases_of_nested_nodes_nest_within_the_bound(tmp_path: Path) -> None:
    lines = [HEAD + "rules: []", "a0: &a0 " + "[" * 40 + "x" + "]" * 40]
    for i in range(1, 200):  # each anchor nests the previous one 40 levels deeper
        lines.append(f"a{i}: &a{i} " + "[" * 40 + f"*a{i - 1}" + "]" * 40)
    err = _error(tmp_path, "nest.yaml", "\n".join(lines) + "\n")
    assert err.problem == (f"the document nests deeper than {MAX_NESTING} levels (through "
                           f"aliases)")
    assert _where(err)[0] == "nest.yaml"


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    err = _error(tmp_path, "rec.yaml", HEAD + "rules: &r [*r]\n")
    assert err.problem == "recursive alias: a node contains itself"
    assert _where(err) == ("rec.yaml", 4, 8)


@pytest.mark.parametrize(("name", "text", "line", "col"), [
    ("deep.yaml", HEAD + "rules: " + "[" * 500 + "]" * 500 + "\n", 4, 7 + MAX_NESTING),
    ("deepmap.yaml", HEAD + "rules: []\nstyles: " + "{a: " * 500 + "1" + "}" * 500 + "\n",
     5, 8 + MAX_NESTING * 4 - 3),
    ("deep.toml", TOML_HEAD + "rules = " + "[" * 1000 + "]" * 1000 + "\n", 4, 9 + MAX_NESTING),
    ("deeptable.toml", TOML_HEAD + "rules = []\nstyles = " + "{a = " * 1000 + "1" + "}" * 1000
     + "\n", 5, 10 + MAX_NESTING * 5),
])
def test_nesting_beyond_the_bound_is_refused_where_it_happens(
        tmp_path: Path, name: str, text: str, line: int, col: int) -> None:
    err = _error(tmp_path, name, text)
    assert err.problem == f"the document nests deeper than {MAX_NESTING} levels"
    assert _where(err) == (name, line, col)


def test_yaml_nested_a_thousand_deep_is_a_located_recipe_error(tmp_path: Path) -> None:
    """libyaml refuses this itself (its own limit is 1000), before an event reaches ours."""
    err = _error(tmp_path, "deep.yaml", HEAD + "rules: " + "[" * 1000 + "]" * 1000 + "\n")
    assert err.problem in ("invalid YAML: exceeded maximum nesting depth",
                           f"the document nests deeper than {MAX_NESTING} levels"), err.problem
    assert _where(err)[:2] in (("deep.yaml", 4), ("deep.yaml", 1))


def test_dotted_toml_keys_nest_too(tmp_path: Path) -> None:
    err = _error(tmp_path, "dotted.toml", TOML_HEAD + "rules = []\n" + "x." * 200 + "y = 1\n")
    assert err.problem == f"the document nests deeper than {MAX_NESTING} levels"
    assert _where(err)[0] == "dotted.toml"


@pytest.mark.parametrize(("value", "tag"), [
    ("!!timestamp abc", "tag:yaml.org,2002:timestamp"),
    ("!!python/tuple [a]", "tag:yaml.org,2002:python/tuple"),
    ("!!python/object:os.system {}", "tag:yaml.org,2002:python/object:os.system"),
    ("!!python/object/apply:os.system [echo]", "tag:yaml.org,2002:python/object/apply:os.system"),
    ("!!binary aGk=", "tag:yaml.org,2002:binary"),
    ("!!set {a: null}", "tag:yaml.org,2002:set"),
    ("!custom x", "!custom"),
])
def test_tags_outside_the_core_schema_are_refused_on_scalars_lists_and_mappings(
        tmp_path: Path, value: str, tag: str) -> None:
    err = _error(tmp_path, "tag.yaml", HEAD + f"rules: []\ndescription: {value}\n")
    assert err.problem == (f"YAML tag {tag!r} is not allowed: recipes use only the core schema "
                           f"(str, int, float, bool, null, seq, map)")
    assert _where(err) == ("tag.yaml", 5, 14)


@pytest.mark.parametrize(("value", "tag", "what"), [
    ("!!str {a: 1}", "tag:yaml.org,2002:str", "a mapping"),
    ("!!int [1]", "tag:yaml.org,2002:int", "a list"),
    ("!!map [1]", "tag:yaml.org,2002:map", "a list"),
    ("!!seq x", "tag:yaml.org,2002:seq", "a scalar"),
])
def test_a_core_tag_on_the_wrong_kind_of_node_is_refused_not_dropped(
        tmp_path: Path, value: str, tag: str, what: str) -> None:
    err = _error(tmp_path, "kind.yaml", HEAD + f"rules: []\ndescription: {value}\n")
    assert err.problem == f"YAML tag {tag!r} cannot be put on {what}"
    assert _where(err) == ("kind.yaml", 5, 14)


def test_a_core_tag_on_a_value_it_cannot_hold_is_a_located_error(tmp_path: Path) -> None:
    err = _error(tmp_path, "fl.yaml", HEAD + "rules: []\ndescription: !!float llama\n")
    assert err.problem == ("invalid YAML value 'llama' (tag:yaml.org,2002:float): could not "
                           "convert string to float: 'llama'")
    assert _where(err) == ("fl.yaml", 5, 14)


@pytest.mark.parametrize(("name", "text", "line", "col"), [
    ("int.yaml", "recipe: t\nversion: " + "9" * 5000 + "\nmesh: [tp]\nrules: []\n", 2, 10),
    ("int40.yaml", "recipe: t\nversion: " + "9" * 40 + "\nmesh: [tp]\nrules: []\n", 2, 10),
    ("int.toml", 'recipe = "t"\nversion = ' + "9" * 5000 + '\nmesh = ["tp"]\nrules = []\n', 2,
     11),
    ("int40.toml", 'recipe = "t"\nversion = ' + "9" * 40 + '\nmesh = ["tp"]\nrules = []\n', 2,
     11),
])
def test_huge_integers_are_out_of_range(tmp_path: Path, name: str, text: str, line: int,
                                        col: int) -> None:
    err = _error(tmp_path, name, text)
    assert "is out of range (at most 63 bits)" in err.problem, err.problem
    assert _where(err) == (name, line, col)


@pytest.mark.parametrize(("placement", "shown"), [
    ("shard(٠)", "'shard(٠)'"),
    ("shard(" + "9" * 5000 + ")", "'shard(" + "9" * 71 + "...'"),
    ("shard(0, chunks=[" + "9" * 5000 + ", 1])", "'shard(0, chunks=[" + "9" * 60 + "...'"),
])
def test_placements_take_at_most_nine_ascii_digits(tmp_path: Path, placement: str,
                                                   shown: str) -> None:
    text = HEAD + f"rules:\n  - match: a\n    params: {{weight: {{tp: '{placement}'}}}}\n"
    err = _error(tmp_path, "p.yaml", text)
    assert shown in err.problem, err.problem
    assert _where(err) == ("p.yaml", 6, 27)


def test_a_when_condition_with_a_huge_number_is_refused(tmp_path: Path) -> None:
    text = HEAD + "rules:\n  - match: a\n    when: {tp: '>" + "9" * 5000 + "'}\n"
    err = _error(tmp_path, "w.yaml", text)
    assert err.problem.startswith("condition '>999") and err.problem.endswith(
        "...' is not one of >N, >=N, <N, <=N, ==N, !=N or N")
    assert _where(err) == ("w.yaml", 6, 16)


@pytest.mark.parametrize(("match", "problem"), [
    ("re:a{99999999999}", "bad regular expression: repeat {99999999999} is larger than "
                          f"{MAX_NFA_STATES} states at position 1"),
    ("re:(a{1000}){1000}", "bad regular expression: repeat {1000} makes the pattern larger "
                           f"than {MAX_NFA_STATES} states at position 9"),
    ("re:(?=a)a", "bad regular expression: lookarounds, backreferences, flags and atomic groups "
                  "are not supported in recipe patterns (use a plain group) at position 1"),
    ("re:(a)\\1", "bad regular expression: escape \\1 is not supported in recipe patterns at "
                  "position 5"),
    ("{a," * 300 + "b" + "}" * 300, "braces nest deeper than 32"),
])
def test_patterns_are_bounded_before_they_are_built(tmp_path: Path, match: str,
                                                    problem: str) -> None:
    err = _error(tmp_path, "m.yaml", HEAD + f"rules:\n  - match: '{match}'\n")
    assert err.problem == f"invalid pattern {match!r}: {problem}"
    assert _where(err) == ("m.yaml", 5, 12)


@pytest.mark.parametrize("pattern", ["re:(.*)*Z", "re:(a|a)*b", "re:(a+)+b", "re:(.*a){20}b",
                                     "*a*a*a*a*a*a*a*a*a*a*b", "**.**.**.**.**.**.**.**.z"])
def test_catastrophic_patterns_match_in_linear_time(pattern: str) -> None:
    rx = compile_pattern(pattern)
    assert not rx.fullmatch("a" * 5000)
    assert not rx.fullmatch(".".join(["a"] * 2000))
    assert rx.fullmatch("a" * 50 + ("Z" if "Z" in pattern else "b" if "b" in pattern else "")) \
        == (pattern in ("re:(.*)*Z", "re:(a|a)*b", "re:(a+)+b", "re:(.*a){20}b",
                        "*a*a*a*a*a*a*a*a*a*a*b"))


def test_an_extends_chain_longer_than_the_bound_is_refused(tmp_path: Path) -> None:
    count = MAX_EXTENDS_DEPTH + 8
    for i in range(count):
        extends = f"extends: r{i + 1}.yaml\n" if i + 1 < count else ""
        (tmp_path / f"r{i}.yaml").write_text(HEAD + "rules: []\n" + extends)
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "r0.yaml")
    assert err.value.problem == f"extends chain is longer than {MAX_EXTENDS_DEPTH} files"
    assert _where(err.value) == (f"r{MAX_EXTENDS_DEPTH - 1}.yaml", 5, 10)


@pytest.mark.parametrize(("extends", "problem"), [
    ("x" * 5000, "is longer than 1024 characters"),
    ("y" * 1000, "no such file next to this recipe and no shipped recipe of that name"),
    ("z/" * 400 + "y", "no such file next to this recipe and no shipped recipe of that name"),
])
def test_an_over_long_extends_name_is_a_recipe_error(tmp_path: Path, extends: str,
                                                     problem: str) -> None:
    err = _error(tmp_path, "e.yaml", HEAD + f"rules: []\nextends: {extends}\n")
    assert problem in err.problem, err.problem
    assert _where(err) == ("e.yaml", 5, 10)


def test_toml_reports_its_errors_at_their_line(tmp_path: Path) -> None:
    err = _error(tmp_path, "bad.toml", TOML_HEAD + "rules = [\n  {match = 'a',\n")
    assert err.problem.startswith("invalid TOML: ")
    assert _where(err)[:2] == ("bad.toml", 5)


@pytest.mark.parametrize(("text", "problem"), [
    ("[" * 100000 + "]" * 100000, "not a plan: nested too deeply"),
    ('{"a":' * 70 + "1" + "}" * 70, "not a plan: nested deeper than 64 levels at $" + ".a" * 65),
    ('{"format": ' + "9" * 5000 + "}", "not a plan: integer 99999999999999999999... is out of "
                                       "range"),
    ('{"format": NaN}', "not a plan: NaN is not a number a plan holds"),
    ('{"format": 99, "x": [1e999]}', "plan format 99 is not"),
])
def test_hostile_plan_json_raises_only_plan_format_error(text: str, problem: str) -> None:
    with pytest.raises(PlanFormatError) as err:
        Plan.from_json(text, source="p.json")
    assert str(err.value).startswith(f"p.json: {problem}"), str(err.value)


@pytest.fixture(scope="module")
def plan_json() -> dict[str, Any]:
    import json

    import torch

    from hyperrecipe import compile_recipe
    from tests.support.runtime_harness import ROOT
    from tests.support.toy_models import Toy

    with torch.device("meta"):
        model = Toy()
    return json.loads(compile_recipe(str(ROOT / "tests/recipes/toy.yaml"), model,
                                     {"tp": 2}).to_json())


TWO_MB = "a" * (2 << 20)


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda p: p.update(params=TWO_MB),
     "expected a list, found a string of 2097152 characters @ $.params"),
    (lambda p: p["params"][0].update(shape=TWO_MB),
     "expected a list, found a string of 2097152 characters @ $.params[0].shape"),
    (lambda p: p["boundaries"][0].update(out_names=TWO_MB),
     "expected a list, found a string of 2097152 characters @ $.boundaries[0].out_names"),
    (lambda p: p.update(params=[{"fqn": 1, "bogus": 2}] * 100_000),
     "extra fields found ('bogus') @ $.params[0]"),
    (lambda p: p.update(params=[{"fqn": 1}] * 100_000),
     "required field missing @ $.params[0].module"),
    (lambda p: p["params"][0].update(shape=["a"] * 100_000),
     "expected an integer, found a string of 1 characters @ $.params[0].shape[0]"),
    (lambda p: p["params"][0].pop("shape"), "required field missing @ $.params[0].shape"),
    (lambda p: p["params"][0].update(placement=[]),
     "expected a placement string, found a list of 0 values @ $.params[0].placement"),
    (lambda p: p["mesh"].append([1]), "expected an object, found a list of 1 values @ $.mesh[1]"),
])
def test_a_plan_of_the_wrong_shape_is_refused_at_its_first_misfit(
        plan_json: dict[str, Any], edit: Callable[[dict[str, Any]], Any], problem: str) -> None:
    """A value of the wrong JSON kind is refused by shape before cattrs structures anything:
    cattrs built an error per character of a string where a list belongs (a 160,000-character
    string took 25 s and 500 MB), and per element of a long list of the wrong kind."""
    import copy
    import json

    raw = copy.deepcopy(plan_json)
    edit(raw)
    with pytest.raises(PlanFormatError) as err:
        Plan.from_json(json.dumps(raw), source="p.json")
    assert str(err.value) == f"p.json: invalid plan: {problem}"


def test_a_plan_file_that_is_not_utf8_is_a_plan_format_error(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(PlanFormatError) as err:
        Plan.load(path)
    assert str(err.value) == f"{path}: not a plan: not UTF-8 text (invalid start byte at byte 12)"


@pytest.mark.parametrize(("text", "lint_exit"), [
    (HEAD + "rules: []\n" + _laughs(9), 1),
    (HEAD + "rules: &r [*r]\n", 1),
    (HEAD + "rules:\n  - match: 're:(.*)*Z'\n", 0),  # valid syntax; compile finds no module
    (HEAD + "rules: []\ndescription: !!timestamp abc\n", 1),
])
def test_the_cli_reports_hostile_recipes_without_a_traceback(
        tmp_path: Path, text: str, lint_exit: int, capsys: pytest.CaptureFixture[str]) -> None:
    from hyperrecipe.cli import main

    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    assert main(["compile", str(path), "--model", "tests.support.toy_models:make_toy", "--mesh",
                 "tp=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hyperrecipe: error: {path}:") and "Traceback" not in err, err
    assert main(["lint", str(path)]) == lint_exit
    out = capsys.readouterr().out
    assert (out.startswith(f"{path}:") and " HR100 recipe-schema " in out) == bool(lint_exit)
