"""Hostile paths, configs, meshes, API arguments and hand-edited plans: each ends in a located
hyperrecipe error (CLI exit 2), never a traceback, a hang or a process eating all memory.

Complements tests/recipe/test_untrusted_recipes.py (hostile recipe *content*). The inputs here come
from red-teaming every entry point (docs/security.md): a FIFO or ``/dev/zero`` given as a recipe
or plan, a transformers config with a field of the wrong type, ``--mesh tp=2,tp =4``, a
``pyproject.toml`` with ``tool = 1``, a plan edited by hand with its checksum recomputed. No
wall-clock asserts: the FIFO and ``/dev/zero`` cases run in a child with a memory cap and a
timeout only so that a regression fails the test instead of hanging or swapping the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest

from hyperrecipe import PlanFormatError, PlanMismatchError, RecipeError, compile_recipe
from hyperrecipe import load_plan, load_recipe
from hyperrecipe._cli_commands import parse_mesh
from hyperrecipe.errors import ModelSpecError, UsageError
from hyperrecipe.lint.cli import main as lint_main
from hyperrecipe.lint.config import ConfigError, load_config
from hyperrecipe.model_tree import build_model, load_model_config
from hyperrecipe.plan import Plan, compute_fingerprint, converter
from hyperrecipe.refs import is_trusted_module, trusting
from tests.support.runtime_harness import ROOT

TOY = str(ROOT / "tests/recipes/toy.yaml")
ALL_REPLICATED = "recipe: r\nversion: 1\nmesh: [tp]\nrules: []\n"


def _toy_meta() -> Any:
    import torch

    from tests.support.toy_models import Toy

    with torch.device("meta"):
        return Toy()


# ----------------------------------------------------------------- paths that are not files


_READ_SPECIAL = textwrap.dedent("""
    import json, sys
    from hyperrecipe import HyperrecipeError, load_plan, load_recipe
    out = []
    for load, path in [(load_recipe, p) for p in sys.argv[1:3]] + [(load_plan, p) for p in sys.argv[3:]]:
        try:
            load(path)
            out.append("loaded")
        except HyperrecipeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps(out))
""")


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_a_fifo_or_a_device_named_as_recipe_or_plan_is_refused_not_read(tmp_path: Path) -> None:
    fifo_recipe, fifo_plan = tmp_path / "r.yaml", tmp_path / "plan.json"
    os.mkfifo(fifo_recipe)
    os.mkfifo(fifo_plan)
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    args = [str(fifo_recipe), str(tmp_path / "zero.yaml"), str(fifo_plan),
            str(tmp_path / "zero.json")]
    # Before the fix: opening the FIFO waits for a writer forever; /dev/zero is read until
    # memory runs out. The cap and the timeout turn either into a failure, not a hang.
    done = subprocess.run([sys.executable, "-c", _READ_SPECIAL, *args], capture_output=True,
                          text=True, timeout=120, preexec_fn=_cap_memory, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [
        f"RecipeError: {fifo_recipe}:1:1: cannot read recipe file: not a regular file (a FIFO) @ $",
        f"RecipeError: {tmp_path / 'zero.yaml'}:1:1: cannot read recipe file: not a regular file "
        f"(a character device) @ $",
        f"PlanFormatError: {fifo_plan}: cannot read plan: not a regular file (a FIFO)",
        f"PlanFormatError: {tmp_path / 'zero.json'}: cannot read plan: not a regular file (a "
        f"character device)",
    ]


def test_a_recipe_over_the_size_limit_is_refused_before_it_is_read(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    import hyperrecipe.recipe.source as source

    monkeypatch.setattr(source, "MAX_FILE_BYTES", 64)
    path = tmp_path / "big.yaml"
    path.write_text(ALL_REPLICATED + "description: " + "x" * 100 + "\n", encoding="utf-8")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    size = path.stat().st_size
    assert err.value.problem == f"cannot read recipe file: the file is {size} bytes; the limit is 64"


# ----------------------------------------------------------------------------- model configs


def test_a_config_field_of_the_wrong_type_is_a_model_spec_error() -> None:
    # transformers (huggingface_hub's strict dataclasses) raises an Exception subclass that is
    # neither ValueError nor KeyError: before the fix it escaped as a traceback (exit 1).
    with pytest.raises(ModelSpecError) as err:
        build_model("hf:llama", {"hidden_size": "big"})
    assert str(err.value) == (
        "hf:llama: the model config is not valid for this family: Validation error for field "
        "'hidden_size': TypeError: Field 'hidden_size' expected int, got str (value: 'big')")


def test_an_unknown_hf_family_suggests_the_nearest() -> None:
    with pytest.raises(ModelSpecError) as err:
        build_model("hf:lama", "tiny-llama")
    message = str(err.value)
    assert message.startswith("--model hf:lama: transformers ")
    assert "has no model type 'lama'; did you mean 'llama'?; use the config's `model_type`" \
        in message
    assert len(message) < 300, "not the list of every model type transformers knows"


def test_model_config_files_that_json_would_half_accept_are_refused(tmp_path: Path) -> None:
    dup = tmp_path / "dup.json"
    dup.write_text('{"hidden_size": 64, "hidden_size": 32}', encoding="utf-8")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"name": "\xe9"}')
    cases = {str(dup): f"model config {str(dup)!r}: key 'hidden_size' is given twice",
             str(deep): f"model config {str(deep)!r}: JSON nested too deeply",
             str(latin): f"model config {str(latin)!r} is not UTF-8 text (invalid continuation "
                         f"byte at byte 10)",
             "[1, 2]": "[1, 2]: a model config must be a JSON object of config fields, found a "
                       "JSON list"}
    for config, message in cases.items():
        with pytest.raises(ModelSpecError) as err:
            load_model_config(config)
        assert str(err.value) == message


# ------------------------------------------------------------------------------------ meshes


@pytest.mark.parametrize(("text", "problem"), [
    ("tp=2,tp =4", "mesh 'tp=2,tp =4': 'tp' given twice"),
    ("tp=\u0662", "mesh 'tp=\u0662': expected NAME=SIZE[,NAME=SIZE...] with each SIZE a whole "
                  "number written in digits, e.g. tp=2,dp=4"),
    ("tp=\u00b2", "mesh 'tp=\u00b2': expected NAME=SIZE[,NAME=SIZE...] with each SIZE a whole "
                  "number written in digits, e.g. tp=2,dp=4"),
    ("tp=1000000000", "mesh 'tp=1000000000': size of 'tp' has more than 9 digits"),
])
def test_mesh_text_that_would_be_misread_is_refused(text: str, problem: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_mesh(text)
    assert str(err.value) == problem


def test_padded_mesh_text_still_parses() -> None:
    assert parse_mesh(" tp = 2 , dp=004") == {"tp": 2, "dp": 4}


def test_a_mesh_size_a_plan_cannot_hold_is_refused_at_compile(tmp_path: Path) -> None:
    # Before the fix this compiled, and load_plan then refused the plan it had written
    # (plan integers are below 2^63).
    recipe = tmp_path / "r.yaml"
    recipe.write_text(ALL_REPLICATED, encoding="utf-8")
    with pytest.raises(RecipeError) as err:
        compile_recipe(recipe, _toy_meta(), {"tp": 2**64})
    assert err.value.problem == (f"mesh dim 'tp' has size {2**64}; sizes are integers from 1 "
                                 f"to 999999999")
    assert err.value.span is not None and err.value.span.line == 3


# --------------------------------------------------------------------------- API arguments


def test_api_arguments_of_the_wrong_type_are_usage_errors_naming_the_argument() -> None:
    model = _toy_meta()
    cases: list[tuple[Any, str]] = [
        (lambda: compile_recipe(TOY, model, "tp=2"),
         "compile_recipe: mesh_shape must be a mapping of mesh dim name to size, e.g. {'tp': 2}, "
         "not str"),
        (lambda: compile_recipe(TOY, "hf:llama", {"tp": 2}),
         "compile_recipe: model must be an nn.Module (built on the meta device) or its "
         "ModelTree, not str"),
        (lambda: compile_recipe(None, model, {"tp": 2}),
         "load_recipe: path must be a path (str or os.PathLike), not NoneType"),
        (lambda: load_recipe(42), "load_recipe: path must be a path (str or os.PathLike), not int"),
        (lambda: load_plan(b"plan.json"),
         "load_plan: path must be a path (str or os.PathLike), not bytes"),
    ]
    for call, message in cases:
        with pytest.raises(UsageError) as err:
            call()
        assert str(err.value) == message
        assert isinstance(err.value, TypeError)


def test_trust_code_given_as_one_string_trusts_that_prefix_not_its_letters() -> None:
    with trusting("zz_untrusted_pkg"):
        assert is_trusted_module("zz_untrusted_pkg.sub")
        assert not is_trusted_module("z")


# ----------------------------------------------------------------------------- lint config


@pytest.mark.parametrize(("text", "problem"), [
    ("tool = 1\n", "[tool] must be a table, found int"),
    ('[tool]\nhyperrecipe = "x"\n', "[tool.hyperrecipe] must be a table, found str"),
    ('[tool.hyperrecipe.lint.per-file-ignores]\n"a.py" = 1\n',
     "[tool.hyperrecipe.lint] per-file-ignores 'a.py' must be a list of strings, got 1"),
])
def test_a_malformed_pyproject_is_a_usage_error(tmp_path: Path, text: str, problem: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(text, encoding="utf-8")
    (tmp_path / "a.py").write_text("x = 1\n", encoding="utf-8")
    assert lint_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"hyperrecipe lint: error: {pyproject}: {problem}\n"


def test_a_pyproject_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_bytes(b'[tool.hyperrecipe.lint]\nselect = ["\xff"]\n')
    with pytest.raises(ConfigError) as err:
        load_config(pyproject)
    assert str(err.value) == (f"{pyproject}: cannot read configuration: not UTF-8 text "
                              f"(invalid start byte at byte 35)")


@pytest.mark.parametrize(("argv", "message"), [
    (["--file-timeout", "inf", "."], "argument --file-timeout: must be at most 1e+06 seconds, "
                                     "got inf"),
    (["a" * 5000], "no such file or folder: " + "a" * 5000),
])
def test_lint_arguments_the_os_cannot_take_are_usage_errors(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert lint_main(argv) == 2
    assert capsys.readouterr().err.endswith(f"hyperrecipe lint: error: {message}\n")


def test_lint_names_a_fifo_for_what_it_is(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    assert lint_main([str(fifo)]) == 2
    assert capsys.readouterr().err == (f"hyperrecipe lint: error: no such file or folder: {fifo} "
                                       f"(a FIFO, not a regular file)\n")


# ------------------------------------------------------------------ plans edited by hand


def _edited(plan: Plan, edit: Any) -> Plan:
    """``plan`` with ``edit`` applied to its JSON, checksum and fingerprint recomputed, as
    anyone can (the checksum is an integrity check, not a signature)."""
    raw = json.loads(plan.to_json())
    edit(raw)
    structured = converter.structure(raw, Plan)
    structured = attrs.evolve(structured, fingerprint=compute_fingerprint(
        structured.recipe_digest, structured.model_digest, structured.mesh))
    structured = attrs.evolve(structured, checksum=structured.content_checksum())
    return Plan.from_json(structured.to_json(), source="edited.json")


def _set_first(key: str, field: str, value: Any) -> Any:
    def edit(raw: dict[str, Any]) -> None:
        raw[key][0][field] = value
    return edit


def _edited_plan_worker(rank: int, world: int) -> list[str]:
    import torch

    from hyperrecipe import apply
    from tests.support.runtime_harness import mesh_1d
    from tests.support.toy_models import Toy

    plan = compile_recipe(TOY, _toy_meta(), {"tp": world})
    edits = [
        _set_first("boundaries", "fqn", "layers.9.mlp"),
        _set_first("params", "module", "nowhere"),
        _set_first("params", "dtensor", ["shard(99)"]),
        _set_first("params", "local_shape", [1, 1]),
        lambda raw: raw["params"].append(raw["params"][0]),
    ]
    out = []
    for edit in edits:
        for mode in ("production", "validate"):
            torch.manual_seed(0)
            model = Toy()
            try:
                apply(model, _edited(plan, edit), mesh_1d(world), mode=mode)  # type: ignore[arg-type]
                out.append(f"{mode}: applied")
            except PlanMismatchError as exc:
                out.append(f"{mode}: {exc}")
            except Exception as exc:  # noqa: BLE001 - what the test is about
                out.append(f"{mode}: {type(exc).__name__}: {exc}")
            out.append(f"{mode}: untouched {all('forward' not in vars(m) for m in model.modules())}")
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_an_edited_plan_naming_what_the_model_lacks_is_refused_before_apply_installs() -> None:
    from hyperrecipe.check.launcher import run_ranks

    out = run_ranks(_edited_plan_worker, 1, timeout_s=120)[0]
    tail = "; the plan was edited or compiled for another model: recompile the recipe against " \
           "this model"
    first_param = "params[0] ('embed.weight')"
    expected = [
        f"plan 'toy' does not fit this model: boundaries[0]: 'layers.9.mlp' is not a module of "
        f"the model{tail}",
        f"plan 'toy' does not fit this model: {first_param}: module 'nowhere' is not a module of "
        f"the model{tail}",
        f"plan 'toy' does not fit this model: {first_param}: dtensor placement 'shard(99)' is on "
        f"a dim a 2-d parameter does not have{tail}",
        f"plan 'toy' does not fit this model: {first_param}: local_shape [1, 1] is not [32, 8], "
        f"what its placement gives on this mesh{tail}",
        f"plan 'toy' does not fit this model: params: 'embed.weight' is listed twice{tail}",
    ]
    for i, message in enumerate(expected):
        for j, mode in enumerate(("production", "validate")):
            assert out[4 * i + 2 * j] == f"{mode}: {message}"
            assert out[4 * i + 2 * j + 1] == f"{mode}: untouched True"


def test_plan_format_error_is_still_what_a_corrupt_plan_raises(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{}", encoding="utf-8")
    with pytest.raises(PlanFormatError):
        load_plan(path)


# ------------------------------------------------------------- typos say what to do instead


def test_a_mistyped_recipe_path_or_name_suggests_the_nearest(in_root: Path) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe("recipes/lama.yaml")
    assert str(err.value) == (
        "recipes/lama.yaml:1:1: cannot read recipe file: no such file; did you mean "
        "'recipes/llama.yaml'? @ $; a recipe is a .yaml, .yml or .toml file, or a shipped "
        "recipe's name (gpt2, llama, llama-cp, llama-dp, ...)")
    with pytest.raises(RecipeError) as err:
        load_recipe("lama")
    assert err.value.problem == ("no recipe file 'lama' and no shipped recipe of that name; did "
                                 "you mean 'llama'?")


def test_a_mistyped_model_config_suggests_the_nearest(in_root: Path) -> None:
    for config, near in [("tiny-lama", "tiny-llama"),
                         ("recipes/models/tiny-lama.json", "recipes/models/tiny-llama.json")]:
        with pytest.raises(ModelSpecError) as err:
            load_model_config(config)
        assert str(err.value).startswith(f"--model-config {config!r}: no such file and no "
                                         f"shipped tiny config of that name; did you mean "
                                         f"{near!r}? (give a JSON file")


def test_a_mistyped_option_suggests_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    from hyperrecipe.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["compile", "llama", "--model", "hf:llama", "--model-confg", "tiny-llama",
              "--mesh", "tp=2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        "hyperrecipe: error: unrecognized arguments: --model-confg tiny-llama; did you mean "
        "'--model-config'?\n")


def test_explain_given_a_recipe_says_what_a_plan_is(in_root: Path) -> None:
    with pytest.raises(PlanFormatError) as err:
        load_plan("recipes/llama.yaml")
    assert str(err.value) == (
        "recipes/llama.yaml: not JSON: Expecting value: line 1 column 1 (char 0); this looks "
        "like a recipe, and a plan is the JSON that `hyperrecipe compile RECIPE ... -o "
        "plan.json` writes")


def test_compile_output_that_cannot_be_written_is_an_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hyperrecipe.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(ALL_REPLICATED, encoding="utf-8")
    target = tmp_path / "missing" / "plan.json"
    code = main(["compile", str(recipe), "--model", "tests.support.toy_models:Toy", "--mesh", "tp=2",
                 "-o", str(target)])
    assert code == 2
    assert capsys.readouterr().err == (f"hyperrecipe: error: cannot write the plan to {target}: "
                                       f"No such file or directory\n")


@pytest.mark.parametrize("raw", ["inf", "1e300", "nan", "-1", "soon"])
def test_an_agreement_timeout_no_wait_can_take_is_refused(raw: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperrecipe.runtime.preflight.agreement import TIMEOUT_ENV, agreement_timeout

    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(PlanMismatchError) as err:
        agreement_timeout()
    assert str(err.value) == (f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds up "
                              f"to 1e+06")


def test_a_recipes_folder_variable_naming_no_folder_is_named(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYPERRECIPE_RECIPES", str(tmp_path / "nowhere"))
    with pytest.raises(RecipeError) as err:
        load_recipe("llama")
    assert err.value.hint == (f"shipped recipes: (none found in HYPERRECIPE_RECIPES="
                              f"{str(tmp_path / 'nowhere')!r}, which should name a folder of "
                              f"recipes; unset it for the recipes that ship with hyperrecipe)")


def _apply_mistakes_worker(rank: int, world: int) -> list[str]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import HyperrecipeError, apply
    from tests.support.runtime_harness import mesh_1d
    from tests.support.toy_models import Toy

    plan = compile_recipe(TOY, _toy_meta(), {"tp": world})
    torch.manual_seed(0)
    model = Toy()
    calls = [lambda: apply(model, "plan.json", mesh_1d(world)),  # type: ignore[arg-type]
             lambda: apply(model, plan, None),  # type: ignore[arg-type]
             lambda: apply(model, plan, init_device_mesh("cpu", (world,)))]
    out = []
    for call in calls:
        try:
            call()
            out.append("applied")
        except HyperrecipeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - what the test is about
            out.append(f"not a HyperrecipeError: {type(exc).__name__}: {exc}")
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_apply_mistakes_a_new_user_makes_say_what_to_do() -> None:
    from hyperrecipe.check.launcher import run_ranks

    assert run_ranks(_apply_mistakes_worker, 1, timeout_s=120)[0] == [
        "UsageError: apply: plan must be a Plan, not str; load it first: hyperrecipe.apply(model, "
        "hyperrecipe.load_plan('plan.json'), mesh)",
        "UsageError: apply: mesh must be a DeviceMesh (init_device_mesh(..., mesh_dim_names=...)),"
        " not NoneType",
        "PlanMismatchError: plan 'toy' was compiled for mesh tp=1, but the DeviceMesh has no dim "
        "names; build it with mesh_dim_names=('tp',)",
    ]


def test_sarif_names_a_file_whose_name_is_not_utf8(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The name is held as a surrogate escape; quoting it as str raised UnicodeEncodeError
    # (a traceback, exit 1, which reads as "findings").
    (tmp_path / os.fsdecode(b"bad\xff.py")).write_text("x.forward = 1\n", encoding="utf-8")
    assert lint_main([str(tmp_path), "--format", "sarif"]) == 1
    log = json.loads(capsys.readouterr().out)
    [result] = log["runs"][0]["results"]
    uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert uri.endswith("/bad%FF.py") and uri.startswith("file://")


def test_extends_naming_something_that_is_not_a_file_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "loop.yaml").symlink_to("loop.yaml")
    os.mkfifo(tmp_path / "pipe.yaml")
    for ref, what in [("loop.yaml", "a symlink that leads nowhere (dangling, or a loop)"),
                      ("pipe.yaml", "a FIFO"), (".", "a directory")]:
        path = tmp_path / "r.yaml"
        path.write_text(ALL_REPLICATED + f"extends: {ref!r}\n", encoding="utf-8")
        with pytest.raises(RecipeError) as err:
            load_recipe(path)
        assert err.value.problem == f"extends {ref!r}: {tmp_path / ref} is {what}, not a recipe file"
        assert err.value.span is not None and err.value.span.line == 5


def test_statistics_follow_the_format_or_refuse_it(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Before: `--statistics --format json` (or sarif) printed the text table regardless.
    (tmp_path / "a.py").write_text("x.forward = 1\ny.forward = 2\n", encoding="utf-8")
    assert lint_main([str(tmp_path), "--statistics", "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out) == [
        {"count": 2, "code": "HR001", "name": "forward-assignment"}]
    assert lint_main([str(tmp_path), "--statistics", "--format", "sarif"]) == 2
    assert capsys.readouterr().err == (
        "hyperrecipe lint: error: --statistics prints a table (--format text) or JSON (--format "
        "json), not sarif; drop --statistics for sarif findings\n")


def test_a_plan_key_given_twice_is_refused() -> None:
    # json keeps the last value: a reviewer reading the file and load_plan would disagree.
    plan = compile_recipe(TOY, _toy_meta(), {"tp": 2})
    text = plan.to_json().replace('"recipe": "toy"', '"recipe": "reviewed", "recipe": "toy"', 1)
    with pytest.raises(PlanFormatError) as err:
        Plan.from_json(text, source="p.json")
    assert str(err.value) == "p.json: not a plan: key 'recipe' is given twice in one object"


@pytest.mark.parametrize("weight_map", ['["a.safetensors"]', '{"w": 5}', '"x"'])
def test_a_safetensors_index_of_the_wrong_shape_is_a_weight_load_error(
        tmp_path: Path, weight_map: str) -> None:
    # A checkpoint can come from someone else too; its index was indexed without a type check
    # (AttributeError / TypeError from deep inside load_weights).
    from hyperrecipe.errors import WeightLoadError
    # the index reader behind load_weights
    from torch import nn

    from hyperrecipe.runtime.state.weights import _key_files, _Safetensors, open_snapshot

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(f'{{"weight_map": {weight_map}}}', encoding="utf-8")
    with open_snapshot(tmp_path) as snapshot, pytest.raises(WeightLoadError) as err:
        _key_files(_Safetensors(nn.Module(), snapshot), snapshot)
    assert str(err.value) == (f"{index}: not a safetensors index (weight_map must map tensor "
                              f"names to file names)")


BOM = "\ufeff"
TYPO_YAML = "recipe: x\nversion: 1\nmesh: [tp]\nrules:\n  - match: lm_head\n    style: colwse\n"
TYPO_TOML = ('recipe = "x"\r\nversion = 1\r\nmesh = ["tp"]\r\n[[rules]]\r\nmatch = "lm_head"\r\n'
             'style = "colwse"\r\n')


@pytest.mark.parametrize(("name", "text", "where"), [
    ("r.yaml", BOM + TYPO_YAML, "6:12"), ("r.toml", BOM + TYPO_TOML, "6:9")])
def test_a_recipe_with_a_byte_order_mark_is_linted_and_loaded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str,
        where: str) -> None:
    # Before: the lint did not recognise either file as a recipe (exit 0, nothing checked),
    # and the TOML one did not load ("invalid TOML: Invalid statement" at 1:1).
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    assert lint_main([str(path)]) == 1
    assert capsys.readouterr().out.startswith(
        f"{path}:{where}: HR100 recipe-schema unknown style 'colwse'; did you mean 'colwise'?")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert err.value.problem == "unknown style 'colwse'; did you mean 'colwise'?"


def test_a_pyproject_with_a_byte_order_mark_says_so(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_bytes(b"\xef\xbb\xbf[tool.hyperrecipe.lint]\n")
    with pytest.raises(ConfigError) as err:
        load_config(pyproject)
    assert str(err.value) == (f"{pyproject}: cannot read configuration: the file starts with a "
                              f"UTF-8 byte order mark, which TOML parsers (pip's too) refuse; save "
                              f"it as UTF-8 without BOM")


@pytest.mark.parametrize("text", [
    '{"recipe": "x", "version": 2, "mesh": ["tp"], "rules": []}\n',   # JSON-style YAML
    "# converted\n---\n{recipe: x, version: 2, mesh: [tp], rules: []}\n",
    "? recipe\n: x\nversion: 2\nmesh: [tp]\nrules: []\n",
])
def test_a_flow_style_yaml_recipe_is_linted(tmp_path: Path, text: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # Before: only a `recipe:` key in column 0 made a YAML file a recipe; these load (and fail)
    # in compile, but the lint skipped them and exited 0.
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8")
    assert lint_main([str(path)]) == 1
    assert "HR100 recipe-schema unsupported recipe version 2; expected 1" in capsys.readouterr().out


def test_yaml_that_only_mentions_recipe_is_not_a_recipe(tmp_path: Path) -> None:
    from hyperrecipe.lint.recipes import is_recipe_file

    for name, text in [("ci.yaml", "on: push\njobs:\n  a:\n    steps:\n      - run: recipe\n"),
                       ("nested.yaml", "items:\n  - recipe: x\n"), ("seq.yaml", "[recipe, x]\n"),
                       ("bad.yaml", "recipe x: [\n")]:
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert not is_recipe_file(tmp_path / name), name


def test_a_config_for_another_family_is_refused_not_built_at_default_size() -> None:
    # Before: transformers kept gpt2's fields as plain attributes and built the default Llama
    # (6.7 B parameters) -- on the meta device for compile, for real on every rank in check.
    with pytest.raises(ModelSpecError) as err:
        build_model("hf:llama", "tiny-gpt2")
    assert str(err.value) == (
        "--model hf:llama: the model config sets neither hidden_size nor num_hidden_layers of "
        "LlamaConfig, and has fields it does not know (attn_pdrop (did you mean "
        "'attention_dropout'?), embd_pdrop, n_embd, n_head (did you mean 'head_dim'?), n_layer "
        "(did you mean 'num_hidden_layers'?), n_positions (did you mean "
        "'max_position_embeddings'?), ...): it looks like a config for another family, and "
        "would build transformers' default size; give a llama config (e.g. --model-config "
        "tiny-llama where one ships), or also set hidden_size and num_hidden_layers")
    with pytest.raises(ModelSpecError) as err:
        build_model("hf:llama", {"model_type": "gpt2", "n_embd": 64})
    assert str(err.value) == ("--model hf:llama with a 'gpt2' config (its model_type); use "
                              "--model hf:gpt2, or a config for llama")


@pytest.mark.parametrize(("family", "config"), [
    # a config of runtime options only (no sizes): eager here is the option, not a workaround
    ("llama", {"attn_implementation": "eager"}), ("gpt2", "tiny-llama"),
    ("llama", {"model_type": "llama", "num_hidden_layers": 1, "rope_theta": 1e4}),
    ("phi3", "tiny-phi3"),  # head_dim, which Phi3Config does not list, beside its sizes
])
def test_configs_that_set_the_size_or_only_runtime_options_still_build(
        family: str, config: Any) -> None:
    assert build_model(f"hf:{family}", config) is not None


def test_a_checkpoints_own_config_json_builds(tmp_path: Path) -> None:
    # A config.json saved by transformers names its model_type; for_model takes the type
    # positionally, and that raised TypeError "got multiple values for argument 'model_type'".
    from transformers import AutoConfig

    AutoConfig.for_model("llama", **load_model_config("tiny-llama")).save_pretrained(tmp_path)
    assert "model_type" in json.loads((tmp_path / "config.json").read_text())
    model = build_model("hf:llama", str(tmp_path / "config.json"))
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2


def test_standard_input_is_read_up_to_a_bound(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # `hyperrecipe lint - < /dev/zero` read until memory ran out (MemoryError traceback).
    import io

    import hyperrecipe.lint.cli as lint_cli

    monkeypatch.setattr(lint_cli, "MAX_STDIN_BYTES", 2**20)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x = 1\n" * 200_000)))
    assert lint_main(["-"]) == 2
    assert capsys.readouterr().err == (
        "hyperrecipe lint: error: standard input is larger than 1 MiB; name the file instead "
        "(files are read by workers with a memory budget, --file-memory)\n")


@pytest.mark.parametrize(("option", "value", "problem"), [
    ("--atol", "inf", "argument --atol: inf is not a finite non-negative number"),  # agreed always
    ("--timeout", "inf", "argument --timeout: inf is not a finite non-negative number"),
    ("--timeout", "1e300", "argument --timeout: the timeout must be at most 1e+06 seconds"),
])
def test_check_numbers_that_would_disable_the_check_or_overflow_are_refused(
        option: str, value: str, problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: --atol inf made every mode "agree"; --timeout inf raised OverflowError (time_t).
    from hyperrecipe.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["check", TOY, "--model", "tests.support.toy_models:Toy", "--mesh", "tp=2", "-q",
              option, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"hyperrecipe: error: {problem}\n")
