"""Expert parallel Mixtral through a local compute region (``recipes/mixtral-ep.yaml``).

- the shipped recipe passes ``hyperrecipe check`` at ep=2 in both modes;
- on real gloo ranks, against one process: logits and every parameter's gradient, both modes,
  transformers' three experts implementations, the router load-balancing loss, and the
  sharded-token variants: the all-gather / reduce-scatter fallback
  ``tests/recipes/mixtral-ep-sharded-tokens.yaml`` and the all-to-all token dispatch
  ``tests/recipes/mixtral-ep-dispatch.yaml``;
  production issues exactly the plan's manifest, and ``restore()`` puts the expert count back;
- the kernel alone (one process): each rank's partial output is the sum over its own experts,
  computed by hand, and foreign slots get no routing-weight gradient;
- the plans: the expected collectives, the recorded kernel and expert counts, and the
  compile-time refusal (at the recipe line) of a layout no kernel fits.

Tolerances (fp32), as in ``tests/runtime/test_family_recipes.py``: every element within atol 2e-6, rtol
1e-5, and every tensor's largest difference within 1e-5 of its largest value. The kernel test
uses atol 1e-6, rtol 1e-5 (sums of the same products in a different order).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.errors import RecipeError
from tests.support.family_harness import build, config, reference, step
from tests.support.runtime_harness import ROOT, assert_close

RECIPE = str(ROOT / "recipes/mixtral-ep.yaml")
SHARDED_TOKENS = str(ROOT / "tests/recipes/mixtral-ep-sharded-tokens.yaml")
DISPATCH = str(ROOT / "tests/recipes/mixtral-ep-dispatch.yaml")
SCALED_TOL = 1e-5
EXPERTS = "model.layers.{}.mlp.experts"


def _ep_mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))


def ep_worker(rank: int, world: int, recipe: str, mode: str, overrides: dict[str, Any],
              aux_loss: bool) -> dict[str, Any]:
    """Apply ``recipe`` to tiny Mixtral on an ep mesh, run one step; return what to compare."""
    from hyperrecipe import apply
    from hyperrecipe.runtime.comm.collectives import count_collectives

    model = build("mixtral", **overrides)
    plan = compile_recipe(recipe, build("mixtral", "meta", **overrides), {"ep": world})
    inst = apply(model, plan, _ep_mesh(world), mode=mode)  # type: ignore[arg-type]
    from torch.distributed.tensor import DTensor

    experts = model.get_submodule(EXPERTS.format(0))
    weight = experts._parameters["gate_up_proj"]
    assert weight is not None
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    applied = (experts.num_experts, experts._is_expert_parallel, tuple(local.shape))
    with count_collectives() as log:
        logits = step(model, 1 if aux_loss else None)
    counted = Counter((r.kind, r.mesh_dim, r.direction) for r in log.records)
    expected = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest)
    grads = inst.full_grads()
    inst.restore()
    return {"logits": logits, "grads": grads, "counted": dict(counted),
            "expected": dict(expected), "applied": applied,
            "restored": (experts.num_experts, experts._is_expert_parallel)}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_close(actual, expected, what)
    worst = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert worst <= SCALED_TOL * scale, f"{what}: max diff {worst:.3e} > {SCALED_TOL} x {scale:.3e}"


# ------------------------------------------------------------------------------ hyperrecipe check


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("recipe", [RECIPE, DISPATCH], ids=["shipped", "dispatch"])
def test_recipe_passes_check_at_ep2_in_both_modes(recipe: str) -> None:
    report = run_check(CheckOptions(
        recipe=recipe, model="hf:mixtral", mesh={"ep": 2},
        model_config=str(ROOT / "recipes/models/tiny-mixtral.json")))
    assert [m.mode for m in report.modes] == ["production", "validate"]
    for m in report.modes:
        assert m.agree, f"mode {m.mode} diverged: {m.comparison}"
    assert report.exit_code == 0


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_tensor_times_expert_parallel_passes_check_on_four_ranks() -> None:
    """Attention over tp, experts over ep (tests/recipes/mixtral-tp-ep.yaml): each layout is
    replicated over the dim it does not name, on a 2 x 2 mesh."""
    report = run_check(CheckOptions(
        recipe=str(ROOT / "tests/recipes/mixtral-tp-ep.yaml"), model="hf:mixtral",
        mesh={"tp": 2, "ep": 2}, model_config=str(ROOT / "recipes/models/tiny-mixtral.json")))
    for m in report.modes:
        assert m.agree, f"mode {m.mode} diverged: {m.comparison}"
        assert len(m.comparison.gradients) == 21
    assert report.exit_code == 0


# ------------------------------------------------------------------------------ vs one process


CASES: list[tuple[str, str, dict[str, Any], bool]] = [
    (RECIPE, "production", {}, False),  # grouped_mm experts (transformers' default)
    (RECIPE, "production", {"experts_implementation": "eager"}, False),
    (RECIPE, "production", {"experts_implementation": "batched_mm"}, True),
    (RECIPE, "validate", {}, True),  # grouped_mm, on local tensors inside the region
    (RECIPE, "validate", {"experts_implementation": "eager"}, False),
    (SHARDED_TOKENS, "production", {}, False),
    (SHARDED_TOKENS, "validate", {}, False),
    (DISPATCH, "production", {}, False),
    (DISPATCH, "production", {"experts_implementation": "eager"}, False),
    (DISPATCH, "production", {"experts_implementation": "batched_mm"}, False),
    (DISPATCH, "validate", {}, False),
]


def _case_id(recipe: str, mode: str, overrides: dict[str, Any], aux_loss: bool) -> str:
    name = {SHARDED_TOKENS: "sharded-tokens", DISPATCH: "dispatch"}.get(recipe, "ep")
    impl = overrides.get("experts_implementation", "grouped_mm")
    return f"{name}-{mode}-{impl}" + ("-aux-loss" if aux_loss else "")


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("recipe", "mode", "overrides", "aux_loss"), CASES,
                         ids=[_case_id(*c) for c in CASES])
def test_expert_parallel_matches_single_process_logits_and_every_gradient(
        recipe: str, mode: str, overrides: dict[str, Any], aux_loss: bool) -> None:
    ref_logits, ref_grads, _ = reference("mixtral", aux_loss=aux_loss, **overrides)
    results = run_ranks(ep_worker, 2, recipe, mode, overrides, aux_loss, timeout_s=300)
    for rank, res in enumerate(results):
        assert_matches(res["logits"], ref_logits, f"rank {rank} logits")
        assert set(res["grads"]) == set(ref_grads), "every parameter has a full gradient"
        for name, g in ref_grads.items():
            assert_matches(res["grads"][name], g, f"rank {rank} grad {name}")
        assert res["applied"] == (2, True, (2, 128, 64)), \
            "two local experts (held and counted), flagged expert parallel, in both modes"
        assert res["restored"] == (4, False), "restore() puts the global count back"
    if mode == "production":
        assert results[0]["counted"] == results[0]["expected"], \
            "collectives issued in one step equal the plan's manifest"


# ------------------------------------------------------------------------------ the kernel


def _full_experts(impl: str) -> Any:
    """Tiny Mixtral's whole experts module, seeded, with weights large enough to matter."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg: Any = build("mixtral", "meta", experts_implementation=impl).config
    torch.manual_seed(0)
    full = MixtralExperts(cfg)
    with torch.no_grad():
        full.gate_up_proj.normal_(std=0.1)
        full.down_proj.normal_(std=0.1)
    return full


def _local_experts(full: Any, rank: int, count: int) -> Any:
    """Rank ``rank``'s ``count`` experts of ``full``, set up as ``apply`` sets them."""
    from hyperrecipe.runtime.features.experts import expert_parallel_attributes

    local = type(full)(full.config)
    experts = slice(rank * count, (rank + 1) * count)
    local.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[experts].detach().clone())
    local.down_proj = torch.nn.Parameter(full.down_proj[experts].detach().clone())
    for attr, value in expert_parallel_attributes(local, count, fqn="experts").items():
        setattr(local, attr, value)
    return local


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_each_rank_sums_exactly_its_own_experts(impl: str) -> None:
    from hyperrecipe.runtime.forward.compute import class_forward
    from hyperrecipe.runtime.features.experts import expert_parallel_forward

    full = _full_experts(impl)
    cfg = full.config
    E, world, T, k = full.num_experts, 2, 12, 2
    count = E // world
    x = torch.randn(T, cfg.hidden_size)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[0] = torch.tensor([0, 1])  # a token entirely on rank 0, one entirely on rank 1
    ids[1] = torch.tensor([2, 3])
    w = torch.rand(T, k)

    def by_hand(rank: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                if rank * count <= e < (rank + 1) * count:
                    gate, up = (full.gate_up_proj[e] @ x[t]).chunk(2)
                    out[t] += w[t, j] * (full.down_proj[e] @ (full.act_fn(gate) * up))
        return out

    total = torch.zeros_like(x)
    for rank in range(world):
        local = _local_experts(full, rank, count)
        assert local.num_experts == count
        kernel = expert_parallel_forward(class_forward(local), first=rank * count, count=count)
        weights = w.clone().requires_grad_(True)
        out = kernel(x, ids, weights)
        expected = by_hand(rank)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
        assert out[rank].abs().sum() > 0 and out[1 - rank].abs().sum() == 0, \
            "a token routed only to the other rank's experts gets exactly zero here"
        out.sum().backward()
        mine = (ids >= rank * count) & (ids < (rank + 1) * count)
        assert weights.grad is not None
        assert torch.all(weights.grad[~mine] == 0), "foreign slots get no routing gradient"
        assert torch.all(weights.grad[mine] != 0)
        total += out.detach()
    torch.testing.assert_close(total, full(x, ids, w).detach(), atol=1e-6, rtol=1e-5)


def _experts_case(impl: str, world: int, skew: bool) -> dict[str, Any]:
    """A full experts module and one batch of every rank's tokens, the same in every process."""
    full = _full_experts(impl)
    cfg = full.config
    E, T, k = full.num_experts, 3, 2
    pool = E // world if skew else E  # skew: every slot goes to rank 0's experts
    ids = torch.stack([torch.randperm(pool)[:k] for _ in range(world * T)])
    return {"full": full, "x": torch.randn(world * T, cfg.hidden_size), "ids": ids,
            "w": torch.rand(world * T, k), "cotangent": torch.randn(world * T, cfg.hidden_size),
            "T": T, "count": E // world}


def dispatch_worker(rank: int, world: int, impl: str, skew: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from hyperrecipe.runtime.forward.compute import class_forward
    from hyperrecipe.runtime.features.reach import reaching_forward
    from hyperrecipe.runtime.features.token_dispatch import dispatch_forward

    c = _experts_case(impl, world, skew)
    full, count, mine = c["full"], c["count"], slice(rank * c["T"], (rank + 1) * c["T"])
    local = _local_experts(full, rank, count)
    kernel = dispatch_forward(reaching_forward(class_forward(local), local), count=count,
                              group=dist.group.WORLD, size=world)  # as apply builds it
    x = c["x"][mine].clone().requires_grad_(True)
    w = c["w"][mine].clone().requires_grad_(True)
    out = kernel(x, c["ids"][mine], w)
    (out * c["cotangent"][mine]).sum().backward()
    return {"out": out, "x": x.grad, "w": w.grad, "gate_up_proj": local.gate_up_proj.grad,
            "down_proj": local.down_proj.grad}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "all-to-rank-0"])
def test_dispatch_matches_the_whole_module_even_when_a_rank_receives_nothing(
        impl: str, skew: bool) -> None:
    """Every rank's tokens, expert outputs and gradients (tokens, routing weights, its experts)
    equal one process running the whole module on every token. With every slot routed to rank
    0's experts, rank 1 receives no rows and must still take part in every backward exchange
    (eager experts return an output that depends on nothing when no expert is hit)."""
    world = 2
    c = _experts_case(impl, world, skew)
    x = c["x"].clone().requires_grad_(True)
    w = c["w"].clone().requires_grad_(True)
    full = c["full"]
    out = full(x, c["ids"], w)
    (out * c["cotangent"]).sum().backward()
    results = run_ranks(dispatch_worker, world, impl, skew, timeout_s=60)
    T, count = c["T"], c["count"]
    for rank, res in enumerate(results):
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * count, (rank + 1) * count)
        for name, got, want in [("output", res["out"], out[mine]), ("x grad", res["x"], x.grad[mine]),
                                ("w grad", res["w"], w.grad[mine]),
                                ("gate_up_proj grad", res["gate_up_proj"],
                                 full.gate_up_proj.grad[experts]),
                                ("down_proj grad", res["down_proj"], full.down_proj.grad[experts])]:
            assert got is not None, f"rank {rank}: no {name}"
            torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def test_experts_that_used_nothing_still_hand_back_zero_gradients() -> None:
    """transformers' eager experts, with no slot for this rank's experts, return zeros that
    depend on nothing; tied, backward reaches the inputs and every parameter with zeros."""
    from hyperrecipe.runtime.forward.compute import class_forward
    from hyperrecipe.runtime.features.experts import expert_parallel_forward
    from hyperrecipe.runtime.features.reach import reaching_forward

    c = _experts_case("eager", 2, skew=True)  # every slot on rank 0's experts
    count = c["count"]
    experts = _local_experts(c["full"], 1, count)  # rank 1's experts
    x = c["x"].clone().requires_grad_(True)
    w = c["w"].clone().requires_grad_(True)
    foreign = expert_parallel_forward(class_forward(experts), first=count, count=count)
    assert not foreign(x, c["ids"], w).requires_grad, "the failure mode this guards against"
    tied = expert_parallel_forward(reaching_forward(class_forward(experts), experts),
                                   first=count, count=count)
    out = tied(x, c["ids"], w)
    assert out.requires_grad and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for name, t in [("x", x), ("w", w), ("gate_up_proj", experts.gate_up_proj),
                    ("down_proj", experts.down_proj)]:
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t)), name


def test_an_output_that_requires_grad_is_returned_untouched() -> None:
    from hyperrecipe.runtime.features.reach import tie_unreached

    x = torch.randn(3, requires_grad=True)
    out = (x * 2, torch.arange(3))
    assert tie_unreached(out, [x]) is out


# ------------------------------------------------------------------------------ plans


def _manifest(recipe: str) -> Counter[tuple[str, str, str, str, str]]:
    plan = compile_recipe(recipe, build("mixtral", "meta"), {"ep": 2})
    return Counter((e.boundary, e.stage, e.name, e.op.kind, e.direction) for e in plan.manifest)


def test_replicated_tokens_plan_all_reduces_the_partial_sum_and_two_input_gradients() -> None:
    expected: Counter[tuple[str, str, str, str, str]] = Counter()
    for layer in range(2):
        b = EXPERTS.format(layer)
        expected[(b, "output", "output", "all_reduce", "forward")] += 1
        expected[(b, "input", "hidden_states", "all_reduce", "backward")] += 1
        expected[(b, "input", "top_k_weights", "all_reduce", "backward")] += 1
    assert _manifest(RECIPE) == expected


def test_sharded_tokens_plan_gathers_inputs_and_reduce_scatters_the_output() -> None:
    expected: Counter[tuple[str, str, str, str, str]] = Counter()
    for layer in range(2):
        b, mlp = EXPERTS.format(layer), f"model.layers.{layer}.mlp"
        for name in ("hidden_states", "top_k_index", "top_k_weights"):
            expected[(b, "input", name, "all_gather", "forward")] += 1
        for name in ("hidden_states", "top_k_weights"):  # the ids carry no gradient
            expected[(b, "input", name, "reduce_scatter", "backward")] += 1
        expected[(b, "output", "output", "reduce_scatter", "forward")] += 1
        expected[(b, "output", "output", "all_gather", "backward")] += 1
        expected[(mlp, "input", "hidden_states", "all_gather", "backward")] += 1
        expected[(mlp, "output", "output", "all_gather", "forward")] += 1
    # both routers' gradients, one bucket (it spans two boundaries: attributed to none)
    expected[("", "param_grad", "grad_buckets[0]", "all_reduce", "backward")] += 1
    assert _manifest(SHARDED_TOKENS) == expected


def test_dispatch_plan_has_no_layout_collective_at_the_experts() -> None:
    """The experts' inputs and output stay sharded: only the MoE block's slice and gather (and
    the router's gradient) are layout collectives; the token all-to-alls are the kernel's own."""
    expected: Counter[tuple[str, str, str, str, str]] = Counter()
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        expected[(mlp, "input", "hidden_states", "all_gather", "backward")] += 1
        expected[(mlp, "output", "output", "all_gather", "forward")] += 1
    expected[("", "param_grad", "grad_buckets[0]", "all_reduce", "backward")] += 1
    assert _manifest(DISPATCH) == expected


def _compile_edited(tmp_path: Path, recipe: str, old: str, new: str) -> tuple[Any, Path]:
    text = Path(recipe).read_text()
    assert old in text
    path = tmp_path / "edited.yaml"
    path.write_text(text.replace(old, new))
    return compile_recipe(str(path), build("mixtral", "meta"), {"ep": 2}), path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _refusal(tmp_path: Path, recipe: str, old: str, new: str) -> tuple[RecipeError, Path]:
    with pytest.raises(RecipeError) as info:
        _compile_edited(tmp_path, recipe, old, new)
    return info.value, tmp_path / "edited.yaml"


@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_the_plan_records_the_kernel_the_declared_inputs_call_for() -> None:
    for recipe, kind in ((RECIPE, "partial"), (DISPATCH, "dispatch")):
        plan = compile_recipe(recipe, build("mixtral", "meta"), {"ep": 2})
        ep = plan.boundary(EXPERTS.format(0)).expert_parallel
        assert ep is not None
        experts = config("mixtral")["num_local_experts"]
        assert (ep.mesh_dim, ep.kernel, ep.experts, ep.local_experts) == (
            "ep", kind, experts, experts // 2)


def test_inputs_partly_sharded_are_refused_at_compile_time(tmp_path: Path) -> None:
    error, path = _refusal(tmp_path, DISPATCH, "top_k_weights: {ep: shard(0)}",
                           "top_k_weights: replicate")
    assert error.problem.startswith(
        "model.layers.0.mlp.experts: an expert-parallel region takes its inputs either whole on "
        "ep (each rank runs its experts on every token) or all sharded on dim 0")
    assert "top_k_weights: replicate" in error.problem
    assert error.span is not None and error.span.path == str(path)
    assert error.span.line == _line_of(path, "top_k_weights: replicate")


@pytest.mark.parametrize(("recipe", "old", "new", "want", "declared"), [
    (DISPATCH, "out_src: {0: {ep: shard(0)}}\n    params", "out_src: {0: {ep: partial}}\n    params",
     "{ep: shard(0)}", "partial"),
    (RECIPE, "out_src: {0: {ep: partial}}", "out_src: {0: replicate}", "{ep: partial}", "replicate"),
], ids=["dispatch-declared-partial", "replicated-declared-whole"])
def test_an_output_layout_the_kernel_does_not_produce_is_refused_at_compile_time(
        tmp_path: Path, recipe: str, old: str, new: str, want: str, declared: str) -> None:
    error, path = _refusal(tmp_path, recipe, old, new)
    assert f"produces {want} outputs; the recipe declares out_src {{ep: {declared}}}" in \
        error.problem
    assert error.span is not None and error.span.line == _line_of(path, new.split("\n")[0])


@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_expert_parallel_is_recorded_only_where_the_experts_are_sharded() -> None:
    ep = compile_recipe(RECIPE, build("mixtral", "meta"), {"ep": 2})
    tp = compile_recipe(str(ROOT / "recipes/mixtral.yaml"), build("mixtral", "meta"), {"tp": 2})
    b = ep.boundary(EXPERTS.format(0))
    assert b.local_region
    assert b.expert_parallel is not None and b.expert_parallel.mesh_dim == "ep"
    assert tp.boundary("model.layers.0.mlp").expert_parallel is None


def test_experts_sharded_on_different_axes_are_refused_at_compile_time(tmp_path: Path) -> None:
    error, path = _refusal(tmp_path, RECIPE, "down_proj: {ep: shard(0)}",
                           "down_proj: {ep: shard(2)}")
    assert error.problem == (
        "model.layers.0.mlp.experts: an expert-parallel region shards every per-expert tensor "
        "(the 3-D weights and any [E, ...] bias) on dim 0 over one mesh dim; found "
        "gate_up_proj: {ep: shard(0)}, "
        "down_proj: {ep: shard(2)}")
    assert error.span is not None and error.span.line == _line_of(path, "down_proj: {ep: shard(2)}")


# ------------------------------------------------------------------ GPT-OSS: experts with biases

GPT_OSS = str(ROOT / "tests/recipes/gpt-oss-ep.yaml")
GPT_OSS_CONFIG = ROOT / "tests/recipes/models/tiny-gpt_oss.json"


def _gpt_oss(device: str = "cpu", **overrides: Any) -> torch.nn.Module:
    """Tiny GPT-OSS; its biases (zero at init, which would hide a misplaced one) drawn
    nonzero."""
    import json

    from hyperrecipe.model_tree import build_model

    torch.manual_seed(0)
    cfg = {**json.loads(GPT_OSS_CONFIG.read_text()), **overrides}
    model = build_model("hf:gpt_oss", cfg, device=device)
    if device != "meta":
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def gpt_oss_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    from hyperrecipe import apply

    model = _gpt_oss()
    plan = compile_recipe(GPT_OSS, _gpt_oss("meta"), {"ep": world})
    inst = apply(model, plan, _ep_mesh(world), mode=mode)  # type: ignore[arg-type]
    logits = step(model)
    return {"logits": logits, "grads": inst.full_grads()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_gpt_oss_experts_with_biases_match_one_process_at_ep2(mode: str) -> None:
    """Per-expert biases sharded with their experts: logits and every gradient as one process."""
    model = _gpt_oss()
    logits = step(model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for r in run_ranks(gpt_oss_worker, 2, mode, timeout_s=300):
        assert_matches(r["logits"], logits, "logits")
        assert set(r["grads"]) == set(grads)
        for name, g in grads.items():
            assert_matches(r["grads"][name], g, name)


def test_per_expert_biases_left_whole_are_refused_at_compile_time(tmp_path: Path) -> None:
    """A whole bias would be indexed with local expert ids: rank 1's experts 2, 3 would add
    experts 0, 1's biases. Refused, naming the bias and the placement to give it."""
    path = tmp_path / "edited.yaml"
    path.write_text(Path(GPT_OSS).read_text().replace(
        "      gate_up_proj_bias: {ep: shard(0)}\n", "").replace(
        "      down_proj_bias: {ep: shard(0)}\n", ""))
    with pytest.raises(RecipeError) as info:
        compile_recipe(str(path), _gpt_oss("meta"), {"ep": 2})
    error = info.value
    assert "gate_up_proj_bias: replicate" in error.problem
    assert "down_proj_bias: replicate" in error.problem
    assert error.hint.startswith("give 'gate_up_proj_bias' the same placement as the other "
                                 "expert tensors ({ep: shard(0)})")


def test_a_whole_bias_of_tensor_parallel_experts_is_refused_at_compile_time() -> None:
    """GPT-OSS's down_proj_bias after a down projection sharded on I would be added by every
    rank to its partial sum: refused, pointing at expert parallelism."""
    recipe = ROOT / "tests/recipes/broken-gpt-oss-tp-expert-bias.yaml"
    with pytest.raises(RecipeError) as info:
        compile_recipe(str(recipe), _gpt_oss("meta"), {"tp": 2})
    error = info.value
    assert error.problem == (
        "model.layers.0.mlp.experts: the experts' weights are sharded over tp but their "
        "per-expert tensor 'down_proj_bias' [4, 64] is whole there: every rank would add all of "
        "it to its own slice or partial sum")
    assert "shard the experts whole over an ep dim instead" in error.hint


def test_tiny_mixtral_experts_divide_by_two() -> None:
    assert config("mixtral")["num_local_experts"] % 2 == 0


def bad_ids_worker(rank: int, world: int) -> str:
    import torch.distributed as dist

    from hyperrecipe.runtime.features.token_dispatch import dispatch_forward

    kernel = dispatch_forward(lambda h, i, w: h * w, count=2, group=dist.group.WORLD, size=world)
    ids = torch.tensor([[0, 1], [2, 3]]) if rank == 0 else torch.tensor([[0, 9], [1, 2]])
    try:
        kernel(torch.randn(2, 4), ids, torch.rand(2, 2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_an_expert_id_beyond_the_plan_fails_every_rank_without_a_hang() -> None:
    """Only rank 1's router is wrong; both ranks learn it from the count exchange and raise."""
    messages = run_ranks(bad_ids_worker, 2, timeout_s=60)
    assert all("a router chose an expert id outside [0, 4)" in m for m in messages), messages
    assert messages[0].endswith("(on another rank)") and messages[1].endswith("(here: 0..9)")


def test_the_tie_is_exactly_zero_even_when_a_source_overflows() -> None:
    from hyperrecipe.runtime.features.reach import tie_unreached

    big = torch.full((4096, 64), 60000.0, dtype=torch.float16, requires_grad=True)
    assert torch.isinf(big.sum()), "the sum itself overflows fp16"
    tied = tie_unreached(torch.zeros(3, dtype=torch.float16), [big])
    assert tied.requires_grad and torch.equal(tied, torch.zeros(3, dtype=torch.float16))
    tied.sum().backward()
    assert big.grad is not None and torch.equal(big.grad, torch.zeros_like(big))


@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_explain_reads_the_recorded_kernels() -> None:
    from hyperrecipe.plan_report import explain

    experts = config("mixtral")["num_local_experts"]
    ep = compile_recipe(RECIPE, build("mixtral", "meta"), {"ep": 2})
    assert (f"  expert parallel over ep: partial kernel, {experts // 2} of {experts} experts per "
            f"rank") in explain(ep, EXPERTS.format(0)).splitlines()
    tp = compile_recipe(str(ROOT / "recipes/mixtral.yaml"), build("mixtral", "meta"), {"tp": 2})
    assert tp.boundary("model.embed_tokens").vocab_parallel == "tp"
    assert ("  vocab-parallel lookup over tp: production mode looks up the ids this rank owns, "
            "others read as zero rows") in explain(tp, "model.embed_tokens").splitlines()
