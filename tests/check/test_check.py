"""``hyperrecipe check``: recipes run on real gloo ranks against a single-process reference.

Tolerances are check's defaults for fp32 (atol 1e-5, rtol 1e-4). The shipped Llama recipes must
agree in both modes; each deliberately broken recipe in ``tests/recipes/broken-*.yaml`` must be
caught at the right boundary with exit 1 and the matching cause; a rank that raises outside the
step and a recipe that does not fit are errors (exit 2). The last tests feed the comparison and
the heuristics hand-made traces, to show that a suggestion needs its pattern.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.compare import compare_mode, diff_tensors
from hyperrecipe.check.diagnose import (
    BIAS_COUNTED_TP_TIMES,
    COLWISE_ROWWISE_SWAPPED,
    GRADIENT_REDUCTION_MISSING,
    GRADIENT_REDUCTION_WRONG,
    HEAD_COUNT_UNDIVIDED,
    PARAMS_UNUSED_ON_RANKS,
    PLAIN_TENSOR_MEETS_DTENSOR,
    DiagnosisContext,
    suggest,
)
from hyperrecipe.check.record import Event, Trace
from hyperrecipe.check.run import CheckOptions, CheckReport, ModeResult, run_check
from hyperrecipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes/models/tiny-llama.json")
ATTN_TOY = "tests.support.check_models:make_attn_toy"


def check(recipe: str, model: str = "hf:llama", **kw: Any) -> CheckReport:
    config = kw.pop("model_config", TINY if model.startswith("hf:") else None)
    return run_check(CheckOptions(recipe=str(ROOT / recipe), model=model, model_config=config,
                                  mesh={"tp": 2}, **kw))


def mode(report: CheckReport, name: str) -> ModeResult:
    return next(m for m in report.modes if m.mode == name)


# ------------------------------------------------------------------------- shipped recipes


@pytest.mark.parametrize(("recipe", "steps"), [("recipes/llama.yaml", 0),
                                               ("recipes/llama-sp.yaml", 2)])
def test_shipped_llama_recipe_agrees_with_one_process_in_both_modes(recipe: str,
                                                                    steps: int) -> None:
    report = check(recipe, steps=steps)
    assert report.exit_code == 0
    assert [m.mode for m in report.modes] == ["production", "validate"]
    for m in report.modes:
        c = m.comparison
        assert m.agree, f"{m.mode}: {c.first}"
        assert c.first is None and m.suggestion is None
        assert c.events_compared > 2 * 6, "every boundary output of both layers was compared"
        assert len(c.gradients) == 21 and not c.diverged_gradients
        assert c.output is not None and c.output.diff.max_abs is not None
        assert c.output.diff.max_abs < report.atol
        assert len(c.params_after) == (21 if steps else 0)


PHI3_GQA = {**json.loads((ROOT / "recipes/models/tiny-phi3.json").read_text()),
            "num_key_value_heads": 2}


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("recipe", "tp", "gradients"), [
    ("recipes/gpt2.yaml", 2, 29), ("recipes/gpt2.yaml", 4, 29), ("recipes/phi3.yaml", 2, 15),
    ("tests/recipes/phi3-gqa.yaml", 2, 15)])
def test_fused_projection_recipes_agree_with_one_process_in_both_modes(recipe: str, tp: int,
                                                                      gradients: int) -> None:
    """GPT-2's c_attn (``shard(1, chunks=3)``) and Phi-3's qkv_proj / gate_up_proj (``chunks=3``,
    ``chunks=2``) are chunked shards: validate mode holds them as ``_StridedShard`` and splits
    the fused output on its chunk boundaries; production computes on the local chunks. A GQA
    Phi-3's qkv_proj (``chunks=[64, 32, 32]``) runs part by part in validate mode."""
    family = recipe.rpartition("/")[2].split("-")[0].removesuffix(".yaml")
    config: Any = (PHI3_GQA if recipe.endswith("-gqa.yaml")
                   else str(ROOT / f"recipes/models/tiny-{family}.json"))
    report = run_check(CheckOptions(recipe=str(ROOT / recipe), model=f"hf:{family}",
                                    model_config=config, mesh={"tp": tp}))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    for m in report.modes:
        c = m.comparison
        assert m.error is None and m.agree, f"{m.mode}: {m.error or c.first}"
        assert len(c.gradients) == gradients and not c.diverged_gradients
    assert report.exit_code == 0


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_linear_of_unequal_parts_agrees_in_validate_mode_used_whole_and_with_its_bias() -> None:
    """The toy MLP's ``up`` in parts, its bias in parts (layer 0) or replicated (layer 1), its
    fused output used whole by ``down``: validate mode computes ``up`` part by part and hands
    ``down`` the gathered concatenation."""
    report = check("tests/recipes/toy-chunk-parts.yaml", "tests.support.toy_models:make_toy",
                   modes=("validate",))
    (m,) = report.modes
    assert m.error is None and m.agree, m.error or m.comparison.first
    assert len(m.comparison.gradients) == 14 and not m.comparison.diverged_gradients


MIXTRAL = str(ROOT / "recipes/models/tiny-mixtral.json")
BATCHED_NOTE = "experts_implementation=batched_mm for every run"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_tensor_parallel_experts_run_batched_in_validate_mode_and_agree() -> None:
    """grouped_mm cannot run on float32 DTensors on the CPU; check switches every run to
    batched_mm (and says so) rather than report a divergence the recipe did not cause."""
    report = check("recipes/mixtral.yaml", "hf:mixtral", model_config=MIXTRAL)
    assert any(n.startswith(BATCHED_NOTE) for n in report.notes), report.notes
    assert report.exit_code == 0
    assert [m.agree for m in report.modes] == [True, True]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_check_of_an_moe_model_returning_its_router_loss_compares_logits_and_that_loss(
        tmp_path: Path) -> None:
    """A config with ``output_router_logits`` makes the model return ``aux_loss`` before its
    logits: check compared that scalar alone. Its loss is now the logits' mean of squares plus
    the router loss, and both modes agree with one process on it (the router loss counted once
    in production)."""
    config = tmp_path / "tiny-mixtral-router-loss.json"
    config.write_text(json.dumps({**json.loads(Path(MIXTRAL).read_text()),
                                  "output_router_logits": True}))
    report = check("recipes/mixtral.yaml", "hf:mixtral", model_config=str(config))
    assert report.exit_code == 0, [(m.mode, m.agree) for m in report.modes]
    assert [m.agree for m in report.modes] == [True, True]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_experts_in_a_local_region_keep_transformers_default() -> None:
    report = run_check(CheckOptions(recipe=str(ROOT / "recipes/mixtral-ep.yaml"),
                                    model="hf:mixtral", model_config=MIXTRAL, mesh={"ep": 2},
                                    modes=("validate",)))
    assert not any(n.startswith(BATCHED_NOTE) for n in report.notes), report.notes
    assert report.exit_code == 0


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_cli_check_runs_as_a_subprocess_and_reports_json(in_root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(in_root)}
    proc = subprocess.run(
        [sys.executable, "-m", "hyperrecipe", "check", "recipes/llama.yaml", "--model",
         "hf:llama", "--model-config", "recipes/models/tiny-llama.json", "--mesh", "tp=2",
         "--format", "json"],
        cwd=in_root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["agree"] is True and data["world_size"] == 2 and data["backend"] == "gloo"
    assert set(data["modes"]) == {"production", "validate"}
    for result in data["modes"].values():
        assert result["agree"] is True and result["first_divergent"] is None
        assert result["worst_gradient"]["max_abs"] < 1e-5
        assert result["timings"]["launch_s"] > 0
    stamped = [re.fullmatch(r"hyperrecipe check \[ *(\d+\.\d) s\] (.*)", line)
               for line in proc.stderr.splitlines()]
    assert all(stamped), proc.stderr
    messages = [m.group(2) for m in stamped if m]
    # the first line comes before torch is imported, then one line per phase, in order
    assert messages[0] == "checking recipes/llama.yaml on tp=2: importing torch"
    phases = ["recipe 'llama' loaded (8 rules)",
              "building hf:llama on the CPU (seed 0; transformers is imported first)",
              "built hf:llama: 33 modules, 90,432 parameters",
              "plan compiled: 10 boundaries, 21 parameters, world size 2",
              "reference: 20 boundary values recorded", "mode production: launching 2 ranks (gloo)",
              "mode validate: running (all 2 ranks ready)",
              "mode validate: comparing with the reference", "mode validate: agree"]
    at = [next(i for i, m in enumerate(messages) if m.startswith(p)) for p in phases]
    assert at == sorted(at), messages
    stamps = [float(m.group(1)) for m in stamped if m]
    assert stamps == sorted(stamps), "times count from the start of the command"
    assert data["timings"]["total_s"] >= stamps[-1] - 0.05, "the total counts from the start"


# ------------------------------------------------------------------------- broken recipes


def test_swapped_colwise_rowwise_mlp_is_caught_in_the_mlp(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "tests/recipes/broken-swapped-mlp.yaml", "--model", "hf:llama",
               "--model-config", "recipes/models/tiny-llama.json", "--mesh", "tp=2", "-q"])
    out = capsys.readouterr().out
    assert rc == 1
    lines = out.splitlines()
    prod = next(i for i, line in enumerate(lines) if line.startswith("production"))
    assert lines[prod].startswith(
        "production  DIVERGED  first divergent boundary: model.layers.0.mlp (raised in forward")
    assert "it raised in model.layers.0.mlp.gate_proj" in lines[prod + 1]
    assert lines[prod + 2].strip() == f"likely cause: {COLWISE_ROWWISE_SWAPPED}"
    assert ("model.layers.0.mlp.gate_proj.weight is sharded on its input features "
            "({tp: shard(1)}, row-wise: local in_features 32) but model.layers.0.mlp.gate_proj "
            "received an input with all 64 features") in lines[prod + 3]
    val = next(line for line in lines if line.startswith("validate"))
    assert val.startswith(
        "validate    DIVERGED  first divergent boundary: model.layers.0.mlp.down_proj (raised in")
    assert out.count(f"likely cause: {COLWISE_ROWWISE_SWAPPED}") == 2
    assert lines[-1].startswith("diverged: production, validate")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_undeferred_bias_is_named_at_o_proj_as_a_bias_counted_tp_times(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "tests/recipes/broken-no-defer-bias.yaml",
               "--model", "tests.support.check_models:biased_llama",
               "--model-config", "recipes/models/tiny-llama.json",
               "--inputs", "tests.support.check_models:llama_inputs", "--mesh", "tp=2",
               "--mode", "both", "--format", "json", "-q"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["agree"] is False
    prod = data["modes"]["production"]
    first = prod["first_divergent"]
    assert (first["fqn"], first["what"], first["rank"]) == (
        "model.layers.0.self_attn.o_proj", "output", 0)
    assert first["max_abs"] > 1e-2 and first["max_rel"] > 1.0
    assert prod["suggestion"]["cause"] == BIAS_COUNTED_TP_TIMES
    assert ("is the same at every position and equals 1.000 x "
            "model.layers.0.self_attn.o_proj.bias: the bias is added 2 times (tp has size 2); "
            "the plan does not defer model.layers.0.self_attn.o_proj.bias"
            ) in prod["suggestion"]["evidence"]
    assert prod["worst_gradient"]["max_abs"] > 1e-4
    assert "model.layers.0.self_attn.o_proj.bias" in prod["gradients"]["diverged"]
    # DTensor adds a replicated bias to a partial output correctly: validate mode agrees
    assert data["modes"]["validate"]["agree"] is True
    assert set(prod["timings"]) >= {"launch_s", "rank0_forward_s", "rank0_apply_s"}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_undivided_head_count_is_named_at_the_attention_in_production_only() -> None:
    report = check("tests/recipes/broken-head-count.yaml", ATTN_TOY)
    assert report.exit_code == 1
    prod = mode(report, "production")
    first = prod.comparison.first
    assert first is not None and (first.fqn, first.what) == ("layers.0.attn", "output")
    assert "the input it passed to layers.0.attn.o differs" in first.detail
    assert prod.suggestion is not None and prod.suggestion.cause == HEAD_COUNT_UNDIVIDED
    assert prod.suggestion.evidence == (
        "layers.0.attn.num_heads = 4 is an integer attribute named like a head count and the "
        "plan does not divide it (HeadAttention.forward uses self.num_heads), while "
        "layers.0.attn.q.weight is sharded {tp: shard(0)}: each rank holds 1/2 of what it "
        "counts; add head_counts: {num_heads: tp} to the rule for layers.0.attn")
    assert mode(report, "validate").agree, "validate computes with global head counts"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_an_undivided_head_count_in_a_local_region_is_named_in_validate_mode_too(
        tmp_path: Path) -> None:
    """A local region's code runs on this rank's shards in validate mode as well, so a head
    count the plan leaves global there is wrong in both modes, and check names it in both."""
    recipe = tmp_path / "broken-head-count-region.yaml"
    recipe.write_text(
        "recipe: broken-head-count-region\nversion: 1\nmesh: [tp]\n"
        f"extends: {ROOT / 'tests/recipes/broken-head-count.yaml'}\n"
        "rules:\n  - match: layers.*.attn\n    local_region: true\n", encoding="utf-8")
    report = check(str(recipe), ATTN_TOY)
    assert report.exit_code == 1
    for m in report.modes:
        assert not m.agree and m.suggestion is not None, m.mode
        assert m.suggestion.cause == HEAD_COUNT_UNDIVIDED, (m.mode, m.suggestion)
        assert m.suggestion.evidence.startswith(
            "layers.0.attn.num_heads = 4 is an integer attribute named like a head count and "
            "the plan does not divide it"), m.suggestion.evidence


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.skipif(not (ROOT / "recipes/gpt2.yaml").exists(),
                    reason="the GPT-2 recipe (and the runtime's Conv1D support) is not here")
def test_undivided_gpt2_split_size_is_named_where_the_attention_fails() -> None:
    report = check("tests/recipes/broken-gpt2-split-size.yaml", "hf:gpt2",
                   model_config=str(ROOT / "recipes/models/tiny-gpt2.json"),
                   modes=("production",))
    prod = mode(report, "production")
    first = prod.comparison.first
    assert report.exit_code == 1
    assert first is not None and (first.fqn, first.what) == ("transformer.h.0.attn",
                                                             "raised in forward")
    assert first.detail == "ValueError: not enough values to unpack (expected 3, got 2)"
    assert prod.suggestion is not None and prod.suggestion.cause == HEAD_COUNT_UNDIVIDED
    assert prod.suggestion.evidence.startswith(
        "transformer.h.0.attn.split_size = 64 is an integer attribute named like a head count "
        "and the plan does not divide it (GPT2Attention.forward uses self.split_size)")
    assert "num_heads" not in prod.suggestion.evidence, "GPT-2 reshapes with -1: not num_heads"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_sequence_sharded_value_the_model_reshapes_is_named_with_where_to_gather() -> None:
    """GPT2Model views ln_f's output with the whole sequence's shape: a stream still sharded
    there is refolded silently (same elements, another shape) in both modes."""
    report = check("tests/recipes/broken-gpt2-sp-gather-at-head.yaml", "hf:gpt2",
                   model_config=str(ROOT / "recipes/models/tiny-gpt2.json"),
                   modes=("production",))
    first = mode(report, "production").comparison.first
    assert report.exit_code == 1
    assert first is not None and (first.fqn, first.what) == ("lm_head", "input")
    assert ("shape [1, 16, 64], reference [2, 8, 64]); model code outside any boundary computed "
            "it, after transformer.ln_f returned; the same number of elements in another shape: "
            "the model's code reshaped a value that was still sharded with the whole tensor's "
            "shape; gather it before that code (`out_dst: {0: replicate}` on transformer.ln_f)"
            ) in first.detail


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_validate_mode_refuses_a_sequence_shard_the_model_refolds_naming_where_to_gather(
        ) -> None:
    """The same recipe in validate mode: the value lm_head takes as sequence-sharded is a view
    of the shard transformer.ln_f handed back, refolded by GPT2Model's ``view``; validate mode
    used to compute the same wrong rows as production without an error. It now refuses it."""
    report = check("tests/recipes/broken-gpt2-sp-gather-at-head.yaml", "hf:gpt2",
                   model_config=str(ROOT / "recipes/models/tiny-gpt2.json"),
                   modes=("validate",))
    failure = mode(report, "validate").comparison.failure
    assert report.exit_code == 1 and failure is not None and failure.phase == "forward"
    assert failure.error.startswith(
        "PlanMismatchError: lm_head: input 'input' (declared {tp: shard(1)}) arrived with local "
        "shape [1, 8, 64], a view of the local shard that transformer.ln_f handed back as "
        "output 0 (shape [2, 4, 64], dim 1 sharded over tp)"), failure.error
    assert failure.error.endswith(
        "Gather it before that code: `out_dst: {0: replicate}` on transformer.ln_f, and take it "
        "replicated at lm_head"), failure.error


QWEN3_OVER_LLAMA_SP = (
    "recipe: qwen3-over-llama-sp\nversion: 1\nmesh: [tp]\nextends: llama-sp\nrules: []\n")
"""Qwen3 over Llama's sequence-parallel recipe alone: qwen3.yaml's q_norm/k_norm rule
(``reduce_grads: {weight: tp}``) is gone (docs/recipes.md, "Sequence and context parallel for
another family")."""


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_validate_mode_names_a_per_head_norm_whose_gradient_production_leaves_partial(
        tmp_path: Path) -> None:
    """Production's q_norm/k_norm gradients stay partial (4 of 25 differ, the forward agrees);
    DTensor reduced them and validate mode agreed. It now refuses the partial gradient of a
    replicated parameter the plan does not reduce, naming the parameter and the field."""
    recipe = tmp_path / "qwen3-over-llama-sp.yaml"
    recipe.write_text(QWEN3_OVER_LLAMA_SP, encoding="utf-8")
    report = check(str(recipe), "hf:qwen3",
                   model_config=str(ROOT / "recipes/models/tiny-qwen3.json"))
    prod, validate = mode(report, "production"), mode(report, "validate")
    assert report.exit_code == 1 and not prod.agree and not validate.agree
    assert prod.comparison.forward_agrees
    assert {g.name.rpartition(".")[0].rpartition(".")[2]
            for g in prod.comparison.diverged_gradients} == {"q_norm", "k_norm"}
    failure = validate.comparison.failure
    assert failure is not None and failure.phase == "backward"
    assert re.match(
        r"PlanMismatchError: model\.layers\.[01]\.self_attn\.[qk]_norm\.weight: its gradient "
        r"comes back partial over tp .*, but the plan reduces no gradient of this replicated "
        r"parameter there: production mode would leave each rank's partial gradient unreduced "
        r"\(no rule claims it: the recipe's `unclaimed: replicate` places it, ", failure.error
    ), failure.error
    assert failure.error.endswith(
        "Declare the reduction: `reduce_grads: {weight: tp}` on "
        f"{failure.error.split(': ')[1].removesuffix('.weight')}'s rule (or `style: "
        "sequence_parallel` for a norm on the sequence-sharded stream)"), failure.error


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_the_qwen3_sp_recipe_that_declares_the_reduction_agrees_in_validate_mode() -> None:
    report = check("tests/recipes/qwen3-sp.yaml", "hf:qwen3",
                   model_config=str(ROOT / "recipes/models/tiny-qwen3.json"),
                   modes=("validate",))
    validate = mode(report, "validate")
    assert report.exit_code == 0 and validate.agree, validate.comparison.first
    assert len(validate.comparison.gradients) == 25


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_missing_gradient_reduction_is_reported_with_a_right_forward() -> None:
    report = check("tests/recipes/broken-no-reduce-grads.yaml", ATTN_TOY,
                   model_config={"qk_norm": True}, modes=("production",))
    prod = mode(report, "production")
    c = prod.comparison
    assert report.exit_code == 1 and c.first is None and c.forward_agrees
    bad = {g.name for g in c.diverged_gradients}
    assert {"layers.0.attn.q_norm.weight", "layers.1.attn.q_norm.weight"} <= bad
    assert all(".q_norm." in n or ".k_norm." in n for n in bad)
    assert prod.suggestion is not None and prod.suggestion.cause == GRADIENT_REDUCTION_MISSING
    assert "the ranks' gradients of layers.0.attn.q_norm.weight (over tp)" in prod.suggestion.evidence


# ------------------------------------------------------------------------- errors and imports


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_correct_plain_torch_recipe_agrees_without_importing_transformers(in_root: Path) -> None:
    code = ("import sys\nfrom hyperrecipe.cli import main\n"
            "rc = main(['check', 'tests/recipes/toy-attn.yaml', '--model', "
            "'tests.support.check_models:make_attn_toy', '--mesh', 'tp=2', '-q'])\n"
            "print('transformers imported:', 'transformers' in sys.modules)\n"
            "raise SystemExit(rc)\n")
    env = {**os.environ, "PYTHONPATH": str(in_root)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=in_root, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all modes agree with the single-process reference" in proc.stdout
    assert "likely cause" not in proc.stdout
    assert proc.stdout.splitlines()[-1] == "transformers imported: False"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_rank_that_raises_is_reported_with_its_error_and_exit_2(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    rc = main(["check", "tests/recipes/toy-attn.yaml", "--model",
               "tests.support.check_models:raising_in_rank_1", "--mesh", "tp=2", "--mode", "production"])
    err = capsys.readouterr().err
    assert rc == 2
    assert ("hyperrecipe: error: mode production: rank 1 of 2 failed: "
            "hyperrecipe.errors.ModelSpecError: building 'tests.support.check_models:raising_in_rank_1' "
            "failed: RuntimeError: injected failure while building the model in rank 1") in err
    assert "--- traceback of rank 1 ---" in err
    assert multiprocessing.active_children() == [], "no rank is left running"
    assert time.monotonic() - t0 < 60


def test_recipe_that_does_not_fit_exits_2_before_any_rank_starts(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "tests/recipes/toy-attn.yaml", "--model", ATTN_TOY, "--mesh", "tp=3"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.splitlines()[-1] == (
        "hyperrecipe: error: tests/recipes/toy-attn.yaml:8:12: parameter 'embed.weight': dim 0 "
        "(size 32) is not divisible by mesh dim tp=3 (shard(0)) @ $.rules[0].params.weight; "
        "shape [32, 16]; each rank must hold an equal slice")
    assert "Traceback" not in captured.err and "launching" not in captured.err
    rc = main(["check", "tests/recipes/toy-attn.yaml", "--model", ATTN_TOY, "--mesh", "tp=3",
               "--format", "json", "-q"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 2 and data["agree"] is False
    assert data["error"].startswith("tests/recipes/toy-attn.yaml:8:12: parameter 'embed.weight'")


def test_timeout_stops_a_model_factory_or_forward_that_hangs_in_the_parent(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "tests/recipes/toy-attn.yaml", "--model",
               "tests.support.check_models:hanging_in_the_parent", "--mesh", "tp=2", "--timeout", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.splitlines()[-1] == (
        "hyperrecipe: error: building tests.support.check_models:hanging_in_the_parent in this process "
        "did not finish within 1 s (--timeout); the model factory hangs or is too slow for this "
        "check")
    assert "launching" not in err and multiprocessing.active_children() == []
    rc = main(["check", "tests/recipes/toy-attn.yaml", "--model",
               "tests.support.check_models:forward_hanging_in_the_parent", "--mesh", "tp=2",
               "--timeout", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.splitlines()[-1] == (
        "hyperrecipe: error: the reference step in this process did not finish within 1 s "
        "(--timeout); the model's forward or backward hangs or is too slow for this check")


def test_hf_model_without_a_config_is_refused_with_its_size_and_the_opt_in(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "recipes/llama.yaml", "--model", "hf:llama", "--mesh", "tp=2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.splitlines()[-1] == (
        "hyperrecipe: error: --model hf:llama without --model-config: transformers' default "
        "LlamaConfig (32 layers, hidden size 4096, vocab 32000; 6.74 B parameters, 25.1 GiB in "
        "float32); pass --model-config FILE or inline JSON for another size, e.g. --model-config "
        "recipes/models/tiny-llama.json. check builds that model for real, in this process and on "
        "each of the 2 ranks; to check the default config on purpose, pass --model-config '{}'")
    assert "building hf:llama on the CPU" not in err


def test_bad_flag_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", "r.yaml", "--model", ATTN_TOY, "--mesh", "tp=2", "--batch", "0"])
    assert exc.value.code == 2
    assert "hyperrecipe: error: argument --batch: 0 is less than 1" in capsys.readouterr().err


# ------------------------------------------------------------------------- heuristics, by hand


@pytest.fixture(scope="module")
def toy_plan() -> Any:
    from hyperrecipe import compile_recipe
    from hyperrecipe.model_tree import build_model, snapshot

    tree = snapshot(build_model(ATTN_TOY))
    return compile_recipe(str(ROOT / "tests/recipes/toy-attn.yaml"), tree, {"tp": 2}), tree


def _trace(*events: tuple[str, str, str | None, torch.Tensor],
           grads: dict[str, torch.Tensor] | None = None) -> Trace:
    return Trace(events=tuple(Event(fqn=f, call=0, kind=k, name="0", enclosing=enc, value=v)  # type: ignore[arg-type]
                              for f, k, enc, v in events),
                 output=torch.zeros(2), loss=0.0, grads=grads or {}, params_after=None)


def _diagnose(toy_plan: Any, reference: Trace, ranks: list[Trace]) -> Any:
    plan, tree = toy_plan
    cmp = compare_mode("production", reference, ranks, atol=1e-5, rtol=1e-4)
    ctx = DiagnosisContext(plan=plan, tree=tree, reference_params={}, mode="production",
                           rank_ids=tuple(range(len(ranks))))
    return cmp, suggest(cmp, reference, ranks, ctx, atol=1e-5, rtol=1e-4)


def test_output_exactly_tp_times_the_reference_suggests_a_value_counted_tp_times(
        toy_plan: Any) -> None:
    b = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    ref = _trace(("embed", "output", None, b))
    cmp, found = _diagnose(toy_plan, ref, [_trace(("embed", "output", None, 2 * b))] * 2)
    assert cmp.first is not None and cmp.first.fqn == "embed"
    assert found is not None and found.cause == BIAS_COUNTED_TP_TIMES
    assert "embed's value is 2.0000 x the reference and tp has size 2" in found.evidence


def test_ranks_partial_values_that_sum_to_the_reference_suggest_swapped_layers(
        toy_plan: Any) -> None:
    g = torch.Generator().manual_seed(1)
    part = torch.randn(2, 8, 16, generator=g)
    rest = torch.randn(2, 8, 16, generator=g)
    ref = _trace(("embed", "output", None, part + rest))
    ranks = [_trace(("embed", "output", None, part)), _trace(("embed", "output", None, rest))]
    _, found = _diagnose(toy_plan, ref, ranks)
    assert found is not None and found.cause == COLWISE_ROWWISE_SWAPPED
    assert found.evidence.startswith("summing the ranks' values of embed over tp reproduces")


def test_unstructured_error_gets_no_suggestion(toy_plan: Any) -> None:
    g = torch.Generator().manual_seed(2)
    b = torch.randn(2, 8, 16, generator=g)
    noisy = 2 * b + 0.1 * torch.randn(2, 8, 16, generator=g)
    cmp, found = _diagnose(toy_plan, _trace(("embed", "output", None, b)),
                           [_trace(("embed", "output", None, noisy))] * 2)
    assert not cmp.agree and cmp.first is not None and cmp.first.fqn == "embed"
    assert found is None, "an error that is almost 2x is no evidence of anything"


def test_input_already_wrong_inside_a_boundary_blames_the_enclosing_boundary(
        toy_plan: Any) -> None:
    x = torch.ones(2, 8, 16)
    ref = _trace(("layers.0.attn", "input", None, x), ("layers.0.attn.o", "input",
                 "layers.0.attn#0", x), ("layers.0.attn.o", "output", "layers.0.attn#0", x),
                 ("layers.0.attn", "output", None, x))
    rank = _trace(("layers.0.attn", "input", None, x), ("layers.0.attn.o", "input",
                  "layers.0.attn#0", 3 * x), ("layers.0.attn.o", "output", "layers.0.attn#0",
                  3 * x), ("layers.0.attn", "output", None, 3 * x))
    cmp = compare_mode("production", ref, [rank], atol=1e-5, rtol=1e-4)
    assert cmp.first is not None
    assert (cmp.first.fqn, cmp.first.what, cmp.first.max_abs) == ("layers.0.attn", "output", 2.0)


def test_wrong_gradient_with_a_right_forward_suggests_a_missing_reduction(
        toy_plan: Any) -> None:
    x = torch.ones(4)
    g = torch.tensor([1.0, 2.0, 3.0])
    ref = _trace(("embed", "output", None, x), grads={"layers.0.norm.weight": g})
    ranks = [_trace(("embed", "output", None, x), grads={"layers.0.norm.weight": g * 0.25}),
             _trace(("embed", "output", None, x), grads={"layers.0.norm.weight": g * 0.75})]
    cmp, found = _diagnose(toy_plan, ref, ranks)
    assert cmp.first is None and not cmp.agree
    assert found is not None and found.cause == GRADIENT_REDUCTION_MISSING
    assert "the ranks' gradients of layers.0.norm.weight (over tp) sum to the reference" \
        in found.evidence


def test_wrong_gradients_that_no_sum_explains_do_not_claim_a_missing_reduction(
        toy_plan: Any) -> None:
    """Every rank's gradient off by a factor no mesh dim explains (a declared residual's doubled
    gradient mixed into others): no sum of the ranks' gradients gives the reference, so the cause
    names both directions and points at validate mode, which names the input."""
    x = torch.ones(4)
    g = torch.tensor([1.0, 2.0, 3.0])
    ref = _trace(("embed", "output", None, x), grads={"layers.0.norm.weight": g})
    ranks = [_trace(("embed", "output", None, x), grads={"layers.0.norm.weight": 3 * g})] * 2
    _, found = _diagnose(toy_plan, ref, ranks)
    assert found is not None and found.cause == GRADIENT_REDUCTION_WRONG
    assert found.evidence.endswith("no rank's gradients sum to the reference. Validate mode "
                                   "checks each declared replicated input's gradient against "
                                   "the reduction production gives it, and names an input whose "
                                   "gradient is already whole, or an input or output whose "
                                   "gradient arrives partial where the plan takes it whole "
                                   "(declare it with in_grad / out_grad: a Mamba mixer's x_proj)")


def test_parameters_without_a_gradient_on_a_rank_are_named_as_unused(toy_plan: Any) -> None:
    """StableLM's per-head q_layernorm.norms under head-sharded attention: rank 1 normalizes its
    heads with norms 0 and 1, so norms 2 and 3 get no gradient on any rank."""
    x = torch.ones(4)
    g = torch.tensor([1.0, 2.0, 3.0])
    ref = _trace(("embed", "output", None, x),
                 grads={"layers.0.norm.weight": g, "layers.1.norm.weight": g})
    ranks = [_trace(("embed", "output", None, x), grads={"layers.0.norm.weight": g})] * 2
    _, found = _diagnose(toy_plan, ref, ranks)
    assert found is not None and found.cause == PARAMS_UNUSED_ON_RANKS
    assert found.evidence.endswith(
        "layers.1.norm.weight got no gradient on rank 0 (in the reference it does): the sharded "
        "forward never used it, and computed what it should have with other parameters "
        "(another head's)")


def test_gradients_tp_times_the_reference_are_named_as_reduced_once_too_often(
        toy_plan: Any) -> None:
    """A reduce_grads on a norm whose gradient is already whole: every rank holds 2 x the
    reference at tp=2."""
    x = torch.ones(4)
    g = torch.tensor([1.0, 2.0, 3.0])
    ref = _trace(("embed", "output", None, x), grads={"layers.0.norm.weight": g})
    ranks = [_trace(("embed", "output", None, x), grads={"layers.0.norm.weight": 2 * g})] * 2
    _, found = _diagnose(toy_plan, ref, ranks)
    assert found is not None and found.cause == GRADIENT_REDUCTION_WRONG
    assert "every rank's gradient of layers.0.norm.weight (2 x, tp) is the reference times the " \
        "mesh dim's size: a whole gradient reduced once too often" in found.evidence


def test_a_tensor_below_atol_is_still_compared_against_its_own_size() -> None:
    """A tiny model's norm gradients (~2e-6, Cohere's logit scale) reduced twice differ by less
    than atol everywhere; they must not agree. A reference of exact zeros still agrees with
    rounding noise."""
    g = torch.full((64,), 2e-6)
    assert not diff_tensors(2 * g, g, atol=1e-5, rtol=1e-4).ok
    assert diff_tensors(g * (1 + 1e-6), g, atol=1e-5, rtol=1e-4).ok
    assert diff_tensors(torch.full((4,), 1e-12), torch.zeros(4), atol=1e-5, rtol=1e-4).ok


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_zero_initialised_bias_counted_tp_times_is_caught(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers zeroes a Llama's biases; the check draws them, so a row-wise bias that every
    rank adds to its partial output diverges instead of agreeing by accident."""
    rc = main(["check", "tests/recipes/broken-no-defer-bias.yaml", "--model", "hf:llama",
               "--model-config",
               json.dumps({**json.loads((in_root / "recipes/models/tiny-llama.json").read_text()),
                           "attention_bias": True, "mlp_bias": True}),
               "--mesh", "tp=2", "--mode", "production", "--format", "json", "-q"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["agree"] is False
    first = data["modes"]["production"]["first_divergent"]
    assert first["fqn"] == "model.layers.0.self_attn.o_proj" and first["max_abs"] > 1e-2
    drawn = next(n for n in data["notes"] if "initialised to zero" in n)
    assert drawn.startswith("14 parameters initialised to zero drawn from N(0, 0.1^2)")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_router_buffer_beside_replicated_dtensor_scores_runs_in_validate_mode(
        in_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3's router adds its plain buffer ``e_score_correction_bias`` ([experts]) to
    replicated DTensor scores: validate mode used to refuse the mix (the recipe's router had to
    be a local region); the buffer broadcasts over every sharded dim (there is none), so it is
    taken as replicated and both modes agree with one process."""
    rc = main(["check", "tests/recipes/deepseek-v3-plain-router.yaml",
               "--model", "hf:deepseek_v3",
               "--model-config", "tests/recipes/models/tiny-deepseek_v3.json",
               "--mesh", "tp=2", "--format", "json", "-q"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["agree"] is True, data["modes"]
    assert set(data["modes"]) == {"production", "validate"}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_plain_tensor_that_could_be_a_ranks_piece_names_local_region(
        in_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tests/recipes/cookbook/t5-heads.yaml without its local regions: the first block's
    attention looks its bucket ids (a plain [q, k] tensor the model makes) up in the
    head-sharded ``relative_attention_bias``; validate mode does not take them as replicated
    (they do not broadcast over the sharded dim), and check names the cause and the fix."""
    text = (in_root / "tests/recipes/cookbook/t5-heads.yaml").read_text(encoding="utf-8")
    start = text.index('  - match: "{encoder.block.0.layer.0.SelfAttention,decoder')
    end = text.index("local_region: true\n", start) + len("local_region: true\n")
    recipe = tmp_path / "t5-heads-no-regions.yaml"
    recipe.write_text(text[:start] + text[end:], encoding="utf-8")
    rc = main(["check", str(recipe), "--model", "hf:t5/seq2seq-lm", "--model-config",
               "tests/recipes/cookbook/models/tiny-t5.json", "--mesh", "tp=2", "--mode",
               "validate", "--format", "json", "-q"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["agree"] is False
    val = data["modes"]["validate"]
    assert val["first_divergent"]["fqn"] == "encoder.block.0.layer.0.SelfAttention"
    assert val["suggestion"]["cause"] == PLAIN_TENSOR_MEETS_DTENSOR
    assert val["suggestion"]["evidence"].startswith(
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias raised in forward")
