"""Gradient reductions in buckets: decided at compile time, one flat collective per bucket.

Compile-time tests read the plan of ``recipes/llama-sp.yaml`` (the sequence-parallel norms'
gradients are partial). Multi-rank tests apply it on real gloo ranks to tiny Llama and compare
with one process in fp32: every parameter's gradient after two micro-batches accumulated,
atol 2e-6 and rtol 1e-5 (``tests/support/runtime_harness.py``; measured differences are ~1e-8), and
count the collectives actually issued against the plan's manifest.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.collective import CollectiveOp
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.plan import ManifestEntry, Plan
from hyperrecipe.resolve.grad_buckets import GRAD_BUCKET_CAP_BYTES, plan_grad_buckets
from tests.support.runtime_harness import ROOT, assert_close, grads_of, llama, mesh_1d

SP = str(ROOT / "recipes/llama-sp.yaml")
CP = str(ROOT / "recipes/llama-tp-cp.yaml")
FROZEN = "model.layers.0.input_layernorm.weight"
"""Frozen in the frozen-parameter cases: it gets no gradient, in one process or on the ranks."""


def _sp_plan(world: int = 2) -> Plan:
    return compile_recipe(SP, llama("meta"), {"tp": world})


def _with_buckets(plan: Plan, cap_bytes: int) -> Plan:
    """``plan`` with its gradients bucketed at ``cap_bytes`` and the manifest to match: what
    the resolver decides with another cap (the runtime reads the plan only)."""
    buckets = plan_grad_buckets(plan.params, cap_bytes=cap_bytes)
    kept = [e for e in plan.manifest if e.stage != "param_grad"]
    grads = [ManifestEntry(boundary="", stage="param_grad", name=b.name, mesh_dim=op.mesh_dim,
                           direction="backward", op=op) for b in buckets for op in b.ops]
    return attrs.evolve(plan, grad_buckets=buckets, manifest=(*kept, *grads)).sealed()


# ---------------------------------------------------------------------------------------------
# Compile time.


def test_every_reduced_gradient_is_in_exactly_one_bucket_and_the_manifest_lists_buckets() -> None:
    plan = _sp_plan()
    reduced = [p.fqn for p in plan.params if p.grad_reduce]
    assert len(reduced) == 2 * 2 + 1, "two norms per layer (tiny Llama has 2) and the final norm"
    in_buckets = [fqn for b in plan.grad_buckets for fqn in b.params]
    assert sorted(in_buckets) == sorted(reduced)
    assert len(plan.grad_buckets) == 1, "a few KiB of norm weights fill one 25 MiB bucket"
    grad_entries = [e for e in plan.manifest if e.stage == "param_grad"]
    assert [(e.name, str(e.op)) for e in grad_entries] == [("grad_buckets[0]", "all_reduce[tp](sum)")]
    assert plan.grad_buckets[0].numel == sum(
        plan.param(f).local_shape[0] for f in plan.grad_buckets[0].params)


def test_buckets_follow_reverse_parameter_order_and_close_at_the_cap() -> None:
    plan = _sp_plan()
    norm_bytes = plan.param("model.norm.weight").local_shape[0] * 4
    buckets = plan_grad_buckets(plan.params, cap_bytes=2 * norm_bytes)
    reduced = [p.fqn for p in plan.params if p.grad_reduce]
    # the last parameter's gradient is ready first in backward: it opens bucket 0
    assert [f for b in buckets for f in b.params] == reduced[::-1]
    assert [len(b.params) for b in buckets] == [2, 2, 1]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert GRAD_BUCKET_CAP_BYTES == 25 * 2**20


def test_parameters_reduced_over_different_dims_or_dtypes_never_share_a_bucket() -> None:
    plan = _sp_plan()
    over_cp = (CollectiveOp(kind="all_reduce", mesh_dim="cp"),)
    params = tuple(
        attrs.evolve(p, grad_reduce=over_cp) if p.module.endswith("post_attention_layernorm")
        else attrs.evolve(p, dtype="bfloat16") if p.fqn == "model.norm.weight" else p
        for p in plan.params)
    buckets = plan_grad_buckets(params)
    by_fqn = {p.fqn: p for p in params}
    assert len(buckets) == 3
    for b in buckets:
        assert {by_fqn[f].grad_reduce for f in b.params} == {b.ops}
        assert {by_fqn[f].dtype for f in b.params} == {b.dtype}
    assert sorted(f for b in buckets for f in b.params) == sorted(
        p.fqn for p in params if p.grad_reduce)
    # launch order: the bucket whose last gradient is expected first goes first
    assert [b.params[-1] for b in buckets] == [
        "model.norm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.input_layernorm.weight"]


@pytest.mark.slow  # resolves and dry-runs a context-parallel plan (~14 s)
def test_context_parallel_manifest_lists_the_buckets_ops() -> None:
    plan = compile_recipe(CP, llama("meta"), {"tp": 2, "cp": 2})
    reduced = [p for p in plan.params if p.grad_reduce]
    assert sum(len(b.params) for b in plan.grad_buckets) == len(reduced) > len(plan.grad_buckets)
    assert [e.op for e in plan.manifest if e.stage == "param_grad"] == [
        op for b in plan.grad_buckets for op in b.ops]


def test_a_parameter_larger_than_the_cap_is_a_bucket_of_its_own() -> None:
    plan = _sp_plan()
    buckets = plan_grad_buckets(plan.params, cap_bytes=1)
    assert [b.params for b in buckets] == [(f,) for f in reversed(
        [p.fqn for p in plan.params if p.grad_reduce])]
    assert all(b.ops == (CollectiveOp(kind="all_reduce", mesh_dim="tp"),) for b in buckets)


# ---------------------------------------------------------------------------------------------
# On ranks.


def _micro_batches() -> list[torch.Tensor]:
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        out.append(torch.randint(0, 128, (2, 8), generator=g))
    return out


def _accumulate(model: torch.nn.Module) -> None:
    """Two micro-batches, one backward each, gradients accumulated."""
    for ids in _micro_batches():
        model(input_ids=ids).logits.float().pow(2).mean().backward()


def _reference(frozen: bool, **overrides: Any) -> dict[str, torch.Tensor]:
    model = llama(**overrides)
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    _accumulate(model)
    return grads_of(model)


def _worker(rank: int, world: int, mode: str, cap_bytes: int | None, frozen: bool,
            overrides: dict[str, Any]) -> dict[str, Any]:
    from hyperrecipe.runtime.comm.collectives import count_collectives

    model = llama(**overrides)
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    plan = compile_recipe(SP, llama("meta", **overrides), {"tp": world})
    if cap_bytes is not None:
        plan = _with_buckets(plan, cap_bytes)
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    with count_collectives() as log:
        _accumulate(model)
    counted = Counter((r.kind, r.mesh_dim, r.direction) for r in log.records)
    per_step = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest)
    return {"grads": inst.full_grads(), "counted": dict(counted),
            "expected": {k: 2 * v for k, v in per_step.items()},
            "grad_collectives": sum(1 for e in plan.manifest if e.stage == "param_grad"),
            "reduced_params": sum(1 for p in plan.params if p.grad_reduce),
            "buckets": len(plan.grad_buckets)}


def _assert_matches_one_process(results: list[dict[str, Any]],
                                ref: dict[str, torch.Tensor]) -> None:
    for rank, res in enumerate(results):
        assert set(res["grads"]) == set(ref), "the same parameters have gradients"
        for name, g in ref.items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_gradients_accumulated_over_two_micro_batches_match_one_process(mode: str) -> None:
    overrides: dict[str, Any] = {}  # the model's defaults (sdpa) in both modes
    results = run_ranks(_worker, 2, mode, None, False, overrides, timeout_s=300)
    _assert_matches_one_process(results, _reference(False, **overrides))
    if mode == "production":
        res = results[0]
        assert res["counted"] == res["expected"], \
            "collectives issued in two steps equal twice the plan's manifest"
        assert res["grad_collectives"] == 1 < res["reduced_params"] == 5


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_several_buckets_with_a_frozen_parameter_launch_in_order_and_match_one_process() -> None:
    plan = _sp_plan()
    cap = 2 * plan.param("model.norm.weight").local_shape[0] * 4
    results = run_ranks(_worker, 2, "production", cap, True, {}, timeout_s=300)
    _assert_matches_one_process(results, _reference(True))
    assert FROZEN not in results[0]["grads"], "a frozen parameter gets no gradient, as in one process"
    for res in results:
        assert res["buckets"] == 3
        assert res["counted"] == res["expected"], \
            "every bucket is reduced once per backward, the frozen one's slot as zeros"


def _refusal_worker(rank: int, world: int) -> list[str]:
    """Two ways a bucketed gradient would escape its reduction: each must raise instead."""
    out = []
    model = llama()
    apply(model, _sp_plan(world), mesh_1d(world))
    loss = model(input_ids=_micro_batches()[0]).logits.pow(2).mean()
    norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
    try:
        torch.autograd.grad(loss, norms)
        out.append("no error")
    except PlanMismatchError as exc:
        out.append(str(exc))
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_gradients_that_would_escape_their_bucket_are_refused_not_returned_unreduced() -> None:
    for (taken,) in run_ranks(_refusal_worker, 2, timeout_s=300):
        assert "never accumulated into .grad (torch.autograd.grad?)" in taken
        assert "call backward() instead" in taken


def _unfrozen_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = llama()
    model.get_parameter(FROZEN).requires_grad_(False)
    inst = apply(model, _sp_plan(world), mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    model(input_ids=_micro_batches()[0]).logits.pow(2).mean().backward()  # still frozen
    frozen_grad = model.get_parameter(FROZEN).grad
    model.zero_grad(set_to_none=True)
    model.get_parameter(FROZEN).requires_grad_(True)  # gradual unfreezing, after apply
    _accumulate(model)
    return {"grads": inst.full_grads(), "frozen_grad": frozen_grad}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_parameter_unfrozen_after_apply_is_reduced_like_the_others(mode: str) -> None:
    """A bucketed norm frozen at apply and unfrozen after a step: its gradient over two
    micro-batches matches one process (production hooked it at apply; validate mode hooks its
    placement before the next forward)."""
    results = run_ranks(_unfrozen_worker, 2, mode, timeout_s=300)
    for res in results:
        assert res["frozen_grad"] is None, "while frozen it got no gradient"
    _assert_matches_one_process(results, _reference(False))
