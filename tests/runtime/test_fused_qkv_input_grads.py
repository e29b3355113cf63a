"""Validate mode's per-use check of a replicated input's gradient, on a fused qkv stored in
chunks (timm's ``qkv(x).reshape(B, N, 3, heads, head_dim)``).

DTensor has no matmul strategy for the chunked weight's ``_StridedShard``, so validate mode
gathers it and computes the projection whole: the input's gradient through that product comes
back whole, as a residual's does, although production's local product with its shard gives the
partial sum its reduction completes. The check now tells the two apart (a product with a
sharded parameter, after views only, versus anything else), and must still name a residual.
Both are run against one process in both modes (check's default tolerances: atol 1e-5,
rtol 1e-4), with compile's verification in the report.
"""

from __future__ import annotations

import pytest

from hyperrecipe.check.run import CheckOptions, CheckReport, run_check

BYO = "tests.support.byo_models"
RECIPES = "tests/recipes/byo"


def _check(recipe: str) -> CheckReport:
    return run_check(CheckOptions(recipe=f"{RECIPES}/{recipe}", model=f"{BYO}:make_vit",
                                  mesh={"tp": 2}, inputs=f"{BYO}:make_pixels"))


@pytest.mark.slow  # launches ranks
def test_timm_attention_with_its_qkv_in_chunks_agrees_in_both_modes() -> None:
    report = _check("vit-fused-qkv.yaml")
    for mode in report.modes:
        assert mode.agree, (mode.mode, mode.comparison, mode.suggestion)
        assert mode.suggestion is None
    assert report.exit_code == 0


@pytest.mark.slow  # launches ranks
def test_the_residual_beside_a_chunked_qkv_is_still_named() -> None:
    """The boundary on the whole block: its input also feeds the residual add, which production
    would count twice. Validate mode names that use, not the gathered product's."""
    report = _check("vit-block-residual.yaml")
    prod, validate = report.modes
    assert not prod.agree and prod.comparison is not None and prod.comparison.forward_agrees
    failure = validate.comparison.failure if validate.comparison is not None else None
    assert failure is not None
    assert failure.error.startswith(
        "PlanMismatchError: blocks.1: input 'x' is used by AddBackward0 whose share of its "
        "gradient comes back whole (replicate on tp)"), failure.error
    assert "vit-block-residual.yaml:9:13" in failure.error
