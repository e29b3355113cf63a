"""Benchmark ``hyperrecipe lint`` against the cost of merely parsing the same tree.

Lints the installed ``torch/distributed`` package (no configuration, so no rewriter allowance)
and, in the same run, times a plain single-process ``ast.parse`` of every file of that tree —
the floor any Python-aware checker pays. Also times the full libcst pass (``--no-screen``) and
checks that both passes report the same findings, and that the forward findings are exactly the
three known assignments in ``pipelining/_IR.py``.

With ``--transformers`` it also lints the installed ``transformers`` package against its own
floor (screened pass only; CPU time is the figure the target is stated in). And it times the
pre-commit case: one clean file and one file with a finding, as whole commands, against
``python -c pass``.

Each timing runs in a fresh interpreter (so no run inherits another's imports) and is repeated;
the minimum is the figure (the machine is shared; the minimum is the least disturbed run).

Usage::

    python tools/bench_lint.py [--root PATH] [--transformers] [--repeat N] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXPECTED_FORWARD_FINDINGS = [
    ("pipelining/_IR.py", 628, "HR001"),
    ("pipelining/_IR.py", 1240, "HR001"),
    ("pipelining/_IR.py", 1242, "HR001"),
]

_FLOOR = """
import ast, pathlib, sys, time
files = sorted(pathlib.Path(sys.argv[1]).rglob("*.py"))
start, cpu = time.perf_counter(), time.process_time()
for path in files:
    ast.parse(path.read_bytes(), str(path))
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
print(wall, cpu, len(files), sum(p.read_bytes().count(b"\\n") for p in files))
"""

_LINT = """
import json, resource, sys, time
def cpu():
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)
start = time.perf_counter()
from hyperrecipe.lint.runner import lint_paths
imported, cpu_start = time.perf_counter(), cpu()
result = lint_paths([sys.argv[1]], screen=sys.argv[2] == "screen")
end = time.perf_counter()
print(json.dumps({"seconds": end - imported, "with_import": end - start, "cpu": cpu() - cpu_start,
                  "files": result.files, "libcst_files": result.libcst_files,
                  "torch_imported": "torch" in sys.modules,
                  "findings": [[f.path, f.line, f.column, f.code, f.message]
                               for f in result.findings]}))
"""


def _torch_distributed() -> Path:
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torch is not installed; pass --root")
    return Path(next(iter(spec.submodule_search_locations))) / "distributed"


def _package_folder(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _best_wall(command: list[str], repeat: int, cwd: Path | None = None) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=False, cwd=cwd)
        best = min(best, time.perf_counter() - start)
    return best


def _single_file(repeat: int) -> dict[str, float]:
    """The pre-commit case: the whole command on one file, over ``python -c pass``."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "clean.py").write_text("import torch\n\ndef f(x):\n    return x * 2\n")
        (root / "hit.py").write_text("def f(m, g):\n    m.forward = g\n")
        lint = [sys.executable, "-m", "hyperrecipe", "lint"]
        base = _best_wall([sys.executable, "-c", "pass"], repeat, root)
        clean = _best_wall([*lint, "clean.py"], repeat, root)
        hit = _best_wall([*lint, "hit.py"], repeat, root)
    return {"python_c_pass": base, "clean_file": clean, "clean_over_pass": clean - base,
            "file_with_finding": hit, "finding_over_pass": hit - base}


def _tree(root: Path, repeat: int) -> dict[str, Any]:
    """Screened lint against the ast floor on one tree, interleaved; minima and CPU."""
    floors, floor_cpus, lints, lint_cpus = [], [], [], []
    run: dict[str, Any] = {}
    files = lines = 0
    for _ in range(repeat):
        seconds, cpu_seconds, files_text, lines_text = _python(_FLOOR, str(root)).split()
        floors.append(float(seconds))
        floor_cpus.append(float(cpu_seconds))
        files, lines = int(files_text), int(lines_text)
        run = json.loads(_python(_LINT, str(root), "screen"))
        lints.append(run["seconds"])
        lint_cpus.append(run["cpu"])
    return {
        "root": str(root), "files": files, "lines": lines,
        "ast_floor_min": min(floors), "lint_min": min(lints),
        "ast_floor_cpu_min": min(floor_cpus), "lint_cpu_min": min(lint_cpus),
        "ratio_wall": min(lints) / min(floors), "ratio_cpu": min(lint_cpus) / min(floor_cpus),
        "libcst_files": run["libcst_files"], "findings": len(run["findings"]),
        "codes": sorted({f[3] for f in run["findings"]}),
        "torch_imported": run["torch_imported"],
    }


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          check=True)
    return done.stdout.strip().splitlines()[-1]


def _command_wall(root: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hyperrecipe", "lint", str(root), "--format", "json"],
                   capture_output=True, check=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="tree to lint (torch/distributed)")
    parser.add_argument("--repeat", type=int, default=7, help="repetitions of the fast timings")
    parser.add_argument("--full-repeat", type=int, default=2, help="repetitions of the full pass")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results")
    parser.add_argument("--transformers", action="store_true",
                        help="also lint the installed transformers package against its floor")
    args = parser.parse_args(argv)
    root = (args.root or _torch_distributed()).resolve()

    floors, floor_cpus, lints, lint_cpus, with_import, commands = [], [], [], [], [], []
    lint_run: dict[str, Any] = {}
    files = lines = 0
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        seconds, cpu_seconds, files_text, lines_text = _python(_FLOOR, str(root)).split()
        floors.append(float(seconds))
        floor_cpus.append(float(cpu_seconds))
        files, lines = int(files_text), int(lines_text)
        lint_run = json.loads(_python(_LINT, str(root), "screen"))
        lints.append(lint_run["seconds"])
        lint_cpus.append(lint_run["cpu"])
        with_import.append(lint_run["with_import"])
        commands.append(_command_wall(root))
    fulls = []
    full_run: dict[str, Any] = {}
    for _ in range(args.full_repeat):
        full_run = json.loads(_python(_LINT, str(root), "full"))
        fulls.append(full_run["seconds"])

    identical = lint_run["findings"] == full_run["findings"]
    rows = [(Path(p).absolute().relative_to(root).as_posix(), line, code)
            for p, line, _, code, _ in lint_run["findings"]]
    forward = [row for row in rows if row[2] in ("HR001", "HR002", "HR003")]
    others = [row for row in rows if row[2] not in ("HR001", "HR002", "HR003")]
    floor, lint, full = min(floors), min(lints), min(fulls)
    results = {
        "root": str(root),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "platform": platform.platform()},
        "tree": {"files": files, "lines": lines},
        "seconds": {
            "ast_floor_min": floor, "ast_floor_median": statistics.median(floors),
            "lint_min": lint, "lint_median": statistics.median(lints),
            "lint_with_import_min": min(with_import),
            "command_wall_min": min(commands), "command_wall_median": statistics.median(commands),
            "full_libcst_min": full,
            "ast_floor_cpu_min": min(floor_cpus), "lint_cpu_min": min(lint_cpus),
        },
        "ratio_lint_to_floor": lint / floor,
        "ratio_full_to_floor": full / floor,
        "libcst_files": {"screened": lint_run["libcst_files"], "full": full_run["libcst_files"]},
        "findings_identical_to_full_pass": identical,
        "forward_findings": forward,
        "forward_findings_as_expected": forward == EXPECTED_FORWARD_FINDINGS,
        "other_findings": others,
        "torch_imported": lint_run["torch_imported"] or full_run["torch_imported"],
        "single_file": _single_file(args.repeat),
    }
    transformers = _package_folder("transformers") if args.transformers else None
    if transformers is not None:
        results["transformers"] = _tree(transformers, max(1, args.repeat // 2))
    print(f"tree        {root} ({files} files, {lines} lines), {results['machine']['cpus']} CPUs")
    print(f"ast floor   {floor:.3f} s  (median {statistics.median(floors):.3f}; single process)")
    print(f"lint        {lint:.3f} s  (median {statistics.median(lints):.3f}; "
          f"{lint / floor:.2f} x floor; libcst on {lint_run['libcst_files']} files)")
    print(f"  + import  {min(with_import):.3f} s  (importing hyperrecipe.lint included)")
    print(f"cpu         lint {min(lint_cpus):.3f} s (all processes); "
          f"floor {min(floor_cpus):.3f} s")
    print(f"command     {min(commands):.3f} s  (`hyperrecipe lint`, interpreter start included)")
    print(f"full libcst {full:.3f} s  ({full / floor:.2f} x floor; --no-screen)")
    print(f"identical findings: {identical}; forward findings as expected: "
          f"{results['forward_findings_as_expected']}")
    for row in rows:
        print(f"  {row[0]}:{row[1]} {row[2]}")
    one = results["single_file"]
    print(f"one file    clean {one['clean_file']:.3f} s (+{one['clean_over_pass']:.3f} over "
          f"`python -c pass` {one['python_c_pass']:.3f} s); with a finding "
          f"{one['file_with_finding']:.3f} s (+{one['finding_over_pass']:.3f})")
    if "transformers" in results:
        t = results["transformers"]
        print(f"transformers {t['files']} files, {t['lines']} lines: "
              f"floor {t['ast_floor_min']:.3f} s"
              f" (cpu {t['ast_floor_cpu_min']:.3f}), lint {t['lint_min']:.3f} s (cpu "
              f"{t['lint_cpu_min']:.3f}; {t['ratio_cpu']:.2f} x floor cpu), libcst on "
              f"{t['libcst_files']} files, {t['findings']} findings {t['codes']}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    ok = identical and results["forward_findings_as_expected"] and not results["torch_imported"]
    ok = ok and not results.get("transformers", {}).get("torch_imported", False)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
