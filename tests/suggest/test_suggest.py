"""`hyperrecipe suggest`: transformers' plan translated, verified by check in both modes, narrowed
where it fails, and written so that check passes again from the file.

The end-to-end tests run the real check (two gloo ranks, production and validate mode, compared
with one process) on transformers models built from tiny configs; the translation tests build
the model on the meta device only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import SuggestError
from hyperrecipe.models.hf_plans import read_plans
from hyperrecipe.models.hf_tiny import tiny_config
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.recipe import load_recipe
from hyperrecipe.resolve import resolve_recipe
from hyperrecipe.suggest import SuggestOptions, suggest_recipe
from hyperrecipe.suggest.render import render_recipe
from hyperrecipe.suggest.translate import TranslateOptions, translate
from tests.support.runtime_harness import ROOT

TP2 = {"tp": 2}


def _recheck(path: Path, model: str, config: str | dict[str, Any]) -> None:
    """The written file, loaded again, passes check in both modes."""
    report = run_check(CheckOptions(recipe=str(path), model=model, model_config=config, mesh=TP2))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_suggest_verifies_the_family_plan_and_the_written_file_passes_check(
        family: str, tmp_path: Path) -> None:
    config = str(ROOT / "recipes/models" / f"tiny-{family}.json")
    lines: list[str] = []
    s = suggest_recipe(f"hf:{family}", TP2, model_config=config, on_progress=lines.append)
    assert s.verified, s.summary()
    assert s.narrowed == () and len(s.attempts) == 1
    assert s.attempts[0].verdict == "both modes agree"
    assert any(line.startswith("check 1/6: ") for line in lines)
    cfg_cls = f"{'Llama' if family == 'llama' else 'Qwen2'}Config"
    # every rule says where it came from
    assert f"# {cfg_cls}.base_model_tp_plan: model.layers.*.self_attn.q_proj: colwise" in s.text
    assert "# region: model.layers.*.self_attn holds the column-wise q_proj, k_proj, v_proj" in s.text
    assert "  - match: model.embed_tokens\n    style: vocab_parallel\n" in s.text
    assert "  - match: lm_head\n    style: colwise_gather_output\n" in s.text
    # deeper than transformers' plan: sequence parallelism and the loss on vocab shards
    assert ('  - match: "{model.layers.*.input_layernorm,model.layers.*.post_attention_layernorm,'
            'model.norm}"\n    style: sequence_parallel\n') in s.text
    assert "    out_dst: {0: {tp: shard(-1)}}\n    loss_parallel: true\n" in s.text
    assert "# verified: hyperrecipe check agreed in production and validate mode at tp=2" in s.text
    # all projections, the embedding and the head are sharded; only the norms stay whole
    assert 0.9 < s.sharded_fraction["tp"] < 1.0
    assert s.collectives == (11, 11)  # sequence parallel: gathers and reduce-scatters
    path = tmp_path / f"{family}.yaml"
    path.write_text(s.text)
    _recheck(path, f"hf:{family}", config)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_experts_are_sharded_whole_over_ep_from_the_expert_parallel_plan(tmp_path: Path) -> None:
    config = str(ROOT / "recipes/models/tiny-mixtral.json")
    s = suggest_recipe("hf:mixtral", {"ep": 2}, model_config=config)
    assert s.verified, s.summary()
    (rule,) = s.rules
    assert rule.match == "model.layers.*.mlp.experts"
    assert dict(rule.fields)["params"] == {"gate_up_proj": {"ep": "shard(0)"},
                                           "down_proj": {"ep": "shard(0)"}}
    assert "# MixtralConfig.base_model_ep_plan: model.layers.*.mlp.experts: ep_dispatch_experts" in s.text
    assert 0.5 < s.sharded_fraction["ep"] < 1
    path = tmp_path / "mixtral-ep.yaml"
    path.write_text(s.text)
    report = run_check(CheckOptions(recipe=str(path), model="hf:mixtral", model_config=config,
                                    mesh={"ep": 2}))
    assert report.agree


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_experts_called_with_their_own_argument_names_are_sharded_over_ep() -> None:
    # GPT-OSS's experts take (hidden_states, router_indices, routing_weights), biases [E, ...]
    # beside the 3-D weights; they were left replicated for not naming top_k_weights
    s = suggest_recipe("hf:gpt_oss", {"ep": 2}, model_config=tiny_config("gpt_oss"),
                       options=SuggestOptions(timeout_s=120))
    assert s.verified, s.summary()
    (rule,) = (dict(r.fields) for r in s.rules if r.match == "model.layers.*.mlp.experts")
    assert rule["in_src"] == {"hidden_states": "replicate", "routing_weights": "replicate"}
    assert rule["params"] == {p: {"ep": "shard(0)"} for p in (
        "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    assert s.sharded_fraction["ep"] > 0.5


def test_the_tensor_parallel_entries_an_expert_parallel_plan_repeats_are_not_given_up() -> None:
    # transformers applies the ep plan instead of the tp plan, so Gemma 4's repeats the dense
    # mlp's colwise/rowwise entries; they were reported as expert styles with no translation
    model = build_model("hf:gemma4_text", tiny_config("gemma4_text"))
    entries = read_plans(model)
    assert ("model.layers.*.mlp.down_proj", "rowwise") in {
        (e.pattern, e.style) for e in entries if e.plan == "ep"}
    t = translate(entries, snapshot(model), {"tp": 2, "ep": 2})
    assert [n.what for n in t.narrowed if "expert-parallel plan" in n.why] == []
    fields = {r.match: dict(r.fields) for r in t.rules}
    assert fields["model.layers.*.mlp.{gate_proj,up_proj}"]["style"] == "colwise"
    assert fields["model.layers.*.mlp.down_proj"]["style"] == "rowwise"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_an_untranslatable_style_is_narrowed_with_its_reason(tmp_path: Path) -> None:
    # MiniCPM3's multi-head latent attention: transformers' `mla_kv_a_proj` style has no
    # translation, and its plan names a q_proj this (q_lora_rank) config does not build
    s = suggest_recipe("hf:minicpm3", TP2)
    why = {n.what: n.why for n in s.narrowed}
    assert "mla_kv_a_proj" in why["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert "has no translation; left replicated" in why["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert "matches no module of this model" in why["model.layers.*.self_attn.q_proj"]
    summary = s.summary()
    assert "narrowed: model.layers.*.self_attn.kv_a_proj_with_mqa: MiniCPM3Config" in summary
    assert s.verified, summary
    assert 0 < s.sharded_fraction["tp"] < 1
    path = tmp_path / "minicpm3.yaml"
    path.write_text(s.text)
    _recheck(path, "hf:minicpm3", s.check_config)


def test_a_parameter_inside_a_region_that_the_plan_leaves_out_gets_its_gradient_reduced() -> None:
    # Apertus' xIELU activation holds learnable scalars between up_proj (colwise) and down_proj
    # (rowwise); transformers' plan does not mention them
    from hyperrecipe.models.hf_tiny import tiny_config

    model = build_model("hf:apertus", tiny_config("apertus"))
    entries, tree = read_plans(model), snapshot(model)
    rules = {r.match: dict(r.fields) for r in translate(entries, tree, TP2).rules}
    assert rules["model.layers.*.mlp.act_fn"] == {"reduce_grads": {"alpha_p": "tp", "alpha_n": "tp"}}
    # transformers' replicated_with_grad_allreduce becomes the same field
    assert rules["model.layers.*.self_attn.q_norm"] == {"reduce_grads": {"weight": "tp"}}
    off = translate(entries, tree, TP2, TranslateOptions(reduce_reached=False))
    assert "model.layers.*.mlp.act_fn" not in {r.match for r in off.rules}


def test_attention_sinks_are_sharded_with_the_heads_they_belong_to() -> None:
    from hyperrecipe.models.hf_tiny import tiny_config

    model = build_model("hf:granite_swa", tiny_config("granite_swa"))
    t = translate(read_plans(model), snapshot(model), TP2)
    attn = next(dict(r.fields) for r in t.rules
                if r.match == "model.layers.*.self_attn" and not r.deeper)
    assert attn["params"] == {"sinks": {"tp": "shard(0)"}}
    assert t.narrowed == ()  # `local_params` on the attention is what the region does


def test_the_rendered_recipe_loads_and_compiles(tmp_path: Path) -> None:
    model = build_model("hf:llama", str(ROOT / "recipes/models/tiny-llama.json"))
    t = translate(read_plans(model), snapshot(model), TP2,
                  TranslateOptions(loss_parallel=True))
    path = tmp_path / "r.yaml"
    path.write_text(render_recipe("r", ["tp"], t.rules, header=["h"], description="d"))
    plan = resolve_recipe(load_recipe(path), snapshot(model), TP2)
    assert plan.loss_parallel is not None
    assert {p.fqn: str(p.placement.get("tp")) for p in plan.params}[
        "model.layers.0.self_attn.q_proj.weight"] == "shard(0)"


def test_a_family_without_a_plan_is_refused_by_name() -> None:
    # Mamba: no plan, and no column-wise/row-wise pair in its structure (GPT-2, once the
    # example here, is now read off its Conv1D projections: tests/suggest/test_structure.py)
    with pytest.raises(SuggestError, match=r"hf:mamba \(MambaForCausalLM\) declares no "
                                           r"tensor-parallel plan"):
        suggest_recipe("hf:mamba", TP2, model_config=tiny_config("mamba"))
    with pytest.raises(SuggestError, match="the mesh dp=2 has none of them: give --mesh tp=N"):
        suggest_recipe("hf:llama", {"dp": 2})


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hyperrecipe", "suggest", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_cli_unverified_writes_the_translation_marked_not_verified(tmp_path: Path) -> None:
    out = tmp_path / "llama.yaml"
    done = _cli("--model", "hf:llama", "--model-config",
                str(ROOT / "recipes/models/tiny-llama.json"), "--mesh", "tp=2", "--unverified",
                "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "# NOT verified: not checked (--unverified)" in out.read_text()
    assert "hyperrecipe suggest [" in done.stderr  # progress lines
    assert f"recipe written to {out}" in done.stdout


@pytest.mark.slow  # starts a fresh interpreter (docs/benchmarks.md#test-suite)
def test_cli_writes_nothing_when_check_never_agreed(tmp_path: Path) -> None:
    # one attempt is not enough for MiniCPM3 (its vocab-parallel embedding fails validate mode)
    out = tmp_path / "m.yaml"
    done = _cli("--model", "hf:minicpm3", "--mesh", "tp=2", "--max-attempts", "1", "-q",
                "-o", str(out), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert not out.exists()
    assert "NOT verified: check still disagreed after 1 attempts" in done.stderr
    assert "no verified recipe, so none was written; --unverified" in done.stderr


def test_suggest_options_default_to_verifying() -> None:
    assert SuggestOptions().verify and SuggestOptions().max_attempts == 6


def test_the_tiny_config_shrinks_every_size_the_family_names_under_its_own_spelling() -> None:
    from hyperrecipe.models.hf_tiny import tiny_config

    # GPT-style field names through the config's attribute_map; ids inside the tiny vocabulary
    assert tiny_config("codegen") == {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128,
                                      "n_positions": 128, "bos_token_id": 127,
                                      "eos_token_id": 127, "rotary_dim": 4}
    # grouped-query attention stays grouped; multi-head stays multi-head
    assert tiny_config("mixtral")["num_key_value_heads"] == 2
    assert tiny_config("llama")["num_key_value_heads"] == 4
    # the given fields win where they are not sizes
    assert tiny_config("llama", {"rms_norm_eps": 1e-5, "hidden_size": 4096})["hidden_size"] == 64


def test_a_check_config_that_is_not_tiny_is_refused_before_anything_is_built_for_real() -> None:
    with pytest.raises(SuggestError, match=r"would be checked on has 6,738,415,616 parameters"):
        suggest_recipe("hf:llama", TP2, options=SuggestOptions(check_config={}))


def test_suggest_help_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    from hyperrecipe.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["suggest", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Propose a recipe for a transformers model from its own tensor-parallel plan" in text
    assert "--no-sequence-parallel" in text and "--unverified" in text


def test_a_divergent_gradient_is_blamed_on_the_last_one_a_suggested_rule_places() -> None:
    # CTRL: production-mode gradients diverged from the embedding to the final norm; the last
    # one in forward order (transformer.layernorm) is placed by no rule, so nothing was blamed
    # and the family was refused. The source is the last one a rule places.
    from types import SimpleNamespace

    from hyperrecipe.check.compare import ModeComparison, NamedDiff, TensorDiff
    from hyperrecipe.suggest.rules import SuggestedRule
    from hyperrecipe.suggest.verify import _blame

    def diff(name: str) -> NamedDiff:
        return NamedDiff(name=name, rank=0, diff=TensorDiff(ok=False, max_abs=1e-3, max_rel=1e-3))

    names = ["transformer.w.weight", "transformer.h.0.ffn.up.weight", "transformer.layernorm.weight"]
    cmp = ModeComparison(mode="production", agree=False, first=None, events_compared=0,
                         event_diffs=(), output=None, gradients=tuple(map(diff, names)),
                         params_after=(), failure=None, failure_rank=None)
    report = SimpleNamespace(modes=[SimpleNamespace(mode="production", error=None,
                                                    comparison=cmp)])
    rule = SuggestedRule(match="transformer.h.*.ffn", fields=(("boundary", True),),
                         sources=("region",), group="transformer.h.*.ffn", deeper=False, order=0)
    blamed = _blame(report, [rule])
    assert blamed is not None and blamed[0] == "transformer.h.0.ffn.up.weight"
