"""The docs say what the code does: the generated reference is current, the JSON Schema matches
the field table, and every example in docs/recipes.md runs as shown.

Conventions of docs/recipes.md that these tests rely on:

- a ```yaml or ```toml block whose first line is ``# file: NAME`` is written to ``NAME`` (as
  shown, comment included) in a scratch folder, in document order;
- a ```console block holds ``$ hyperrecipe ...`` commands, each followed by its expected output;
  a line ``...`` stands for any number of lines;
- in the checks section, a ```yaml block followed by a ```text block that starts with
  ``hyperrecipe: error:`` is an error example: the YAML is the rest of a ``demo.yaml`` after
  :data:`CHECK_HEADER` (or the whole file when it starts with ``recipe:``), compiled against the
  toy model with ``--mesh tp=2`` or the options of its ``# compile with`` comment. Two parts
  of a message that depend on the machine are written as placeholders: the scratch folder as
  ``/path/to`` and the list of shipped recipes as ``llama, ...``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from hyperrecipe.cli import main as cli_main
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.recipe import BUILTIN_STYLES, load_recipe, shipped_recipes
from hyperrecipe.recipe.jsonschema import recipe_json_schema
from hyperrecipe.recipe.patterns import compile_pattern
from hyperrecipe.recipe.validate import INNER_WRAPPERS, RULE_FIELD_SPECS, TOP_LEVEL_SPECS

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "recipes.md"
TOY = "tests.support.toy_models:make_toy"
CHECK_HEADER = "recipe: demo\nversion: 1\nmesh: [dp, tp]\nrules:\n"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "tools" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _gen_docs()


# ----------------------------------------------------------------------------- reference


def test_reference_on_disk_is_what_gen_docs_generates() -> None:
    on_disk = (REPO / "docs" / "recipe-reference.md").read_text(encoding="utf-8")
    assert gen_docs.render_reference() == on_disk, "run: python tools/gen_docs.py"


def test_gen_docs_check_exits_1_when_the_file_drifted(tmp_path: Path) -> None:
    target = tmp_path / "recipe-reference.md"
    target.write_text(gen_docs.render_reference(), encoding="utf-8")
    assert gen_docs.main(["--check", "--output", str(target)]) == 0
    target.write_text(gen_docs.render_reference().replace("colwise", "colwize", 1),
                      encoding="utf-8")
    assert gen_docs.main(["--check", "--output", str(target)]) == 1


def test_reference_names_every_field_style_and_wrapper() -> None:
    text = gen_docs.render_reference()
    for spec in (*TOP_LEVEL_SPECS, *RULE_FIELD_SPECS):
        assert f"| `{spec.name}` |" in text, spec.name
    for name in BUILTIN_STYLES:
        assert f"### `{name}`" in text, name
    for name in INNER_WRAPPERS:
        assert f"| `{name}` |" in text, name


@pytest.mark.parametrize("name", sorted(BUILTIN_STYLES))
def test_documented_style_expansion_is_the_style(name: str, tmp_path: Path) -> None:
    """The fields the reference shows for a style, written out in a rule, mean the same."""
    style = BUILTIN_STYLES[name]
    fields = gen_docs.render_style_fields(style.fields)
    body = "\n".join(f"    {line}" for line in fields.splitlines())
    path = tmp_path / "expanded.yaml"
    path.write_text(f"recipe: x\nversion: 1\nmesh: [tp]\nrules:\n  - match: m\n{body}\n",
                    encoding="utf-8")
    (rule,) = load_recipe(path).rules
    assert rule.fields == style.fields


# ----------------------------------------------------------------------------- JSON Schema


def test_schema_command_prints_json_whose_properties_are_the_field_tables() -> None:
    proc = subprocess.run([sys.executable, "-m", "hyperrecipe", "schema"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    schema = json.loads(proc.stdout)
    assert list(schema["$defs"]["rule"]["properties"]) == sorted(s.name for s in RULE_FIELD_SPECS)
    assert set(schema["properties"]) == {s.name for s in TOP_LEVEL_SPECS}


def test_shipped_llama_recipe_validates_against_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    data = yaml.safe_load((REPO / "recipes" / "llama.yaml").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(recipe_json_schema()).validate(data)


# ----------------------------------------------------------------------------- the guide


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def _compile(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    try:
        cli_main(args)
    except SystemExit:
        pass
    captured = capsys.readouterr()
    return (captured.out + captured.err).rstrip("\n")


def _matches(expected: list[str], actual: list[str]) -> bool:
    """``expected`` lines against ``actual``, where a ``...`` line stands for any lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and actual[0] == expected[0] and _matches(expected[1:], actual[1:])


def _console_commands(body: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for line in body.rstrip("\n").splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            out[-1][1].append(line)
    return out


def test_guide_examples_run_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    ran = 0
    for lang, body in _blocks(GUIDE.read_text(encoding="utf-8")):
        first = body.split("\n", 1)[0]
        if lang in ("yaml", "toml") and first.startswith("# file: "):
            (tmp_path / first.removeprefix("# file: ").strip()).write_text(body, encoding="utf-8")
        elif lang == "console":
            for command, expected in _console_commands(body):
                argv = shlex.split(command)
                assert argv[0] == "hyperrecipe", command
                actual = _compile(argv[1:], capsys).splitlines()
                assert _matches(expected, actual), (
                    f"$ {command}\n--- expected\n" + "\n".join(expected)
                    + "\n--- actual\n" + "\n".join(actual))
                ran += 1
    assert ran >= 6


def _error_examples(text: str) -> list[tuple[str, str]]:
    blocks = _blocks(text)
    return [(body, nxt.strip()) for (lang, body), (nlang, nxt) in zip(blocks, blocks[1:])
            if lang == "yaml" and nlang == "text" and nxt.startswith("hyperrecipe: error:")]


def test_guide_shows_the_header_its_error_examples_assume() -> None:
    assert f"```yaml\n{CHECK_HEADER}```" in GUIDE.read_text(encoding="utf-8")


ERROR_EXAMPLES = _error_examples(GUIDE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("body, message", ERROR_EXAMPLES,
                         ids=[f"{i}" for i in range(len(ERROR_EXAMPLES))])
def test_guide_error_example_gives_the_shown_message(body: str, message: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    source = body if body.startswith("recipe:") else CHECK_HEADER + body
    (tmp_path / "demo.yaml").write_text(source, encoding="utf-8")
    options = re.search(r"^\s*# compile with (.*)$", source, re.M)
    extra = shlex.split(options.group(1)) if options else ["--mesh", "tp=2"]
    actual = _compile(["compile", "demo.yaml", "--model", TOY, *extra], capsys)
    actual = actual.replace(str(tmp_path.resolve()), "/path/to").replace(
        f"shipped recipes: {', '.join(sorted(shipped_recipes()))}", "shipped recipes: llama, ...")
    assert actual == message


def test_guide_has_an_error_example_for_many_checks() -> None:
    assert len(ERROR_EXAMPLES) >= 40


def test_guide_pattern_table_matches_the_toy_model() -> None:
    fqns = [m.fqn for m in snapshot(build_model(TOY)).modules if m.fqn]
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Matching modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, re.M)
    assert len(rows) >= 8
    for pattern, shown in rows:
        rx = compile_pattern(pattern)
        assert re.findall(r"`([^`]+)`", shown) == [f for f in fqns if rx.fullmatch(f)], pattern


# ----------------------------------------------------------------------------- plan.md

PLAN_DOC = REPO / "docs" / "plan.md"


def test_plan_doc_lowering_table_is_what_lower_transition_does() -> None:
    from hyperrecipe.placement import REPLICATE, Partial, Placement, Shard
    from hyperrecipe.resolve.lowering import ImpossibleTransition, lower_transition

    section = PLAN_DOC.read_text(encoding="utf-8").split("## Lowering", 1)[1]
    rows = re.findall(r"^\| `(\w+)(?:\(a\))?` \| (.+) \| (.+) \| (.+) \|$", section, re.M)
    placements: dict[str, Placement] = {"replicate": REPLICATE, "shard": Shard(dim=0),
                                        "partial": Partial()}
    targets: tuple[Placement, ...] = (REPLICATE, Shard(dim=1), Partial())
    assert [r[0] for r in rows] == ["replicate", "shard", "partial"]
    for src_name, *cells in rows:
        for dst, cell in zip(targets, cells):
            kind: str
            try:
                kind = lower_transition(placements[src_name], dst, "tp").kind
            except ImpossibleTransition:
                kind = "impossible"
            assert cell.split("(")[0] == kind, (src_name, dst, cell)


def test_plan_doc_manifest_example_is_the_toy_plans(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperrecipe.resolve import resolve_recipe

    monkeypatch.chdir(tmp_path)
    guide = GUIDE.read_text(encoding="utf-8")
    toy = next(body for lang, body in _blocks(guide) if body.startswith("# file: toy.yaml\n"))
    (tmp_path / "toy.yaml").write_text(toy, encoding="utf-8")
    plan = resolve_recipe(load_recipe("toy.yaml"), snapshot(build_model(TOY)), {"tp": 2})
    shown = PLAN_DOC.read_text(encoding="utf-8").split("The toy plan's manifest:", 1)[1]
    body = _blocks(shown)[0][1]
    rows = [line.split() for line in body.splitlines()]
    assert rows == [[e.boundary, e.stage, e.name, e.mesh_dim, e.direction, str(e.op)]
                    for e in plan.manifest]


def test_readme_lists_every_shipped_recipe() -> None:
    readme = (REPO / "README.md").read_text()
    listed = set(re.findall(r"^\| `(recipes/[\w.-]+\.yaml)` \|", readme, re.M))
    shipped = {f"recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    assert listed == shipped


@pytest.mark.parametrize("doc", ["README.md", *sorted(
    f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_relative_links_resolve(doc: str) -> None:
    path = REPO / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file = target.split("#")[0]
        if file:
            assert (path.parent / file).exists(), f"{doc}: link to {target} is broken"
