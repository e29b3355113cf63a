"""What ``check`` names when a plan shards a forward that defeats it (issue 39).

Models written outside transformers (``tests/support/byo_models.py``,
``tests/support/byo_hazards.py``) are sharded naively (``tests/recipes/hazard-*.yaml``) and
checked on real gloo ranks in both modes at check's fp32 tolerances (atol 1e-5, rtol 1e-4).
Each diverging mode must name, first, the cause whose fix works for that model, with the
evidence it read (the source line, the einops pattern, the boundary that never ran, the 16-bit
ops of the reference); where a fix is a recipe change, the fixed run agrees. The last tests feed
the heuristics by hand, to show that each new cause needs its pattern and leaves the old causes
their cases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.compare import compare_mode
from hyperrecipe.check.diagnose import (
    BIAS_COUNTED_TP_TIMES,
    HEAD_COUNT_UNDIVIDED,
    HEADS_FIXED_IN_EINOPS,
    MHA_READS_ITS_OWN_WEIGHTS,
    REFERENCE_COMPUTES_IN_16_BIT,
    WIDTH_READ_OFF_INPUT,
    DiagnosisContext,
    suggest,
)
from hyperrecipe.check.diagnose.structure import forward_hazard_in
from hyperrecipe.check.precision import HalfPrecision
from hyperrecipe.check.record import Event, Trace
from hyperrecipe.check.run import CheckOptions, CheckReport, ModeResult, run_check
from hyperrecipe.forward_hazards import forward_hazards

ROOT = Path(__file__).resolve().parents[2]
BYO = "tests.support.byo_models"
HAZARDS = "tests.support.byo_hazards"


def check(recipe: str, model: str, **kw: Any) -> CheckReport:
    return run_check(CheckOptions(recipe=str(ROOT / recipe), model=model, mesh={"tp": 2}, **kw))


def mode(report: CheckReport, name: str) -> ModeResult:
    return next(m for m in report.modes if m.mode == name)


# ------------------------------------------------------------------------- on real ranks


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_an_attention_reading_its_width_off_the_input_is_named_not_its_head_count() -> None:
    """nanoGPT's ``C // self.n_head`` with the head count divided: before, check pointed at
    the inputs (ALiBi) because the plan already divides the heads."""
    report = check("tests/recipes/hazard-nanogpt-width.yaml", f"{BYO}:make_gpt")
    assert report.exit_code == 1
    prod = mode(report, "production")
    assert prod.comparison is not None
    first = prod.comparison.first
    assert first is not None and (first.fqn, first.what) == ("transformer.h.0.attn",
                                                             "raised in forward")
    assert prod.suggestion is not None and prod.suggestion.cause == WIDTH_READ_OFF_INPUT
    assert prod.suggestion.evidence.startswith(
        "transformer.h.0.attn (CausalSelfAttention): its forward reads the width off its input "
        "(B, T, C = x.size()) and shapes its heads by it, while "
        "transformer.h.0.attn.c_attn.weight is sharded {tp: shard(0, chunks=3)} (local [48, 32] "
        "of [96, 32]): each rank's q, k and v hold 1/2 of that width (tp = 2); the plan divides "
        "n_embd, n_head (head_counts), and the width is still read whole")
    assert "ALiBi" not in prod.suggestion.evidence
    assert mode(report, "validate").agree, "validate mode computes with global shapes"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_heads_fixed_in_an_einops_layer_are_named_with_the_pattern() -> None:
    """``Rearrange(..., h=heads)`` was built with the global count: dividing ``heads`` does
    not reach it, and production computes the wrong attention without an error."""
    report = check("tests/recipes/hazard-einops.yaml", f"{HAZARDS}:make_einops_layer")
    assert report.exit_code == 1
    prod = mode(report, "production")
    assert prod.comparison is not None and prod.comparison.first is not None
    assert prod.comparison.first.fqn == "layers.0.attn"
    assert prod.comparison.failure is None, "no error: the values are wrong"
    assert prod.suggestion is not None and prod.suggestion.cause == HEADS_FIXED_IN_EINOPS
    assert prod.suggestion.evidence == (
        "layers.0.attn (EinopsLayerAttention): its split_heads (Rearrange 'b n (h d) -> b h n "
        "d', {'h': 4}) fixes the head count in an einops pattern, while "
        "layers.0.attn.to_qkv.weight is sharded {tp: shard(0, chunks=3)} (local [48, 32] of "
        "[96, 32]): a rank splits its 1/2 of the width into all the heads, each 1/2 as wide "
        "(tp = 2); the plan divides heads (head_counts), which the pattern, built with its "
        "count, never reads; fix the head size (d=) instead, or leave layers.0.attn replicated")
    assert mode(report, "validate").agree


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_heads_fixed_by_self_heads_in_an_einops_call_name_the_division_that_fixes_them() -> None:
    """``rearrange(t, ..., h=self.heads)`` reads the attribute: the evidence says to divide
    it, and the recipe that does agrees in both modes."""
    report = check("tests/recipes/hazard-einops-undivided.yaml", f"{HAZARDS}:make_einops_call",
                   modes=("production",))
    prod = mode(report, "production")
    assert prod.suggestion is not None and prod.suggestion.cause == HEADS_FIXED_IN_EINOPS
    assert prod.suggestion.evidence.startswith(
        "layers.0.attn (EinopsCallAttention): its forward fixes the head count in an einops "
        "pattern (rearrange(t, \"b n (h d) -> b h n d\", h=self.heads))")
    assert prod.suggestion.evidence.endswith(
        "h=self.heads reads an attribute the plan can divide: add head_counts: {heads: tp} to "
        "the rule for layers.0.attn, or fix d= instead")
    fixed = check("tests/recipes/hazard-einops.yaml", f"{HAZARDS}:make_einops_call")
    assert fixed.exit_code == 0, [(m.mode, m.suggestion) for m in fixed.modes]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_nn_multihead_attention_sharded_as_any_attention_names_its_own_weight_reads() -> None:
    report = check("tests/recipes/hazard-mha.yaml", f"{BYO}:make_mha_encoder")
    assert report.exit_code == 1
    for m in report.modes:
        assert not m.agree and m.suggestion is not None, m.mode
        assert m.suggestion.cause == MHA_READS_ITS_OWN_WEIGHTS, (m.mode, m.suggestion)
        assert m.suggestion.evidence.startswith(
            "layers.0.self_attention is nn.MultiheadAttention: F.multi_head_attention_forward "
            "reads layers.0.self_attention.in_proj_weight and "
            "layers.0.self_attention.out_proj.weight itself and takes head_dim from the input's "
            "width, never calling layers.0.self_attention.out_proj, while "
            "layers.0.self_attention.in_proj_weight is sharded {tp: shard(0, chunks=3)}"), m.mode
        assert ("the boundary layers.0.self_attention.out_proj recorded nothing in the "
                "reference: never called") in m.suggestion.evidence


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("factory", "ops"), [
    ("make_bf16_cast", "4 ops (aten.addmm) in bfloat16"),
    ("make_bf16_autocast", "6 ops (aten.addmm, aten.gelu) in bfloat16"),
])
def test_16_bit_computation_in_a_float32_model_is_named_from_the_reference(
        factory: str, ops: str) -> None:
    """A right recipe on a float32 model whose MLPs compute in bfloat16: every mode diverges
    at fp32 tolerances by bfloat16 rounding, and check says the reference itself is 16-bit."""
    report = check("tests/recipes/hazard-bf16-mlp.yaml", f"{HAZARDS}:{factory}")
    assert report.exit_code == 1 and (report.atol, report.rtol) == (1e-5, 1e-4)
    for m in report.modes:
        assert not m.agree and m.suggestion is not None, m.mode
        assert m.suggestion.cause == REFERENCE_COMPUTES_IN_16_BIT, (m.mode, m.suggestion)
        assert m.suggestion.evidence.startswith(
            f"the reference (one process, no plan) computed {ops} inside layers.0.ff"), m.mode
        assert ("while the model's parameters are float32; re-compared at atol 1e-2, rtol 1e-2 "
                "(check's tolerances for a 16-bit model) every value agrees") in \
            m.suggestion.evidence
        assert m.suggestion.evidence.endswith(
            "pass --atol 1e-2 --rtol 1e-2, or check the model's float32 path")
    if factory == "make_bf16_cast":  # what the evidence says to do agrees
        assert check("tests/recipes/hazard-bf16-mlp.yaml", f"{HAZARDS}:{factory}",
                     atol=1e-2, rtol=1e-2).exit_code == 0


# ------------------------------------------------------------------------- by hand


def _plan(recipe: str, model: torch.nn.Module) -> Any:
    from hyperrecipe import compile_recipe
    from hyperrecipe.model_tree import snapshot

    tree = snapshot(model)
    return compile_recipe(recipe, tree, {"tp": 2}, verify=False), tree


def _ctx(plan: Any, tree: Any, **kw: Any) -> DiagnosisContext:
    return DiagnosisContext(plan=plan, tree=tree, reference_params={}, mode="production",
                            rank_ids=(0, 1), **kw)


NANOGPT_GATHERED = """recipe: nanogpt-gathered
version: 1
mesh: [tp]
rules:
  - match: transformer.h.*.attn.c_attn
    style: colwise_gather_output
  - match: transformer.h.*.attn.c_proj
    style: rowwise
    in_src: {0: replicate}
"""


def test_an_attention_whose_projection_is_gathered_is_no_hazard_of_the_plan(
        tmp_path: Path) -> None:
    """docs/bring-your-own-model.md's recipe for nanoGPT's forward (gather c_attn's output)
    shards parameters inside the attention, but hands its forward whole values: a divergence
    there must be explained by something else."""
    from tests.support.byo_models import make_gpt

    recipe = tmp_path / "gathered.yaml"
    recipe.write_text(NANOGPT_GATHERED, encoding="utf-8")
    model = make_gpt()
    plan, tree = _plan(str(recipe), model)
    empty = Trace(events=(), output=None, loss=None, grads={}, params_after=None)
    ctx = _ctx(plan, tree, hazards=forward_hazards(model))
    assert "transformer.h.0.attn" in ctx.hazards
    assert forward_hazard_in("transformer.h.0.attn", None, empty, ctx) is None
    naive = _plan(str(ROOT / "tests/recipes/hazard-nanogpt-width.yaml"), model)
    found = forward_hazard_in("transformer.h.0.attn", None, empty,
                              _ctx(*naive, hazards=ctx.hazards))
    assert found is not None and found.cause == WIDTH_READ_OFF_INPUT


def test_an_einops_call_whose_head_count_the_plan_divides_is_no_hazard() -> None:
    pytest.importorskip("einops")
    from tests.support.byo_hazards import make_einops_call, make_einops_layer

    empty = Trace(events=(), output=None, loss=None, grads={}, params_after=None)
    for factory, expected in ((make_einops_call, None), (make_einops_layer,
                                                         HEADS_FIXED_IN_EINOPS)):
        model = factory()
        plan, tree = _plan(str(ROOT / "tests/recipes/hazard-einops.yaml"), model)
        found = forward_hazard_in("layers.0.attn", None, empty,
                                  _ctx(plan, tree, hazards=forward_hazards(model)))
        assert (found.cause if found else None) == expected, factory.__name__


BF16 = HalfPrecision(params_dtype="float32", dtypes=("bfloat16",), ops=4,
                     op_names=("aten.addmm",), modules=("layers.0.ff.up",))


def _toy() -> tuple[Any, Any]:
    from hyperrecipe.model_tree import build_model

    plan, tree = _plan(str(ROOT / "tests/recipes/toy-attn.yaml"),
                       build_model("tests.support.check_models:make_attn_toy"))
    return plan, tree


def _trace(value: torch.Tensor) -> Trace:
    return Trace(events=(Event(fqn="embed", call=0, kind="output", name="0", enclosing=None,
                               value=value),),
                 output=torch.zeros(2), loss=0.0, grads={}, params_after=None)


@pytest.mark.parametrize(("half", "scale", "expected"), [
    (BF16, 1.0, REFERENCE_COMPUTES_IN_16_BIT),  # rounding-sized, the reference is 16-bit
    (None, 1.0, None),  # the same error, a float32 reference: no guess
    (BF16, 2.0, BIAS_COUNTED_TP_TIMES),  # 2x the reference: more than rounding, the old cause
])
def test_the_16_bit_cause_needs_a_16_bit_reference_and_an_error_16_bit_rounding_explains(
        half: HalfPrecision | None, scale: float, expected: str | None) -> None:
    plan, tree = _toy()
    b = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    a = scale * b + 2e-3 * torch.sign(b) * (scale == 1.0)
    reference, ranks = _trace(b), [_trace(a)] * 2
    cmp = compare_mode("production", reference, ranks, atol=1e-5, rtol=1e-4)
    assert not cmp.agree
    found = suggest(cmp, reference, ranks, _ctx(plan, tree, half_precision=half),
                    atol=1e-5, rtol=1e-4)
    assert (found.cause if found else None) == expected


def _sample(*args: Any) -> Any:
    from hyperrecipe.verify.sample import Sample

    return Sample(args=args, kwargs={}, description="by hand")


def test_torchtitans_grouped_experts_are_seen_computing_in_bfloat16() -> None:
    """torchtitan's ``GroupedExperts`` keeps float32 weights and casts to bfloat16 for
    ``_grouped_mm`` inside its forward: the re-run reference sees those ops, where it sees none
    in a float32 model that stays float32."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts

    from hyperrecipe.check.precision import half_precision_seen
    from tests.support.byo_models import make_gpt

    torch.manual_seed(0)
    experts = GroupedExperts(GroupedExperts.Config(dim=16, hidden_dim=32, num_experts=4))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    seen = half_precision_seen(experts, _sample(torch.randn(8, 16), torch.tensor([2, 2, 2, 2])))
    assert seen is not None and seen.params_dtype == "float32"
    assert seen.dtypes == ("bfloat16",) and "aten._grouped_mm" in seen.op_names
    assert half_precision_seen(make_gpt(), _sample(torch.randint(0, 64, (2, 8)))) is None


def test_a_width_read_off_the_input_is_named_before_an_undivided_head_count(
        tmp_path: Path) -> None:
    """Without ``head_counts`` the old cause (a head count left undivided) also holds, but
    dividing ``n_head`` would not fix nanoGPT's forward: the width read off the input ranks
    first, and says so."""
    from hyperrecipe.check.compare import Divergence, ModeComparison
    from hyperrecipe.check.record import Failure
    from tests.support.byo_models import make_gpt

    text = (ROOT / "tests/recipes/hazard-nanogpt-width.yaml").read_text(encoding="utf-8")
    recipe = tmp_path / "undivided.yaml"
    recipe.write_text("\n".join(line for line in text.splitlines() if "head_counts" not in line),
                      encoding="utf-8")
    model = make_gpt()
    plan, tree = _plan(str(recipe), model)
    assert plan.head_counts == ()
    failure = Failure(phase="forward", error="ValueError: not enough values to unpack",
                      boundary="transformer.h.0.attn", module="transformer.h.0.attn")
    empty = Trace(events=(), output=None, loss=None, grads={}, params_after=None)
    cmp = ModeComparison(
        mode="production", agree=False, events_compared=0, event_diffs=(), output=None,
        gradients=(), params_after=(), failure=failure, failure_rank=0,
        first=Divergence(fqn="transformer.h.0.attn", what="raised in forward", rank=0,
                         max_abs=None, max_rel=None, detail=failure.error))
    for hazards, expected in (({}, HEAD_COUNT_UNDIVIDED),
                              (forward_hazards(model), WIDTH_READ_OFF_INPUT)):
        found = suggest(cmp, empty, [empty], _ctx(plan, tree, hazards=hazards), atol=1e-5,
                        rtol=1e-4)
        assert found is not None and found.cause == expected
    assert found is not None
    assert ("dividing n_head = 4 (head_counts) does not change the width read off the input"
            in found.evidence)
