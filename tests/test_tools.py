"""Every script under ``tools/`` runs as the docs write it (``python tools/NAME.py ...`` from the
repository root), in its smallest configuration.

The scripts run in fresh interpreters with only the package under test on the path, as an
install provides it: ``python tools/X.py`` puts ``tools/`` first on ``sys.path`` and not the
checkout's root, so a tool that imports ``tests.*`` by accident fails here as it fails for a
user (issue 24). Each run asserts on what the tool prints, so a tool that runs but measures
nothing fails too. Speed figures are not asserted (they belong to docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hyperrecipe

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"

SHARED_MODULES = {"peak_rss.py", "library_models.py"}
"""Modules the tools import from each other, not scripts a user runs."""

COVERED_ELSEWHERE = {
    "train.py": "tests/runtime/state/test_training_state.py::test_documented_trainer_resumes_at_another_tp_size"
                "_and_exports runs it under torchrun as docs/training.md does; tests/test_train_tool.py "
                "runs its data, schedule, accumulation, bf16 and dp x tp options against one process",
}


def _torch_pipelining() -> str:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "distributed" / "pipelining")


# tool -> (its smallest arguments, a line fragment its output must hold)
SMOKE: dict[str, tuple[list[str], str]] = {
    "gen_docs.py": (["--check"], ""),
    # the libraries are no dependency: where one is missing its row says so
    "suggest_libraries.py": (["--only", "litgpt_llama"], "| litgpt_llama |"),
    "bench_verify.py": (["--only", "llama", "--skip-70b", "--repeat", "1", "--json"],
                        '"verify_s"'),
    "bench_cli.py": (["--runs", "1", "--quiet"], "code 0"),
    "bench_launch.py": (["--repeats", "1", "--world-sizes", "2"], "| fork | 2 |"),
    "bench_lint.py": (["--repeat", "1", "--full-repeat", "1", "--root", "<pipelining>"],
                      "identical findings: True"),
    "bench_gather.py": (["--rounds", "1"], '"in_place_over_floor"'),
    "bench_pipeline.py": (["--schedules", "1F1B", "--hidden", "32", "--intermediate", "64",
                           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
                           "--seq", "16", "--batch", "4", "--rounds", "1", "--steps", "1",
                           "--warmup", "1"], "first-step loss |ours - by hand| = 0.00e+00"),
    "bench_first_forward.py": (["--rounds", "1", "--batch", "2", "--seq", "16", "--json"],
                               '"bytes_sent_per_rank": 656'),
    "suggest_families.py": (["--only", "llama", "--no-ep", "--family-timeout-s", "500"],
                            "| llama | tp=2 | verified |"),
    "redteam_state.py": (["--only", "8"], "1/1 held"),
    "bench_export_integrity.py": (["--gib", "0.05", "--repeat", "1"], '"export_over_fsync"'),
    "bench_export.py": (["--hidden", "128", "--layers", "1", "--vocab", "1000", "--rounds", "1"],
                        '"ratio"'),
    "bench_host.py": (["--launches", "1", "--rounds", "1", "--steps", "1", "--warmup", "1"],
                      '"losses_agree": true'),
    "bench_loss.py": (["--vocab", "1024", "--hidden", "64", "--layers", "1", "--batch", "1",
                       "--seq", "16", "--world", "2", "--repeat", "1", "--json"],
                      '"loss_shards_peak_bytes"'),
    "bench_memory.py": (["--hidden", "128", "--layers", "1", "--vocab", "1024", "--world", "2",
                         "--json"], '"meta_over_ideal"'),
    "bench_reload.py": (["--hidden", "128", "--layers", "1", "--vocab", "1024", "--world", "2",
                         "--runs", "1", "--json"], '"reload_over_first"'),
    "bench_reads.py": (["--hidden", "128", "--layers", "1", "--vocab", "1024", "--world", "2",
                        "--rounds", "1", "--json"], '"preadv"'),
    "bench_torchtitan.py": (["--json", "-", "--dim", "64", "--layers", "1", "--heads", "4",
                             "--kv-heads", "2", "--vocab", "256", "--seq", "16", "--batch", "1",
                             "--warmup", "1", "--steps", "1", "--rounds", "1"],
                            '"losses_equal": true'),
    "bench_resolve.py": (["--repeats", "1", "--layers", "1"], "| 1 |"),
    "bench_runtime.py": (["--rounds", "1", "--steps", "1", "--warmup", "1",
                          "--skip-loss-memory"], "sp_production / sp_torchtitan"),
    "bench_validate_hooks.py": (["--rounds", "1", "--steps", "1", "--warmup", "1", "--json"],
                                '"watch_cost_ms"'),
    "bench_worst_case.py": (["--repeats", "1", "--only", "20000-rules", "plan 100000-deep JSON"],
                            "| 20000-rules |"),
    "editor_diagnostics.py": (["--server", "node_modules/.bin/yaml-language-server",
                               "recipes/llama.yaml"], "recipes/llama.yaml"),
}


def _path_with_only_the_package(folder: Path) -> str:
    """A folder holding just ``hyperrecipe`` (the package this test imported), for PYTHONPATH."""
    folder.mkdir()
    (folder / "hyperrecipe").symlink_to(Path(hyperrecipe.__file__).resolve().parent)
    return str(folder)


def run_tool(name: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    args = [_torch_pipelining() if a == "<pipelining>" else a for a in args]
    env = {**os.environ, "PYTHONPATH": _path_with_only_the_package(tmp_path / "path"),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, f"tools/{name}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_every_tool_has_a_smoke_run() -> None:
    scripts = {p.name for p in TOOLS.glob("*.py")} - SHARED_MODULES
    assert scripts == set(SMOKE) | set(COVERED_ELSEWHERE), (
        "add the new tool's smallest documented command to SMOKE in tests/test_tools.py")


@pytest.mark.slow  # starts fresh interpreters, most of them gloo ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_tool_runs_as_documented(name: str, tmp_path: Path) -> None:
    args, expected = SMOKE[name]
    if name == "editor_diagnostics.py" and not (
            shutil.which("node") and (REPO / args[1]).exists()):
        pytest.skip("needs Node.js and `npm install yaml-language-server` (docs/editor.md)")
    if name == "bench_torchtitan.py" and importlib.util.find_spec("torchtitan") is None:
        pytest.skip("needs torchtitan (the `titan` extra; docs/training.md#torchtitan)")
    proc = run_tool(name, args, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "No module named" not in output, output[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]
    if "--json" in args:
        json.loads(proc.stdout)


@pytest.mark.slow  # starts a fresh interpreter
def test_worst_case_refuses_a_case_name_it_does_not_have(tmp_path: Path) -> None:
    proc = run_tool("bench_worst_case.py", ["--repeats", "1", "--only", "laughs"], tmp_path)
    assert proc.returncode == 2
    assert "--only: no case named ['laughs']; the cases are ['billion-laughs'" in proc.stderr


@pytest.mark.slow  # starts fresh interpreters
def test_suggest_families_runs_only_moe_families_and_records_one_past_its_timeout(
        tmp_path: Path) -> None:
    # llama has no expert-parallel plan: --moe-only leaves it out; mixtral cannot build, compile
    # and check four ranks in 10 ms: recorded as timed out, its worker killed with its ranks
    results = tmp_path / "rows.json"
    proc = run_tool("suggest_families.py",
                    ["--only", "llama", "mixtral", "--moe-only", "--family-timeout-s", "0.01",
                     "--out", str(tmp_path / "out"), "--json", str(results)], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "| mixtral | tp=2,ep=2 | timed out |" in proc.stdout, proc.stdout[-3000:]
    assert "| llama |" not in proc.stdout
    rows = json.loads(results.read_text())["rows"]
    assert [(r["family"], r["outcome"]) for r in rows] == [("mixtral", "timed out")]
