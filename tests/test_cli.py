"""The `hyperrecipe` command: compile, explain, schema; exit codes and error output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperrecipe.cli import main

TOY = ["--model", "tests.support.toy_models:make_toy"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-m", "hyperrecipe", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_compile_prints_summary_and_writes_the_plan(in_root: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["compile", "tests/recipes/toy.yaml", *TOY, "--mesh", "tp=2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("plan 'toy' for mesh tp=2  fingerprint ")
    assert "layers.*.mlp.down x2  boundary" in text
    assert "collectives per step: 4 forward, 3 backward (all_gather x1, all_reduce x6)" in text
    assert "replicated by default (no rule)" not in text
    assert json.loads(out.read_text())["recipe"] == "toy"


def test_compile_json_format_prints_the_plan(in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "tests/recipes/toy.yaml", *TOY, "--mesh", "tp=2", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == [{"name": "tp", "size": 2}]


def test_explain_names_the_rule_and_line_that_decided(in_root: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "tests/recipes/toy.yaml", *TOY, "--mesh", "tp=2",
                 "--explain", "layers.0.mlp.up.weight"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[:2] == [
        "layers.0.mlp.up.weight: {tp: shard(0)}  local [8, 8] of [16, 8] float32",
        "  tests/recipes/toy.yaml:18:12 (rule 2): placed {tp: shard(0)} (style col_inside)",
    ]


def test_explain_from_saved_plan_and_no_match(in_root: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    main(["compile", "tests/recipes/toy.yaml", *TOY, "--mesh", "tp=2", "-o", str(out)])
    capsys.readouterr()
    assert main(["explain", str(out), "layers.0.mlp"]) == 0
    assert "layers.0.mlp: boundary (depth 0)" in capsys.readouterr().out
    assert main(["explain", str(out), "layer.0.mlp.up"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyperrecipe: error: --explain 'layer.0.mlp.up' matches no parameter or "
                          "boundary; nearest: layers.*.mlp.up")


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_recipe_error_prints_without_traceback_and_exits_2(in_root: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: b\nversion: 1\nmesh: [tp]\nrules:\n  - match: layers.*.mlp.up\n"
                   "    style: colwse\n")
    r = run_cli("compile", str(bad), *TOY, "--mesh", "tp=2", cwd=in_root)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"hyperrecipe: error: {bad}:6:12: unknown style 'colwse'; did you "
                               f"mean 'colwise'? @ $.rules[0].style")


@pytest.mark.parametrize(("args", "message"), [
    (["--mesh", "tp2"], "mesh 'tp2': expected NAME=SIZE[,NAME=SIZE...] with each SIZE a whole "
                        "number written in digits, e.g. tp=2,dp=4"),
    (["--model", "nope.mod:f", "--mesh", "tp=2"], "cannot import 'nope.mod' for model spec "
                                                   "'nope.mod:f': No module named 'nope'"),
    (["--model", "tests.support.toy_models", "--mesh", "tp=2"],
     "model spec 'tests.support.toy_models' is neither 'pkg.module:factory' nor "
     "'hf:<model_type>[/<task>]'"),
    (["--model-config", "{bad", "--mesh", "tp=2"], "--model-config is not valid JSON"),
])
def test_bad_arguments_exit_2_with_a_message(in_root: Path, capsys: pytest.CaptureFixture[str],
                                             args: list[str], message: str) -> None:
    base = ["compile", "tests/recipes/toy.yaml"]
    if "--model" not in args:
        base += TOY
    try:
        code = main([*base, *args])
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err


def test_schema_is_json_and_lists_rule_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$defs"]["rule"]["required"] == ["match"]
    assert "params" in schema["$defs"]["rule"]["properties"]


@pytest.mark.slow  # a fresh interpreter; CI also runs this command itself (.ci/run)
def test_python_dash_m_and_compile_of_hf_llama(in_root: Path) -> None:
    r = run_cli("compile", "recipes/llama.yaml", "--model", "hf:llama", "--model-config",
                "recipes/models/tiny-llama.json", "--mesh", "tp=2", cwd=in_root)
    assert r.returncode == 0, r.stderr
    assert "model.layers.*.self_attn x2" in r.stdout
    assert "collectives per step: 6 forward, 5 backward" in r.stdout


# ----------------------------------------------------------------------------- the first hour


def test_version_prints_the_installed_version_and_exits_0(
        capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    import hyperrecipe

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hyperrecipe {hyperrecipe.__version__} (Python ")
    assert hyperrecipe.__version__ == version("hyperrecipe"), "pyproject and __version__ agree"


@pytest.mark.parametrize(("command", "opening"), [
    ("compile", "Load a recipe (YAML or TOML), build the model on the meta device"),
    ("explain", "Say why each parameter and boundary whose FQN matches the pattern"),
    ("schema", "Print the JSON Schema (draft-07) of the recipe format on stdout"),
    ("check", "Apply a recipe on world-size local ranks"),
])
def test_every_subcommand_help_has_a_description(command: str, opening: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert opening in text


@pytest.mark.slow  # builds a default-size model on meta and verifies it (~9 s)
def test_hf_model_without_a_config_compiles_with_a_note_naming_the_default_and_its_size(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "recipes/llama.yaml", "--model", "hf:llama", "--mesh", "tp=2"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "hyperrecipe: note: --model hf:llama without --model-config: transformers' default "
        "LlamaConfig (32 layers, hidden size 4096, vocab 32000; 6.74 B parameters, 25.1 GiB in "
        "float32); pass --model-config FILE or inline JSON for another size, e.g. --model-config "
        "recipes/models/tiny-llama.json\n")
    assert "12853.02 MiB per rank" in captured.out
    assert main(["compile", "recipes/llama.yaml", "--model", "hf:llama", "--model-config",
                 "recipes/models/tiny-llama.json", "--mesh", "tp=2"]) == 0
    assert capsys.readouterr().err == "", "no note when a config is given"
