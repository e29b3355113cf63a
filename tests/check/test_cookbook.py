"""docs/cookbook.md: every pattern's recipe runs through ``hyperrecipe check`` on two gloo ranks
against one process, in the modes the cookbook claims, with the verdict it claims.

Tolerances are check's defaults for fp32 (atol 1e-5, rtol 1e-4). Each case is a tiny config
(``tests/recipes/cookbook/models/`` or ``recipes/models/``) at ``tp=2``. The two naive OLMo-2
recipes must agree in validate mode and diverge in production mode, which is the cookbook's
point about them. Cases that repeat what other test
files cover (the shipped Qwen3 recipe, the SDPA toy) are in the slow tier.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.check.diagnose import (
    GRADIENT_REDUCTION_WRONG,
    HEADS_NOT_WHOLE,
    WHOLE_PARAM_ON_SHARD,
)
from hyperrecipe.check.run import CheckOptions, CheckReport, run_check

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK = ROOT / "docs/cookbook.md"
MODELS = "tests/recipes/cookbook/models"
BOTH = ("production", "validate")

# recipe, model, model config, modes, the verdict per mode (True: agrees with one process)
CASES: list[Any] = [
    ("tests/recipes/cookbook/olmo2.yaml", "hf:olmo2", f"{MODELS}/tiny-olmo2.json",
     BOTH, (True, True)),
    # validate mode hands outputs back as tensors of their own: Falcon adds in place
    ("tests/recipes/cookbook/falcon.yaml", "hf:falcon", f"{MODELS}/tiny-falcon.json",
     BOTH, (True, True)),
    pytest.param("tests/recipes/cookbook/olmo2-naive-sharded-norm.yaml", "hf:olmo2",
                 f"{MODELS}/tiny-olmo2.json", BOTH, (False, True), marks=pytest.mark.slow),
    pytest.param("tests/recipes/cookbook/phi3-chunked.yaml", "hf:phi3",
                 f"{MODELS}/tiny-phi3.json", BOTH, (True, True), marks=pytest.mark.slow),
    pytest.param("tests/recipes/cookbook/phi3-gather.yaml", "hf:phi3",
                 f"{MODELS}/tiny-phi3.json", BOTH, (True, True), marks=pytest.mark.slow),
    pytest.param("tests/recipes/cookbook/qwen2_moe.yaml", "hf:qwen2_moe",
                 f"{MODELS}/tiny-qwen2_moe.json", BOTH, (True, True), marks=pytest.mark.slow),
    # validate mode clamps the by-parts fused output part by part (DBRX's clip_qkv)
    ("tests/recipes/cookbook/dbrx-chunked-qkv.yaml", "hf:dbrx", f"{MODELS}/tiny-dbrx.json",
     BOTH, (True, True)),
    ("tests/recipes/cookbook/deepseek_v3.yaml", "hf:deepseek_v3",
     "tests/recipes/models/tiny-deepseek_v3.json", BOTH, (True, True)),
    pytest.param("tests/recipes/cookbook/bloom.yaml", "hf:bloom", f"{MODELS}/tiny-bloom.json",
                 BOTH, (True, True), marks=pytest.mark.slow),
    pytest.param("recipes/qwen3.yaml", "hf:qwen3", "recipes/models/tiny-qwen3.json", BOTH,
                 (True, True), marks=pytest.mark.slow),
    # an encoder, a vision model and an encoder-decoder, built by hf:<model_type>/<task>
    ("tests/recipes/cookbook/bert.yaml", "hf:bert/sequence-classification",
     f"{MODELS}/tiny-bert.json", BOTH, (True, True)),
    ("tests/recipes/cookbook/vit.yaml", "hf:vit/image-classification",
     f"{MODELS}/tiny-vit.json", BOTH, (True, True)),
    pytest.param("tests/recipes/cookbook/t5.yaml", "hf:t5/seq2seq-lm", f"{MODELS}/tiny-t5.json",
                 BOTH, (True, True), marks=pytest.mark.slow),
    # both modes: in validate mode the decoder's later self-attentions mask the head-sharded
    # position bias with a causal mask they make as a plain [1, 1, q, kv] tensor (aten.where),
    # which broadcasts over the heads and is taken as replicated
    pytest.param("tests/recipes/cookbook/t5-heads.yaml", "hf:t5/seq2seq-lm",
                 f"{MODELS}/tiny-t5.json", BOTH, (True, True), marks=pytest.mark.slow),
    # a hybrid: the Mamba mixer tensor parallel over its channels, x_proj's whole output with a
    # partial gradient (out_grad), the model's own cache and torch scan (docs/cookbook.md)
    ("tests/recipes/cookbook/jamba-mamba.yaml", "hf:jamba", f"{MODELS}/tiny-jamba.json",
     BOTH, (True, True)),
    pytest.param("tests/recipes/sdpa-toy-tp.yaml", "tests.support.sdpa_models:make_sdpa_transformer",
                 None, BOTH, (True, True), marks=pytest.mark.slow),
]


NAIVE_COPY = "tests/recipes/cookbook/olmo2-naive-qwen3-copy.yaml"
"""Checked by its own test below, which asserts the likely cause as well."""

DECLARED_RESIDUAL = "tests/recipes/cookbook/bloom-declared-residual.yaml"
"""Checked by its own test below: validate mode names the residual."""

NAIVE_ALIBI = "tests/recipes/cookbook/bloom-naive-alibi.yaml"
"""Checked by its own test below: production's likely cause points at the ALiBi input."""


TORCHVISION_VIT = "tests/recipes/cookbook/torchvision-vit.yaml"
"""Checked by its own test below: a factory model with images (``--inputs``)."""

NAIVE_BERT = "tests/recipes/cookbook/bert-naive-attention-residual.yaml"
"""Checked by its own test below: production names a gradient reduced wrongly, validate mode
the residual's use."""


def _recipe_of(case: Any) -> str:
    return str(case.values[0] if hasattr(case, "values") else case[0])


def run(recipe: str, model: str, config: str | None, modes: tuple[str, ...]) -> CheckReport:
    return run_check(CheckOptions(recipe=str(ROOT / recipe), model=model,
                                  model_config=str(ROOT / config) if config else None,
                                  mesh={"tp": 2}, modes=modes))


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("recipe", "model", "config", "modes", "agree"), CASES,
                         ids=[Path(_recipe_of(c)).stem for c in CASES])
def test_cookbook_recipe_gives_the_verdict_the_cookbook_states(
        recipe: str, model: str, config: str | None, modes: tuple[str, ...],
        agree: tuple[bool, ...]) -> None:
    report = run(recipe, model, config, modes)
    assert [m.mode for m in report.modes] == list(modes)
    # both modes run the model's own default attention (transformers' sdpa on the CPU)
    assert not any("attn_implementation" in note for note in report.notes), report.notes
    for m, expected in zip(report.modes, agree):
        assert m.error is None, (m.mode, m.error)
        assert m.agree == expected, (m.mode, m.comparison and m.comparison.first)
        if expected:
            assert m.comparison is not None and not m.comparison.diverged_gradients
            assert len(m.comparison.gradients) > 10
    assert report.exit_code == (0 if all(agree) else 1)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_naive_qwen3_copy_fails_in_production_with_the_norm_named() -> None:
    """The literal copy of qwen3.yaml's norm rule: production raises in q_norm (a [64] weight
    meets a [.., 32] shard) and check names the cause; validate agrees."""
    report = run(NAIVE_COPY, "hf:olmo2", f"{MODELS}/tiny-olmo2.json", BOTH)
    prod, validate = report.modes
    assert validate.agree and not prod.agree
    assert prod.comparison is not None and prod.comparison.failure is not None
    assert prod.comparison.failure.module == "model.layers.0.self_attn.q_norm"
    assert prod.suggestion is not None and prod.suggestion.cause == WHOLE_PARAM_ON_SHARD
    assert prod.suggestion.evidence.startswith(
        "model.layers.0.self_attn.q_norm.weight is replicated (shape [64]) but "
        "model.layers.0.self_attn.q_norm received an input with 32 of its 64 features (tp = 2)")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_declared_residual_is_named_by_validate_mode_not_reduced_silently() -> None:
    """BLOOM's MLP adds ``residual`` after its row-wise reduction; declared replicated on a
    boundary holding the column-wise ``dense_h_to_4h``, production all-reduces its whole
    gradient (2x at tp=2) with a right forward. Validate mode used to agree; it now checks the
    gradient DTensor computes for each use of the input against the reduction production gives
    it, and names the input, the use and the recipe line that declared it."""
    report = run(DECLARED_RESIDUAL, "hf:bloom", f"{MODELS}/tiny-bloom.json", BOTH)
    prod, validate = report.modes
    assert not prod.agree and not validate.agree and report.exit_code == 1
    assert prod.comparison is not None and prod.comparison.forward_agrees
    assert prod.suggestion is not None and prod.suggestion.cause == GRADIENT_REDUCTION_WRONG
    failure = validate.comparison.failure if validate.comparison is not None else None
    assert failure is not None
    assert failure.error.startswith(
        "PlanMismatchError: transformer.h.1.mlp: input 'residual' is used by AddBackward0 whose "
        "share of its gradient comes back whole (replicate on tp), but production mode "
        "all_reduces the gradient of 'residual' over tp"), failure.error
    assert re.search(r"production would count its share 2 times \('residual' is declared at "
                     r"\S*tests/recipes/cookbook/bloom-declared-residual\.yaml:11:13\)",
                     failure.error), failure.error
    assert failure.error.endswith("or leave 'residual' out of the boundary's in_src / in_dst")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_megatron_bloom_fails_at_the_alibi_input_and_check_points_at_it() -> None:
    """Heads whole and num_heads divided, yet BLOOM's attention fails: its ``alibi`` holds every
    head, flattened with the batch. The likely cause says so instead of only "heads cut"."""
    report = run(NAIVE_ALIBI, "hf:bloom", f"{MODELS}/tiny-bloom.json", ("production",))
    (prod,) = report.modes
    assert not prod.agree and prod.suggestion is not None
    assert prod.suggestion.cause == HEADS_NOT_WHOLE
    assert prod.suggestion.evidence.endswith(
        "the plan already divides num_heads and the heads divide evenly, so look at the inputs: "
        "one built outside transformer.h.0.self_attention for every head (a per-head bias "
        "flattened with the batch, ALiBi's [batch * heads, 1, kv]) has no layout that is one "
        "rank's heads; compute this attention whole (gather its fused projection, "
        "docs/cookbook.md#alibi-and-residual-arguments-bloom)")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_bert_with_llamas_attention_boundary_counts_the_residual_twice_and_validate_says_so(
        ) -> None:
    """BertAttention hands its input to ``output`` as the residual: a boundary there declares it
    replicated and production all-reduces a gradient whose residual part is already whole. The
    forward agrees; check blames the gradient reduction. Validate mode used to agree: DTensor
    adds the residual's whole share to the projections' partial ones and the sum comes back
    partial. It now looks at each use's share and names the residual's add and the recipe line."""
    report = run(NAIVE_BERT, "hf:bert/sequence-classification", f"{MODELS}/tiny-bert.json", BOTH)
    prod, validate = report.modes
    assert prod.error is None and not prod.agree and report.exit_code == 1
    assert prod.comparison is not None and prod.comparison.forward_agrees
    assert len(prod.comparison.diverged_gradients) == 20
    assert prod.suggestion is not None and prod.suggestion.cause == GRADIENT_REDUCTION_WRONG
    assert not validate.agree
    failure = validate.comparison.failure if validate.comparison is not None else None
    assert failure is not None
    assert re.match(
        r"PlanMismatchError: bert\.encoder\.layer\.[01]\.attention: input 'hidden_states' is "
        r"used by AddBackward0 whose share of its gradient comes back whole \(replicate on tp\), "
        r"but production mode all_reduces the gradient of 'hidden_states' over tp", failure.error
    ), failure.error
    line = next(i for i, text in enumerate((ROOT / NAIVE_BERT).read_text().splitlines(), 1)
                if "in_src: {hidden_states: replicate}" in text)
    assert re.search(r"production would count its share 2 times \('hidden_states' is declared "
                     rf"at \S*tests/recipes/cookbook/bert-naive-attention-residual\.yaml:{line}:",
                     failure.error), failure.error


def test_the_cookbooks_multihead_attention_rules_are_the_checked_file() -> None:
    """The rules docs/cookbook.md shows for torchvision's ViT are the file the test below runs."""
    text = COOKBOOK.read_text(encoding="utf-8")
    section = text.split("## nn.MultiheadAttention (torchvision's ViT)", 1)[1]
    shown = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert shown in (ROOT / TORCHVISION_VIT).read_text(encoding="utf-8")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_torchvision_vit_with_multihead_attention_by_heads_agrees_in_both_modes() -> None:
    report = run_check(CheckOptions(
        recipe=str(ROOT / TORCHVISION_VIT), model="tests.support.byo_models:make_torchvision_vit",
        inputs="tests.support.byo_models:make_pixels", mesh={"tp": 2}, modes=BOTH))
    assert [m.mode for m in report.modes] == list(BOTH)
    for m in report.modes:
        assert m.error is None, (m.mode, m.error)
        assert m.agree, (m.mode, m.comparison and m.comparison.first)
        assert m.comparison is not None and not m.comparison.diverged_gradients
        assert len(m.comparison.gradients) == 32
    assert report.exit_code == 0


def test_cookbook_names_every_recipe_the_suite_checks_and_nothing_else() -> None:
    text = COOKBOOK.read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:tests/)?recipes/[\w./-]+\.yaml)`", text))
    checked = {_recipe_of(c) for c in CASES} | {NAIVE_COPY, DECLARED_RESIDUAL, NAIVE_ALIBI,
                                                NAIVE_BERT, TORCHVISION_VIT}
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "tests/recipes/cookbook").glob("*.yaml")}
    assert on_disk <= checked, on_disk - checked
    assert checked <= named, checked - named
    for name in named:
        assert (ROOT / name).is_file(), name


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_jamba_without_out_grad_diverges_in_production_and_validate_names_x_proj(
        tmp_path: Path) -> None:
    """The Mamba mixer's x_proj without ``out_grad``: the rowwise default (backward identity)
    leaves dt/B/C's partial gradient unreduced; production's forward agrees and its gradients
    do not, and validate mode refuses instead of agreeing (DTensor alone reduces it)."""
    text = (ROOT / "tests/recipes/cookbook/jamba-mamba.yaml").read_text(encoding="utf-8")
    line = "    out_grad: {0: {tp: partial}}\n"
    assert line in text
    recipe = tmp_path / "jamba-no-out-grad.yaml"
    recipe.write_text(text.replace(line, ""), encoding="utf-8")
    report = run(str(recipe), "hf:jamba", f"{MODELS}/tiny-jamba.json", BOTH)
    prod, validate = report.modes
    assert not prod.agree and prod.comparison is not None and prod.comparison.forward_agrees
    assert "model.layers.0.mamba.x_proj.weight" in {
        d.name for d in prod.comparison.diverged_gradients}
    failure = validate.comparison.failure if validate.comparison is not None else None
    assert failure is not None
    assert failure.error == (
        "PlanMismatchError: model.layers.0.mamba.x_proj: the gradient of output 'output' "
        "arrives partial on tp (each rank holds a share of a sum), but the plan takes it whole "
        "(the resolver's default: no in_grad / out_grad declared): production mode runs "
        "identity there and would hand each rank's share on as the gradient. Declare "
        "out_grad: {0: {tp: partial}} so that production reduces it (Megatron's f)")
