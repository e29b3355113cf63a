"""One bad file does not end the run: every file is checked within a time and memory budget.

The files are generated here, not committed: a source nested 100,000 brackets deep (it crashes
libcst's native parser), a multi-megabyte generated module, a billion-laughs recipe YAML, a
1000-deep TOML recipe. Each is reported with its reason, located, and every other file's
findings are kept.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperrecipe.lint.findings import Finding
from hyperrecipe.lint.runner import Budget, lint_paths
from hyperrecipe.lint.supervisor import TaskFailure, run_bounded
from tests.lint.conftest import WriteTree

HIT = "m.forward = f\n"
ROOT = Path(__file__).resolve().parents[2]


def _rows(findings: tuple[Finding, ...]) -> list[tuple[str, int, int, str]]:
    return [(f.path, f.line, f.column, f.code) for f in findings]


def _deep_parentheses(depth: int) -> str:
    return "x = " + "(" * depth + ")" * depth + "\n"


def _bigger_than(megabytes: float) -> str:
    """A generated module that needs the libcst pass (it reads `forward` and assigns one)."""
    block = "def f{0}(m, x):\n    y = x + {0}\n    return m.forward(y) * {0}\n"
    lines: list[str] = []
    size, index = 0, 0
    while size < megabytes * 1e6:
        line = block.format(index)
        lines.append(line)
        size += len(line)
        index += 1
    return "".join(lines) + HIT


def _many_clean_files(count: int) -> dict[str, str | bytes]:
    return {f"pkg/clean_{index}.py": f"x{index} = {index}\n" for index in range(count)}


@pytest.mark.parametrize("screen", [True, False], ids=["screened", "libcst-only"])
def test_a_source_nested_100000_deep_is_a_located_syntax_error_and_other_findings_stay(
    write_tree: WriteTree, screen: bool
) -> None:
    """The interpreter refuses it ("too many nested parentheses"); libcst would crash (SIGSEGV)."""
    write_tree({"pkg/deep.py": _deep_parentheses(100_000), "pkg/hit.py": HIT,
                **_many_clean_files(10)})
    result = lint_paths(["pkg"], jobs=2, screen=screen)
    assert _rows(result.findings) == [
        ("pkg/deep.py", 1, 205, "HR000"),  # the 201st bracket, where the interpreter stops
        ("pkg/hit.py", 1, 1, "HR001"),
    ]
    assert result.findings[0].message == "cannot parse: too many nested parentheses"
    assert result.exit_code == 1


def test_a_file_the_interpreter_refuses_for_nesting_does_not_lint_clean(
    write_tree: WriteTree,
) -> None:
    """300 parentheses: libcst parses it, the interpreter does not; it is not Python."""
    write_tree({"nested.py": "x = " + "(" * 300 + "1" + ")" * 300 + "\n"})
    for screen in (True, False):
        result = lint_paths(["nested.py"], screen=screen)
        assert _rows(result.findings) == [("nested.py", 1, 205, "HR000")]
        assert result.exit_code == 2


@pytest.mark.parametrize("screen", [True, False], ids=["screened-in-process", "libcst-only"])
def test_a_small_file_too_deep_for_the_parser_is_hr998_beside_a_finding(
    write_tree: WriteTree, screen: bool
) -> None:
    """Two small files are screened in the lint's own process (the pre-commit case): the
    parser's MemoryError on 60,000 nested `not` is still that file's HR998, and the run goes on."""
    write_tree({"deep.py": "x = " + "not " * 60_000 + "x\n", "hit.py": HIT})
    result = lint_paths(["deep.py", "hit.py"], screen=screen)
    rows = _rows(result.findings)
    assert rows[1] == ("hit.py", 1, 1, "HR001")
    if screen:
        assert rows[0] == ("deep.py", 1, 1, "HR998")
        assert "(MemoryError)" in result.findings[0].message
    else:  # libcst's native parser: a crash (HR998) or its own error (HR000), never a finding
        assert rows[0][0] == "deep.py" and rows[0][3] in {"HR998", "HR000"}


IN_PROCESS_BUDGET = """
import json
from hyperrecipe.lint.runner import Budget, lint_paths
result = lint_paths(["wide.py", "hit.py"], budget=Budget(seconds=None, memory_mib=20))
print(json.dumps([[f.path, f.line, f.column, f.code, f.message] for f in result.findings]))
"""


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_the_memory_budget_holds_for_files_screened_in_process(write_tree: WriteTree) -> None:
    """A 200 kB tuple display takes the parser ~80 MB: over a 20 MiB budget, in-process too;
    the limit is lifted afterwards, so the next file is checked as usual. Run in a fresh
    interpreter, as the pre-commit hook runs the lint: the budget caps address space on top of
    what the process holds, and a test process that already freed hundreds of MB (earlier
    tests) would serve the parser from its own free heap without growing at all."""
    import json

    root = write_tree({"wide.py": "y = " + "x, " * 66_000 + "x\n", "hit.py": HIT})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", IN_PROCESS_BUDGET], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [tuple(r[:4]) for r in rows] == [("hit.py", 1, 1, "HR001"), ("wide.py", 1, 1, "HR998")]
    assert "memory budget (20 MiB)" in rows[1][4]


@pytest.mark.parametrize("crash", [2, 3], ids=["with-a-task-queued-behind", "last-queued"])
def test_a_crashing_worker_reports_its_task_and_the_others_finish(crash: int) -> None:
    results = dict(run_bounded(_crash_on, [(value, crash) for value in range(6)], workers=2,
                               budget=Budget()))
    assert sorted(results) == list(range(6))
    failure = results.pop(crash)
    assert isinstance(failure, TaskFailure)
    assert failure.reason.startswith("the parser crashed (SIGSEGV")
    assert results == {value: value * 10 for value in range(6) if value != crash}


def _crash_on(task: tuple[int, int]) -> int:
    value, crash = task
    if value == crash:
        faulthandler.disable()  # pytest enables it; the worker's dump would only be noise
        ctypes.string_at(0)  # a real segmentation fault, as libcst's parser has on deep nesting
    return value * 10


def test_a_file_over_its_time_budget_is_hr998_and_the_others_are_checked(
    write_tree: WriteTree,
) -> None:
    write_tree({"gen.py": _bigger_than(3), "hit.py": HIT})
    result = lint_paths(["."], budget=Budget(seconds=1.0, memory_mib=None))
    assert _rows(result.findings) == [("gen.py", 1, 1, "HR998"), ("hit.py", 1, 1, "HR001")]
    assert result.findings[0].message == (
        "not checked: it took longer than the time budget (1 s); the other files' findings stand"
    )


@pytest.mark.parametrize("screen", [True, False], ids=["screened", "libcst-only"])
def test_a_file_over_its_memory_budget_is_hr998_and_the_others_are_checked(
    write_tree: WriteTree, screen: bool
) -> None:
    """The screen's parser raises MemoryError; libcst's native parser aborts (SIGABRT)."""
    write_tree({"gen.py": _bigger_than(3), "hit.py": HIT})
    result = lint_paths(["."], screen=screen, budget=Budget(seconds=None, memory_mib=150))
    assert _rows(result.findings) == [("gen.py", 1, 1, "HR998"), ("hit.py", 1, 1, "HR001")]
    message = result.findings[0].message
    assert "memory budget (150 MiB)" in message or "SIGABRT" in message, message


def _billion_laughs() -> str:
    lines = ["recipe: laughs", "version: 1", "mesh: [tp]",
             'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    lines.append("rules: *a9")
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_recipe_finishes_within_its_budget(write_tree: WriteTree) -> None:
    write_tree({"laughs.yaml": _billion_laughs(), "hit.py": HIT})
    result = lint_paths(["."], budget=Budget(seconds=5.0, memory_mib=1024))
    rows = _rows(result.findings)
    assert rows[0] == ("hit.py", 1, 1, "HR001")
    # Over the budget (HR998), or refused by the recipe loader's own alias bound (HR100).
    assert [(path, code in {"HR998", "HR100"}) for path, _, _, code in rows[1:]] == [
        ("laughs.yaml", True)
    ]


def test_a_recipe_toml_nested_1000_deep_is_reported_without_a_traceback(
    write_tree: WriteTree,
) -> None:
    write_tree({"deep.toml": "recipe = 'r'\nx = " + "[" * 1000 + "]" * 1000 + "\n"})
    script = "from hyperrecipe.cli import main; raise SystemExit(main(['lint', 'deep.toml']))"
    done = subprocess.run([sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "Traceback" not in done.stderr
    assert done.returncode in (1, 2)
    # the recipe loader's nesting bound, at the bracket past it (or the budget's HR998 at 1:1)
    assert done.stdout.startswith(("deep.toml:2:69: HR100 recipe-schema the document nests "
                                   "deeper than 64 levels", "deep.toml:1:1: HR998")), done.stdout


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_a_tree_of_10000_files_finishes_with_every_finding(tmp_path: Path) -> None:
    """Issue 28: from about 8,000 files the parent and both workers sat blocked sending on
    their sockets, forever. Run in a child with a timeout, so a regression fails instead of
    hanging the suite."""
    for i in range(10_000):
        folder = tmp_path / f"pkg{i // 500}"
        folder.mkdir(exist_ok=True)
        (folder / f"m{i}.py").write_text(HIT if i % 1000 == 0 else f"def f(x):\n    return x + {i}\n")
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from hyperrecipe.cli import main; "
         "sys.exit(main(['lint', '--jobs', '2', '.']))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    assert done.stdout.count("HR001") == 10


SLOW_PARENT = """
import sys, time
from hyperrecipe.lint.supervisor import Budget, run_bounded

def slow(x):
    time.sleep(0.2)
    return x

for index, _ in run_bounded(slow, list(range(1000)), workers=2, budget=Budget()):
    print("running", flush=True)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_workers_die_with_their_parent() -> None:
    """A killed parent's workers used to live on, orphaned: the workers forked later held the
    parent's end of the earlier ones' pipes, so those never saw it close."""
    import signal
    import time

    parent = subprocess.Popen([sys.executable, "-c", SLOW_PARENT], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert parent.stdout is not None
        parent.stdout.readline()
        workers = _children(parent.pid)
        assert len(workers) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    alive = workers
    for _ in range(100):  # up to 10 s, polled: the kernel's signal is immediate
        alive = [w for w in alive if _running(w)]
        if not alive:
            break
        time.sleep(0.1)
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert alive == [], "workers outlived their parent"
