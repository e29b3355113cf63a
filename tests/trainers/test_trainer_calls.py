"""docs/training.md's table of trainer-side calls on production shards stays true, and its
trainer examples run as shown.

- The table names exactly the calls and statuses below, and every test its last column cites
  exists (each of those tests asserts the row: a made-right route against one process, a
  refusal by its message, a *wrong* row by the difference it makes).
- The torch rows run here on gloo ranks (tiny Llama, ``recipes/llama.yaml``, tp=2, one
  backward of the ``labels=`` loss) against one process: ``inst.clip_grad_norm_`` clips as one
  process does (every gradient to atol 2e-6 / rtol 1e-5), ``clip_grad_value_`` is elementwise
  (the same), torch's ``clip_grad_norm_`` returns one process's norm (rtol 1e-5: hyperrecipe
  supplies it while the installation lives, ``runtime/grads/torch_clip_guard.py``).
- ``accelerator.clip_grad_norm_`` (accelerate, the applied model not prepared) in five clipped
  AdamW steps: one process's norms (rtol 1e-5) and losses (rtol 1e-5, atol 1e-6).
- The trainer examples run under torchrun; the Lightning one's export loads with
  ``from_pretrained`` and equals its last DCP checkpoint bit for bit.
- No module outside ``hyperrecipe/trainers/`` imports a trainer library.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import (
    ROOT,
    TINY_LLAMA,
    assert_close,
    llama,
    llama_batch,
    mesh_1d,
)

LLAMA = str(ROOT / "recipes/llama.yaml")
DOC = ROOT / "docs/training.md"

TABLE = {
    "`inst.clip_grad_norm_(max_norm)`, `inst.grad_norm()`": "right",
    "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, `get_total_norm`":
        "made right",
    "torch's `clip_grad_norm_` over an applied model's gradients and other tensors": "refused",
    "`torch.nn.utils.clip_grad_value_(model.parameters(), value)`": "safe",
    "`DistributedDataParallel(model)` over the tp ranks": "refused",
    '`DistributedDataParallel(model, process_group=mesh["dp"].get_group())`, a plan without '
    'gradient buckets': "safe",
    "the same over a plan with gradient buckets (sequence-parallel norms)": "refused",
    '`data_parallel(inst, mesh["dp"].get_group())`': "made right",
    "`transformers.Trainer` under `torchrun`": "refused",
    "`HyperrecipeTrainer`: `max_grad_norm`, logged `grad_norm`": "made right",
    "`HyperrecipeTrainer` with `fp16=True` (a loss scale)": "made right",
    "`HyperrecipeTrainer`: logged counters and rates (`num_input_tokens_seen`, "
    "`train_tokens_per_second`, `total_flos`, `eval_steps_per_second`)": "made right",
    "`HyperrecipeTrainer` with `average_tokens_across_devices=False`": "made right",
    "`HyperrecipeTrainer`: `save_steps`, `resume_from_checkpoint`": "made right",
    "`HyperrecipeTrainer` with a validate-mode installation": "made right",
    "`HyperrecipeTrainer` at dp × tp": "made right",
    "`accelerate.Accelerator().prepare(model)` under `torchrun`": "refused",
    "`HyperrecipeAccelerator`: `clip_grad_norm_`, LR schedule, `save_state`/`load_state`":
        "made right",
    "`HyperrecipeAccelerator` at dp × tp": "made right",
    "`HyperrecipeAccelerator` with an optimizer built before apply": "refused",
    "TRL `SFTTrainer`'s fused LM head under `HyperrecipeSFTTrainer`": "made right",
    "TRL `DPOTrainer`'s fused LM head under `HyperrecipeDPOTrainer`": "made right",
    "TRL's logged `num_tokens` (SFT and DPO) and their other gathered metrics": "made right",
    "`HyperrecipeDPOTrainer` with a `ref_model` that has a plan applied": "refused",
    "`HyperrecipeTrainerMixin` over a TRL trainer that patched the fused LM head, production "
    "mode": "refused",
    "`accelerator.clip_grad_norm_(model.parameters(), max_norm)`": "made right",
    "Lightning `gradient_clip_val` under `ModelParallelStrategy`": "made right",
    "Lightning `gradient_clip_val` under `HyperrecipeStrategy`": "made right",
    "Lightning at dp × tp under `HyperrecipeStrategy`": "made right",
    "Lightning `fit(ckpt_path=...)` under `HyperrecipeStrategy`": "made right",
    "Lightning's `lightning.pytorch.utilities.grad_norm(self, 2)` on production shards":
        "wrong: use ours",
    "Lightning `HyperrecipeStrategy` without a plan applied": "refused",
    "Lightning `HyperrecipeStrategy` with a recipe lacking the `dp` dim at `dp > 1`": "refused",
}


def _table_rows() -> list[list[str]]:
    text = DOC.read_text()
    start = text.index("### Trainer-side calls, kept true by a test")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith("| call ") and "---" not in line:
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def test_the_trainer_calls_table_names_exactly_these_calls_and_statuses() -> None:
    rows = _table_rows()
    assert {r[0]: r[1] for r in rows} == TABLE
    assert len(rows) == len(TABLE)


def test_every_test_the_table_cites_exists() -> None:
    for row in _table_rows():
        cited = re.fullmatch(r"`(tests/[\w/]+\.py)::(\w+)`", row[3])
        assert cited, f"{row[0]}: the last column must cite one test, not {row[3]!r}"
        tree = ast.parse((ROOT / cited.group(1)).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert cited.group(2) in names, f"{row[0]}: {cited.group(0)} does not exist"


def _calls_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    extra = {"attn_implementation": "eager"} if mode == "validate" else {}
    model = llama(**extra)
    inst = apply(model, compile_recipe(LLAMA, llama("meta", **extra), {"tp": world}),
                 mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    ids = llama_batch()
    out: dict[str, Any] = {}
    model(input_ids=ids, labels=ids).loss.backward()
    out["full_norm"] = float(inst.grad_norm())
    out["torch_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01,
                                    foreach=False if mode == "validate" else None)
    out["value_clipped"] = inst.full_grads()
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    out["returned"] = float(inst.clip_grad_norm_(0.5))
    out["norm_clipped"] = inst.full_grads()
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_torch_clipping_calls_on_shards_do_what_the_table_says(mode: str) -> None:
    ids = llama_batch()
    extra = {"attn_implementation": "eager"} if mode == "validate" else {}
    ref = llama(**extra)
    ref(input_ids=ids, labels=ids).loss.backward()
    full = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    saved = {n: p.grad.clone() for n, p in ref.named_parameters()}
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    by_value = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for n, p in ref.named_parameters():
        p.grad = saved[n].clone()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    by_norm = {n: p.grad for n, p in ref.named_parameters()}
    assert full > 2 * 0.5  # the norm clip scales

    results = run_ranks(_calls_worker, 2, mode, timeout_s=600)
    for res in results:
        assert res["full_norm"] == pytest.approx(full, rel=1e-5)
        assert res["returned"] == pytest.approx(full, rel=1e-5)
        for name in by_value:
            assert_close(res["value_clipped"][name], by_value[name], f"value-clipped {name}")
            assert_close(res["norm_clipped"][name], by_norm[name], f"norm-clipped {name}")
        # torch's call: the full norm, supplied by hyperrecipe (alone, torch returned each
        # rank's own shards' norm in production and refused the mixed list in validate mode)
        assert res["torch_norm"] == pytest.approx(full, rel=1e-5)


def _accelerate_worker(rank: int, world: int, mode: str) -> list[tuple[float, float]]:
    from accelerate import Accelerator

    from tests.runtime.grads.test_torch_clip_guard import MAX_NORM, _applied, _loop

    accelerator = Accelerator(cpu=True)
    model, _inst = _applied(world, mode)
    return _loop(model, lambda m: accelerator.clip_grad_norm_(m.parameters(), MAX_NORM))


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_accelerate_clip_grad_norm_on_the_applied_model_clips_like_one_process(
        mode: str) -> None:
    """accelerate 1.16 norms each mesh's gradients with ``torch.nn.utils.get_total_norm`` and
    scales with ``clip_grads_with_norm_`` (plain ones in one group): both reach the guard."""
    pytest.importorskip("accelerate", reason="pip install '.[trainers]'")
    from tests.runtime.grads.test_torch_clip_guard import _check_loop, _reference

    _check_loop(run_ranks(_accelerate_worker, 2, mode, timeout_s=600), _reference(mode))


_TRAINER_LIBRARIES = ("accelerate", "lightning", "pytorch_lightning", "trl")


def test_only_the_trainers_import_trainer_libraries() -> None:
    """The runtime proper names no trainer; ``hyperrecipe/__init__`` imports no integration
    module (they are imported by the user, and import their library themselves)."""
    for path in sorted((ROOT / "hyperrecipe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                top = name.split(".")[0]
                if top in _TRAINER_LIBRARIES or (name == "transformers" and isinstance(
                        node, ast.ImportFrom) and any(a.name == "Trainer" for a in node.names)):
                    assert rel.startswith("hyperrecipe/trainers/"), f"{rel} imports {name}"
                if name.startswith("hyperrecipe.trainers.") and name.split(".")[2] in (
                        "hf_trainer", "lightning"):
                    assert rel.startswith("hyperrecipe/trainers/"), f"{rel} imports {name}"


def _example(name: str) -> str:
    text = DOC.read_text()
    start = text.index(f"<!-- example: {name} -->")
    block = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    return block


@pytest.mark.slow  # starts fresh interpreters under torchrun (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("name", "library", "checkpoint"), [
    ("hf-trainer", "accelerate", "out-hf/checkpoint-8/hyperrecipe-dcp/.metadata"),
    ("accelerate", "accelerate", "out-accelerate/step-8/hyperrecipe-dcp/.metadata"),
    ("trl-sft", "trl", "out-sft/checkpoint-8/hyperrecipe-dcp/.metadata"),
    ("lightning", "lightning", "out-lightning/epoch=0-step=8.ckpt/.metadata")])
def test_the_documented_trainer_examples_run_under_torchrun(
        name: str, library: str, checkpoint: str, tmp_path: Path) -> None:
    pytest.importorskip(library, reason="pip install '.[trainers]'")
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    script = tmp_path / "train.py"
    script.write_text(_example(name))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / checkpoint).is_file()
    if name == "lightning":  # the export the example ends with loads, and is the trained model
        _assert_lightning_export_is_the_last_checkpoint(tmp_path)


def _assert_lightning_export_is_the_last_checkpoint(tmp_path: Path) -> None:
    """``out-lightning/final`` loads with ``from_pretrained`` and holds the weights of the
    step-8 checkpoint ``ModelCheckpoint`` wrote after the last step (Lightning's sharded DCP
    folder, read back whole with DCP's ``dcp_to_torch_save``): every tensor bit for bit, and
    moved from the initial weights (so the export is the trained model, not the seed's)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out-lightning/final")
    assert exported.config.vocab_size == 128
    whole = tmp_path / "step-8.pt"
    dcp_to_torch_save(tmp_path / "out-lightning/epoch=0-step=8.ckpt", whole)
    saved = torch.load(whole, weights_only=False)["state_dict"]  # written here, by this test
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the example's initial weights, built as it builds them
    initial = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).state_dict()
    for key, value in exported.state_dict().items():
        assert torch.equal(value, saved[f"model.{key}"]), key
    moved = [k for k, v in exported.state_dict().items() if not torch.equal(v, initial[k])]
    assert len(moved) == len(initial), "the export still holds initial weights"
