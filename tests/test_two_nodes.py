"""One job launched as two torchrun "nodes" on this host trains as the same job launched as one
(docs/multi-node.md).

Each test runs a 4-rank dp=2 x tp=2 job twice, from a real ``save_pretrained`` checkpoint of
the tiny Llama (``recipes/models/tiny-llama.json``), with the gloo backend:

- one node: ``torchrun --nproc-per-node 4``;
- two nodes: two ``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --rdzv-backend c10d
  --rdzv-endpoint localhost:PORT --rdzv-id ID`` launches started together (PORT a free port),
  both given the same ``--out`` folder, as a shared file system gives it: DCP checkpoints need
  a folder every rank sees (docs/multi-node.md#checkpoints-need-storage-every-rank-shares).

What is compared: every step's loss and gradient norm (to :data:`LOSS_ATOL` /
:data:`NORM_RTOL`), every tensor of every DCP checkpoint (model and optimizer state, read back
whole with DCP's own ``dcp_to_torch_save``) and of the ``save_pretrained`` export, to
:data:`WEIGHT_ATOL`. The two layouts run the same ranks, mesh and collectives, so the numbers
are expected equal bit for bit, and the tolerances only leave room for a gloo reduction order
that would differ (measured: every difference 0.0, both routes).

With ``--rdzv-backend c10d`` torchrun numbers the nodes in the order they join, not by
``--node-rank``: the launch given ``--node-rank 1`` may get global ranks 0-1 (measured).
Nothing here depends on which launch gets which ranks: the records are read from whichever
launch holds global rank 0 (the scripts print on global rank 0 only), and the test reports
which one it was.

The two routes: ``tools/train.py --dp 2`` (the shipped trainer; it prints its records with
``--json``) and our own loop as docs/training.md writes it (``tests/support/own_loop.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.runtime_harness import ROOT, llama

pytestmark = pytest.mark.slow(reason="two concurrent torchrun launches of 4 gloo ranks, and one "
                                     "of 4 to compare with, per test (1-3 min each on 2 cores)")

LOSS_ATOL = 1e-6  # tools/train.py rounds its printed loss to 6 decimals
NORM_RTOL = 1e-6
WEIGHT_ATOL = 1e-6
TIMEOUT_S = 600

TOOL_ARGS = ("--dp", "2", "--steps", "4", "--save-every", "2", "--seq-len", "16",
             "--micro-batch", "2", "--lr", "1e-2", "--warmup-steps", "1", "--json")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf-tiny-llama")
    model: Any = llama()
    model.save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _start(launch: list[str], program: list[str], log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, *program],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env, cwd=ROOT,
        start_new_session=True)


def _finish(procs: list[subprocess.Popen[str]], logs: list[Path]) -> list[str]:
    """Every launch's stdout; on a failure or the timeout, the other launches are stopped (a
    rendezvous peer would otherwise wait for the one that died) and the logs are shown."""
    deadline = time.monotonic() + TIMEOUT_S
    outs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
            if proc.returncode != 0:
                break
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if len(outs) < len(procs) or any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- {log.name} (rc {p.returncode}):\n{log.read_text()[-3000:]}"
                          for p, log in zip(procs, logs, strict=True))
        pytest.fail(f"a launch failed or timed out after {TIMEOUT_S} s:\n{tails}")
    return outs


def _records(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _one_node(program: list[str], logs: Path) -> list[dict[str, Any]]:
    log = logs / "one-node.log"
    (out,) = _finish([_start(["--nproc-per-node", "4"], program, log)], [log])
    return _records(out)


def _two_nodes(program: list[str], logs: Path) -> tuple[list[dict[str, Any]], int]:
    """Both launches at once; returns the records and the ``--node-rank`` of the launch that
    printed them (the one holding global rank 0)."""
    port = _free_port()
    procs, paths = [], []
    for node in (0, 1):
        paths.append(logs / f"node-{node}.log")
        procs.append(_start(
            ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
             "--rdzv-id", f"two-nodes-{port}"], program, paths[-1]))
    outs = _finish(procs, paths)
    printed = [node for node, out in enumerate(outs) if _records(out)]
    assert len(printed) == 1, outs  # global rank 0 lives in exactly one launch
    return _records(outs[printed[0]]), printed[0]


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): tree}


def _read_dcp(folder: Path, scratch: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, target)
    return _flat(torch.load(target, weights_only=False))  # written here, by this test


def _read_export(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no safetensors in {folder}"
    return tensors


def _assert_same_tensors(got: dict[str, Any], want: dict[str, Any], what: str) -> float:
    """Same keys, every tensor within :data:`WEIGHT_ATOL`, other values equal; returns the
    largest difference."""
    assert sorted(got) == sorted(want), what
    worst = 0.0
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].shape == value.shape and got[key].dtype == value.dtype, (what, key)
            diff = float((got[key].double() - value.double()).abs().max()) if value.numel() else 0.0
            assert diff <= WEIGHT_ATOL, f"{what}: {key} differs by {diff}"
            worst = max(worst, diff)
        else:
            assert got[key] == value, (what, key)
    return worst


def _assert_same_job(one: Path, two: Path, records: tuple[list[dict[str, Any]], ...],
                     checkpoints: tuple[str, ...], scratch: Path) -> dict[str, float]:
    single, double = records
    steps = [r for r in single if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in double if "loss" in r] == [1, 2, 3, 4]
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for got, want in zip([r for r in double if "loss" in r], steps, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=LOSS_ATOL), got
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=NORM_RTOL), got
        for key in worst:
            worst[key] = max(worst[key], abs(got[key] - want[key]))
    for name in checkpoints:
        worst[name] = _assert_same_tensors(_read_dcp(two / name, scratch),
                                           _read_dcp(one / name, scratch), name)
    worst["final"] = _assert_same_tensors(_read_export(two / "final"),
                                          _read_export(one / "final"), "final")
    return worst


def test_tools_train_on_two_nodes_matches_one_node(checkpoint: Path, tmp_path: Path) -> None:
    """``tools/train.py --dp 2`` (recipe auto: llama-dp, FSDP2 over dp) for 4 steps,
    checkpointing at steps 2 and 4 and exporting ``final/``."""
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    tool = [str(ROOT / "tools/train.py"), "--weights", str(checkpoint), *TOOL_ARGS]
    single = _one_node([*tool, "--out", str(one)], tmp_path)
    double, launch = _two_nodes([*tool, "--out", str(two)], tmp_path)
    worst = _assert_same_job(one, two, (single, double), ("step-2", "step-4"), tmp_path)
    print(f"global rank 0 ran in the launch given --node-rank {launch}; largest differences "
          f"{worst}")


def test_own_loop_on_two_nodes_matches_one_node(checkpoint: Path, tmp_path: Path) -> None:
    """docs/training.md's loop (``tests/support/own_loop.py``) for 4 steps, checkpointing at
    steps 2 and 4 and exporting ``final/``."""
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    loop = [str(ROOT / "tests/support/own_loop.py"), str(checkpoint)]
    single = _one_node([*loop, str(one)], tmp_path)
    double, launch = _two_nodes([*loop, str(two)], tmp_path)
    assert [r for r in single if "launch" in r] == [{"launch": 0}]
    # the rendezvous's node 0 holds global rank 0, whichever --node-rank its launch was given
    assert [r for r in double if "launch" in r] == [{"launch": 0}]
    worst = _assert_same_job(one, two, (single, double), ("step-2", "step-4"), tmp_path)
    print(f"global rank 0 ran in the launch given --node-rank {launch}; largest differences "
          f"{worst}")
