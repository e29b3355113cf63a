"""``hyperrecipe lint``: formats, exit codes, parse errors, start-up without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyperrecipe.lint.cli import main
from tests.lint.conftest import WriteTree

ROOT = Path(__file__).resolve().parents[2]
HR001_MESSAGE = (
    "assigns `forward` outside the rewriter; hand the replacement to hyperrecipe.rewriter "
    "(Rewrite.install_forward)"
)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_clean_tree_exits_0_and_prints_nothing(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": "y = m.forward(x)\n"})
    assert _run([], capsys) == (0, "", "")


def test_text_format_prints_path_line_column_code_name_message(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"pkg/a.py": "import torch\n\nmodel.forward = f\n"})
    code, out, err = _run(["pkg"], capsys)
    assert code == 1
    assert out == f"pkg/a.py:3:1: HR001 forward-assignment {HR001_MESSAGE}\n"
    assert err == "hyperrecipe lint: 1 finding in 1 file checked\n"


def test_json_format_is_a_list_of_objects_with_the_eight_keys_end_included(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": 'x = 1\nsetattr(m, "forward", f)\n'})
    code, out, err = _run(["--format", "json", "a.py"], capsys)
    assert code == 1
    assert err == ""
    assert json.loads(out) == [
        {
            "path": "a.py", "line": 2, "column": 1, "end_line": 2, "end_column": 25,
            "code": "HR002", "name": "forward-setattr",
            "message": "sets `forward` by name (setattr()) outside the rewriter; hand the "
                       "replacement to hyperrecipe.rewriter (Rewrite.install_forward)",
        }
    ]


def test_json_format_of_a_clean_run_is_an_empty_list(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": "x = 1\n"})
    assert _run(["--format=json"], capsys) == (0, "[]\n", "")


def test_github_format_prints_workflow_error_commands(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a,b.py": "m.forward = f\n"})
    code, out, _ = _run(["--format", "github"], capsys)
    assert code == 1
    assert out == (
        "::error file=a%2Cb.py,line=1,col=1,endLine=1,endColumn=10,"
        f"title=HR001 forward-assignment::{HR001_MESSAGE}\n"
    )


def test_select_and_ignore_take_comma_separated_codes_and_names(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": 'm.forward = f\nsetattr(m, "forward", f)\nm.__class__ = C\n'})
    argv = ["--select", "HR001,forward-setattr", "--ignore", "HR002", "--format", "json"]
    code, out, _ = _run(argv, capsys)
    assert code == 1
    assert [f["code"] for f in json.loads(out)] == ["HR001"]


def test_a_file_that_does_not_parse_is_reported_and_exits_2(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"bad.py": "def f(:\n    pass\n", "good.py": "x = 1\n"})
    code, out, err = _run([], capsys)
    assert code == 2
    assert out == "bad.py:1:7: HR000 syntax-error cannot parse: invalid syntax\n"
    assert err == "hyperrecipe lint: 0 findings, 1 file not linted in 2 files checked\n"


def test_parse_errors_alongside_findings_exit_1(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"bad.py": "x = (\n", "a.py": "m.forward = f\n"})
    code, out, _ = _run(["--format", "json"], capsys)
    assert code == 1
    assert [(f["path"], f["code"], f["message"]) for f in json.loads(out)] == [
        ("a.py", "HR001", HR001_MESSAGE),
        ("bad.py", "HR000", "cannot parse: '(' was never closed"),
    ]


def test_undecodable_and_nul_byte_files_are_parse_errors_not_tracebacks(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"latin.py": b"x = '\xe9'\n", "nul.py": b"x = 1\x00\n"})
    code, out, _ = _run(["--format", "json"], capsys)
    assert code == 2
    rows = [(f["path"], f["code"]) for f in json.loads(out)]
    assert rows == [("latin.py", "HR000"), ("nul.py", "HR000")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--select", "HR042"],
         "hyperrecipe lint: error: --select: unknown rule code or name 'HR042'"),
        (["--format", "xml"], "hyperrecipe lint: error: argument --format: invalid choice: 'xml'"),
        (["missing.py"], "hyperrecipe lint: error: no such file or folder: missing.py"),
        (["--jobs", "0"], "hyperrecipe lint: error: --jobs must be at least 1"),
        (["--bogus"], "hyperrecipe lint: error: unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    argv: list[str], message: str, write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": "x = 1\n"})
    code, out, err = _run(argv, capsys)
    assert (code, out) == (2, "")
    assert err.startswith(message)


def test_explain_prints_the_rule_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--explain", "forward-dict"], capsys)
    assert code == 0
    assert out.startswith("## HR003 forward-dict\n")
    assert "### Why is this bad?" in out


def test_explain_of_a_non_rule_code_prints_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--explain", "HR900"], capsys) == (
        0, "HR900 unused-suppression: a suppression comment silences nothing\n", ""
    )


def test_more_files_than_the_pool_threshold_give_the_same_findings_in_parallel(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    files: dict[str, str | bytes] = {f"m{i:02}.py": "x = 1\n" for i in range(20)}
    files["m07.py"] = "m.forward = f\n"
    files["m13.py"] = "def f(:\n"
    write_tree(files)
    serial = _run(["--jobs", "1", "--format", "json"], capsys)
    parallel = _run(["--jobs", "2", "--format", "json"], capsys)
    assert serial == parallel
    assert [f["path"] for f in json.loads(serial[1])] == ["m07.py", "m13.py"]


# -- ruff's habits ---------------------------------------------------------------------------


def test_stdin_is_linted_as_the_stdin_filename_with_its_configuration(
    write_tree: WriteTree,
) -> None:
    root = write_tree({
        "pyproject.toml": '[tool.hyperrecipe.lint]\nrewriter = ["pkg/rewriter.py"]\n'
                          'exclude = ["gen"]\n',
        "pkg/rewriter.py": "",
    })
    source = "x = 1\nm.forward = f\n"
    shown = _command("-", "--stdin-filename", "pkg/a.py", cwd=root, stdin=source)
    assert (shown.returncode, shown.stdout) == (
        1, f"pkg/a.py:2:1: HR001 forward-assignment {HR001_MESSAGE}\n"
    )
    bare = _command("-", cwd=root, stdin=source)
    assert bare.stdout == f"-:2:1: HR001 forward-assignment {HR001_MESSAGE}\n"
    allowed = _command("-", "--stdin-filename", "pkg/rewriter.py", cwd=root, stdin=source)
    assert (allowed.returncode, allowed.stdout) == (0, "")
    excluded = _command("-", "--stdin-filename", "gen/a.py", "--force-exclude", cwd=root,
                        stdin=source)
    assert (excluded.returncode, excluded.stdout) == (0, "")


def test_stdin_filename_without_stdin_is_a_usage_error(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": "x = 1\n"})
    assert _run(["--stdin-filename", "a.py", "a.py"], capsys) == (
        2, "", "hyperrecipe lint: error: --stdin-filename needs `-` among the paths\n"
    )


def test_exit_zero_keeps_the_output_and_exits_0_unless_a_file_was_not_linted(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": "m.forward = f\n"})
    code, out, _ = _run(["--exit-zero"], capsys)
    assert (code, out) == (0, f"a.py:1:1: HR001 forward-assignment {HR001_MESSAGE}\n")
    write_tree({"b.py": "def f(:\n"})
    assert _run(["--exit-zero"], capsys)[0] == 2  # a file that could not be checked


def test_statistics_counts_findings_per_code_most_frequent_first(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"a.py": "m.forward = f\nn.forward = g\nsetattr(m, 'forward', f)\n",
                "b.py": "o.forward = h\n"})
    code, out, _ = _run(["--statistics"], capsys)
    assert (code, out) == (1, "3\tHR001\tforward-assignment\n1\tHR002\tforward-setattr\n")


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert _run(["--version"], capsys) == (0, f"hyperrecipe lint {version('hyperrecipe')}\n", "")


def test_sarif_output_is_a_sarif_2_1_0_log_with_rules_and_located_results(
    write_tree: WriteTree, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tree({"sub dir/a.py": "x = 1\nsetattr(m, 'forward',\n        f)\n"})
    code, out, _ = _run(["--format", "sarif"], capsys)
    assert code == 1
    log = json.loads(out)
    assert log["version"] == "2.1.0"
    (run,) = log["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [rule["id"] for rule in rules][:3] == ["HR000", "HR001", "HR002"]
    (result,) = run["results"]
    assert result["ruleId"] == "HR002"
    assert rules[result["ruleIndex"]]["name"] == "forward-setattr"
    assert result["locations"] == [{
        "physicalLocation": {
            "artifactLocation": {"uri": "sub%20dir/a.py"},
            "region": {"startLine": 2, "startColumn": 1, "endLine": 3, "endColumn": 11},
        }
    }]
    assert log["$schema"] == "https://json.schemastore.org/sarif-2.1.0.json"
    assert run["tool"]["driver"]["name"] == "hyperrecipe-lint"


# -- the real command ----------------------------------------------------------------------


def _command(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hyperrecipe", "lint", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False, input=stdin,
    )


def test_command_reports_findings_and_exits_1(write_tree: WriteTree) -> None:
    root = write_tree({"a.py": "m.forward = f\n"})
    done = _command(cwd=root)
    assert done.returncode == 1
    assert done.stdout == f"a.py:1:1: HR001 forward-assignment {HR001_MESSAGE}\n"


def test_command_json_output_parses(write_tree: WriteTree) -> None:
    root = write_tree({"a.py": "del m.forward\n"})
    done = _command("--format", "json", cwd=root)
    assert done.returncode == 1
    assert [f["code"] for f in json.loads(done.stdout)] == ["HR001"]


def test_command_usage_error_exits_2_without_a_traceback(write_tree: WriteTree) -> None:
    root = write_tree({"a.py": "x = 1\n"})
    done = _command("--select", "nope", cwd=root)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("hyperrecipe lint: error: --select: unknown rule code or name")


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_command_on_this_repository_is_clean() -> None:
    done = _command(cwd=ROOT)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_lint_never_imports_torch_even_in_its_workers(tmp_path: Path) -> None:
    """The pre-commit environment has no torch: linting must not need it, in any process.

    torch is made unimportable (``sys.modules["torch"] = None``; forked workers inherit that),
    so an import anywhere would turn into an ``HR999``/``HR998`` error or a traceback. How fast
    the command starts is a benchmark (``tools/bench_lint.py``), not a unit test.
    """
    (tmp_path / "clean.py").write_text("x = 1\n")
    (tmp_path / "hit.py").write_text("m.forward = f\n")
    (tmp_path / "recipe.yaml").write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules: []\n")
    many = tmp_path / "many"
    many.mkdir()
    for index in range(12):  # over the pool threshold: several workers
        (many / f"m{index}.py").write_text(f"m{index}.forward = f\n" if index % 3 else "x = 1\n")
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from hyperrecipe.cli import main\n"
        f"clean = main(['lint', {str(tmp_path / 'clean.py')!r}])\n"
        "clean_libcst = 'libcst' in sys.modules\n"
        "clean_forked = 'multiprocessing' in sys.modules  # one small file: screened in-process\n"
        f"hit = main(['lint', {str(tmp_path / 'hit.py')!r}])\n"
        f"recipe = main(['lint', {str(tmp_path / 'recipe.yaml')!r}])\n"
        f"many = main(['lint', '--jobs', '2', '--statistics', {str(many)!r}])\n"
        "print(clean, clean_libcst, clean_forked, hit, recipe, many,"
        " sys.modules['torch'] is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split()[-7:] == ["0", "False", "False", "1", "0", "1", "True"], done.stdout
    assert "8\tHR001\tforward-assignment" in done.stdout
    assert "Traceback" not in done.stderr
