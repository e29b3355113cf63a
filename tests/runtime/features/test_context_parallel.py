"""Context-parallel attention: the offset causal mask per rank, and the shipped CP recipes through
``hyperrecipe check`` (both modes, against one process), plus the fallback chain's bookkeeping."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from hyperrecipe.refs import TRUST_ENV
from hyperrecipe.runtime.features.context_parallel import causal_mask_for_rank

CHECK = ["--model", "hf:llama", "--model-config", "recipes/models/tiny-llama.json", "-q"]


@pytest.fixture(autouse=True)
def _trust_test_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy wrappers live in ``tests``: these tests opt in to them as a user would
    (docs/security.md); tests/test_trust.py covers the refusal."""
    monkeypatch.setenv(TRUST_ENV, "tests")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_offset_causal_mask_is_the_ranks_rows_of_the_full_mask(cp: int, window: int | None) -> None:
    seq = 8
    full = causal_mask_for_rank(seq, seq, 0, sliding_window=window)
    reference = torch.ones(seq, seq).tril().bool()
    if window is not None:
        reference &= torch.ones(seq, seq).triu(-(window - 1)).bool()
    assert torch.equal(full, reference)
    rows = seq // cp
    for rank in range(cp):
        mine = causal_mask_for_rank(rows, seq, rank * rows, sliding_window=window)
        assert torch.equal(mine, reference[rank * rows:(rank + 1) * rows])


def test_is_causal_top_left_alignment_would_be_wrong_off_rank_zero() -> None:
    # what SDPA's is_causal builds for q_len != kv_len: query i sees keys 0..i
    top_left = torch.ones(4, 8).tril().bool()
    assert torch.equal(causal_mask_for_rank(4, 8, 0), top_left)
    assert not torch.equal(causal_mask_for_rank(4, 8, 4), top_left)


@pytest.mark.parametrize(("recipe", "mesh"), [
    ("recipes/llama-cp.yaml", "cp=2"),
    pytest.param("recipes/llama-tp-cp.yaml", "tp=2,cp=2", marks=pytest.mark.slow),  # four ranks
])
def test_cp_recipes_agree_with_one_process_in_both_modes(recipe: str, mesh: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from hyperrecipe.cli import main

    code = main(["check", recipe, "--mesh", mesh, *CHECK])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "production  agree" in out and "validate    agree" in out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_without_the_wrapper_cp_attention_diverges(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    text = open("recipes/llama-cp.yaml").read()
    text = "\n".join(line for line in text.splitlines()
                     if "inner_wrapper:" not in line and "inner_out_src:" not in line)
    path = tmp_path / "nowrap.yaml"
    path.write_text(text)
    from hyperrecipe.cli import main

    code = main(["check", str(path), "--mesh", "cp=2", "--mode", "production", *CHECK])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "first divergent boundary: model.layers.0.self_attn" in out


def _chain_worker(rank: int, world: int, recipe: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply, compile_recipe
    from tests.support.runtime_harness import llama, llama_batch, llama_step

    model = llama()
    scaling = model.model.layers[0].self_attn.scaling
    plan = compile_recipe(recipe, llama("meta"), {"cp": world})
    inst = apply(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    llama_step(model, llama_batch())
    rows = [(r.fqn, r.what, r.state, r.error) for r in inst.state.status()
            if r.what.startswith("inner wrapper")]
    return {"rows": rows, "scaling_kept": model.model.layers[0].self_attn.scaling == scaling}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_fallback_chain_skips_the_ineligible_and_rolls_back_the_failed(tmp_path: Any) -> None:
    from hyperrecipe.check.launcher import run_ranks

    text = open("recipes/llama-cp.yaml").read().replace(
        "inner_wrapper: cp_allgather_kv",
        "inner_wrapper: [tests.support.cp_chain:needs_nccl, tests.support.cp_chain:fails_midway, cp_allgather_kv]")
    path = tmp_path / "chain.yaml"
    path.write_text(text)
    results = run_ranks(_chain_worker, 2, str(path))
    for r in results:
        assert r["scaling_kept"]
        layer0 = [row for row in r["rows"] if row[0] == "model.layers.0.self_attn"]
        assert [(w, s) for _, w, s, _ in layer0] == [
            ("inner wrapper tests.support.cp_chain:needs_nccl", "ineligible"),
            ("inner wrapper tests.support.cp_chain:fails_midway", "failed"),
            ("inner wrapper cp_allgather_kv", "installed")]
        assert "requires backend nccl: backend is gloo" in layer0[0][3]
        assert "RuntimeError: kernel not available" in layer0[1][3]


def _cp_variant(tmp_path: Any, wrapper: str) -> str:
    text = open("recipes/llama-cp.yaml").read().replace(
        "inner_wrapper: cp_allgather_kv", f"inner_wrapper: {wrapper}")
    path = tmp_path / "variant.yaml"
    path.write_text(text)
    return str(path)


def _check_json(recipe: str, mesh: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    import json

    from hyperrecipe.cli import main

    code = main(["check", recipe, "--mesh", mesh, "--format", "json", *CHECK])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_ulysses_agrees_with_one_process_in_both_modes(tmp_path: Any,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # tiny-llama: 4 query heads, 2 key/value heads, so cp=2 leaves whole heads on each rank
    code, report = _check_json(_cp_variant(tmp_path, "ulysses"), "cp=2", capsys)
    assert code == 0, report
    for mode in ("production", "validate"):
        m = report["modes"][mode]
        assert m["agree"] and m["output"]["max_abs"] <= 1e-5
        chosen = {(w["wrapper"], w["state"]) for w in m["inner_wrappers"]}
        assert chosen == {("ulysses", "installed")}
        assert len(m["inner_wrappers"]) == 2  # one per decoder layer of tiny-llama


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_chain_falls_back_from_ulysses_when_heads_do_not_divide(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _cp_variant(tmp_path, "[ulysses, cp_allgather_kv]")
    code, report = _check_json(recipe, "cp=4", capsys)
    assert code == 0, report
    for mode in ("production", "validate"):
        rows = report["modes"][mode]["inner_wrappers"]
        layer0 = [(w["wrapper"], w["state"]) for w in rows
                  if w["fqn"] == "model.layers.0.self_attn"]
        assert layer0 == [("ulysses", "ineligible"), ("cp_allgather_kv", "installed")]
        reason = next(w["reason"] for w in rows if w["state"] == "ineligible")
        assert "not divisible by cp=4" in reason
    from hyperrecipe.cli import main

    assert main(["check", recipe, "--mesh", "cp=4", "--mode", "production", *CHECK]) == 0
    text = capsys.readouterr().out
    assert "inner wrappers: ulysses ineligible on 2 modules (" in text
    assert "cp_allgather_kv installed on 2 modules" in text


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_ulysses_alone_fails_naming_the_boundary_when_heads_do_not_divide(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # apply refuses before any step runs, so the run ends with an error, not a divergence
    code, report = _check_json(_cp_variant(tmp_path, "ulysses"), "cp=4", capsys)
    assert code == 2 and report["agree"] is False
    error = report["error"]
    assert "model.layers.0.self_attn: no inner wrapper of the chain could be installed" in error
    assert "k_proj: 2 local heads; not divisible by cp=4" in error
    assert "traceback" not in error  # our own errors are complete without our internals


def test_compile_summary_names_communication_the_manifest_cannot_list() -> None:
    from hyperrecipe import compile_recipe
    from hyperrecipe.plan_report import summary
    from tests.support.runtime_harness import llama

    plan = compile_recipe("recipes/llama-cp.yaml", llama("meta"), {"cp": 2})
    text = summary(plan)
    assert ("not counted (issued by the wrapped code itself, not by layouts): inner wrapper "
            "cp_allgather_kv on 2 modules") in text
    # cos/sin and the mask are declared no_grad: slicing them plans no backward gather
    attn = [e for e in plan.manifest
            if e.boundary == "model.layers.0.self_attn" and e.stage == "input"]
    assert attn == []
    # layer 0's input gather and the 20 replicated weights' gradients, reduced in one bucket
    assert "gradient buckets: 1 (20 parameters, 321.2 KiB per rank)" in text
    assert "collectives per step: 1 forward, 2 backward" in text


def _toy_wrapper_error(tmp_path: Any, wrapper: str) -> str:
    """The error compiling one toy rule naming ``wrapper``; it must point at that rule's line."""
    from hyperrecipe import compile_recipe
    from hyperrecipe.errors import RecipeError
    from tests.support.toy_models import Toy

    path = tmp_path / "w.yaml"
    path.write_text("recipe: w\nversion: 1\nmesh: [cp]\nrules:\n"
                    f"  - {{match: layers.*.mlp, boundary: true, inner_wrapper: {wrapper}}}\n")
    with torch.device("meta"):
        model = Toy()
    with pytest.raises(RecipeError) as err:
        compile_recipe(str(path), model, {"cp": 2})
    text = str(err.value)
    assert text.startswith(f"{path}:5:"), text
    return text


@pytest.mark.parametrize(("ref", "message"), [
    ("no_such_pkg.attn:ring", "inner wrapper 'no_such_pkg.attn:ring' names module "
                              "'no_such_pkg.attn', which is not trusted; "),
    ("tests.support.cp_chain:nope", "'tests.support.cp_chain' has no attribute 'nope' (inner wrapper "
                            "'tests.support.cp_chain:nope')"),
    ("tests.support.toy_models:make_toy", "inner wrapper 'tests.support.toy_models:make_toy' is not declared with "
                                  "@hyperrecipe.wrappers.inner_wrapper"),
])
def test_a_wrapper_reference_that_does_not_load_is_refused_at_compile_time(
        tmp_path: Any, ref: str, message: str) -> None:
    text = _toy_wrapper_error(tmp_path, f"'{ref}'")
    assert message in text, text


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_the_documented_custom_wrapper_agrees_with_one_process(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/context-parallel.md's example wrapper, as written there, through ``check``."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs/context-parallel.md").read_text()
    found = re.search(r"```python\n# file: user_cp\.py\n(.*?)```", doc, re.S)
    assert found, "docs/context-parallel.md shows user_cp.py"
    (tmp_path / "user_cp.py").write_text(found.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(TRUST_ENV, "user_cp")  # as the doc says: the user opts in to their module
    code, report = _check_json(_cp_variant(tmp_path, "user_cp:gather_kv"), "cp=2", capsys)
    assert code == 0, report
    for mode in ("production", "validate"):
        m = report["modes"][mode]
        assert m["agree"], m
        assert {(w["wrapper"], w["state"]) for w in m["inner_wrappers"]} == {
            ("user_cp:gather_kv", "installed")}


def test_the_wrappers_declared_output_layout_is_the_default() -> None:
    from hyperrecipe import compile_recipe
    from tests.support.runtime_harness import llama

    b = compile_recipe("recipes/llama-cp.yaml", llama("meta"), {"cp": 2}).boundary(
        "model.layers.0.self_attn")
    assert [(a.name, a.position, str(a.src)) for a in b.inner_out_src] == [
        ("attn_output", 0, "{cp: shard(1)}")]
    assert any("inner_out_src to the wrappers' declaration: attn_output {cp: shard(1)}"
               in p.reason for p in b.provenance)


def test_a_wrapper_declaring_no_output_layout_needs_inner_out_src(tmp_path: Any) -> None:
    text = _toy_wrapper_error(tmp_path, "tests.support.cp_chain:undeclared")
    assert ("inner wrapper 'tests.support.cp_chain:undeclared' of 'layers.0.mlp' declares no output "
            "layout, so the rule must give inner_out_src") in text


def test_a_rule_inner_out_src_overrides_the_declarations(tmp_path: Any) -> None:
    from hyperrecipe import compile_recipe
    from tests.support.toy_models import Toy

    path = tmp_path / "w.yaml"
    path.write_text("recipe: w\nversion: 1\nmesh: [cp]\nrules:\n"
                    "  - {match: layers.*.mlp, boundary: true, inner_out_src: {0: replicate},\n"
                    "     inner_wrapper: [tests.support.cp_chain:undeclared, tests.support.cp_chain:fails_midway]}\n")
    with torch.device("meta"):
        model = Toy()
    b = compile_recipe(str(path), model, {"cp": 2}).boundary("layers.0.mlp")
    assert [str(a.src) for a in b.inner_out_src] == ["replicate"]


def test_a_chain_declaring_different_layouts_needs_inner_out_src(tmp_path: Any) -> None:
    text = _toy_wrapper_error(tmp_path, "[tests.support.cp_chain:fails_midway, "
                                        "tests.support.cp_chain:replicated_out]")
    assert ("the inner wrappers of 'layers.0.mlp' declare different output layouts "
            "(tests.support.cp_chain:fails_midway: 0: {cp: shard(1)}; tests.support.cp_chain:replicated_out: "
            "0: replicate)") in text


def test_a_declaration_silent_on_a_sharded_dim_is_refused(tmp_path: Any) -> None:
    from hyperrecipe import compile_recipe
    from hyperrecipe.errors import RecipeError
    from tests.support.runtime_harness import llama

    text = "\n".join(line for line in open("recipes/llama-tp-cp.yaml").read().splitlines()
                     if "inner_out_src:" not in line)
    path = tmp_path / "tpcp.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        compile_recipe(str(path), llama("meta"), {"tp": 2, "cp": 2})
    assert ("inner wrapper 'cp_allgather_kv' of 'model.layers.0.self_attn' declares its output "
            "layout over cp (0: {cp: shard(1)}), but 'model.layers.0.self_attn' is also sharded "
            "over tp; give inner_out_src naming every dim") in str(err.value)


@pytest.mark.parametrize(("declared", "message"), [
    ({"attn_output": {"cp": "shard(1)"}}, "keyed by output position (0, 1, ...), not 'attn_output'"),
    ({0: {"tp": "shard(2)"}}, "names mesh dim(s) tp, which the wrapper does not declare"),
    ({0: {"cp": "shard(x)"}}, "inner_out_src[0]: "),
    ({0: "shard(1)"}, "must name its mesh dim"),
])
def test_a_malformed_declaration_fails_at_decoration(declared: Any, message: str) -> None:
    from hyperrecipe.wrappers import inner_wrapper

    with pytest.raises(ValueError, match=re.escape(message)):
        inner_wrapper(mesh_dims=("cp",), inner_out_src=declared)


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("wrapper", ["cp_allgather_kv", "ulysses"])
def test_mistral_sliding_window_attention_agrees_at_cp4(
        tmp_path: Any, wrapper: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Another family through the Llama CP recipe (same module names): tiny Mistral's window of
    4 keys over 16 positions spans rank boundaries at cp=4 (4 positions per rank), and the mask
    the model builds is sliced to each rank's query rows; 8 query / 4 kv heads suit Ulysses."""
    import json

    from hyperrecipe.cli import main

    code = main(["check", _cp_variant(tmp_path, wrapper), "--mesh", "cp=4", "--seq", "16",
                 "--model", "hf:mistral", "--model-config", "recipes/models/tiny-mistral.json",
                 "--format", "json", "-q"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    for mode in ("production", "validate"):
        m = report["modes"][mode]
        assert m["agree"] and {w["state"] for w in m["inner_wrappers"]} == {"installed"}


def _forward_hook_worker(rank: int, world: int, recipe: str, mode: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply, compile_recipe
    from tests.support.toy_models import Toy

    torch.manual_seed(0)
    model = Toy()
    with torch.device("meta"):
        meta = Toy()
    plan = compile_recipe(recipe, meta, {"cp": world})
    inst = apply(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
                 mode=mode)  # type: ignore[arg-type]
    tokens = torch.arange(8).reshape(2, 4) % 32
    out = model(tokens)
    from torch.distributed.tensor import DTensor

    out = out.full_tensor() if isinstance(out, DTensor) else out
    out.sum().backward()
    rows = [(r.fqn, r.state) for r in inst.state.status() if r.what.startswith("inner wrapper")]
    return {"out": out, "grads": inst.full_grads(), "rows": rows}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_forward_hook_wrapper_runs_the_compute_on_local_tensors(tmp_path: Any, mode: str) -> None:
    """A ``hook="forward"`` wrapper calls the boundary's compute on local tensors in both modes
    (validate mode swaps the module's DTensor parameters for local views for the call)."""
    from hyperrecipe.check.launcher import run_ranks
    from tests.support.toy_models import Toy

    path = tmp_path / "fwd.yaml"
    path.write_text("recipe: fwd\nversion: 1\nmesh: [cp]\nrules:\n"
                    "  - {match: layers.*.mlp, boundary: true, in_src: {x: replicate},\n"
                    "     out_src: {0: replicate}, inner_wrapper: tests.support.cp_chain:replicated_out}\n")
    torch.manual_seed(0)
    ref = Toy()
    ref(torch.arange(8).reshape(2, 4) % 32).sum().backward()
    for res in run_ranks(_forward_hook_worker, 2, str(path), mode):
        torch.testing.assert_close(res["out"], ref(torch.arange(8).reshape(2, 4) % 32).detach())
        for name, p in ref.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(res["grads"][name], p.grad, atol=1e-6, rtol=1e-5)
        assert {state for _, state in res["rows"]} == {"installed"} and res["rows"]


@pytest.mark.parametrize(("backend", "met"), [("nccl", True), ("cpu:gloo,cuda:nccl", True),
                                              ("cpu:gloo", False), ("gloo", False)])
def test_requires_backend_reads_per_device_backend_strings(backend: str, met: bool) -> None:
    from types import SimpleNamespace

    from hyperrecipe.wrappers import requires_backend

    reason = requires_backend("nccl").check(SimpleNamespace(backend=lambda: backend))  # type: ignore[arg-type]
    assert (reason is None) == met, reason


@pytest.mark.parametrize(("name", "met"), [("json", True), ("json.decoder", True),
                                           ("no_such_pkg_hr", False),
                                           ("no_such_pkg_hr.sub", False), ("json.no_such_sub", False)])
def test_requires_package_reports_a_missing_parent_instead_of_raising(name: str, met: bool) -> None:
    from types import SimpleNamespace

    from hyperrecipe.wrappers import requires_package

    reason = requires_package(name).check(SimpleNamespace())  # type: ignore[arg-type]
    assert (reason is None) == met, reason
    if not met:
        assert reason is not None and reason.startswith(f"{name} is not installed")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_the_built_in_wrappers_require_sdpa(tmp_path: Any, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    from hyperrecipe.cli import main

    code = main(["check", _cp_variant(tmp_path, "[ulysses, cp_allgather_kv]"), "--mesh", "cp=2",
                 "--model", "hf:llama", "--model-config",
                 '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                 '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, '
                 '"attn_implementation": "eager"}', "--mode", "production", "-q"])
    out = capsys.readouterr()
    assert code == 2
    assert "requires sdpa attention: attn_implementation is 'eager'" in out.out + out.err
